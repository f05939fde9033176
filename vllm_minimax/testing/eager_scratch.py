"""Issue 66's GPU check: an eager engine reserves FlashInfer's decode scratch and checks a
prebuild as an engine with CUDA graphs does.

    python3 -m vllm_minimax.testing.eager_scratch RUNS_DIR [--planted-manifest PATH]

RUNS_DIR holds ``flashinfer-graphs`` and ``flashinfer-eager`` (``<run>.json`` and ``.log`` of
``tests/gpu_e2e/sparse_attention_engine.py``, the same settings but ``--eager``; vLLM turns its
JIT warm-up off for ``--enforce-eager``). ``scripts/gpu-sparse-attention eager-scratch`` makes
them with 1024 sequences, where the scratch is about 2.1 GiB a rank, and plants a prebuild
manifest of another CUDA toolkit before the eager run (``--planted-manifest``).

What must hold, one line each, then PASS or FAIL (exit status 0 or 1):

- both engines served (no error recorded);
- both logs carry patch 0007's warm-up line, with the same number of launches and the same
  decode scratch held (log rounding, 0.01 GiB);
- the memory the model's construction took (vLLM's "Model loading took"), which holds the
  scratch and is what the profiler subtracts before sizing the KV cache, is the same in both
  within the log's rounding (0.02 GiB) and at least the scratch: without the reservation the
  eager figure is smaller by the scratch;
- the memory held once ready is the same within ``READY_TOLERANCE_GIB``. With
  ``gpu_memory_utilization`` fixed this holds with or without the reservation (the KV cache
  takes what the scratch leaves), so it is reported beside the discriminating check above;
- the eager log shows the prebuild check (the planted manifest's "built for another setup"
  warning) and the manifest is gone.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GRAPHS, EAGER = "flashinfer-graphs", "flashinfer-eager"
# The log prints GiB with two decimals: one figure is within 0.005 of its value.
SCRATCH_TOLERANCE_GIB = 0.01
LOADING_TOLERANCE_GIB = 0.02
READY_TOLERANCE_GIB = 0.25

_WARMUP = re.compile(
    r"MiniMax M3 sparse attention warm-up: (\d+) FlashInfer launches ready in [\d.]+s, "
    r"holding ([\d.]+) GiB of decode scratch(?:, ([\d.]+) GiB less free GPU memory)?"
)
_LOADING = re.compile(r"Model loading took ([\d.]+) GiB memory")
_AVAILABLE_KV = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
PREBUILD_CHECKED = "were built for another setup"


@dataclass(frozen=True)
class RunMemory:
    """What one engine run logged and recorded about the scratch and its memory."""

    error: str | None
    launches: int | None
    scratch_gib: float | None
    free_drop_gib: float | None
    model_loading_gib: float | None
    available_kv_gib: float | None
    used_after_ready_gib: float | None
    prebuild_checked: bool


def _first(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    return pattern.search(text)


def read_run(record: dict[str, Any], log: str) -> RunMemory:
    """Parse one run's JSON record and log."""
    warmup = _first(_WARMUP, log)
    loading = _first(_LOADING, log)
    available = _first(_AVAILABLE_KV, log)
    return RunMemory(
        error=record.get("error"),
        launches=int(warmup.group(1)) if warmup else None,
        scratch_gib=float(warmup.group(2)) if warmup else None,
        free_drop_gib=float(warmup.group(3)) if warmup and warmup.group(3) else None,
        model_loading_gib=float(loading.group(1)) if loading else None,
        available_kv_gib=float(available.group(1)) if available else None,
        used_after_ready_gib=record.get("gpu_used_after_ready_gib"),
        prebuild_checked=PREBUILD_CHECKED in log,
    )


def load(runs: Path, name: str) -> RunMemory:
    """`name`'s run in `runs`; a run that left no JSON counts as failed."""
    json_path, log_path = runs / f"{name}.json", runs / f"{name}.log"
    try:
        record = json.loads(json_path.read_text())
    except (OSError, ValueError) as error:
        record = {"error": f"no record ({error})"}
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    return read_run(record, log)


def _close(a: float | None, b: float | None, tolerance: float) -> bool:
    return a is not None and b is not None and abs(a - b) <= tolerance + 1e-9


def checks(
    graphs: RunMemory, eager: RunMemory, planted_manifest: Path | None = None
) -> list[tuple[str, bool, str]]:
    """``(what, held, the figures)`` for each criterion of the module's docstring."""
    found = [
        (
            "both engines served",
            graphs.error is None and eager.error is None,
            f"graphs: {graphs.error or 'ok'}; eager: {eager.error or 'ok'}",
        ),
        (
            "eager launched what graphs did",
            graphs.launches is not None and graphs.launches == eager.launches,
            f"launches {graphs.launches} graphs, {eager.launches} eager",
        ),
        (
            "eager holds the same decode scratch",
            _close(graphs.scratch_gib, eager.scratch_gib, SCRATCH_TOLERANCE_GIB),
            f"{graphs.scratch_gib} GiB graphs, {eager.scratch_gib} GiB eager"
            f" (free memory taken: {graphs.free_drop_gib}, {eager.free_drop_gib} GiB)",
        ),
        (
            "the profiler counts it in eager too",
            _close(graphs.model_loading_gib, eager.model_loading_gib, LOADING_TOLERANCE_GIB)
            and eager.model_loading_gib is not None
            and eager.scratch_gib is not None
            and eager.model_loading_gib + LOADING_TOLERANCE_GIB >= eager.scratch_gib,
            f"model loading {graphs.model_loading_gib} GiB graphs, "
            f"{eager.model_loading_gib} GiB eager; KV cache available "
            f"{graphs.available_kv_gib} GiB graphs, {eager.available_kv_gib} GiB eager",
        ),
        (
            "memory held once ready",
            _close(graphs.used_after_ready_gib, eager.used_after_ready_gib, READY_TOLERANCE_GIB),
            f"{graphs.used_after_ready_gib} GiB graphs, {eager.used_after_ready_gib} GiB eager"
            f" (within {READY_TOLERANCE_GIB})",
        ),
    ]
    if planted_manifest is not None:
        gone = not planted_manifest.exists()
        found.append(
            (
                "eager checked the prebuild",
                eager.prebuild_checked and gone,
                f"warning logged: {eager.prebuild_checked}; {planted_manifest} removed: {gone}",
            )
        )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--planted-manifest", type=Path)
    parser.add_argument("--json", type=Path, help="also write the checks here")
    args = parser.parse_args(argv)
    if not args.runs.is_dir():
        print(f"eager_scratch: {args.runs} is not a directory", file=sys.stderr)
        return 2
    found = checks(load(args.runs, GRAPHS), load(args.runs, EAGER), args.planted_manifest)
    for what, held, figures in found:
        print(f"{'ok  ' if held else 'FAIL'} {what}: {figures}")
    passed = all(held for _, held, _ in found)
    print("PASS" if passed else "FAIL")
    if args.json is not None:
        args.json.write_text(
            json.dumps([{"check": w, "held": h, "figures": f} for w, h, f in found], indent=1)
        )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
