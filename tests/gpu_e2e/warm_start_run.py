"""One engine start on an empty FlashInfer cache, then a workload of varied shapes.

    python tests/gpu_e2e/warm_start_run.py --model DIR --cache-dir EMPTY [--eager] --out run.json

Run in a fresh process with ``FLASHINFER_WORKSPACE_BASE`` set to an empty
directory before anything imports FlashInfer, and ``FLASHINFER_JIT_BUILD_LOG``
set, so FlashInfer appends one JSON line (with its epoch time) for every
program it builds or compiles, nvcc and CuTe DSL alike. The engine uses vLLM's
defaults (CUDA graphs and JIT warm-up on) with ``jit_monitor_mode="error"``,
or ``--eager``, under which vLLM turns its JIT warm-up off.

The workload runs each shape three times with fresh random tokens: the first
run is what a new geometry costs after ready, the other two its steady state.
Shapes: prefills of 1k to max_num_batched_tokens tokens, prompts of 2k to 30k
tokens (chunked), prompts of a few tokens, decode batches of 1 to 64 requests,
a mixed batch (decodes beside a long prompt's chunks), prefix-cache hits
(a long cached prefix, then a few hundred or a single new token) and logprobs
requests (one at a time, each asking for a number of sampled and prompt logprobs
of another launch class of vLLM's logprobs kernel, 0 to vLLM's default
max_logprobs of 20). ``--workload quick`` runs a few of them and ``--workload
none`` none (a start-up time only).

``--no-jit-warmup`` starts with ``kernel_config.enable_jit_warmup=False`` (vLLM
then leaves its JIT monitor off too). A shape that fails (the JIT monitor in
error mode raises on a compile) has its unfinished requests aborted, so the
next shape starts on an idle engine (``abort_request(..., internal=True)``: the
output processor keys requests by their internal ids). The shape records the
exception's traceback; a later failure names the first failed shape, since vLLM
does not promise that an engine which raised mid-step is whole. The result is
rewritten after the start and after every shape, so a run cut by its time limit
keeps what it measured;
it ends with the sizes of the JIT caches named by ``FLASHINFER_WORKSPACE_BASE``,
``TRITON_CACHE_DIR`` and ``VLLM_CACHE_ROOT``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

MAX_MODEL_LEN = 32768
MAX_NUM_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 64
FIRST_TOKEN_ID = 3
READY_MARKER = "WARM_START_READY"

# name: [(prompt tokens, new tokens), ...] submitted together
SHAPES: dict[str, list[tuple[int, int]]] = {
    "prefill-1k": [(1024, 1)],
    "prefill-4k": [(4096, 1)],
    "prefill-8k": [(MAX_NUM_BATCHED_TOKENS, 1)],
    "prompt-3": [(3, 1)],
    "prompt-100": [(100, 1)],
    "context-16k": [(16384, 1)],
    "context-30k": [(30000, 1)],
    "decode-1": [(600, 16)],
    "decode-8": [(600, 16)] * 8,
    "decode-33": [(600, 16)] * 33,
    "decode-64": [(600, 16)] * 64,
    "mixed-8-decodes-12k": [(600, 48)] * 8 + [(12000, 1)],
}
# name: (cached prefix tokens, new tokens after it)
PREFIX_HITS: dict[str, tuple[int, int]] = {
    "prefix-16k-plus-200": (16384, 200),
    "prefix-16k-plus-1": (16384, 1),
}
# name: the logprobs (sampled and prompt alike) of each request, sent one after another on
# a prompt of LOGPROBS_PROMPT tokens. 1 + the number is the count of token ids vLLM's
# `_topk_log_softmax_kernel` scores a row; these fall in its seven launch classes up to
# max_logprobs=20 (1, 2, 3-4, 5-8, 9-15, 16 and 17-21 ids), five of which no warm-up of stock
# vLLM runs (patch 0009's does).
LOGPROB_SHAPES: dict[str, tuple[int, ...]] = {"logprobs-0-to-20": (0, 1, 2, 4, 8, 15, 16, 20)}
LOGPROBS_PROMPT = 100
REPEATS = 3
QUICK_SHAPES = ("prefill-1k", "prompt-100", "decode-33", "mixed-8-decodes-12k")
QUICK_PREFIX_HITS = ("prefix-16k-plus-200",)
QUICK_LOGPROB_SHAPES = ("logprobs-0-to-20",)
CACHE_ENV = ("FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT")


def write_result(path: Path, result: dict) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(result))
    os.replace(partial, path)


def cache_sizes() -> dict[str, dict]:
    """Bytes and files under each JIT cache directory this process was given."""
    sizes = {}
    for name in CACHE_ENV:
        root = os.environ.get(name)
        if not root:
            continue
        files = [p for p in Path(root).rglob("*") if p.is_file()]
        sizes[name] = {"bytes": sum(p.stat().st_size for p in files), "files": len(files)}
    return sizes


def triton_kernels_cached() -> int:
    """Compiled Triton kernels in TRITON_CACHE_DIR (one cubin per variant)."""
    root = os.environ.get("TRITON_CACHE_DIR")
    return len(list(Path(root).rglob("*.cubin"))) if root else 0


def run(args: argparse.Namespace, result: dict) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        enable_prefix_caching=True,
        enforce_eager=args.eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_config={"indexer_kv_dtype": "fp8", "minimax_m3_indexer_backend": "flashinfer"},
        jit_monitor_mode="error",
        kernel_config={"enable_jit_warmup": not args.no_jit_warmup},
    )
    ready = time.time()
    print(READY_MARKER, flush=True)
    result.update(engine_start_s=round(time.perf_counter() - started, 1), ready=ready)
    result["triton_kernels_at_ready"] = triton_kernels_cached()
    write_result(args.out, result)
    engine = llm.llm_engine
    vocab = llm.llm_engine.model_config.get_vocab_size()
    generator = torch.Generator().manual_seed(4321)

    def tokens(n: int) -> list[int]:
        return torch.randint(FIRST_TOKEN_ID, vocab, (n,), generator=generator).tolist()

    def timed(
        prompts: list[list[int]], new_tokens: list[int], logprobs: int | None = None
    ) -> float:
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=n,
                ignore_eos=True,
                logprobs=logprobs,
                prompt_logprobs=logprobs,
            )
            for n in new_tokens
        ]
        began = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - began

    first_failure: list[str] = []

    def failed(name: str, exc: Exception) -> dict:
        # The engine keeps a failed step's requests; abort them (by their internal
        # ids, as the output processor keys them) so they do not join the next
        # shape's batches.
        unfinished = list(engine.output_processor.request_states)
        engine.abort_request(unfinished, internal=True)
        shape = {
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=-8),
            "aborted": len(unfinished),
            "unfinished_after_abort": engine.get_num_unfinished_requests(),
        }
        if first_failure:
            shape["after_failure_of"] = first_failure[0]
        else:
            first_failure.append(name)
        return shape

    shapes: dict[str, dict] = {}
    result["shapes"] = shapes

    def run_shape(name: str, quick: tuple[str, ...], once) -> None:
        """REPEATS runs of ``once`` (seconds each) as shape ``name``, or its failure."""
        if args.workload == "none" or (args.workload == "quick" and name not in quick):
            return
        seconds = []
        for _ in range(REPEATS):
            try:
                seconds.append(once())
            except Exception as exc:
                shapes[name] = failed(name, exc)
                break
        else:
            shapes[name] = {"seconds": [round(s, 4) for s in seconds]}
        write_result(args.out, result)

    def prefix_hit(prefix_len: int, extra: int) -> float:
        prefix = tokens(prefix_len)
        timed([prefix], [1])  # caches the prefix (a context-16k shape)
        return timed([prefix + tokens(extra)], [1])

    for name, spec in SHAPES.items():
        run_shape(
            name,
            QUICK_SHAPES,
            lambda spec=spec: timed([tokens(n) for n, _ in spec], [m for _, m in spec]),
        )
    for name, (prefix_len, extra) in PREFIX_HITS.items():
        run_shape(name, QUICK_PREFIX_HITS, lambda p=prefix_len, e=extra: prefix_hit(p, e))
    for name, counts in LOGPROB_SHAPES.items():
        run_shape(
            name,
            QUICK_LOGPROB_SHAPES,
            lambda counts=counts: sum(timed([tokens(LOGPROBS_PROMPT)], [4], k) for k in counts),
        )


def mark_compiles(builds: list[dict]) -> list[dict]:
    """Set ``compiled`` on each FlashInfer build record: whether it made a program.

    FlashInfer 0.7.4 (``flashinfer/jit/core.py``) routes every load of a JIT-cache
    (non-AOT) nvcc module through ``build()``, which runs ninja and appends a
    record even when ninja finds the ``.so`` up to date, so a warm cache logs one
    record per module loaded. A record compiled a program iff the module's ``.so``
    was written after the build began (a cold build, or ninja relinking after a
    change of sources or flags). A CuTe-DSL record is always a compile: FlashInfer
    records it around ``compile_fn()`` only.
    """
    from flashinfer.jit import env as jit_env

    for build in builds:
        if build["toolchain"] != "nvcc":
            build["compiled"] = True
            continue
        library = jit_env.FLASHINFER_JIT_DIR / build["name"] / f"{build['name']}.so"
        began = build["time"] - build["seconds"]
        build["so_mtime"] = round(library.stat().st_mtime, 3) if library.exists() else None
        build["compiled"] = build["so_mtime"] is None or build["so_mtime"] >= began - 0.01
    return builds


def read_build_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--eager", action="store_true", help="enforce_eager (JIT warm-up off)")
    parser.add_argument(
        "--no-jit-warmup", action="store_true", help="kernel_config.enable_jit_warmup=False"
    )
    parser.add_argument(
        "--workload",
        choices=("full", "quick", "none"),
        default="full",
        help="every shape, a few, or none (start-up time only)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    build_log = Path(os.environ["FLASHINFER_JIT_BUILD_LOG"])
    assert os.environ.get("FLASHINFER_WORKSPACE_BASE") == str(args.cache_dir), (
        "set FLASHINFER_WORKSPACE_BASE to --cache-dir before the process starts"
    )
    result: dict = {
        "config": {
            "eager": args.eager,
            "jit_warmup": not (args.eager or args.no_jit_warmup),
            "workload": args.workload,
            "model": args.model,
            "cache_dir": str(args.cache_dir),
            "caches_at_start": cache_sizes(),
        }
    }
    try:
        run(args, result)
    except Exception as exc:
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["builds"] = mark_compiles(read_build_log(build_log))
    result["caches"] = cache_sizes()
    result["triton_kernels"] = triton_kernels_cached()
    write_result(args.out, result)
    print(f"warm_start_run: wrote {args.out}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
