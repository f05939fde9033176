"""Engine runs of tests/gpu_e2e: the prompts and the per-request record the run scripts
write, loading saved runs, comparing their prompt logprobs, and listing the FlashInfer
programs the engine's JIT cache holds.

The run scripts (`sparse_attention_engine.py`, `tp_engine.py`) write one JSON per run
(`generate_seeded_prompts` makes its `requests`), committed gzip'ed under results/; the
checks read either form.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# The FlashInfer and Triton sparse attends on one fp8 KV cache against the cache's dtype:
# each kernel sits within 2.3e-3 relative L2 of a float32 reference per layer (measured,
# results/*/sparse-attention), while an fp8 e4m3 cache rounds each key and value by about
# 2^-4 / sqrt(3) = 3.6e-2 RMS. To first order a prompt logprob moves in proportion to the
# attention's error, so the two attends may differ by 0.064 of what the dtype moves them;
# the bound allows four times that. The control pair (one attend on the two dtypes) sits at
# 1 by definition and must move the logprobs by more than SPARSE_ATTEND_MIN_CONTROL.
SPARSE_ATTEND_RATIO_BOUND = 4 * 2.3e-3 / 3.6e-2
SPARSE_ATTEND_MIN_CONTROL = 1e-3


# What the start-up failure of an attend forced to FlashInfer on pages it cannot read names: the
# option, the layout the engine resolved (LBNHC under VLLM_KV_CACHE_LAYOUT=NHD) and the fix.
FORCED_FLASHINFER_NOT_DENSE = (
    "minimax_m3_sparse_attention_backend='flashinfer'",
    "LBNHC",
    "VLLM_KV_CACHE_LAYOUT=LBHNC",
)
# The attend of each sparse impl class whose attend does not depend on the bound cache.
_FIXED_ATTENDS = {
    "MiniMaxM3SparseTritonImpl": "triton",
    "MiniMaxM3SparseMSAImpl": "msa",
    "MiniMaxM3SparseMSANvfp4Impl": "msa",
}


def attend_of(impl: Any) -> str:
    """The attend a sparse attention impl runs: what it resolved for its bound cache
    (``attend``, the FlashInfer impl), else what its class always runs; ``unresolved (...)``
    for an impl that resolves per cache and has none bound."""
    attend = getattr(impl, "attend", None)
    if isinstance(attend, str):
        return attend
    name = type(impl).__name__
    return _FIXED_ATTENDS.get(name, f"unresolved ({name})")


def sparse_layer_attends(worker: Any) -> dict[str, str]:
    """Per MiniMax M3 sparse attention layer of the engine (target and draft): the attend its
    impl runs (`attend_of`). Runs inside the worker (`LLM.collective_rpc`)."""
    context = worker.vllm_config.compilation_config.static_forward_context
    return {
        name: attend_of(layer.impl)
        for name, layer in sorted(context.items())
        if hasattr(layer, "indexer") and hasattr(layer, "impl")
    }


def record_run(run: Callable[[], dict[str, Any]], out: Path) -> int:
    """Write what `run` returns to `out` as JSON, or ``{"error": ...}`` when it raises (the
    checks then report the run's failure); the exit status says which."""
    try:
        result = run()
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    out.write_text(json.dumps(result))
    return 0 if "error" not in result else 1


def load_run(directory: Path, name: str) -> dict[str, Any]:
    """`<name>.json` in `directory`, or its gzip'ed copy (committed results)."""
    path = directory / f"{name}.json"
    if path.exists():
        return json.loads(path.read_text())
    packed = path.with_suffix(".json.gz")
    assert packed.exists(), f"no run {path}"
    return json.loads(gzip.decompress(packed.read_bytes()))


def load_finished_run(directory: Path, name: str) -> dict[str, Any]:
    """`load_run`, asserting the run recorded no error (a failed run has nothing to compare)."""
    run = load_run(directory, name)
    assert "error" not in run, f"{name}: {run['error']}"
    return run


def mean_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Mean |difference| of two runs' prompt logprobs, token by token."""
    diffs = []
    for ra, rb in zip(a["requests"], b["requests"], strict=True):
        for x, y in zip(ra["prompt_logprobs"], rb["prompt_logprobs"], strict=True):
            if x is not None and y is not None:
                diffs.append(abs(x - y))
    assert diffs
    return sum(diffs) / len(diffs)


def flashinfer_jit_files() -> set[str]:
    """The built programs in FlashInfer's JIT cache: files that appear between two listings
    were built in between."""
    root = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", Path.home())) / ".cache" / "flashinfer"
    return {str(p) for p in root.rglob("*.so")} if root.exists() else set()


def seeded_prompts(vocab_size: int, lengths: Sequence[int]) -> list[list[int]]:
    """Random token ids from a fixed seed, one prompt per length, each a prefix of the
    longest: a length given twice repeats its prompt, which the prefix cache then hits."""
    rng = random.Random(0)
    base = [rng.randrange(10, vocab_size - 10) for _ in range(max(lengths))]
    return [base[:n] for n in lengths]


def request_record(output: Any) -> dict[str, Any]:
    """One finished request: the logprob of each prompt token (None for the first), the
    generated tokens and, when the request asked for them, their sampled logprobs."""
    completion = output.outputs[0]
    record: dict[str, Any] = {
        "prompt_logprobs": [
            None if entry is None else entry[token].logprob
            for token, entry in zip(output.prompt_token_ids, output.prompt_logprobs, strict=True)
        ],
        "tokens": list(completion.token_ids),
    }
    if completion.logprobs is not None:
        record["logprobs"] = [
            entry[token].logprob
            for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
        ]
    return record


def generate_seeded_prompts(llm: Any, lengths: Sequence[int], params: Any) -> dict[str, Any]:
    """Run `seeded_prompts` of `lengths` through a ready `vllm.LLM` with `params` (one
    `SamplingParams` for every prompt): the seconds it took, the FlashInfer programs built
    meanwhile (``jit_built_after_ready``) and each request's `request_record`."""
    from vllm.inputs import TokensPrompt

    vocab_size = llm.llm_engine.model_config.get_vocab_size()
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in seeded_prompts(vocab_size, lengths)]
    before = flashinfer_jit_files()
    began = time.perf_counter()
    outputs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
    return {
        "generate_s": round(time.perf_counter() - began, 2),
        "jit_built_after_ready": sorted(flashinfer_jit_files() - before),
        "requests": [request_record(output) for output in outputs],
    }
