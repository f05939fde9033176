"""The FlashInfer sparse attend on a rank with two KV heads: the KV-cache layout it asks for,
which attend each sparse layer resolved, and what a layout whose pages it cannot read does.

Reads the runs of `sparse_attention_engine.py` from `VLLM_MINIMAX_SA_LAYOUT_RUNS` (GPU runs,
checked here on any machine), made by `scripts/gpu-sparse-attention layout` on a tiny MiniMax
M3 with 16 query heads over 2 KV heads (a TP-2 rank's group of 8). Each run records, per
sparse attention layer, the attend its impl resolved for the bound cache (``sparse_attends``),
so a layer that falls back to Triton fails the check of a FlashInfer run:

- ``gqa2-flashinfer-graphs``: fp8 KV cache, the attend forced to FlashInfer. The backend puts
  LBHNC first among its layouts, so the engine resolves it, every head's pages are dense and
  every sparse layer attends with FlashInfer;
- ``gqa2-nhd-auto-graphs``: the same with ``VLLM_KV_CACHE_LAYOUT=NHD`` and the attend left to
  ``auto``. The pages interleave the heads, FlashInfer's prefill cannot read them, and every
  sparse layer attends with vLLM's Triton kernels (one log line says why); their decode kernels
  are built by the warm-up, so vLLM's JIT monitor sees none of them compiled after the engine
  is ready (nor vLLM's own sampler kernel, but in runs saved before patch 0009 warmed it,
  `STOCK_KERNELS_COMPILED_AFTER_READY`);
- ``gqa2-nhd-flashinfer-graphs``: NHD with the attend forced to FlashInfer: the engine does not
  start, and its error names the option, the layout and the fix;
- ``gqa2-triton-bf16-graphs``: the control, Triton on a bf16 KV cache.

The bound and the control's floor are those of `test_sparse_attention_engine.py` (derived in
`vllm_minimax.testing.engine_runs`): the two attends on one fp8 cache may differ by at most
0.26 of what the cache's dtype moves the prompt logprobs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_minimax.testing.engine_runs import (
    FORCED_FLASHINFER_NOT_DENSE,
    SPARSE_ATTEND_MIN_CONTROL,
    SPARSE_ATTEND_RATIO_BOUND,
    load_finished_run,
    load_run,
    mean_abs_diff,
    series_kernels_compiled_after_ready,
)

RUNS_ENV = "VLLM_MINIMAX_SA_LAYOUT_RUNS"

pytestmark = pytest.mark.skipif(
    not os.environ.get(RUNS_ENV), reason=f"set {RUNS_ENV} to a directory of engine runs"
)


def _load(name: str) -> dict:
    return load_finished_run(Path(os.environ[RUNS_ENV]), name)


def _attends(run: dict) -> set[str]:
    assert "sparse_attends_error" not in run, run["sparse_attends_error"]
    attends = run.get("sparse_attends")
    assert attends, "the run recorded no sparse attention layer"
    return set(attends.values())


def test_the_flashinfer_attend_gets_dense_pages_in_every_layer():
    run = _load("gqa2-flashinfer-graphs")
    assert run["kv_cache_layout"] == "LBHNC"
    assert _attends(run) == {"flashinfer"}, run["sparse_attends"]


def test_nhd_with_auto_attends_with_triton_in_every_layer():
    run = _load("gqa2-nhd-auto-graphs")
    assert run["kv_cache_layout"] == "LBNHC"
    assert _attends(run) == {"triton"}, run["sparse_attends"]


def test_nhd_with_flashinfer_forced_stops_at_start_with_the_reason():
    run = load_run(Path(os.environ[RUNS_ENV]), "gqa2-nhd-flashinfer-graphs")
    assert "error" in run, "the engine started: the layers attended with something else"
    for fragment in FORCED_FLASHINFER_NOT_DENSE:
        assert fragment in run["error"], run["error"]


def test_the_control_pair_moves_the_logprobs():
    control = mean_abs_diff(_load("gqa2-nhd-auto-graphs"), _load("gqa2-triton-bf16-graphs"))
    print(f"control (Triton fp8 vs bf16 KV): mean |d logprob| {control:.3e}")
    assert control > SPARSE_ATTEND_MIN_CONTROL


def test_flashinfer_on_dense_pages_within_bound_of_the_triton_fallback():
    control = mean_abs_diff(_load("gqa2-nhd-auto-graphs"), _load("gqa2-triton-bf16-graphs"))
    diff = mean_abs_diff(_load("gqa2-flashinfer-graphs"), _load("gqa2-nhd-auto-graphs"))
    print(f"FlashInfer (LBHNC) vs Triton (NHD): {diff:.3e} = {diff / control:.3f} x control")
    assert diff <= SPARSE_ATTEND_RATIO_BOUND * control


@pytest.mark.parametrize("run", ["gqa2-flashinfer-graphs", "gqa2-nhd-auto-graphs"])
def test_no_flashinfer_program_built_after_ready(run):
    assert _load(run)["jit_built_after_ready"] == []


@pytest.mark.parametrize(
    "run", ["gqa2-flashinfer-graphs", "gqa2-nhd-auto-graphs", "gqa2-triton-bf16-graphs"]
)
def test_no_kernel_of_the_series_compiled_after_ready(run):
    assert series_kernels_compiled_after_ready(_load(run)) == []
