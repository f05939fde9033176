"""Warm start: nothing is compiled after the engine says it is ready.

Engine starts of the tiny MiniMax M3 (FlashInfer indexer, fp8 index cache), each
in a fresh process (`warm_start_run.py`) with its own JIT caches (FlashInfer's
``FLASHINFER_WORKSPACE_BASE``, ``TRITON_CACHE_DIR``, ``VLLM_CACHE_ROOT``), in
this order, each under its own time limit; each result is copied to
``VLLM_MINIMAX_E2E_OUT`` as soon as it exists, so a cut phase keeps what it
measured:

- ``warm-start-graphs``: empty caches, vLLM's defaults (CUDA graphs on, JIT
  warm-up on) with ``jit_monitor_mode="error"``, every shape. After ready,
  FlashInfer's build log (one JSON line per nvcc build or CuTe-DSL compile,
  ``FLASHINFER_JIT_BUILD_LOG``) and its log lines ("Building JIT module",
  "Compiling CuTe-DSL kernel") must show nothing, no shape may fail (the JIT
  monitor raises on any Triton or CuTe-DSL compile), and each shape's first
  run must take at most 1.5x its steady state.
- ``warm-start-graphs-warm``: the same on the caches the first run filled, a
  few shapes: nothing built at all, the monitor clean.
- ``warm-start-nowarmup-warm`` / ``warm-start-nowarmup``: JIT warm-up off
  (``kernel_config.enable_jit_warmup=False``), warm and empty caches, start-up
  only: the start-time table (``test_start_time_table``).
- ``warm-start-eager``: ``enforce_eager`` on empty caches, under which vLLM
  turns its JIT warm-up off by design: reported, not asserted (builds after
  ready, the stall).

    python -m pytest -q -s tests/gpu_e2e/test_warm_start.py

`VLLM_MINIMAX_E2E_SAVED=DIR` re-checks saved runs (DIR/warm-start-*.json, .log).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import SAVED_RUNS_ENV
from warm_start_run import READY_MARKER

HERE = Path(__file__).parent
OUT_ENV = "VLLM_MINIMAX_E2E_OUT"


@dataclass(frozen=True)
class WarmStartRun:
    flags: tuple[str, ...] = ()
    workload: str = "full"
    caches_of: str | None = None  # reuse this run's caches (None: empty ones)
    time_limit_s: int = 300
    label: str = ""


RUNS = {
    "warm-start-graphs": WarmStartRun(time_limit_s=330, label="empty cache, warm-up on"),
    "warm-start-graphs-warm": WarmStartRun(
        workload="quick",
        caches_of="warm-start-graphs",
        time_limit_s=150,
        label="warm cache, warm-up on",
    ),
    "warm-start-nowarmup-warm": WarmStartRun(
        flags=("--no-jit-warmup",),
        workload="none",
        caches_of="warm-start-graphs",
        time_limit_s=120,
        label="warm cache, warm-up off",
    ),
    "warm-start-nowarmup": WarmStartRun(
        flags=("--no-jit-warmup",),
        workload="none",
        time_limit_s=200,
        label="empty cache, warm-up off",
    ),
    "warm-start-eager": WarmStartRun(
        flags=("--eager",), workload="quick", time_limit_s=240, label="enforce_eager, empty"
    ),
}
CACHE_NAMES = {
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "TRITON_CACHE_DIR": "triton",
    "VLLM_CACHE_ROOT": "vllm",
}

# A first run may take this much longer than the same shape's steady state.
FIRST_RUN_RATIO = 1.5
# Timer noise on shapes that take tens of milliseconds; a program build takes seconds.
FIRST_RUN_SLACK_S = 0.05
# The target for what the warm-up adds to a start on a warm cache.
WARM_CACHE_WARMUP_BUDGET_S = 30.0
BUILD_LINES = ("Building JIT module", "Compiling CuTe-DSL kernel")
WARMUP_LINES = (
    "MiniMax M3 FlashInfer indexer warm-up:",
    "MiniMax M3 sparse decode attention warm-up:",
    "Logprobs kernel warm-up:",
)
MONITOR_LINE = "during inference:"


def _cache_root(name: str, out_dir: Path) -> Path:
    spec = RUNS[name]
    if spec.caches_of is not None:
        roots = sorted(out_dir.glob(f"{spec.caches_of}-caches-*"))
        assert roots, f"{name}: the caches of {spec.caches_of} are gone"
        return roots[0]
    return Path(tempfile.mkdtemp(prefix=f"{name}-caches-", dir=out_dir))


def _keep(paths: list[Path]) -> None:
    """Copy a run's files to VLLM_MINIMAX_E2E_OUT as soon as they exist."""
    out = os.environ.get(OUT_ENV)
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    for path in paths:
        if path.exists():
            shutil.copy2(path, Path(out) / path.name)


def _run(name: str, model: Path, out_dir: Path) -> tuple[dict, str]:
    spec = RUNS[name]
    out, log = out_dir / f"{name}.json", out_dir / f"{name}.log"
    builds = out_dir / f"{name}.builds.jsonl"
    if not out.exists():
        root = _cache_root(name, out_dir)
        caches = {env: root / sub for env, sub in CACHE_NAMES.items()}
        for path in caches.values():
            path.mkdir(exist_ok=True)
        env = dict(
            os.environ,
            **{key: str(path) for key, path in caches.items()},
            FLASHINFER_JIT_BUILD_LOG=str(builds),
            PYTHONUNBUFFERED="1",
        )
        cmd = [
            sys.executable,
            str(HERE / "warm_start_run.py"),
            f"--model={model}",
            f"--cache-dir={caches['FLASHINFER_WORKSPACE_BASE']}",
            f"--workload={spec.workload}",
            f"--out={out}",
            *spec.flags,
        ]
        limit = int(os.environ.get("WARM_START_RUN_LIMIT_S", spec.time_limit_s))
        began = time.perf_counter()
        with log.open("w") as handle:
            try:
                subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=limit)
            except subprocess.TimeoutExpired:
                print(f"warm-start: {name} cut at its {limit}s limit", flush=True)
        print(f"warm-start: {name} took {time.perf_counter() - began:.0f}s", flush=True)
        _keep([out, log, builds])
    text = log.read_text(errors="replace") if log.exists() else ""
    if not out.exists():
        pytest.fail(f"{name}: no result; log tail:\n{text[-3000:]}")
    data = json.loads(out.read_text())
    if "builds" not in data:  # cut before the end: the build log is still there
        lines = builds.read_text().splitlines() if builds.exists() else []
        data["builds"] = [json.loads(line) for line in lines if line.strip()]
    return data, text


@pytest.fixture(scope="module")
def runs(request) -> Callable[[str], tuple[dict, str]]:
    """The run of a name, started at the first test that needs it (so ``-k graphs``
    skips the others), or read from the saved runs."""
    saved = os.environ.get(SAVED_RUNS_ENV)

    @functools.cache
    def run(name: str) -> tuple[dict, str]:
        if saved:
            out, log = Path(saved) / f"{name}.json", Path(saved) / f"{name}.log"
            if not out.exists():
                pytest.fail(f"{name} is not among the saved runs")
            data = json.loads(out.read_text())
            builds = Path(saved) / f"{name}.builds.jsonl"
            if "builds" not in data and builds.exists():
                lines = builds.read_text().splitlines()
                data["builds"] = [json.loads(line) for line in lines if line.strip()]
            return data, log.read_text(errors="replace") if log.exists() else ""
        model = request.getfixturevalue("tiny_model")
        out_dir = request.getfixturevalue("e2e_dir")
        return _run(name, model, out_dir)

    return run


def _compiles(data: dict, log: str) -> list[dict]:
    """The FlashInfer build records that made a program, not ninja's no-op checks.

    FlashInfer 0.7.4 appends a build record for every load of a JIT-cache nvcc
    module, up to date or not (``warm_start_run.mark_compiles``), so a warm cache
    logs one ~20 ms record per module. The issue counts programs compiled; the run
    marks each record ``compiled`` from the module's ``.so`` mtime. A run saved
    before that mark counts an nvcc record as a compile iff its log has
    FlashInfer's cold-build line for the module ("Building JIT module NAME").
    """
    cold = {line.split("Building JIT module ", 1)[1].split(";")[0].strip()
            for line in log.splitlines() if "Building JIT module " in line}  # fmt: skip
    return [
        b
        for b in data.get("builds", [])
        if b.get("compiled", b["toolchain"] != "nvcc" or b["name"] in cold)
    ]


def _builds_after_ready(data: dict, log: str) -> list[dict]:
    return [b for b in _compiles(data, log) if b["time"] > data["ready"]]


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


def _warmup_lines(log: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {marker: [] for marker in WARMUP_LINES}
    for line in log.splitlines():
        for marker in WARMUP_LINES:
            if marker in line:
                found[marker].append(line[line.index(marker) :])
    return found


def test_graphs_engine_builds_nothing_after_ready(runs):
    data, log = _get(runs, "warm-start-graphs")
    warmups = _warmup_lines(log)
    print(f"\nwarm-start-graphs: engine start {data['engine_start_s']}s on an empty cache")
    for lines in warmups.values():
        for line in lines:
            print("  " + line)
    before = [b for b in _compiles(data, log) if b["time"] <= data["ready"]]
    print(f"  FlashInfer builds before ready: {len(before)}, after ready: 0 expected")
    for marker, lines in warmups.items():
        assert lines, f"the engine log has no {marker!r} line"
    assert before, "no FlashInfer build before ready: the cache was not empty, or not used"
    after = _builds_after_ready(data, log)
    assert not after, "built after ready: " + ", ".join(b["name"] for b in after)
    logged = _log_builds_after_ready(log)
    assert not logged, "logged after ready:\n" + "\n".join(logged)


def test_graphs_engine_every_shape_runs_at_steady_state(runs):
    """No shape fails and none stalls. A failure after the first is reported as
    following it: the engine raised mid-step before it (in runs saved before the
    runner aborted by internal id, the first failure's requests also stayed in the
    batches of every later shape)."""
    data, _ = _get(runs, "warm-start-graphs")
    errors = {name: shape for name, shape in data["shapes"].items() if "error" in shape}
    if errors:
        first, *later = errors
        report = f"{first}: {errors[first]['error']}"
        for name in later:
            report += f"\n  then, after {first}'s failure, {name}: {errors[name]['error']}"
        pytest.fail(f"shapes that failed (the JIT monitor raises on a compile):\n{report}")
    slow = {}
    for name, (first, steady) in _stalls(data).items():
        print(f"  {name:24s} first {first:7.3f}s  steady {steady:7.3f}s")
        if first > FIRST_RUN_RATIO * steady + FIRST_RUN_SLACK_S:
            slow[name] = (first, steady)
    assert not slow, f"first run over {FIRST_RUN_RATIO}x steady state: {slow}"


def test_warm_cache_engine_builds_nothing(runs):
    data, log = _get(runs, "warm-start-graphs-warm")
    print(f"\nwarm-start-graphs-warm: engine start {data['engine_start_s']}s on a warm cache")
    for lines in _warmup_lines(log).values():
        for line in lines:
            print("  " + line)
    compiled = _compiles(data, log)
    loaded = len(data["builds"]) - len(compiled)
    print(f"  FlashInfer build records: {len(data['builds'])}, ninja no-op loads: {loaded}")
    assert not compiled, "compiled on a warm cache: " + ", ".join(b["name"] for b in compiled)
    errors = {name: shape["error"] for name, shape in data["shapes"].items() if "error" in shape}
    assert not errors, f"shapes that failed on a warm cache: {errors}"
    monitored = [line for line in log.splitlines() if MONITOR_LINE in line]
    assert not monitored, "JIT monitor events:\n" + "\n".join(monitored)


def _mib(data: dict, env: str) -> str:
    size = data.get("caches", {}).get(env)
    return f"{size['bytes'] / 2**20:.0f} MiB" if size else "-"


def test_start_time_table(runs):
    """The issue's figures: engine start with an empty and a warm cache, with and without
    the warm-up; programs built; the caches' sizes. The warm-up may add at most 30 s to a
    start on a warm cache."""
    names = [name for name in RUNS if name != "warm-start-eager"]
    rows = {name: _get(runs, name) for name in names}
    print("\n| start | engine start | FlashInfer compiles (before/after ready) | Triton kernels"
          " in cache | FlashInfer cache | Triton cache | vLLM cache |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, (data, log) in rows.items():
        after = len(_builds_after_ready(data, log))
        before = len(_compiles(data, log)) - after
        print(
            f"| {RUNS[name].label} | {data['engine_start_s']} s | {before} / {after} |"
            f" {data.get('triton_kernels', '-')} | {_mib(data, 'FLASHINFER_WORKSPACE_BASE')} |"
            f" {_mib(data, 'TRITON_CACHE_DIR')} | {_mib(data, 'VLLM_CACHE_ROOT')} |"
        )
    added = (
        rows["warm-start-graphs-warm"][0]["engine_start_s"]
        - rows["warm-start-nowarmup-warm"][0]["engine_start_s"]
    )
    print(f"warm-up added to a warm-cache start: {added:.1f}s")
    assert added < WARM_CACHE_WARMUP_BUDGET_S


def test_eager_engine_report(runs):
    """enforce_eager turns vLLM's JIT warm-up off: what that costs, for the record."""
    data, log = _get(runs, "warm-start-eager")
    after = _builds_after_ready(data, log)
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
