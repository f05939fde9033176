"""benchmarks.sparse_attention_bench without a GPU: one arm's measurement goes through the
timing harness, with its output poisoned before the timed calls, so an impl that leaves part
of its output unwritten is seen even where the stale values were right."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from benchmarks import sparse_attention_bench as bench


class _Arm:
    """An arm whose call writes only the first ``written`` tokens of its output."""

    def __init__(self, written: int) -> None:
        self.metadata = None
        self.out = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
        self.written = written

    def call(self) -> None:
        self.out[: self.written] = 0.5


@pytest.mark.parametrize(("written", "left"), [(4, 0), (3, 8 * 128)])
def test_measure_times_eager_then_replays_and_leaves_unwritten_output_poisoned(
    monkeypatch: pytest.MonkeyPatch, written: int, left: int
) -> None:
    timed: list[str] = []

    class Graph:
        def __init__(self, fn: Any) -> None:
            self.replay = fn

    def per_call_ms(fn: Any, iters: int, warmup: int = 3) -> float:
        timed.append("replay" if isinstance(fn, type(lambda: 0)) else "eager")
        fn()
        return 2.0 if timed[-1] == "eager" else 1.0

    monkeypatch.setattr(bench.cases, "forward_context", lambda metadata: contextlib.nullcontext())
    monkeypatch.setattr(bench.timing, "capture_graph", lambda fn, warmup: Graph(lambda: fn()))
    monkeypatch.setattr(bench.timing, "per_call_ms", per_call_ms)
    arm = _Arm(written)
    assert bench.measure(arm, iters=5) == (2.0, 1.0)
    assert timed == ["eager", "replay"]
    assert bench.timing.unwritten(arm.out) == left
