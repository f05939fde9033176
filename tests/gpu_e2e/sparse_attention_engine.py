"""One engine run of the sparse attend on a tiny MiniMax M3; results as JSON.

    python tests/gpu_e2e/sparse_attention_engine.py --model DIR --attend flashinfer \
        --kv-cache-dtype fp8 [--eager] [--mtp K] [--max-num-seqs N] --out run.json

The model must have 8 or 16 query heads per KV head (one TP rank's group) for
FlashInfer's attend to run; `make-tiny-model` with those head counts makes one.
vLLM's defaults otherwise (CUDA graphs, chunked prefill, prefix caching). The
prompts (random ids from a fixed seed: 8k, 16k and 24k tokens, the 16k one twice
so the second hits the prefix cache) are scored with prompt logprobs and decode
32 greedy tokens. The FlashInfer JIT cache is listed before the first request
and after the last: files that appear are programs built after the engine was
ready. The run records the KV-cache layout the engine resolved (``kv_cache_layout``;
``VLLM_KV_CACHE_LAYOUT`` forces one), per sparse attention layer, the attend its impl
resolved for the bound cache (``sparse_attends``: flashinfer, triton or msa), and every kernel
vLLM's JIT monitor saw compiled after the engine was ready (``jit_compiled_after_ready``;
Triton's included, the monitor in its warn mode, so that a kernel compiled then is recorded
rather than ending the run), and whether the tree warms vLLM's own sampler kernel, which stock
vLLM compiles at the first logprobs request (``logprobs_kernel_warmed``: patch 0009). It
records what the process holds on the GPU once the engine is ready
(``gpu_used_after_ready_gib``), beside the share of the card it was given. An engine that does
not start records its error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from vllm_minimax.testing.engine_runs import (
    generate_seeded_prompts,
    logprobs_kernel_warmed,
    record_run,
    recording_jit_events,
    sparse_layer_attends,
)

PROMPT_LENS = (8192, 16384, 24576, 16384)
GPU_MEMORY_UTILIZATION = 0.3


def run(args: argparse.Namespace) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm import LLM, SamplingParams

    speculative_config = None
    if args.mtp:
        from vllm_minimax.testing import mtp_draft

        speculative_config = mtp_draft.speculative_config(args.model, args.mtp)
    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        seed=0,
        max_model_len=32768,
        max_num_batched_tokens=8192,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.eager,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=128,
        attention_config={
            "indexer_kv_dtype": "fp8",
            "minimax_m3_sparse_attention_backend": args.attend,
        },
        speculative_config=speculative_config,
        jit_monitor_mode="warn",
    )
    result: dict = {
        "engine_start_s": round(time.perf_counter() - started, 1),
        "kv_cache_layout": resolved_kv_cache_layout(llm),
        **memory_after_ready(),
    }
    try:
        result["sparse_attends"] = llm.collective_rpc(sparse_layer_attends)[0]
    except Exception as exc:  # the prompts still run; the checks report it
        result["sparse_attends_error"] = f"{type(exc).__name__}: {exc}"
    with recording_jit_events() as compiled:
        result.update(
            generate_seeded_prompts(
                llm,
                PROMPT_LENS,
                SamplingParams(temperature=0.0, max_tokens=32, prompt_logprobs=0, logprobs=1),
            )
        )
    result["jit_compiled_after_ready"] = compiled
    result["logprobs_kernel_warmed"] = logprobs_kernel_warmed(Path(vllm.__file__).parents[1])
    return result


def memory_after_ready() -> dict:
    """What the process holds on the GPU once the (in-process) engine is ready,
    against the share of the card it was given."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return {
        "gpu_used_after_ready_gib": round((total - free) / (1 << 30), 3),
        "gpu_total_gib": round(total / (1 << 30), 3),
        "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
    }


def resolved_kv_cache_layout(llm: object) -> str | None:
    """The layout the engine core recorded on the cache config (in-process engine core)."""
    engine = getattr(llm, "llm_engine", None)
    vllm_config = getattr(engine, "vllm_config", None)
    cache_config = getattr(vllm_config, "cache_config", None)
    return getattr(cache_config, "kv_cache_layout", None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--attend", choices=["auto", "flashinfer", "triton"], required=True)
    parser.add_argument("--kv-cache-dtype", choices=["fp8", "auto"], default="fp8")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--mtp", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    return record_run(lambda: run(args), args.out)


if __name__ == "__main__":
    sys.exit(main())
