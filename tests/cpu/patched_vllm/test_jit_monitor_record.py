"""vLLM's JIT monitor, in its warn mode, reports a kernel compiled after the engine was ready
in words that `recording_jit_events` records: the ``jit_compiled_after_ready`` of the GPU
engine runs (tests/gpu_e2e/sparse_attention_engine.py), which their checks read."""

from __future__ import annotations

import uuid

import pytest
from vllm.utils import jit_monitor

from vllm_minimax.testing.engine_runs import recording_jit_events


@pytest.fixture
def warn_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jit_monitor, "_mode", "warn")
    monkeypatch.setattr(jit_monitor, "_verbose", False)


def _compiled(kernel: str, detail: str | None = None) -> None:
    """What the monitor's Triton hook reports for a first compilation after ready."""
    jit_monitor._handle_jit_event(
        backend="Triton kernel", event="JIT compilation", fn_name=kernel, detail=detail
    )


def test_a_kernel_compiled_after_ready_is_recorded_by_name(warn_mode: None) -> None:
    # The monitor reports each message once a process: names of their own.
    plain, detailed, outside = (f"_kernel_{uuid.uuid4().hex[:8]}" for _ in range(3))
    with recording_jit_events() as events:
        _compiled(plain)
        _compiled(detailed, detail="BLOCK_SIZE=1024")
    _compiled(outside)
    assert events == [
        {"event": "Triton kernel JIT compilation", "kernel": plain},
        {"event": "Triton kernel JIT compilation", "kernel": detailed},
    ]


def test_an_autotuning_run_after_ready_is_recorded(warn_mode: None) -> None:
    kernel = f"_tuned_{uuid.uuid4().hex[:8]}"
    with recording_jit_events() as events:
        jit_monitor._handle_jit_event(
            backend="Triton", event="autotuning", fn_name=kernel, detail=None
        )
    assert events == [{"event": "Triton autotuning", "kernel": kernel}]
