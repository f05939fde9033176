"""Engine runs of tests/gpu_e2e: the prompts and the per-request record the run scripts
write, loading saved runs, comparing their prompt logprobs, listing the FlashInfer
programs the engine's JIT cache holds, and the kernels vLLM's JIT monitor saw compiled
after the engine was ready.

The run scripts (`sparse_attention_engine.py`, `tp_engine.py`) write one JSON per run
(`generate_seeded_prompts` makes its `requests`), plain or gzip'ed (how they come back
from the device); the checks read either form. results/ keeps their summaries, and CI's
re-check reads a thinned copy under tests/cpu/fixtures/.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
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
# Stock vLLM 0.34.0's sampler computes the logprobs a request asks for with a Triton kernel
# (vllm/v1/worker/gpu/sample/logprob.py) whose launch classes its warm-ups reach only in part, so
# the first request asking for another number of logprobs compiles it after ready. Patch 0009
# warms every class; only a run on a series without it (a record without
# ``logprobs_kernel_warmed``, as those saved before it) may show it. Every other kernel compiled
# after the engine was ready is a warm-up this series (or its test) misses.
STOCK_KERNELS_COMPILED_AFTER_READY = frozenset({"_topk_log_softmax_kernel"})
# The function patch 0009 adds beside that kernel, by which a vLLM tree shows it warms it.
_LOGPROBS_WARMUP = re.compile(r"^def warmup_token_logprobs\(", re.MULTILINE)
# How vLLM's JIT monitor (vllm/utils/jit_monitor.py) words a compilation after ready: the
# backend and the event, then the kernel's name, then an optional "(detail)".
_JIT_EVENT = re.compile(r"(?P<event>[^\]\s][^\]\n]*?) during inference: (?P<kernel>[^\s(]+?)[ .(]")
JIT_MONITOR_LOGGER = "vllm.utils.jit_monitor"

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


def jit_events_in(text: str) -> list[dict[str, str]]:
    """The compilations after ready that vLLM's JIT monitor reported in `text` (its log lines
    or messages), in order: each an ``event`` (``Triton kernel JIT compilation``, say) and the
    ``kernel``'s name."""
    return [
        {"event": match["event"], "kernel": match["kernel"]} for match in _JIT_EVENT.finditer(text)
    ]


class _JitEventRecorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.events: list[dict[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.events.extend(jit_events_in(record.getMessage()))


@contextlib.contextmanager
def recording_jit_events() -> Iterator[list[dict[str, str]]]:
    """The compilations vLLM's JIT monitor (in its warn mode) reports while inside, as
    `jit_events_in` words them. The monitor reports in the process that compiles, so the
    engine core must run in this one (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the monitor
    reports each kernel once a process."""
    recorder = _JitEventRecorder()
    logger = logging.getLogger(JIT_MONITOR_LOGGER)
    logger.addHandler(recorder)
    try:
        yield recorder.events
    finally:
        logger.removeHandler(recorder)


def logprobs_kernel_warmed(vllm_root: Path) -> bool:
    """Whether the vLLM tree under ``vllm_root`` warms its sampler's logprobs kernel before
    ready (patch 0009 applied), read off ``vllm/v1/worker/gpu/sample/logprob.py``."""
    path = Path(vllm_root) / "vllm" / "v1" / "worker" / "gpu" / "sample" / "logprob.py"
    return path.exists() and _LOGPROBS_WARMUP.search(path.read_text(errors="replace")) is not None


def series_kernels_compiled_after_ready(run: dict[str, Any]) -> list[str]:
    """The kernels a run saw compiled after ready (``jit_compiled_after_ready``), less
    `STOCK_KERNELS_COMPILED_AFTER_READY` for a run whose record does not say its vLLM warmed
    them (``logprobs_kernel_warmed``); a run without the record fails."""
    assert "jit_compiled_after_ready" in run, "the run recorded no JIT monitor events"
    allowed = (
        frozenset() if run.get("logprobs_kernel_warmed") else STOCK_KERNELS_COMPILED_AFTER_READY
    )
    return [
        event["kernel"]
        for event in run["jit_compiled_after_ready"]
        if event["kernel"] not in allowed
    ]
