"""One tensor-parallel engine run of the patched MiniMax M3; results as JSON.

    python tests/gpu_e2e/tp_engine.py --model DIR --tp N --attend flashinfer \
        --kv-cache-dtype fp8 [--expert-parallel] --out run.json > run.log 2>&1

DIR is a `make-tiny-model --geometry m3-heads` checkpoint (64 query heads, 4 KV and
4 index heads): at TP N a rank holds 64 / N query heads and max(1, 4 / N) KV and
index heads, what it holds of the real model. The FlashInfer indexer is asked for
(``minimax_m3_indexer_backend`` auto on an fp8 index cache, as the shipped configs
set it) and the sparse attend is ``--attend``. vLLM's defaults otherwise (CUDA
graphs, chunked prefill, prefix caching). The prompts (random ids from a fixed
seed: 8k and 16k tokens, and the 8k one again so it hits the prefix cache) are
scored with prompt logprobs and decode 16 greedy tokens. The FlashInfer JIT cache,
which every rank of the host shares, is listed before the first request and
after the last: files that appear are programs some rank built after the engine
was ready. Every rank logs its backend selection to the log the caller captures
(tests/gpu_e2e/test_tp_engine.py reads both).

NVLink multicast must stay off on the lent multi-GPU machines: a run with TP > 1
refuses to start unless the environment keeps it off (MULTICAST_OFF).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from vllm_minimax.testing.engine_runs import generate_seeded_prompts, record_run

PROMPT_LENS = (8192, 16384, 8192)
MAX_TOKENS = 16
# What keeps NCCL, PyTorch, NVSHMEM and vLLM's all-reduce off NVLink multicast.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
}


def multicast_not_off(environ: dict[str, str]) -> list[str]:
    """The variables of MULTICAST_OFF that ``environ`` does not set to their value."""
    return [
        f"{name}={environ.get(name, '<unset>')} (need {value})"
        for name, value in MULTICAST_OFF.items()
        if environ.get(name) != value
    ]


def run(args: argparse.Namespace) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        seed=0,
        tensor_parallel_size=args.tp,
        enable_expert_parallel=args.expert_parallel,
        max_model_len=32768,
        max_num_batched_tokens=8192,
        max_num_seqs=16,
        gpu_memory_utilization=0.3,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=128,
        attention_config={
            "indexer_kv_dtype": "fp8",
            "minimax_m3_indexer_backend": "auto",
            "minimax_m3_sparse_attention_backend": args.attend,
        },
    )
    result: dict = {
        "tensor_parallel_size": args.tp,
        "expert_parallel": args.expert_parallel,
        "attend": args.attend,
        "kv_cache_dtype": args.kv_cache_dtype,
        "engine_start_s": round(time.perf_counter() - started, 1),
    }
    result.update(
        generate_seeded_prompts(
            llm,
            PROMPT_LENS,
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=0),
        )
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, choices=[1, 2, 4, 8], required=True)
    parser.add_argument("--attend", choices=["auto", "flashinfer", "triton"], required=True)
    parser.add_argument("--kv-cache-dtype", choices=["fp8", "auto"], default="fp8")
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    unsafe = multicast_not_off(dict(os.environ)) if args.tp > 1 else []
    if unsafe:
        print("NVLink multicast is not off: " + ", ".join(unsafe), file=sys.stderr)
        return 2
    return record_run(lambda: run(args), args.out)


if __name__ == "__main__":
    sys.exit(main())
