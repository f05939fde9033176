"""End-to-end tests of the patched vLLM on an SM90/SM12x GPU (never CI).

    vllm-minimax apply --target SITE      # the vLLM these tests import
    python -m pytest -q tests/gpu_e2e

The engine configurations in `ENGINE_RUNS` run once per session, one after the
other, each in its own process (`engine_run.py`); the tests read their JSON
results and logs, and refuse a run that another revision of the series
produced (`vllm_minimax.testing.series_record`). (Engines started side by side
on one GPU fail their memory profiling: each counts the others' allocations
against its own budget.) A run whose JSON is already in the directory is not
repeated when its recorded series is this checkout's; one of another series is
refused (delete it to re-run). Set
`VLLM_MINIMAX_E2E_DIR` to keep them (default: a pytest temporary directory),
`VLLM_MINIMAX_TINY_MODEL` to reuse a checkpoint from `vllm-minimax
make-tiny-model --initializer-range 0.1 --mtp-modules 1` (without its `mtp/`
draft the `mtp-*` runs record an error and test_mtp.py fails).

Set `VLLM_MINIMAX_E2E_RUNS=a,b` to start only the engine runs named (each other run records an
error, so only the tests that need just those can pass; `scripts/gpu-e2e engine-min`).

Set `VLLM_MINIMAX_E2E_SAVED=DIR` to re-check saved runs on any machine, GPU or
not: the tests read `DIR/<run>.json` and `.log` and start no engine; a run not
in DIR, or one of another series, fails the tests that need it (runs saved
before runs recorded their series fail as "unknown series"). `test_serve.py`
needs a live GPU and is skipped in that mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_minimax.testing.series_record import series_mismatch
from vllm_minimax.tiny_model import MTP_SUBDIRECTORY

HERE = Path(__file__).parent
SAVED_RUNS_ENV = "VLLM_MINIMAX_E2E_SAVED"
SELECTED_RUNS_ENV = "VLLM_MINIMAX_E2E_RUNS"
# Sharper than the default 0.02 init: a wrong block moves the logprobs more and
# greedy margins are wider (see test_engine.py).
E2E_INITIALIZER_RANGE = 0.1
# One MTP module (vLLM 0.34.0 runs every draft step on module 0 anyway), K = 2
# speculated tokens: the target verifies 3 query tokens per decoding request.
# test_mtp.py names the mtp-* runs and their non-MTP counterparts.
E2E_MTP_MODULES = 1
E2E_MTP_TOKENS = 2


@dataclass(frozen=True)
class EngineRun:
    backend: str
    kv_dtype: str = "fp8"
    graphs: bool = False
    audit: bool = False
    mtp: int = 0  # speculated tokens a step with the MTP draft (0: no speculation)
    fault: str = ""  # engine_run.py --fault: a planted bug, for a control run


ENGINE_RUNS = {
    "triton-eager": EngineRun("triton", audit=True),
    "flashinfer-eager": EngineRun("flashinfer", audit=True),
    "auto-graphs": EngineRun("auto", graphs=True, audit=True),
    "triton-graphs": EngineRun("triton", graphs=True, audit=True),
    "bf16-auto-eager": EngineRun("auto", kv_dtype="bf16"),
    "bf16-flashinfer-eager": EngineRun("flashinfer", kv_dtype="bf16"),
    "mtp-triton-eager": EngineRun("triton", mtp=E2E_MTP_TOKENS),
    "mtp-flashinfer-eager": EngineRun("flashinfer", audit=True, mtp=E2E_MTP_TOKENS),
    "mtp-triton-graphs": EngineRun("triton", graphs=True, mtp=E2E_MTP_TOKENS),
    "mtp-flashinfer-graphs": EngineRun("flashinfer", graphs=True, audit=True, mtp=E2E_MTP_TOKENS),
    "page-count-fault-flashinfer-eager": EngineRun("flashinfer", fault="page-count"),
}


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory) -> Path:
    configured = os.environ.get("VLLM_MINIMAX_E2E_DIR")
    path = Path(configured) if configured else tmp_path_factory.mktemp("e2e")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_model(e2e_dir) -> Path:
    configured = os.environ.get("VLLM_MINIMAX_TINY_MODEL")
    if configured:
        return Path(configured)
    from vllm_minimax.tiny_model import make_tiny_model

    directory = e2e_dir / "tiny-minimax-m3"
    make_tiny_model(directory, initializer_range=E2E_INITIALIZER_RANGE, mtp_modules=E2E_MTP_MODULES)
    return directory


@dataclass
class EngineResult:
    name: str
    data: dict
    log: str

    @property
    def error(self) -> str | None:
        return self.data.get("error")

    @property
    def sm90(self) -> bool:
        """Whether the run came from an SM90 GPU (runs saved before the
        capability was recorded came from the H200)."""
        return tuple(self.data.get("device_capability") or (9, 0)) == (9, 0)

    def workload(self, name: str) -> list[dict]:
        return self.data["workloads"][name]["requests"]


def _run_engine(name: str, run: EngineRun, model: Path, out_dir: Path) -> EngineResult:
    out = out_dir / f"{name}.json"
    log = out_dir / f"{name}.log"
    draft = model / MTP_SUBDIRECTORY / "config.json"
    if run.mtp and not out.exists() and not draft.exists():
        message = f"no MTP draft at {draft.parent} (make-tiny-model --mtp-modules 1)"
        return EngineResult(name, {"error": message}, "")
    if not out.exists():
        cmd = [
            sys.executable,
            str(HERE / "engine_run.py"),
            f"--model={model}",
            f"--backend={run.backend}",
            f"--kv-dtype={run.kv_dtype}",
            f"--out={out}",
        ]
        cmd += ["--graphs"] * run.graphs + ["--audit"] * run.audit
        cmd += [f"--mtp={run.mtp}"] * bool(run.mtp)
        cmd += [f"--fault={run.fault}"] * bool(run.fault)
        began = time.perf_counter()
        with log.open("w") as handle:
            subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, timeout=900, check=False)
        print(f"e2e: {name} took {time.perf_counter() - began:.0f}s", flush=True)
    text = log.read_text(errors="replace") if log.exists() else ""
    if not out.exists():
        return EngineResult(name, {"error": f"no result; log tail:\n{text[-3000:]}"}, text)
    hint = "delete it to run this configuration again"
    return _checked_series(EngineResult(name, json.loads(out.read_text()), text), out, hint)


def _checked_series(result: EngineResult, out: Path, hint: str) -> EngineResult:
    """`result`, or an error result where its run is not of this checkout's series."""
    mismatch = series_mismatch(result.data)
    if mismatch is None:
        return result
    return EngineResult(result.name, {"error": f"{out} refused: {mismatch}; {hint}"}, result.log)


def _saved_run(name: str, directory: Path) -> EngineResult:
    out, log = directory / f"{name}.json", directory / f"{name}.log"
    if not out.exists():
        return EngineResult(name, {"error": f"{out} is not among the saved runs"}, "")
    text = log.read_text(errors="replace") if log.exists() else ""
    hint = "re-check runs saved by this series"
    return _checked_series(EngineResult(name, json.loads(out.read_text()), text), out, hint)


@pytest.fixture(scope="session")
def engine_results(request) -> dict[str, EngineResult]:
    saved = os.environ.get(SAVED_RUNS_ENV)
    if saved:
        return {name: _saved_run(name, Path(saved)) for name in ENGINE_RUNS}
    model = request.getfixturevalue("tiny_model")
    out_dir = request.getfixturevalue("e2e_dir")
    selected = _selected_runs()
    return {
        name: _run_engine(name, run, model, out_dir)
        if name in selected
        else EngineResult(name, {"error": f"not started: {SELECTED_RUNS_ENV} leaves it out"}, "")
        for name, run in ENGINE_RUNS.items()
    }


def _selected_runs() -> set[str]:
    """The runs `VLLM_MINIMAX_E2E_RUNS` names (all when unset); an unknown name fails the
    tests before any engine starts."""
    configured = os.environ.get(SELECTED_RUNS_ENV, "").strip()
    if not configured:
        return set(ENGINE_RUNS)
    names = {name.strip() for name in configured.split(",") if name.strip()}
    unknown = sorted(names - set(ENGINE_RUNS))
    if unknown:
        known = ", ".join(ENGINE_RUNS)
        raise pytest.UsageError(f"{SELECTED_RUNS_ENV}: no run {', '.join(unknown)}; known: {known}")
    return names


# The score-workspace run (test_score_workspace.py): one long-context engine.
WORKSPACE_RUN = "score-workspace"
WORKSPACE_MAX_MODEL_LEN = 1 << 20


@pytest.fixture(scope="session")
def workspace_result(request) -> dict:
    """`workspace_run.py`'s JSON (run once, or read from the saved runs)."""
    saved = os.environ.get(SAVED_RUNS_ENV)
    if saved:
        out = Path(saved) / f"{WORKSPACE_RUN}.json"
        return json.loads(out.read_text()) if out.exists() else {"error": f"{out} not saved"}
    model = request.getfixturevalue("tiny_model")
    out_dir: Path = request.getfixturevalue("e2e_dir")
    out, log = out_dir / f"{WORKSPACE_RUN}.json", out_dir / f"{WORKSPACE_RUN}.log"
    if not out.exists():
        cmd = [
            sys.executable,
            str(HERE / "workspace_run.py"),
            f"--model={model}",
            f"--max-model-len={WORKSPACE_MAX_MODEL_LEN}",
            f"--out={out}",
        ]
        began = time.perf_counter()
        with log.open("w") as handle:
            subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, timeout=560, check=False)
        print(f"e2e: {WORKSPACE_RUN} took {time.perf_counter() - began:.0f}s", flush=True)
    if not out.exists():
        return {"error": f"no result; log tail:\n{log.read_text(errors='replace')[-3000:]}"}
    return json.loads(out.read_text())
