"""Where an engine step of MiniMax M3's TP-8 rank goes: the indexer, and the kernel families.

    python -m benchmarks.step_profile --model DIR --out OUT
    python -m benchmarks.step_profile --from-traces OUT --out OUT   # re-report saved traces

DIR is a ``vllm-minimax make-tiny-model DIR --geometry m3-tp8-rank`` directory (or any
MiniMax M3 config). The engine takes the settings of ``--config`` (default
evals/h200-m3-tp8-rank-serve.yaml: dummy weights in fp8, an fp8 index cache, CUDA graphs and
chunked prefill on), plus the arm's indexer backend and ``--max-num-batched-tokens``.
Needs the patched vLLM (the ``minimax_m3_indexer_backend`` attention option). An arm
named triton or flashinfer sets that indexer backend; ``--arm NAME=JSON`` (``vllm-minimax
eval ab``'s arms: serve arguments merged into the config, a null removing a key) defines
any other, e.g. ``--arm 'fp8={"kv-cache-dtype": "fp8"}'``. Each arm (``--arms``, default
triton and flashinfer, or the ``--arm`` names in order) runs in a process of its own with one
``LLM(...)`` engine, in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the torch
profiler sees the model. Three points:

- ``decode``: ``--decode-batch`` requests of ``--decode-context`` tokens, their prompts in the
  prefix cache first, so that the profiled steps after ``--skip-steps`` are pure decode;
- ``mixed``: ``--mixed-decodes`` cached 2k-token requests decoding while one uncached
  ``--mixed-long-context``-token prompt is prefilled chunk by chunk in the same steps; the
  decodes run as many steps as the prompt has chunks, so every profiled step is mixed;
- ``prefill``: uncached ``--prefill-context``-token prompts alone, one after another, one
  chunk of ``--max-num-batched-tokens`` a step; ``--steps`` must be a multiple of a prompt's
  chunks, so that the profiled steps hold every chunk position equally often. With
  ``--prefill-prefix P`` a P-token prompt is cached first and every prefill prompt starts
  with it: its new tokens are prefilled at a P-token prefix (``--prefill-context 8192
  --prefill-prefix 32768``: every step one 8k chunk at 32k).

Only the ``--steps`` steps after ``--skip-steps`` are reported. Before the profiled run, the
point's unprofiled run of the same shape is timed (wall ms per step, in the report), and
``--python-profile`` adds a cProfile of one more run of the shape (ARM/POINT.pyprof.txt:
where the host time goes outside PyTorch's operators, e.g. the engine's Python).

Two ranges are added with ``torch.profiler.record_function``: ``LLMEngine.step`` (the
step) and ``MiniMaxM3Indexer.forward`` (the indexer, which vLLM runs eagerly between CUDA
graph pieces, so it is on the host every step). A GPU kernel belongs to the indexer when
the runtime call that launched it lies inside an indexer range. Per point and arm the
report gives: step wall time; GPU busy time (the union of kernel and copy intervals); the
indexer's share of the step's GPU time and of its host (wall) time; kernels per sparse
layer (per indexer call), split into FlashInfer's, vLLM's Triton indexer kernels and
PyTorch's; and whether the step is host-bound (GPU busy less than ``--host-bound-below`` of
the wall time).

GPU time by kernel family (benchmarks/kernel_families.py: MoE GEMMs, linear GEMMs,
attention, indexer, communication, the rest by kind, and 'other' with its largest names, for
the pattern table to be extended): a third range, ``step_profile::moe_experts``, wraps vLLM's
modular MoE kernel's routed experts (not the shared expert), so that a GEMM launched inside
it is the MoE's and a Humming GEMM launched directly outside it a linear layer's; inside a
CUDA graph (decode) no launch lies in a range, and a Humming GEMM is placed by
OUT/ARM/humming_kernels.json, Humming's registry of the kernels this engine compiled (name,
demangled name, whether its layer has experts), where its name is only the MoE's or only a
linear layer's, else reported as unresolved. Writes OUT/ARM/POINT.trace.json.gz,
OUT/ARM/humming_kernels.json, OUT/step_profile.json and OUT/step_profile.md.
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import functools
import gzip
import io
import json
import os
import pstats
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import kernel_families
from benchmarks.kernel_families import FAMILIES

STEP_RANGE = "step_profile::step"
INDEXER_RANGE = "step_profile::indexer"
MOE_RANGE = "step_profile::moe_experts"
HUMMING_KERNELS_FILE = "humming_kernels.json"
TOP_NAMES = 8
ARMS = ("triton", "flashinfer")
POINTS = ("decode", "mixed", "prefill")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
# vLLM 0.34.0's Triton indexer kernels (vllm/models/minimax_m3/common/ops/index_topk.py).
TRITON_INDEXER_KERNEL = re.compile(r"index_block_score|topk_index|decode_index_score")
DEFAULT_SERVE_CONFIG = Path(__file__).resolve().parent.parent / "evals/h200-m3-tp8-rank-serve.yaml"
INDEXER_BACKEND_KEY = "minimax_m3_indexer_backend"
TORCH_KERNEL = re.compile(r"at::|at_cuda|native::|^Memcpy|^Memset|elementwise|reduce_kernel")


class UsageError(Exception):
    """Bad arguments: one message, exit status 2."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.step_profile", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", type=Path, help="the model directory (config.json)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument(
        "--from-traces",
        type=Path,
        metavar="DIR",
        help="analyse the ARM/POINT.trace.json.gz under DIR instead of running engines",
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        help="arms to run, in order: triton, flashinfer (the indexer backends) or names"
        " --arm defines (default: the --arm names, else triton and flashinfer)",
    )
    parser.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="an arm: serve arguments merged into --config, as `vllm-minimax eval ab --arm`;"
        " repeatable",
    )
    parser.add_argument("--points", nargs="+", default=list(POINTS), help=", ".join(POINTS))
    parser.add_argument("--steps", type=int, default=8, help="profiled steps (default: 8)")
    parser.add_argument(
        "--skip-steps",
        type=int,
        default=2,
        help="profiled steps left out of the figures at the start (default: 2)",
    )
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--decode-context", type=int, default=32768)
    parser.add_argument("--mixed-decodes", type=int, default=16)
    parser.add_argument("--mixed-long-context", type=int, default=98304)
    parser.add_argument("--prefill-context", type=int, default=65536)
    parser.add_argument(
        "--prefill-prefix",
        type=int,
        default=0,
        help="tokens of one prompt cached before the prefill point, that every prefill prompt"
        " then starts with: its --prefill-context new tokens are prefilled at that prefix"
        " (default: 0, no prefix)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="the engine's token budget per step, so the long prompt of `mixed` spans the"
        " profiled steps (default: 8192)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_SERVE_CONFIG,
        help="`vllm serve --config` YAML whose settings the engine takes"
        " (default: evals/h200-m3-tp8-rank-serve.yaml)",
    )
    parser.add_argument(
        "--host-bound-below",
        type=float,
        default=0.9,
        help="call a step host-bound when the GPU is busy less than this fraction of its"
        " wall time (default: 0.9)",
    )
    parser.add_argument("--sparse-layers", type=int, help="default: from the model's config")
    parser.add_argument(
        "--python-profile",
        action="store_true",
        help="also cProfile one more run of each point (ARM/POINT.pyprof.txt)",
    )
    parser.add_argument("--run-arm", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_args(args)
    return args


def defined_arms(texts: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``--arm NAME=JSON`` texts by name; bad ones are a UsageError."""
    from vllm_minimax.evals.ab import parse_arm
    from vllm_minimax.evals.common import EvalError

    arms: dict[str, dict[str, Any]] = {}
    for text in texts:
        try:
            arm = parse_arm(text)
        except EvalError as error:
            raise UsageError(str(error)) from None
        if arm.name in arms:
            raise UsageError(f"--arm {arm.name} is defined twice")
        arms[arm.name] = arm.server_args
    return arms


def arm_server_args(name: str, defined: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The serve arguments of arm ``name``: its ``--arm`` definition, else the indexer
    backend of that name."""
    if name in defined:
        return defined[name]
    return {"attention-config": {INDEXER_BACKEND_KEY: name}}


def prompt_chunks(args: argparse.Namespace, context: int) -> int:
    """The whole chunks of ``--max-num-batched-tokens`` in a ``context``-token prompt: the
    steps its prefill takes when it runs alone."""
    return context // args.max_num_batched_tokens


def check_args(args: argparse.Namespace) -> None:
    for name in (
        "steps",
        "decode_batch",
        "decode_context",
        "mixed_decodes",
        "mixed_long_context",
        "prefill_context",
        "max_num_batched_tokens",
    ):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    chunks = prompt_chunks(args, args.mixed_long_context)
    if "mixed" in args.points and chunks < args.skip_steps + args.steps:
        raise UsageError(
            f"--mixed-long-context {args.mixed_long_context} is {chunks} chunks of"
            f" --max-num-batched-tokens {args.max_num_batched_tokens}: fewer than the"
            f" {args.skip_steps + args.steps} steps profiled, so some would not be mixed"
        )
    if "prefill" in args.points:
        prefill_chunks = prompt_chunks(args, args.prefill_context)
        if args.prefill_context % args.max_num_batched_tokens or args.steps % prefill_chunks:
            raise UsageError(
                f"--prefill-context {args.prefill_context} must be whole chunks of"
                f" --max-num-batched-tokens {args.max_num_batched_tokens}, and --steps"
                f" {args.steps} a multiple of their number, so that every chunk position"
                " of the prompt is profiled equally often"
            )
    if args.skip_steps < 0:
        raise UsageError("--skip-steps must be 0 or more")
    if args.prefill_prefix < 0:
        raise UsageError("--prefill-prefix must be 0 or more")
    if not 0 < args.host_bound_below <= 1:
        raise UsageError("--host-bound-below must be in (0, 1]")
    args.defined_arms = defined_arms(args.arm)
    if args.arms is None:
        args.arms = list(args.defined_arms) or list(ARMS)
    known_arms = (*ARMS, *(name for name in args.defined_arms if name not in ARMS))
    for option, given, known in (
        ("--arms", args.arms, known_arms),
        ("--points", args.points, POINTS),
    ):
        # Saved traces are found by arm name: any name will do there.
        named = option == "--arms" and args.from_traces is not None
        unknown = [value for value in given if value not in known and not named]
        if unknown or len(set(given)) != len(given):
            raise UsageError(f"{option} takes distinct values of {', '.join(known)}")
    if args.run_arm is not None and args.run_arm not in known_arms:
        raise UsageError(f"--run-arm takes one of {', '.join(known_arms)}")
    if args.from_traces is not None:
        if args.model is not None:
            raise UsageError("--from-traces analyses saved traces; --model would not be used")
        if not args.from_traces.is_dir():
            raise UsageError(f"--from-traces {args.from_traces} is not a directory")
        if args.sparse_layers is None:
            raise UsageError("--from-traces needs --sparse-layers (57 for MiniMax M3)")
        return
    if args.model is None or not (args.model / "config.json").is_file():
        raise UsageError("--model must be a directory with a config.json")
    if not args.config.is_file():
        raise UsageError(f"--config {args.config} does not exist")


# --- Trace analysis (no GPU, no vLLM) ------------------------------------------------------


def _complete(events: Iterable[dict[str, Any]], categories: Iterable[str]) -> list[dict]:
    wanted = set(categories)
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in wanted]


def _ranges(events: list[dict], name: str) -> list[dict]:
    return sorted(
        (e for e in _complete(events, ("user_annotation",)) if e.get("name") == name),
        key=lambda e: e["ts"],
    )


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


class _RangeIndex:
    """Which ranges (per thread) contain a timestamp."""

    def __init__(self, ranges: list[dict]) -> None:
        self.by_thread: dict[Any, tuple[list[float], list[float]]] = {}
        for r in ranges:
            starts, ends = self.by_thread.setdefault((r.get("pid"), r.get("tid")), ([], []))
            starts.append(r["ts"])
            ends.append(r["ts"] + r["dur"])

    def contains(self, event: dict) -> bool:
        found = self.by_thread.get((event.get("pid"), event.get("tid")))
        if not found:
            return False
        starts, ends = found
        i = bisect.bisect_right(starts, event["ts"]) - 1
        return i >= 0 and event["ts"] <= ends[i]


def kernel_family(name: str) -> str:
    if TRITON_INDEXER_KERNEL.search(name):
        return "triton"
    if TORCH_KERNEL.search(name):
        return "torch"
    return "flashinfer"


def analyze_trace(
    trace: dict[str, Any],
    sparse_layers: int,
    skip_steps: int,
    host_bound_below: float,
    max_steps: int | None = None,
    humming_moe: dict[str, bool] | None = None,
) -> dict[str, Any]:
    """The figures of one profiled point from a torch profiler Chrome trace: the steps
    after the first ``skip_steps``, at most ``max_steps`` of them. ``humming_moe``: Humming
    kernel names -> whether the MoE's (``humming_kernels.json``), for CUDA graphs' kernels."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    steps = _ranges(events, STEP_RANGE)
    if len(steps) <= skip_steps:
        raise ValueError(f"the trace has {len(steps)} steps; {skip_steps} are to be skipped")
    steps = steps[skip_steps:]
    if max_steps is not None:
        steps = steps[:max_steps]
    start, end = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    in_window = [r for r in _ranges(events, INDEXER_RANGE) if start <= r["ts"] <= end]
    indexer_index = _RangeIndex(in_window)
    launches = {
        e["args"]["correlation"]: e
        for e in _complete(events, LAUNCH_CATEGORIES)
        if "correlation" in e.get("args", {}) and start <= e["ts"] <= end
    }
    gpu = [
        e
        for e in _complete(events, GPU_CATEGORIES)
        if e.get("args", {}).get("correlation") in launches
    ]
    indexer_gpu = [e for e in gpu if indexer_index.contains(launches[e["args"]["correlation"]])]
    families = {"flashinfer": 0, "triton": 0, "torch": 0}
    for e in indexer_gpu:
        families["torch" if e["cat"] != "kernel" else kernel_family(e["name"])] += 1
    forwards = sum(
        1
        for s in steps
        if any(s["ts"] <= launch["ts"] <= s["ts"] + s["dur"] for launch in launches.values())
    )
    wall_us = end - start
    step_us = sum(s["dur"] for s in steps)
    gpu_us = sum(e["dur"] for e in gpu)
    busy_us = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    indexer_gpu_us = sum(e["dur"] for e in indexer_gpu)
    named_us = sum(
        e["dur"] for e in gpu if e["cat"] == "kernel" and classify_name(e["name"])[0] == "indexer"
    )
    moe_ranges = [r for r in _ranges(events, MOE_RANGE) if start <= r["ts"] <= end]
    by_family = family_figures(
        gpu, launches, indexer_index, _RangeIndex(moe_ranges), bool(moe_ranges), humming_moe
    )
    indexer_host_us = sum(r["dur"] for r in in_window)
    calls = len(in_window)
    busy_fraction = busy_us / wall_us if wall_us else 0.0
    return {
        "steps": len(steps),
        "forwards": forwards,
        "step_ms": step_us / len(steps) / 1000,
        "gpu_busy_ms_per_step": busy_us / len(steps) / 1000,
        "gpu_busy_fraction": busy_fraction,
        "host_bound": busy_fraction < host_bound_below,
        "indexer_calls_per_forward": calls / forwards if forwards else 0.0,
        "expected_calls_per_forward": sparse_layers,
        "indexer_gpu_ms_per_step": indexer_gpu_us / len(steps) / 1000,
        "indexer_gpu_share": indexer_gpu_us / gpu_us if gpu_us else 0.0,
        "indexer_kernels_ms_per_step": named_us / len(steps) / 1000,
        "indexer_kernels_share": named_us / gpu_us if gpu_us else 0.0,
        "gpu_ms_per_step": gpu_us / len(steps) / 1000,
        "indexer_host_ms_per_step": indexer_host_us / len(steps) / 1000,
        "indexer_host_share": indexer_host_us / step_us if step_us else 0.0,
        "indexer_host_us_per_call": indexer_host_us / calls if calls else 0.0,
        "kernels_per_sparse_layer": {
            family: count / calls if calls else 0.0 for family, count in families.items()
        },
        "moe_ranges_per_step": len(moe_ranges) / len(steps),
        **scaled_families(by_family, len(steps), gpu_us),
    }


@functools.lru_cache(maxsize=65536)
def classify_name(name: str) -> tuple[str, str]:
    """``kernel_families.classify`` with the installed FlashInfer's routes, once a name (a
    trace repeats each name thousands of times)."""
    return kernel_families.classify(name)


def family_figures(
    gpu: list[dict],
    launches: dict[Any, dict],
    indexer_index: _RangeIndex,
    moe_index: _RangeIndex,
    moe_ranges_seen: bool,
    humming_moe: dict[str, bool] | None,
) -> dict[str, dict]:
    """GPU us by family, by (family, kind) and by (family, kernel name). A kernel launched
    inside an indexer range is the indexer's whatever its name; otherwise its name's
    family (``kernel_families.classify``), placed by its launch (``resolve``)."""
    family_us = dict.fromkeys(FAMILIES, 0.0)
    kind_us: dict[str, dict[str, float]] = {family: {} for family in FAMILIES}
    name_us: dict[str, dict[str, float]] = {family: {} for family in FAMILIES}
    for e in gpu:
        launch = launches[e["args"]["correlation"]]
        name = e["name"] if e["cat"] == "kernel" else e["cat"]
        if e["cat"] != "kernel":
            family, kind = "rest", "copy"
        else:
            family, kind = classify_name(name)
        if indexer_index.contains(launch):
            family = "indexer"
        else:
            family, kind = kernel_families.resolve(
                family,
                kind,
                name,
                in_moe=moe_index.contains(launch),
                direct_launch="GraphLaunch" not in launch.get("name", ""),
                moe_ranges_seen=moe_ranges_seen,
                humming_moe=humming_moe,
            )
        family_us[family] += e["dur"]
        kind_us[family][kind] = kind_us[family].get(kind, 0.0) + e["dur"]
        name_us[family][name] = name_us[family].get(name, 0.0) + e["dur"]
    return {"family": family_us, "kind": kind_us, "name": name_us}


def scaled_families(by_family: dict[str, dict], steps: int, gpu_us: float) -> dict[str, Any]:
    """``family_figures``'s sums as ms per step and shares of the summed GPU time, with the
    top kernels of each family and every kind, largest first."""

    def ms(us: float) -> float:
        return us / steps / 1000

    def top(table: dict[str, float], count: int | None) -> list[list[Any]]:
        ranked = sorted(table.items(), key=lambda item: (-item[1], item[0]))
        return [[name, ms(us)] for name, us in ranked[:count]]

    return {
        "families_ms_per_step": {f: ms(us) for f, us in by_family["family"].items()},
        "families_share": {
            f: (us / gpu_us if gpu_us else 0.0) for f, us in by_family["family"].items()
        },
        "family_kinds_ms_per_step": {
            f: top(kinds, None) for f, kinds in by_family["kind"].items() if kinds
        },
        "family_top_kernels": {
            f: top(names, TOP_NAMES) for f, names in by_family["name"].items() if names
        },
    }


ROWS = (
    (
        "unprofiled wall ms / step",
        lambda r: f"{r['unprofiled_step_ms']:.2f}" if "unprofiled_step_ms" in r else "-",
    ),
    ("step wall ms", lambda r: f"{r['step_ms']:.2f}"),
    ("GPU busy ms / step", lambda r: f"{r['gpu_busy_ms_per_step']:.2f}"),
    ("GPU busy / wall", lambda r: f"{100 * r['gpu_busy_fraction']:.0f}%"),
    ("host-bound", lambda r: "yes" if r["host_bound"] else "no"),
    (
        "indexer calls / forward",
        lambda r: f"{r['indexer_calls_per_forward']:.1f} (of {r['expected_calls_per_forward']})",
    ),
    ("GPU kernel+copy ms / step", lambda r: f"{r.get('gpu_ms_per_step', float('nan')):.2f}"),
    ("indexer GPU ms / step", lambda r: f"{r['indexer_gpu_ms_per_step']:.3f}"),
    ("indexer share of GPU time", lambda r: f"{100 * r['indexer_gpu_share']:.1f}%"),
    (
        "indexer kernels by name, ms / step",
        lambda r: f"{r.get('indexer_kernels_ms_per_step', float('nan')):.3f}",
    ),
    (
        "indexer kernels by name, share of GPU time",
        lambda r: f"{100 * r.get('indexer_kernels_share', float('nan')):.1f}%",
    ),
    ("indexer host ms / step", lambda r: f"{r['indexer_host_ms_per_step']:.3f}"),
    ("indexer share of step wall", lambda r: f"{100 * r['indexer_host_share']:.1f}%"),
    ("indexer host us / call", lambda r: f"{r['indexer_host_us_per_call']:.1f}"),
    ("MoE experts' ranges / step", lambda r: f"{r.get('moe_ranges_per_step', 0.0):.1f}"),
    (
        "kernels / sparse layer: FlashInfer",
        lambda r: f"{r['kernels_per_sparse_layer']['flashinfer']:.2f}",
    ),
    (
        "kernels / sparse layer: Triton indexer",
        lambda r: f"{r['kernels_per_sparse_layer']['triton']:.2f}",
    ),
    (
        "kernels / sparse layer: PyTorch",
        lambda r: f"{r['kernels_per_sparse_layer']['torch']:.2f}",
    ),
)


FAMILY_LABELS = {
    "moe_gemm": "MoE GEMMs",
    "linear_gemm": "linear GEMMs",
    "attention": "attention",
    "indexer": "indexer",
    "communication": "communication",
    "rest": "the rest",
    "gemm_unresolved": "Humming GEMM, MoE or linear unresolved",
    "other": "other (no pattern)",
}
SHORT_NAME = 100


def short_name(name: str) -> str:
    """A kernel name cut to ``SHORT_NAME`` characters, with ``|`` escaped for a table."""
    cut = name if len(name) <= SHORT_NAME else name[: SHORT_NAME - 3] + "..."
    return "`" + cut.replace("|", "\\|").replace("`", "'") + "`"


def family_lines(results: dict[str, dict[str, dict[str, Any]]], point: str) -> list[str]:
    """The point's GPU time by kernel family (a column per arm), then per arm the rest's
    kinds, the largest kernels of each GEMM family and the names no pattern knows."""
    arms = [arm for arm in results if point in results[arm]]
    arms = [arm for arm in arms if "families_ms_per_step" in results[arm][point]]
    if not arms:
        return []
    lines = ["GPU time by kernel family, ms / step (share of GPU kernel+copy time):", ""]
    lines += ["| family | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for family in FAMILIES:
        cells = []
        for arm in arms:
            figures = results[arm][point]
            ms = figures["families_ms_per_step"].get(family, 0.0)
            share = figures["families_share"].get(family, 0.0)
            cells.append(f"{ms:.2f} ({100 * share:.1f}%)")
        lines.append(f"| {FAMILY_LABELS[family]} | " + " | ".join(cells) + " |")
    lines.append("")
    for arm in arms:
        figures = results[arm][point]
        kinds = figures["family_kinds_ms_per_step"]
        tops = figures["family_top_kernels"]
        lines.append(f"{arm}:")
        if "rest" in kinds:
            text = ", ".join(f"{kind} {ms:.2f}" for kind, ms in kinds["rest"][:6])
            lines.append(f"- the rest by kind, ms / step: {text}")
        for family in ("moe_gemm", "linear_gemm", "attention", "gemm_unresolved", "rest", "other"):
            if family not in tops:
                continue
            names = "; ".join(f"{short_name(n)} {ms:.3f}" for n, ms in tops[family][:3])
            lines.append(f"- top {FAMILY_LABELS[family]}, ms / step: {names}")
        lines.append("")
    return lines


def format_report(results: dict[str, dict[str, dict[str, Any]]], setup: str) -> str:
    """Markdown: one table per point, a column per arm, and the point's kernel families."""
    lines = ["# Engine step profile: MiniMax M3, indexer and kernel families", "", setup, ""]
    points = sorted({point for by_point in results.values() for point in by_point})
    for point in points:
        arms = [arm for arm in results if point in results[arm]]
        lines += [f"## {point}", "", "| | " + " | ".join(arms) + " |"]
        lines.append("|---" * (len(arms) + 1) + "|")
        for label, cell in ROWS:
            lines.append(f"| {label} | " + " | ".join(cell(results[a][point]) for a in arms) + " |")
        lines.append("")
        lines += family_lines(results, point)
    lines += [
        "GPU time is summed kernel and copy time (streams may overlap); GPU busy is their union.",
        "A kernel is the indexer's when its launch lies inside `MiniMaxM3Indexer.forward`;"
        " inside a CUDA graph (full decode graphs) no launch does, so the rows 'by name'"
        " count the indexer kernels by their names (FlashInfer's MSA indexer programs, vLLM's"
        " Triton indexer kernels) wherever they ran.",
        "Kernel families: by name (benchmarks/kernel_families.py), a kernel launched inside"
        " the indexer's range being the indexer's and a GEMM launched inside the MoE experts'"
        " range (`step_profile::moe_experts`) the MoE's; a Humming GEMM launched directly"
        " outside that range is a linear layer's, one inside a CUDA graph is placed by"
        " Humming's registry of compiled kernels (ARM/humming_kernels.json) where its name"
        " is only the MoE's or only a linear layer's, and is 'unresolved' otherwise.",
        "",
    ]
    return "\n".join(lines)


def load_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def humming_registry(path: Path) -> dict[str, bool] | None:
    """``HUMMING_KERNELS_FILE`` (``dump_humming_kernels``) as kernel name -> whether the
    MoE's, under both its mangled and its demangled name; a name that both MoE and linear
    kernels have, or whose role is unknown, is left out. None when there is no file."""
    if not path.is_file():
        return None
    roles: dict[str, set[Any]] = {}
    for kernel in json.loads(path.read_text()):
        for name in {kernel.get("name"), kernel.get("demangled")} - {None}:
            roles.setdefault(name, set()).add(kernel.get("moe"))
    return {name: next(iter(moe)) for name, moe in roles.items() if moe in ({True}, {False})}


def report_from_traces(directory: Path, args: argparse.Namespace, setup: str) -> dict:
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for arm in args.arms:
        for point in args.points:
            path = directory / arm / f"{point}.trace.json.gz"
            if not path.is_file():
                continue
            figures = analyze_trace(
                load_trace(path),
                args.sparse_layers,
                args.skip_steps,
                args.host_bound_below,
                max_steps=args.steps,
                humming_moe=humming_registry(directory / arm / HUMMING_KERNELS_FILE),
            )
            timing = directory / arm / f"{point}.timing.json"
            if timing.is_file():
                figures.update(json.loads(timing.read_text()))
            results.setdefault(arm, {})[point] = figures
    if not results:
        raise UsageError(
            f"no ARM/POINT.trace.json.gz for {args.arms} x {args.points} in {directory}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_profile.json").write_text(
        json.dumps({"setup": setup, "results": results}, indent=2) + "\n"
    )
    (args.out / "step_profile.md").write_text(format_report(results, setup))
    return results


# --- Engine runs (H200, patched vLLM) ------------------------------------------------------


def sparse_layer_count(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    return sum(1 for kind in config.get("layer_types", []) if kind == "minimax_m3_sparse")


def install_ranges() -> None:
    """Wrap the engine step and the indexer's forward in profiler ranges."""
    import torch
    from vllm.models.minimax_m3.common.indexer import MiniMaxM3Indexer
    from vllm.v1.engine.llm_engine import LLMEngine

    def ranged(function, name):
        def wrapper(*args, **kwargs):
            with torch.profiler.record_function(name):
                return function(*args, **kwargs)

        return wrapper

    LLMEngine.step = ranged(LLMEngine.step, STEP_RANGE)
    MiniMaxM3Indexer.forward = ranged(MiniMaxM3Indexer.forward, INDEXER_RANGE)
    # The routed experts alone (not the shared expert, which the modular kernel runs beside
    # them): vLLM runs the MoE as a custom op, so these run on the host at every step that
    # no CUDA graph replays.
    try:
        from vllm.model_executor.layers.fused_moe import modular_kernel
    except ImportError as error:
        print(f"step_profile: no MoE experts' range ({error})", file=sys.stderr)
        return
    for owner, method in (
        ("FusedMoEKernelModularImpl", "_fused_experts"),
        ("FusedMoEKernelMonolithicImpl", "apply"),
    ):
        cls = getattr(modular_kernel, owner, None)
        if cls is None or not hasattr(cls, method):
            print(f"step_profile: no MoE experts' range on {owner}.{method}", file=sys.stderr)
            continue
        setattr(cls, method, ranged(getattr(cls, method), MOE_RANGE))


def demangle(name: str) -> str | None:
    """``name`` demangled by the C++ runtime (as the profiler names kernels), or None."""
    import ctypes
    import ctypes.util

    try:
        runtime = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
    except OSError:
        return None
    cxa_demangle = runtime.__cxa_demangle
    cxa_demangle.restype = ctypes.c_void_p
    status = ctypes.c_int()
    pointer = cxa_demangle(name.encode(), None, None, ctypes.byref(status))
    if status.value != 0 or not pointer:
        return None
    text = ctypes.string_at(pointer).decode()
    ctypes.CDLL(None).free(ctypes.c_void_p(pointer))
    return text


def dump_humming_kernels(path: Path) -> int:
    """Every Humming GEMM this process compiled, as [{name, demangled, moe}] (``moe``: its
    layer has experts), so that CUDA graphs' Humming kernels can be told MoE from linear by
    name where the names differ. Returns the count (0 without Humming)."""
    try:
        from humming.kernel.humming import HummingKernel
    except Exception:  # no Humming: nothing to write
        return 0
    kernels = []
    for kernel in dict(getattr(HummingKernel, "_id2kernel", {})).values():
        name = getattr(kernel, "kernel_name", None)
        if not isinstance(name, str):
            continue
        experts = getattr(kernel, "num_experts", None)
        moe = None if not isinstance(experts, int) else experts > 0
        kernels.append({"name": name, "demangled": demangle(name), "moe": moe})
    path.write_text(json.dumps(kernels, indent=1) + "\n")
    return len(kernels)


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    import random

    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]} for _ in range(count)
    ]


def engine_kwargs(
    config_path: Path, arm: str | dict[str, Any], max_num_batched_tokens: int
) -> dict[str, Any]:
    """``LLM(...)`` arguments: the serve config's (``max-model-len`` -> ``max_model_len``)
    with the arm's serve arguments merged in as ``eval ab`` merges them (``arm``: those
    arguments, or the name of an indexer backend)."""
    import yaml

    from vllm_minimax.evals.ab import merge_server_args

    config = yaml.safe_load(config_path.read_text()) or {}
    server_args = arm_server_args(arm, {}) if isinstance(arm, str) else arm
    merged = merge_server_args(config, server_args)
    kwargs = {key.replace("-", "_"): value for key, value in merged.items()}
    kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    return kwargs


def run_arm(args: argparse.Namespace, arm: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # Uniform random top-4 per token, as scripts/gpu-rank-slice serves it (unless set already).
    os.environ.setdefault("VLLM_MOE_ROUTING_SIMULATION_STRATEGY", "uniform_random")
    import torch
    from vllm import LLM, SamplingParams

    install_ranges()
    frame = args.skip_steps + args.steps + 2
    kwargs = engine_kwargs(
        args.config, arm_server_args(arm, args.defined_arms), args.max_num_batched_tokens
    )
    longest = max(
        args.decode_context,
        args.mixed_long_context + 2048,
        args.prefill_prefix + args.prefill_context,
    )
    longest += frame
    if kwargs.get("max_model_len", longest) < longest:
        raise UsageError(f"{args.config}: max-model-len is below the {longest} tokens needed")
    llm = LLM(model=str(args.model), **kwargs)
    vocab = len(llm.get_tokenizer())
    out = args.out / arm
    out.mkdir(parents=True, exist_ok=True)
    for point in args.points:
        cached = point_prompts(args, point, vocab)

        def shape(seed: int, steps: int, point: str = point, cached: list = cached):
            return point_run(args, point, cached, vocab, seed, steps)

        if cached:
            llm.generate(cached, SamplingParams(max_tokens=1), use_tqdm=False)
        if point != "decode":
            # The shape once unprofiled first, so no first-call JIT lands in the trace.
            llm.generate(*shape(4, frame), use_tqdm=False)
        prompts, params = shape(5, frame)
        began = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - began
        timing = {"unprofiled_step_ms": 1000 * elapsed / engine_steps(args, point, outputs)}
        (out / f"{point}.timing.json").write_text(json.dumps(timing) + "\n")
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profile:
            llm.generate(*shape(3, args.skip_steps + args.steps), use_tqdm=False)
        if args.python_profile:
            write_python_profile(
                lambda: llm.generate(*shape(6, args.skip_steps + args.steps), use_tqdm=False),
                out / f"{point}.pyprof.txt",
            )
        raw = out / f"{point}.trace.json"
        profile.export_chrome_trace(str(raw))
        with open(raw, "rb") as source, gzip.open(f"{raw}.gz", "wb") as target:
            target.write(source.read())
        raw.unlink()
        print(f"{arm} {point}: wrote {raw}.gz", flush=True)
    count = dump_humming_kernels(out / HUMMING_KERNELS_FILE)
    print(f"{arm}: {count} Humming GEMM kernels in {out / HUMMING_KERNELS_FILE}", flush=True)


def point_prompts(args: argparse.Namespace, point: str, vocab: int) -> list[dict]:
    """The prompts a point caches first: its decoding requests; for ``prefill``, the
    ``--prefill-prefix`` prompt (none without one)."""
    if point == "decode":
        return _prompts(args.decode_batch, args.decode_context, vocab, seed=1)
    if point == "prefill":
        prefix = getattr(args, "prefill_prefix", 0)
        return _prompts(1, prefix, vocab, seed=7) if prefix else []
    return _prompts(args.mixed_decodes, 2048, vocab, seed=2)


def point_run(
    args: argparse.Namespace, point: str, cached: list[dict], vocab: int, seed: int, steps: int
) -> tuple[list[dict], list]:
    """Prompts and sampling parameters of one run of a point lasting ``steps`` steps.
    ``decode``: the cached prompts every time. ``mixed``: the cached decodes beside a new
    long prompt (``seed``) that yields one token, the decodes outlasting its chunks so
    that every step of the run is mixed. ``prefill``: new prompts (``seed``) of one token
    each, as many as fill ``steps`` chunk steps, each after the cached prefix if any."""
    from vllm import SamplingParams

    if point == "decode":
        return cached, [SamplingParams(max_tokens=steps, ignore_eos=True)] * len(cached)
    if point == "prefill":
        count = -(-steps // prompt_chunks(args, args.prefill_context))
        prompts = _prompts(count, args.prefill_context, vocab, seed=seed)
        if cached:
            prefix = cached[0]["prompt_token_ids"]
            prompts = [{"prompt_token_ids": prefix + p["prompt_token_ids"]} for p in prompts]
        return prompts, [SamplingParams(max_tokens=1, ignore_eos=True)] * count
    chunks = prompt_chunks(args, args.mixed_long_context)
    decode = SamplingParams(max_tokens=max(steps, chunks + 1), ignore_eos=True)
    prefill = SamplingParams(max_tokens=1, ignore_eos=True)
    long_prompt = _prompts(1, args.mixed_long_context, vocab, seed=seed)
    return cached + long_prompt, [decode] * len(cached) + [prefill]


def engine_steps(args: argparse.Namespace, point: str, outputs: list) -> int:
    """Engine steps of one run of ``point``. ``prefill``: one a chunk of each prompt.
    Otherwise the requests started together, and each step gives every running request
    one token: the longest output."""
    if point == "prefill":
        return len(outputs) * prompt_chunks(args, args.prefill_context)
    return max(len(output.outputs[0].token_ids) for output in outputs)


def write_python_profile(run: Callable[[], object], path: Path) -> None:
    """cProfile ``run()`` (in-process engine: the scheduler, the runner's host work and
    the output processing are in this thread) and write the top functions."""
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        text.write(f"=== top 60 by {key} ===\n")
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(60)
    path.write_text(text.getvalue())


def run_arms(args: argparse.Namespace) -> int:
    for arm in args.arms:
        command = [
            sys.executable, "-m", "benchmarks.step_profile", "--run-arm", arm,
            "--model", str(args.model), "--out", str(args.out), "--points", *args.points,
            "--steps", str(args.steps), "--skip-steps", str(args.skip_steps),
            "--decode-batch", str(args.decode_batch),
            "--decode-context", str(args.decode_context),
            "--mixed-decodes", str(args.mixed_decodes),
            "--mixed-long-context", str(args.mixed_long_context),
            "--prefill-context", str(args.prefill_context),
            "--prefill-prefix", str(args.prefill_prefix),
            "--config", str(args.config),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            *(["--python-profile"] if args.python_profile else []),
            *(f"--arm={text}" for text in args.arm),
        ]  # fmt: skip
        completed = subprocess.run(command, check=False)
        if completed.returncode != 0:
            print(f"arm {arm} failed (exit {completed.returncode})", file=sys.stderr)
            return 1
    return 0


def setup_line(args: argparse.Namespace) -> str:
    model = args.model if args.model is not None else f"traces in {args.from_traces}"
    shapes = {
        "decode": f"{args.decode_batch} x {args.decode_context} tokens (cached prompts)",
        "mixed": f"{args.mixed_decodes} decodes of 2k + one {args.mixed_long_context}-token"
        " prefill",
        "prefill": f"{args.prefill_context}-token prompts alone"
        + (f" after a cached {args.prefill_prefix}-token prefix" if args.prefill_prefix else ""),
    }
    points = "; ".join(f"{point}: {shapes[point]}" for point in args.points)
    return (
        f"Model: {model}. {points}; {args.max_num_batched_tokens} tokens a step at most."
        f" {args.steps} steps after {args.skip_steps} skipped; host-bound below"
        f" {100 * args.host_bound_below:.0f}% GPU busy."
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        if args.run_arm is not None:
            run_arm(args, args.run_arm)
            return 0
        if args.from_traces is None:
            args.sparse_layers = args.sparse_layers or sparse_layer_count(args.model)
            if run_arms(args) != 0:
                return 1
        results = report_from_traces(args.from_traces or args.out, args, setup_line(args))
    except UsageError as error:
        print(f"step_profile: {error}", file=sys.stderr)
        return 2
    print(format_report(results, setup_line(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
