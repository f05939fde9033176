"""The engine comparison of the FlashInfer sparse attend, re-checked on the H100
runs committed under results/h100/sparse-attention/engine, and shown to fail
when a FlashInfer run is replaced by the control (a bf16-cache run)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from vllm_minimax.testing.engine_runs import load_run, mean_abs_diff

ROOT = Path(__file__).resolve().parents[2]
SAVED = ROOT / "results" / "h100" / "sparse-attention" / "engine"
TEST = ROOT / "tests" / "gpu_e2e" / "test_sparse_attention_engine.py"


def _engine_checks():
    spec = importlib.util.spec_from_file_location("sparse_attention_engine_checks", TEST)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pytest(runs: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TEST)],
        env={**os.environ, "VLLM_MINIMAX_SA_RUNS": str(runs)},
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )


def test_committed_runs_pass_the_engine_checks():
    result = _pytest(SAVED)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "4 passed" in result.stdout


def test_a_flashinfer_run_replaced_by_the_control_fails(tmp_path):
    for path in SAVED.glob("*.json.gz"):
        shutil.copy(path, tmp_path / path.name)
    shutil.copy(SAVED / "triton-bf16-graphs.json.gz", tmp_path / "flashinfer-graphs.json.gz")
    result = _pytest(tmp_path)
    assert result.returncode != 0
    assert "FAILED" in result.stdout and "flashinfer-graphs" in result.stdout


def test_the_bound_separates_the_measured_pair_from_the_control():
    checks = _engine_checks()
    control = mean_abs_diff(load_run(SAVED, "triton-graphs"), load_run(SAVED, "triton-bf16-graphs"))
    real = mean_abs_diff(load_run(SAVED, "flashinfer-graphs"), load_run(SAVED, "triton-graphs"))
    # The margin: the measured pair sits at about half the bound; the control
    # pair, at 1 x control by definition, is about four times it.
    assert real < 0.75 * checks.RATIO_BOUND * control
    assert checks.RATIO_BOUND < 0.3
