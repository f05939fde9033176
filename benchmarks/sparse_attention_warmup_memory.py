"""GPU memory that patch 0007's FlashInfer sparse-attention warm-up leaves allocated.

    python3 -m benchmarks.sparse_attention_warmup_memory --out DIR [--case NAME ...]

Run where vLLM 0.34.0 carries the series (the warm-up's own functions are imported
from the patched ``sparse_attention_flashinfer`` module). Each case runs in a fresh
process, since FlashInfer keeps its decode split scratch for the life of the process:
it launches every warm-up launch of one geometry (``warmup_launches``, on one set of
``WarmupBuffers``, as the engine's warm-up does), then records the GPU's free memory
before and after (after ``empty_cache``, so what is left is what the warm-up retains),
the bytes of FlashInfer's retained decode scratch (``cake_hopper_sm90._decode_scratch``),
the number of launches and the wall time. The cases are the shipped serving configs'
settings at a TP-8 rank (8 query heads over 1 KV head) and vLLM 0.34.0's server defaults
on an H100 or H200 (1024 sequences, 8192 batched tokens), with and without MTP, for
groups of 8 and 16.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30


@dataclass(frozen=True)
class WarmupCase:
    """One rank geometry and scheduler setting whose warm-up is measured."""

    name: str
    num_heads: int
    num_kv_heads: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_speculative_tokens: int
    max_model_len: int

    @classmethod
    def from_args(cls, name: str, args: Any) -> WarmupCase:
        """The case a command line gives: ``args`` from a parser with ``--heads``,
        ``--kv-heads``, ``--max-num-seqs``, ``--max-num-batched-tokens``, ``--mtp`` and
        ``--max-model-len``."""
        return cls(
            name=name,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_speculative_tokens=args.mtp,
            max_model_len=args.max_model_len,
        )

    def geometry(self) -> Any:
        """The patched ``SparseAttentionWarmupGeometry`` of a TP rank with these settings."""
        from vllm.models.minimax_m3.nvidia import sparse_attention_flashinfer as sa

        return sa.sparse_attention_warmup_geometry(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            scale=128**-0.5,
            num_speculative_tokens=self.num_speculative_tokens,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )


CASES = (
    WarmupCase("engine-test-g8", 8, 1, 16, 8192, 0, 32768),
    WarmupCase("h100-8x-g8-mtp2", 8, 1, 64, 8192, 2, 131072),
    WarmupCase("h200-8x-g8-mtp2", 8, 1, 256, 16384, 2, 131072),
    WarmupCase("defaults-g8", 8, 1, 1024, 8192, 0, 131072),
    WarmupCase("defaults-g8-mtp3", 8, 1, 1024, 8192, 3, 131072),
    WarmupCase("defaults-g16", 16, 1, 1024, 8192, 0, 131072),
    WarmupCase("defaults-g16-mtp3", 16, 1, 1024, 8192, 3, 131072),
)


def measure(case: WarmupCase) -> dict:
    """Run ``case``'s warm-up launches in this process and measure what stays."""
    import torch
    from flashinfer.msa_ops import cake_hopper_sm90
    from vllm.models.minimax_m3.nvidia import sparse_attention_flashinfer as sa

    device = torch.device("cuda", 0)
    torch.empty(1, device=device)
    torch.cuda.synchronize()
    free_before, total = torch.cuda.mem_get_info()
    geometry = case.geometry()
    launches = sa.warmup_launches(geometry)
    started = time.perf_counter()
    buffers = sa.WarmupBuffers(geometry, launches, device)
    for launch in launches:
        sa.run_warmup_launch(geometry, *launch, buffers)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del buffers
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info()
    scratch = cake_hopper_sm90._decode_scratch
    scratch_bytes = sum(t.numel() * t.element_size() for bufs in scratch.values() for t in bufs)
    return {
        **asdict(case),
        "launches": len(launches),
        "decode_launches": sum(1 for kind, *_ in launches if kind == "decode"),
        "seconds": round(seconds, 1),
        "free_before_gib": round(free_before / GIB, 3),
        "free_drop_gib": round((free_before - free_after) / GIB, 3),
        "scratch_entries": len(scratch),
        "scratch_gib": round(scratch_bytes / GIB, 3),
        "torch_allocated_gib": round(torch.cuda.memory_allocated() / GIB, 3),
        "total_gib": round(total / GIB, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", action="append", help="a case name (default: all)")
    parser.add_argument("--case-timeout", type=float, default=240.0, help="seconds a case may take")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    by_name = {case.name: case for case in CASES}
    if args.child:
        print(json.dumps(measure(by_name[args.child])))
        return 0
    names = args.case or list(by_name)
    unknown = [name for name in names if name not in by_name]
    if unknown:
        print(f"unknown case(s): {', '.join(unknown)}; known: {', '.join(by_name)}")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows, failed = [], 0
    for name in names:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", __spec__.name, "--out", str(args.out), "--child", name],
                capture_output=True,
                text=True,
                timeout=args.case_timeout,
            )
        except subprocess.TimeoutExpired:
            failed += 1
            print(f"{name}: over {args.case_timeout:.0f}s")
            rows.append({"name": name, "error": [f"over {args.case_timeout:.0f}s"]})
            continue
        if proc.returncode != 0:
            failed += 1
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            print(f"{name}: exit {proc.returncode}: {' | '.join(tail)}")
            rows.append({"name": name, "error": tail})
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        # Written after each case, so a run cut short keeps what it measured.
        (args.out / "warmup_memory.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("case | seqs | tokens | mtp | launches | s | free drop GiB | scratch GiB (entries)")
    for row in rows:
        if "error" in row:
            continue
        print(
            f"{row['name']} | {row['max_num_seqs']} | {row['max_num_batched_tokens']} | "
            f"{row['num_speculative_tokens']} | {row['launches']} | {row['seconds']} | "
            f"{row['free_drop_gib']} | {row['scratch_gib']} ({row['scratch_entries']})"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
