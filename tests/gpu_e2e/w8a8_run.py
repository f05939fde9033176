"""One engine on the tiny MXFP8 MiniMax M3: prompt logprobs of a fixed prompt set, as JSON.

    python tests/gpu_e2e/w8a8_run.py --model DIR [--w8a8] --out run.json

``--w8a8`` serves the checkpoint with the series' MXFP8 requantization (patch 0008):
``quantization_config`` = :data:`vllm_minimax.w8a8.W8A8_QUANTIZATION_CONFIG`, per-channel FP8
weights with power-of-two scales and per-token FP8 activations; without it the checkpoint runs
as vLLM 0.34.0 runs it (on SM90: Humming, W8A16). The engine runs eagerly (no CUDA graphs, no
torch.compile: the comparison is of numerics, and it keeps the start short), prefix caching
off, in this process. Prompts are random token ids from a fixed seed, identical in every run.
A start the engine refuses is recorded as ``error``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

PROMPTS = 4
PROMPT_TOKENS = 1536
PROMPT_SEED = 4321
FIRST_TOKEN_ID = 3  # below: <pad>, <s>, </s>


def run(args: argparse.Namespace) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_minimax.w8a8 import W8A8_QUANTIZATION_CONFIG

    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        seed=0,
        max_model_len=4096,
        max_num_seqs=8,
        enable_prefix_caching=False,
        enforce_eager=True,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_config={"indexer_kv_dtype": "fp8"},
        quantization_config=dict(W8A8_QUANTIZATION_CONFIG) if args.w8a8 else None,
    )
    result: dict = {"engine_start_s": round(time.perf_counter() - started, 1)}
    vocab = min(llm.get_tokenizer().vocab_size, llm.llm_engine.model_config.get_vocab_size())
    g = torch.Generator().manual_seed(PROMPT_SEED)
    prompts = [
        torch.randint(FIRST_TOKEN_ID, vocab, (PROMPT_TOKENS,), generator=g).tolist()
        for _ in range(PROMPTS)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False
    )
    result["prompt_logprobs"] = [
        [
            None if entry is None else entry[token].logprob
            for token, entry in zip(o.prompt_token_ids, o.prompt_logprobs, strict=True)
        ]
        for o in outputs
    ]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--w8a8", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    record: dict = {"model": args.model, "w8a8": args.w8a8}
    try:
        record.update(run(args))
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
    args.out.write_text(json.dumps(record) + "\n")
    print(f"{args.out}: {record.get('error', 'ok')}", file=sys.stderr)
    return 1 if "error" in record else 0


if __name__ == "__main__":
    sys.exit(main())
