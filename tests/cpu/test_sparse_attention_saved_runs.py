"""The engine comparison of the FlashInfer sparse attend, re-checked on the H100 runs of
results/h100/sparse-attention-review/engine, and shown to fail when a FlashInfer run is
replaced by the control (a bf16-cache run) or when a kernel of the series compiles after the
engine was ready.

The runs are read from tests/cpu/fixtures/sparse_attention_engine: the five runs whole but for
their prompt logprobs, of which every 16th position is kept (4,096 of 65,536 a run; see the
folder's README.md). On them FlashInfer sits at 0.128 x control against the full runs' 0.131
(results/h100/sparse-attention-review/engine/runs.json)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from vllm_minimax.testing.engine_runs import (
    SPARSE_ATTEND_RATIO_BOUND,
    load_run,
    mean_abs_diff,
    record_run,
    sparse_layer_attends,
)

ROOT = Path(__file__).resolve().parents[2]
SAVED = ROOT / "tests" / "cpu" / "fixtures" / "sparse_attention_engine"
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


def test_the_fixture_holds_the_five_runs_and_their_thinned_logprobs():
    """Guards the fixture itself: five runs, four requests each, whose prompt logprobs are the
    full runs' every 16th position (8,192 to 24,576 prompt tokens a request)."""
    names = sorted(path.name.removesuffix(".json") for path in SAVED.glob("*.json"))
    assert names == sorted(
        [
            "flashinfer-eager",
            "flashinfer-graphs",
            "mtp-flashinfer-graphs",
            "triton-bf16-graphs",
            "triton-graphs",
        ]
    )
    for name in names:
        lengths = [len(r["prompt_logprobs"]) for r in load_run(SAVED, name)["requests"]]
        assert lengths == [8192 // 16, 16384 // 16, 24576 // 16, 16384 // 16], name


def test_committed_runs_pass_the_engine_checks():
    result = _pytest(SAVED)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "10 passed" in result.stdout


def _saved_runs(directory: Path, **changes: dict) -> Path:
    """The committed runs in `directory`, each run named in `changes` updated with its dict
    (a key set to None is removed)."""
    for path in SAVED.glob("*.json"):
        name = path.name.removesuffix(".json")
        run = {**load_run(SAVED, name), **changes.get(name, {})}
        run = {key: value for key, value in run.items() if value is not None}
        (directory / f"{name}.json").write_text(json.dumps(run))
    return directory


# A kernel of the series that a missed warm-up would compile on the first decode.
SERIES_KERNEL_AFTER_READY = {
    "event": "Triton kernel JIT compilation",
    "kernel": "_sparse_attn_decode_kernel",
}


def test_the_engine_checks_fail_a_kernel_of_the_series_compiled_after_ready(tmp_path):
    stock = load_run(SAVED, "triton-graphs")["jit_compiled_after_ready"]
    assert [event["kernel"] for event in stock] == ["_topk_log_softmax_kernel"]
    late = {"jit_compiled_after_ready": [*stock, SERIES_KERNEL_AFTER_READY]}
    result = _pytest(_saved_runs(tmp_path, **{"triton-graphs": late}))
    assert result.returncode != 0
    assert "1 failed" in result.stdout and "_sparse_attn_decode_kernel" in result.stdout


def test_the_engine_checks_fail_the_sampler_kernel_where_the_series_warms_it(tmp_path):
    """The saved runs predate patch 0009, so their sampler kernel passes as stock vLLM's; a run
    whose vLLM warmed it (``logprobs_kernel_warmed``) and still compiled it after ready fails."""
    result = _pytest(_saved_runs(tmp_path, **{"triton-graphs": {"logprobs_kernel_warmed": True}}))
    assert result.returncode != 0
    assert "1 failed" in result.stdout and "_topk_log_softmax_kernel" in result.stdout


def test_the_engine_checks_fail_a_run_without_the_jit_record(tmp_path):
    unrecorded = {"jit_compiled_after_ready": None}
    result = _pytest(_saved_runs(tmp_path, **{"flashinfer-graphs": unrecorded}))
    assert result.returncode != 0
    assert "1 failed" in result.stdout and "recorded no JIT monitor events" in result.stdout


@pytest.mark.parametrize("run", ["flashinfer-graphs", "mtp-flashinfer-graphs"])
def test_a_flashinfer_run_replaced_by_the_control_fails(tmp_path, run):
    for path in SAVED.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    shutil.copy(SAVED / "triton-bf16-graphs.json", tmp_path / f"{run}.json")
    result = _pytest(tmp_path)
    assert result.returncode != 0
    failed = f"FAILED {TEST.relative_to(ROOT)}::test_flashinfer_within_bound_of_triton[{run}]"
    assert failed in result.stdout


def test_the_bound_separates_the_measured_pair_from_the_control():
    control = mean_abs_diff(load_run(SAVED, "triton-graphs"), load_run(SAVED, "triton-bf16-graphs"))
    real = mean_abs_diff(load_run(SAVED, "flashinfer-graphs"), load_run(SAVED, "triton-graphs"))
    # The margin: the measured pair sits at about half the bound; the control
    # pair, at 1 x control by definition, is about four times it.
    assert real < 0.75 * SPARSE_ATTEND_RATIO_BOUND * control
    assert SPARSE_ATTEND_RATIO_BOUND < 0.3


LAYOUT_TEST = ROOT / "tests" / "gpu_e2e" / "test_sparse_attention_layout.py"
# The sparse attention layers of the layout phase's tiny model (its layers 1 and 3).
SPARSE_LAYERS = ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")
# What the patched impl raises there (its text is checked against the fragments in
# tests/cpu/patched_vllm/test_sparse_attention_selection.py).
FORCED_NHD_ERROR = (
    "ValueError: minimax_m3_sparse_attention_backend='flashinfer' cannot run "
    "model.layers.1.self_attn.attn: the LBNHC KV-cache layout does not store the pages as the "
    "dense [pages, kv_heads, 128, 256] rows FlashInfer's SM90 prefill reads (shape (96, 2, 128, "
    "256), strides (65536, 256, 512, 1)). Use the LBHNC layout (leave VLLM_KV_CACHE_LAYOUT "
    "unset, which lets this backend ask for it, or set VLLM_KV_CACHE_LAYOUT=LBHNC), or set "
    "minimax_m3_sparse_attention_backend to 'auto' or 'triton'"
)


def _layout_runs(
    directory: Path,
    flashinfer_layout: str = "LBHNC",
    flashinfer: str = "flashinfer-graphs",
    flashinfer_attends: tuple[str, ...] = ("flashinfer", "flashinfer"),
    forced_nhd: dict | None = None,
) -> Path:
    """The layout phase's four runs, stood in for by the committed H100 runs of the same kind
    (FlashInfer, Triton on fp8, Triton on bf16), each with the layout and the per-layer attends
    the phase would record, and the forced-NHD run's start-up error."""
    for name, saved, layout, attends in (
        ("gqa2-flashinfer-graphs", flashinfer, flashinfer_layout, flashinfer_attends),
        ("gqa2-nhd-auto-graphs", "triton-graphs", "LBNHC", ("triton", "triton")),
        ("gqa2-triton-bf16-graphs", "triton-bf16-graphs", "LBHNC", ("triton", "triton")),
    ):
        run = {
            **load_run(SAVED, saved),
            "kv_cache_layout": layout,
            "sparse_attends": dict(zip(SPARSE_LAYERS, attends, strict=True)),
        }
        (directory / f"{name}.json").write_text(json.dumps(run))
    forced = {"error": FORCED_NHD_ERROR} if forced_nhd is None else forced_nhd
    (directory / "gqa2-nhd-flashinfer-graphs.json").write_text(json.dumps(forced))
    return directory


def _pytest_layout(runs: Path) -> subprocess.CompletedProcess[str]:
    return _pytest(runs, LAYOUT_TEST, "VLLM_MINIMAX_SA_LAYOUT_RUNS")


def test_the_layout_checks_pass_runs_of_the_expected_kind(tmp_path):
    result = _pytest_layout(_layout_runs(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:]
    assert "10 passed" in result.stdout


def test_the_layout_checks_fail_a_triton_decode_compiled_after_ready(tmp_path):
    """The NHD run's Triton attend needs its decode kernels built by the warm-up."""
    runs = _layout_runs(tmp_path)
    path = runs / "gqa2-nhd-auto-graphs.json"
    run = json.loads(path.read_text())
    run["jit_compiled_after_ready"] = [SERIES_KERNEL_AFTER_READY]
    path.write_text(json.dumps(run))
    result = _pytest_layout(runs)
    assert result.returncode != 0
    assert "1 failed" in result.stdout and "gqa2-nhd-auto-graphs" in result.stdout


def test_the_layout_checks_fail_a_flashinfer_run_on_interleaved_pages(tmp_path):
    result = _pytest_layout(_layout_runs(tmp_path, flashinfer_layout="LBNHC"))
    assert result.returncode != 0
    assert "1 failed" in result.stdout and "dense_pages" in result.stdout


def test_the_layout_checks_fail_a_flashinfer_run_whose_layer_fell_back_to_triton(tmp_path):
    result = _pytest_layout(_layout_runs(tmp_path, flashinfer_attends=("flashinfer", "triton")))
    assert result.returncode != 0
    assert "1 failed" in result.stdout and "dense_pages_in_every_layer" in result.stdout


def test_the_layout_checks_fail_a_forced_nhd_run_that_started(tmp_path):
    """What the series did before: a forced FlashInfer on NHD pages warned once and attended
    with Triton."""
    started = {**load_run(SAVED, "triton-graphs"), "kv_cache_layout": "LBNHC"}
    started["sparse_attends"] = dict.fromkeys(SPARSE_LAYERS, "triton")
    result = _pytest_layout(_layout_runs(tmp_path, forced_nhd=started))
    assert result.returncode != 0
    assert "1 failed" in result.stdout and "stops_at_start" in result.stdout


def test_the_layout_checks_fail_a_forced_nhd_error_without_the_fix(tmp_path):
    vague = {"error": "ValueError: the KV cache pages are not dense"}
    result = _pytest_layout(_layout_runs(tmp_path, forced_nhd=vague))
    assert result.returncode != 0
    assert "1 failed" in result.stdout and "stops_at_start" in result.stdout


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


def test_a_run_records_the_attend_each_sparse_layer_resolved():
    """sparse_layer_attends, which sparse_attention_engine.py runs in the worker: the FlashInfer
    impl's resolved attend, a fixed impl's attend by class, and an impl with no cache bound
    yet as unresolved (a FlashInfer run recording it fails the layout check)."""

    class MiniMaxM3SparseFlashInferImpl:
        def __init__(self, attend):
            self.attend = attend

    class MiniMaxM3SparseTritonImpl:
        pass

    def layer(impl):
        return types.SimpleNamespace(impl=impl, indexer=object())

    context = {
        "model.layers.3.self_attn.attn": layer(MiniMaxM3SparseFlashInferImpl("triton")),
        "model.layers.1.self_attn.attn": layer(MiniMaxM3SparseFlashInferImpl("flashinfer")),
        "model.layers.5.self_attn.attn": layer(MiniMaxM3SparseTritonImpl()),
        "model.layers.7.self_attn.attn": layer(MiniMaxM3SparseFlashInferImpl(None)),
        "model.layers.0.self_attn.attn": types.SimpleNamespace(impl=object()),  # dense layer
    }
    worker = types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(
            compilation_config=types.SimpleNamespace(static_forward_context=context)
        )
    )
    assert sparse_layer_attends(worker) == {
        "model.layers.1.self_attn.attn": "flashinfer",
        "model.layers.3.self_attn.attn": "triton",
        "model.layers.5.self_attn.attn": "triton",
        "model.layers.7.self_attn.attn": "unresolved (MiniMaxM3SparseFlashInferImpl)",
    }
