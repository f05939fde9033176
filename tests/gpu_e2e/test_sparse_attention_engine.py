"""The patched engine with FlashInfer's sparse attend against vLLM's Triton attend.

Reads the runs of `sparse_attention_engine.py` from `VLLM_MINIMAX_SA_RUNS` (a
directory of `<run>.json`; GPU runs, checked here on any machine):

- ``flashinfer-graphs`` and ``triton-graphs``: fp8 KV cache, vLLM's defaults;
- ``triton-bf16-graphs``: the control, a bf16 KV cache with Triton;
- ``flashinfer-eager``: FlashInfer without CUDA graphs;
- ``mtp-flashinfer-graphs``: FlashInfer with two speculative tokens from the model's MTP
  module, whose draft layer attends with FlashInfer too. Speculation leaves the target's
  prompt logprobs as they are, so they are held to the same bound against ``triton-graphs``.

After the engine is ready, nothing of the series compiles: no FlashInfer program is built, and
vLLM's JIT monitor sees no kernel compiled, vLLM's own sampler kernel included where the run
says its vLLM warms it (``logprobs_kernel_warmed``, patch 0009; the runs saved before it may
show that one, `STOCK_KERNELS_COMPILED_AFTER_READY`).

Bound (derived beside `SPARSE_ATTEND_RATIO_BOUND` in
`vllm_minimax.testing.engine_runs`): the two attends on one fp8 cache may differ
by at most 0.26 of what the cache's dtype moves the prompt logprobs; the control
pair (the same attend on the two caches) sits at 1 by definition and must be
large in absolute terms.
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
    series_kernels_compiled_after_ready,
)

RUNS_ENV = "VLLM_MINIMAX_SA_RUNS"

pytestmark = pytest.mark.skipif(
    not os.environ.get(RUNS_ENV), reason=f"set {RUNS_ENV} to a directory of engine runs"
)


def _load(name: str) -> dict:
    return load_finished_run(Path(os.environ[RUNS_ENV]), name)


def test_control_pair_moves_the_logprobs():
    control = mean_abs_diff(_load("triton-graphs"), _load("triton-bf16-graphs"))
    print(f"control (Triton fp8 vs bf16 KV): mean |d logprob| {control:.3e}")
    assert control > SPARSE_ATTEND_MIN_CONTROL


@pytest.mark.parametrize("run", ["flashinfer-graphs", "flashinfer-eager", "mtp-flashinfer-graphs"])
def test_flashinfer_within_bound_of_triton(run):
    control = mean_abs_diff(_load("triton-graphs"), _load("triton-bf16-graphs"))
    diff = mean_abs_diff(_load(run), _load("triton-graphs"))
    print(f"{run} vs triton-graphs: {diff:.3e} = {diff / control:.3f} x control")
    assert diff <= SPARSE_ATTEND_RATIO_BOUND * control


def test_no_flashinfer_program_built_after_ready():
    run = _load("flashinfer-graphs")
    assert run["jit_built_after_ready"] == []


@pytest.mark.parametrize(
    "run",
    [
        "flashinfer-graphs",
        "triton-graphs",
        "triton-bf16-graphs",
        "flashinfer-eager",
        "mtp-flashinfer-graphs",
    ],
)
def test_no_kernel_of_the_series_compiled_after_ready(run):
    assert series_kernels_compiled_after_ready(_load(run)) == []
