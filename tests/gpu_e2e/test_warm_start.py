"""Warm start: no FlashInfer program is built after the engine says it is ready.

Two engine starts of the tiny MiniMax M3 (FlashInfer indexer, fp8 index cache),
each in a fresh process on an empty FlashInfer cache (`warm_start_run.py`):

- ``warm-start-graphs``: vLLM's defaults (CUDA graphs on, JIT warm-up on) with
  ``jit_monitor_mode="error"``. After ready, FlashInfer's build log (one JSON
  line per nvcc build or CuTe-DSL compile, ``FLASHINFER_JIT_BUILD_LOG``) and its
  log lines ("Building JIT module", "Compiling CuTe-DSL kernel") must show
  nothing, and each shape's first run must take at most 1.5x its steady state.
- ``warm-start-eager``: ``enforce_eager``, under which vLLM turns its JIT
  warm-up off by design: reported, not asserted (builds after ready, the stall).

    python -m pytest -q -s tests/gpu_e2e/test_warm_start.py

`VLLM_MINIMAX_E2E_SAVED=DIR` re-checks saved runs (DIR/warm-start-*.json, .log).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SAVED_RUNS_ENV
from warm_start_run import READY_MARKER

HERE = Path(__file__).parent
RUN_EAGER = {"warm-start-graphs": False, "warm-start-eager": True}

# A first run may take this much longer than the same shape's steady state.
FIRST_RUN_RATIO = 1.5
# Timer noise on shapes that take tens of milliseconds; a program build takes seconds.
FIRST_RUN_SLACK_S = 0.05
BUILD_LINES = ("Building JIT module", "Compiling CuTe-DSL kernel")
WARMUP_LINE = "MiniMax M3 FlashInfer indexer warm-up:"


def _run(name: str, eager: bool, model: Path, out_dir: Path) -> tuple[dict, str]:
    out, log = out_dir / f"{name}.json", out_dir / f"{name}.log"
    if not out.exists():
        cache_dir = Path(tempfile.mkdtemp(prefix=f"{name}-flashinfer-", dir=out_dir))
        env = dict(
            os.environ,
            FLASHINFER_WORKSPACE_BASE=str(cache_dir),
            FLASHINFER_JIT_BUILD_LOG=str(out_dir / f"{name}.builds.jsonl"),
            PYTHONUNBUFFERED="1",
        )
        cmd = [
            sys.executable,
            str(HERE / "warm_start_run.py"),
            f"--model={model}",
            f"--cache-dir={cache_dir}",
            f"--out={out}",
        ] + ["--eager"] * eager
        began = time.perf_counter()
        with log.open("w") as handle:
            subprocess.run(
                cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=600, check=False
            )
        print(f"warm-start: {name} took {time.perf_counter() - began:.0f}s", flush=True)
    text = log.read_text(errors="replace") if log.exists() else ""
    if not out.exists():
        pytest.fail(f"{name}: no result; log tail:\n{text[-3000:]}")
    return json.loads(out.read_text()), text


@pytest.fixture(scope="module")
def runs(request) -> Callable[[str], tuple[dict, str]]:
    """The run of a name, started at the first test that needs it (so ``-k graphs``
    skips the eager engine), or read from the saved runs."""
    saved = os.environ.get(SAVED_RUNS_ENV)

    @functools.cache
    def run(name: str) -> tuple[dict, str]:
        if saved:
            out, log = Path(saved) / f"{name}.json", Path(saved) / f"{name}.log"
            if not out.exists():
                pytest.fail(f"{name} is not among the saved runs")
            return json.loads(out.read_text()), log.read_text(errors="replace")
        model = request.getfixturevalue("tiny_model")
        out_dir = request.getfixturevalue("e2e_dir")
        return _run(name, RUN_EAGER[name], model, out_dir)

    return run


def _builds_after_ready(data: dict) -> list[dict]:
    return [b for b in data.get("builds", []) if b["time"] > data["ready"]]


def _log_builds_after_ready(log: str) -> list[str]:
    _, marker, after = log.partition(READY_MARKER)
    assert marker, "the run never reported ready"
    return [line for line in after.splitlines() if any(s in line for s in BUILD_LINES)]


def _stalls(data: dict) -> dict[str, tuple[float, float]]:
    """Per shape: (first run, steady state = the fastest later run), in seconds."""
    return {
        name: (shape["seconds"][0], min(shape["seconds"][1:]))
        for name, shape in data["shapes"].items()
        if "seconds" in shape
    }


def _get(runs: Callable[[str], tuple[dict, str]], name: str) -> tuple[dict, str]:
    data, log = runs(name)
    assert "error" not in data, f"{name}: {data['error']}\n{log[-3000:]}"
    return data, log


def test_graphs_engine_builds_nothing_after_ready(runs):
    data, log = _get(runs, "warm-start-graphs")
    warmup = [line for line in log.splitlines() if WARMUP_LINE in line]
    print(f"\nwarm-start-graphs: engine start {data['engine_start_s']}s on an empty cache")
    for line in warmup:
        print("  " + line[line.index(WARMUP_LINE) :])
    before = [b for b in data["builds"] if b["time"] <= data["ready"]]
    print(f"  FlashInfer builds before ready: {len(before)}, after ready: 0 expected")
    assert warmup, "the engine log has no FlashInfer indexer warm-up line"
    assert before, "no FlashInfer build before ready: the cache was not empty, or not used"
    after = _builds_after_ready(data)
    assert not after, "built after ready: " + ", ".join(b["name"] for b in after)
    logged = _log_builds_after_ready(log)
    assert not logged, "logged after ready:\n" + "\n".join(logged)


def test_graphs_engine_every_shape_runs_at_steady_state(runs):
    data, _ = _get(runs, "warm-start-graphs")
    errors = {name: shape["error"] for name, shape in data["shapes"].items() if "error" in shape}
    assert not errors, f"shapes that failed (the JIT monitor raises on a compile): {errors}"
    slow = {}
    for name, (first, steady) in _stalls(data).items():
        print(f"  {name:24s} first {first:7.3f}s  steady {steady:7.3f}s")
        if first > FIRST_RUN_RATIO * steady + FIRST_RUN_SLACK_S:
            slow[name] = (first, steady)
    assert not slow, f"first run over {FIRST_RUN_RATIO}x steady state: {slow}"


def test_eager_engine_report(runs):
    """enforce_eager turns vLLM's JIT warm-up off: what that costs, for the record."""
    data, log = _get(runs, "warm-start-eager")
    after = _builds_after_ready(data)
    stalls = _stalls(data)
    worst = max(stalls.items(), key=lambda item: item[1][0] - item[1][1])
    print(
        f"\nwarm-start-eager: engine start {data['engine_start_s']}s; FlashInfer builds after"
        f" ready: {len(after)} ({sum(b['seconds'] for b in after):.1f}s of build time); log"
        f" lines after ready: {len(_log_builds_after_ready(log))}; worst first run"
        f" {worst[0]} {worst[1][0]:.2f}s against {worst[1][1]:.3f}s steady"
    )
    for build in after:
        print(f"  {build['toolchain']:8s} {build['seconds']:6.2f}s {build['name']}")
    assert stalls, "the eager run measured no shape"
