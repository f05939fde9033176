"""The FlashInfer sparse attend on a rank with two KV heads: the KV-cache layout it asks for,
and the Triton fallback when the pages it reads are not dense.

Reads the runs of `sparse_attention_engine.py` from `VLLM_MINIMAX_SA_LAYOUT_RUNS` (GPU runs,
checked here on any machine), made by `scripts/gpu-sparse-attention layout` on a tiny MiniMax
M3 with 16 query heads over 2 KV heads (a TP-2 rank's group of 8), every run under vLLM's JIT
monitor in error mode:

- ``gqa2-flashinfer-graphs``: fp8 KV cache, the attend forced to FlashInfer. The backend puts
  LBHNC first among its layouts, so the engine resolves it and every head's pages are dense;
- ``gqa2-nhd-flashinfer-graphs``: the same with ``VLLM_KV_CACHE_LAYOUT=NHD``. The pages
  interleave the heads, FlashInfer's kernels cannot read them, and the whole step runs
  vLLM's Triton attend; its decode kernels are built by the warm-up, so nothing compiles
  after the engine is ready;
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
    SPARSE_ATTEND_MIN_CONTROL,
    SPARSE_ATTEND_RATIO_BOUND,
    load_finished_run,
    mean_abs_diff,
)

RUNS_ENV = "VLLM_MINIMAX_SA_LAYOUT_RUNS"

pytestmark = pytest.mark.skipif(
    not os.environ.get(RUNS_ENV), reason=f"set {RUNS_ENV} to a directory of engine runs"
)


def _load(name: str) -> dict:
    return load_finished_run(Path(os.environ[RUNS_ENV]), name)


def test_the_flashinfer_attend_gets_dense_pages():
    assert _load("gqa2-flashinfer-graphs")["kv_cache_layout"] == "LBHNC"


def test_a_forced_nhd_layout_is_kept():
    assert _load("gqa2-nhd-flashinfer-graphs")["kv_cache_layout"] == "LBNHC"


def test_the_control_pair_moves_the_logprobs():
    control = mean_abs_diff(_load("gqa2-nhd-flashinfer-graphs"), _load("gqa2-triton-bf16-graphs"))
    print(f"control (Triton fp8 vs bf16 KV): mean |d logprob| {control:.3e}")
    assert control > SPARSE_ATTEND_MIN_CONTROL


def test_flashinfer_on_dense_pages_within_bound_of_the_triton_fallback():
    control = mean_abs_diff(_load("gqa2-nhd-flashinfer-graphs"), _load("gqa2-triton-bf16-graphs"))
    diff = mean_abs_diff(_load("gqa2-flashinfer-graphs"), _load("gqa2-nhd-flashinfer-graphs"))
    print(f"FlashInfer (LBHNC) vs Triton (NHD): {diff:.3e} = {diff / control:.3f} x control")
    assert diff <= SPARSE_ATTEND_RATIO_BOUND * control


@pytest.mark.parametrize("run", ["gqa2-flashinfer-graphs", "gqa2-nhd-flashinfer-graphs"])
def test_no_flashinfer_program_built_after_ready(run):
    assert _load(run)["jit_built_after_ready"] == []
