"""A long-context engine near its memory limit, for the FlashInfer indexer's score workspace.

    python tests/gpu_e2e/workspace_run.py --model DIR --out run.json [--max-model-len N]

The engine (FlashInfer indexer forced, fp8 index cache, eager, one GPU) gets
``max_model_len`` N (default 1M) and 16384 batched tokens a step; the patch
scores long prefills in query chunks, so its largest score buffer is
``score_workspace_shape`` (4 index heads x N/128 pages x 2048 rows x 4 bytes,
256 MiB, at 1M), which it reserves in vLLM's workspace during the
memory-profiling run. The caching allocator is capped at the engine's own budget
(``torch.cuda.set_per_process_memory_fraction`` = ``gpu_memory_utilization``),
and the KV cache takes what the profiled peak leaves of it, so an allocation the
profiler did not see finds no room. One prompt of N - 64 tokens is prefilled (its
last chunks score their rows against nearly N tokens, chunk by chunk) and decodes 4 tokens.

The JSON holds ``workspace_bytes`` (vLLM's workspace after the run),
``expected_bytes`` (``score_workspace_shape`` of each FlashInfer layer's heads),
``non_kv_bytes`` (the non-KV memory the profiler counted: ``total_consumed``),
the indexer impls, and the generated token count, or ``error``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
import traceback
from pathlib import Path

MAX_NUM_BATCHED_TOKENS = 16384
NEW_TOKENS = 4
FIRST_TOKEN_ID = 3


def workspace_state(worker) -> dict:
    """Inside the worker (`LLM.collective_rpc`): vLLM's workspace, what the
    FlashInfer layers reserve, and what the memory profiler counted."""
    from vllm.models.minimax_m3.nvidia import indexer_flashinfer
    from vllm.v1.worker.workspace import current_workspace_manager

    config = worker.vllm_config
    context = config.compilation_config.static_forward_context
    layers = sorted(context.items())
    impls = {name: layer.indexer.impl for name, layer in layers if hasattr(layer, "indexer")}
    spec = config.speculative_config
    decode_query_len = 1 + ((spec.num_speculative_tokens or 0) if spec is not None else 0)
    expected = 0
    for impl in impls.values():
        if isinstance(impl, indexer_flashinfer.MiniMaxM3IndexerFlashInferImpl):
            shape = indexer_flashinfer.score_workspace_shape(
                impl.num_index_heads,
                config.model_config.max_model_len,
                config.scheduler_config.max_num_batched_tokens,
                config.scheduler_config.max_num_seqs * decode_query_len,
            )
            expected = max(expected, math.prod(shape) * 4)
    workspace = current_workspace_manager()._current_workspaces[0]
    return {
        "impls": {name: type(impl).__name__ for name, impl in impls.items()},
        "expected_bytes": expected,
        "workspace_bytes": 0 if workspace is None else workspace.numel(),
        "non_kv_bytes": int(worker.total_consumed),
        "max_model_len": config.model_config.max_model_len,
    }


def checkpoint_for_context(model: Path, max_model_len: int) -> Path:
    """The checkpoint with its context raised to ``max_model_len`` (config.json's
    ``max_position_embeddings``, the tokenizer's ``model_max_length``; other files
    linked): vLLM sizes the rotary cache from the first, and positions past it
    read outside that cache."""
    raised = {"config.json": "max_position_embeddings", "tokenizer_config.json": "model_max_length"}
    view = Path(tempfile.mkdtemp(prefix="workspace-model-"))
    for item in model.iterdir():
        key = raised.get(item.name)
        if key is None:
            (view / item.name).symlink_to(item.resolve())
            continue
        fields = json.loads(item.read_text())
        fields[key] = max(int(fields.get(key) or 0), max_model_len)
        (view / item.name).write_text(json.dumps(fields, indent=1))
    return view


def run(args: argparse.Namespace) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    torch.cuda.set_per_process_memory_fraction(args.gpu_memory_utilization)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=str(checkpoint_for_context(Path(args.model), args.max_model_len)),
        dtype="bfloat16",
        seed=0,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=4,
        enable_prefix_caching=False,
        enforce_eager=True,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_config={"indexer_kv_dtype": "fp8", "minimax_m3_indexer_backend": "flashinfer"},
    )
    result: dict = {"engine_start_s": round(time.perf_counter() - started, 1)}
    result.update(llm.collective_rpc(workspace_state)[0])
    vocab = llm.llm_engine.model_config.get_vocab_size()
    generator = torch.Generator().manual_seed(7)
    prompt_len = args.max_model_len - 64
    ids = torch.randint(FIRST_TOKEN_ID, vocab, (prompt_len,), generator=generator).tolist()
    began = time.perf_counter()
    (output,) = llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    result["prefill_s"] = round(time.perf_counter() - began, 1)
    result["prompt_tokens"] = prompt_len
    result["generated_tokens"] = len(output.outputs[0].token_ids)
    result["workspace_bytes_after"] = llm.collective_rpc(workspace_state)[0]["workspace_bytes"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-model-len", type=int, default=1 << 20)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.12)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        result = run(args)
    except Exception as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.out.write_text(json.dumps(result))
    print(f"workspace_run: wrote {args.out}: {json.dumps(result)[:2000]}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
