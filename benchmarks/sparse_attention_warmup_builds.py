"""Cold-cache time of patch 0007's sparse-attention reservation: programs side by side or not.

    python3 -m benchmarks.sparse_attention_warmup_builds --out DIR [--rounds 3] [--max-num-seqs N]
        [--mtp N] [--max-model-len N] [--heads 8] [--kv-heads 1]

Run where vLLM 0.34.0 carries the series, on one SM90 GPU with the CUDA compiler FlashInfer
builds with. Each start of the reservation (``_SparseAttentionJit.reserve``, what a sparse layer
runs at model construction) runs in a fresh process on an empty FlashInfer workspace of its
own (``FLASHINFER_WORKSPACE_BASE``), so every program it needs is built there. Two arms:

- ``side-by-side``: the series as it is: the programs of the launches are built at once
  (``build_warmup_programs``, through patch 0004's ``build_cake_programs``), then launched;
- ``serial``: ``build_warmup_programs`` replaced by one that builds nothing, so each launch
  builds its program at first use, one after another (the reservation before issue 64).

The rounds alternate the arms' order. Each start records the reservation's wall time, its log
line, the programs FlashInfer's planners name for it and the ``.so`` files its workspace holds
afterwards (a start whose workspace was not empty, or that built fewer programs than named,
fails). The default geometry is one TP-8 rank of the MXFP8 EP slice (8 query heads over 1 KV
head, 1024 sequences, a 132096-token context): 7 Cake programs on an H100, which the reservation
built one after another in 43.5 s on an empty cache (results/h100/served-ab/mxfp8-ep).
Writes DIR/warmup_builds.json after each start and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.sparse_attention_warmup_memory import WarmupCase

ARMS = ("side-by-side", "serial")
WARMUP_LINE = re.compile(
    r"MiniMax M3 sparse attention warm-up: (\d+) FlashInfer launches ready in ([\d.]+)s.*?"
    r"(\d+) programs built or loaded side by side in ([\d.]+)s"
)


def arm_order(round_index: int) -> tuple[str, ...]:
    """The arms of round ``round_index`` (from 0): alternated, so neither always goes first."""
    return ARMS if round_index % 2 == 0 else ARMS[::-1]


def parse_warmup_line(text: str) -> dict[str, float] | None:
    """The reservation's log line's figures, or None when it is not in ``text``."""
    found = WARMUP_LINE.search(text)
    if found is None:
        return None
    return {
        "launches": int(found.group(1)),
        "logged_s": float(found.group(2)),
        "side_by_side_programs": int(found.group(3)),
        "side_by_side_s": float(found.group(4)),
    }


def start_errors(row: dict[str, Any]) -> list[str]:
    """Why one start does not count: its workspace was not empty, it built fewer programs than
    the planners named, its log line is missing, or the side-by-side arm built none at once."""
    errors = list(row.get("error", []))
    if errors:
        return errors
    if row["so_before"] != 0:
        errors.append(f"the workspace held {row['so_before']} programs before the start")
    if row["so_after"] < len(row["programs"]):
        errors.append(f"{row['so_after']} programs built of the {len(row['programs'])} named")
    line = row.get("line")
    if line is None:
        errors.append("no warm-up log line (the reservation did not finish)")
    elif row["arm"] == "side-by-side" and line["side_by_side_programs"] != len(row["programs"]):
        errors.append(f"{line['side_by_side_programs']} programs built side by side")
    elif row["arm"] == "serial" and line["side_by_side_programs"] != 0:
        errors.append("the serial arm built programs side by side")
    return errors


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: the reservation's seconds by round, their median, min and max; the median
    ratio serial / side-by-side. Starts with errors are left out and counted."""
    arms: dict[str, Any] = {}
    for arm in ARMS:
        seconds = [r["seconds"] for r in rows if r["arm"] == arm and not start_errors(r)]
        arms[arm] = {
            "seconds": seconds,
            "median_s": round(statistics.median(seconds), 1) if seconds else None,
            "min_s": min(seconds) if seconds else None,
            "max_s": max(seconds) if seconds else None,
        }
    fast, slow = arms["side-by-side"]["median_s"], arms["serial"]["median_s"]
    return {
        "arms": arms,
        "serial_over_side_by_side": round(slow / fast, 2) if fast and slow else None,
        "failed_starts": sum(1 for r in rows if start_errors(r)),
    }


def _so_files(workspace: Path) -> int:
    return sum(1 for _ in workspace.rglob("*.so"))


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One start of the reservation in this process (its workspace set by the parent)."""
    import torch
    from vllm.models.minimax_m3.nvidia import sparse_attention_flashinfer as sa

    workspace = Path(os.environ["FLASHINFER_WORKSPACE_BASE"])
    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    sa.logger.addHandler(_Keep())
    if args.child == "serial":
        sa.build_warmup_programs = lambda geometry, device: 0
    device = torch.device("cuda", 0)
    torch.empty(1, device=device)
    geometry = WarmupCase.from_args("rank", args).geometry()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = sa.warmup_programs(geometry, sms)
    so_before = _so_files(workspace)
    started = time.perf_counter()
    sa._SparseAttentionJit().reserve(geometry, device)
    seconds = time.perf_counter() - started
    text = "\n".join(lines)
    return {
        "arm": args.child,
        "seconds": round(seconds, 1),
        "programs": programs,
        "so_before": so_before,
        "so_after": _so_files(workspace),
        "line": parse_warmup_line(text),
        "log": text[-2000:],
        "gpu": torch.cuda.get_device_name(device),
        "geometry": repr(geometry),
    }


def _commit() -> str:
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--mtp", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=132096)
    parser.add_argument("--start-timeout", type=float, default=240.0)
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    for name in ("rounds", "heads", "kv_heads", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.mtp < 0 or args.max_model_len < 1:
        parser.error("--mtp must be at least 0 and --max-model-len at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    passed = list(argv if argv is not None else sys.argv[1:])
    rows: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        for arm in arm_order(round_index):
            workspace = Path(tempfile.mkdtemp(prefix=f"sa-builds-{round_index}-{arm}-"))
            env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(workspace)}
            command = [sys.executable, "-m", __spec__.name, *passed, "--child", arm]
            try:
                proc = subprocess.run(
                    command, capture_output=True, text=True, timeout=args.start_timeout, env=env
                )
                if proc.returncode != 0:
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                    row = {"arm": arm, "error": [f"exit {proc.returncode}", *tail]}
                else:
                    row = json.loads(proc.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                row = {"arm": arm, "error": [f"over {args.start_timeout:.0f}s"]}
            row["round"] = round_index + 1
            rows.append(row)
            errors = start_errors(row)
            print(f"round {round_index + 1} {arm}: {row.get('seconds', '-')} s", *errors)
            result = {"commit": _commit(), "starts": rows, "summary": summarise(rows)}
            # Written after each start, so a run cut short keeps what it measured.
            (args.out / "warmup_builds.json").write_text(json.dumps(result, indent=1) + "\n")
    summary = summarise(rows)
    gpu = next((r["gpu"] for r in rows if "gpu" in r), "unknown GPU")
    print(f"{gpu}, commit {_commit()}, {args.rounds} rounds, alternated")
    print("arm | programs | reservation s, median [min-max] | by round")
    for arm in ARMS:
        figures = summary["arms"][arm]
        programs = next((len(r["programs"]) for r in rows if "programs" in r), "-")
        print(
            f"{arm} | {programs} | {figures['median_s']} [{figures['min_s']}-{figures['max_s']}]"
            f" | {figures['seconds']}"
        )
    print(f"serial / side-by-side: {summary['serial_over_side_by_side']}")
    return 1 if summary["failed_starts"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
