"""The engine comparison of the FlashInfer sparse attend, re-checked on the H100
runs committed under results/h100/sparse-attention/engine, and shown to fail
when a FlashInfer run is replaced by the control (a bf16-cache run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from vllm_minimax.testing.engine_runs import (
    SPARSE_ATTEND_RATIO_BOUND,
    load_run,
    mean_abs_diff,
    record_run,
)

ROOT = Path(__file__).resolve().parents[2]
SAVED = ROOT / "results" / "h100" / "sparse-attention" / "engine"
TEST = ROOT / "tests" / "gpu_e2e" / "test_sparse_attention_engine.py"


def _pytest(
    runs: Path, test: Path = TEST, runs_env: str = "VLLM_MINIMAX_SA_RUNS"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
        env={**os.environ, runs_env: str(runs)},
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
    control = mean_abs_diff(load_run(SAVED, "triton-graphs"), load_run(SAVED, "triton-bf16-graphs"))
    real = mean_abs_diff(load_run(SAVED, "flashinfer-graphs"), load_run(SAVED, "triton-graphs"))
    # The margin: the measured pair sits at about half the bound; the control
    # pair, at 1 x control by definition, is about four times it.
    assert real < 0.75 * SPARSE_ATTEND_RATIO_BOUND * control
    assert SPARSE_ATTEND_RATIO_BOUND < 0.3


LAYOUT_TEST = ROOT / "tests" / "gpu_e2e" / "test_sparse_attention_layout.py"


def _layout_runs(
    directory: Path, flashinfer_layout: str = "LBHNC", flashinfer: str = "flashinfer-graphs"
) -> Path:
    """The layout phase's three runs, stood in for by the committed H100 runs of the same kind
    (FlashInfer, Triton on fp8, Triton on bf16), each with the layout the phase would record."""
    for name, saved, layout in (
        ("gqa2-flashinfer-graphs", flashinfer, flashinfer_layout),
        ("gqa2-nhd-flashinfer-graphs", "triton-graphs", "LBNHC"),
        ("gqa2-triton-bf16-graphs", "triton-bf16-graphs", "LBHNC"),
    ):
        run = {**load_run(SAVED, saved), "kv_cache_layout": layout}
        (directory / f"{name}.json").write_text(json.dumps(run))
    return directory


def _pytest_layout(runs: Path) -> subprocess.CompletedProcess[str]:
    return _pytest(runs, LAYOUT_TEST, "VLLM_MINIMAX_SA_LAYOUT_RUNS")


def test_the_layout_checks_pass_runs_of_the_expected_kind(tmp_path):
    result = _pytest_layout(_layout_runs(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:]
    assert "6 passed" in result.stdout


def test_the_layout_checks_fail_a_flashinfer_run_on_interleaved_pages(tmp_path):
    result = _pytest_layout(_layout_runs(tmp_path, flashinfer_layout="LBNHC"))
    assert result.returncode != 0
    assert "1 failed" in result.stdout and "dense_pages" in result.stdout


def test_the_layout_checks_fail_a_flashinfer_run_replaced_by_the_control(tmp_path):
    result = _pytest_layout(_layout_runs(tmp_path, flashinfer="triton-bf16-graphs"))
    assert result.returncode != 0
    assert "1 failed" in result.stdout and "within_bound" in result.stdout


def test_a_run_script_records_its_result_or_its_error(tmp_path):
    """record_run, behind sparse_attention_engine.py and tp_engine.py: a run that raises
    leaves its error for the checks to report, and the exit status says which it was."""
    out = tmp_path / "run.json"
    assert record_run(lambda: {"requests": []}, out) == 0
    assert json.loads(out.read_text()) == {"requests": []}

    def engine_fails() -> dict:
        raise RuntimeError("no KV cache fits")

    assert record_run(engine_fails, out) == 1
    assert json.loads(out.read_text()) == {"error": "RuntimeError: no KV cache fits"}
