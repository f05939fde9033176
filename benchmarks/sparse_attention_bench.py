"""Per-layer time of MiniMax M3's sparse attend: vLLM's Triton impl on a bf16 and
on an fp8 KV cache, and the series' FlashInfer impl on the fp8 cache.

    vllm-minimax apply --target SITE
    python -m benchmarks.sparse_attention_bench --out results/<gpu>/sparse-attention

Each case is one step at a TP-8 (8 query heads, 1 KV head) or TP-4 (16 / 1)
rank's geometry, built by `vllm_minimax.testing.sparse_attention_cases` and run
through each impl's `forward` with metadata from its own builder. Times are GPU
time per call: eager (CUDA events around back-to-back calls, host work
included) and CUDA-graph replay of one captured call. Three rounds, the arms'
order rotated each round; the report gives the median and the min..max of the
round medians, and each arm's relative L2 against a float32 reference
(`benchmarks.timing`). Each output is poisoned before its timed calls; a case
whose replays left any element unwritten fails the run (exit 1).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks import timing
from vllm_minimax.testing import sparse_attention_cases as cases

SCALE = 1.0 / math.sqrt(cases.HEAD_DIM)
ARMS = ("triton-bf16", "triton-fp8", "flashinfer-fp8")
WIDTH = 1024  # max_model_len 131072, as the serving configs set it


def step_cases(num_heads: int) -> dict[str, cases.StepShape]:
    gen = torch.Generator().manual_seed(num_heads)

    def lens(n: int, around: int) -> tuple[int, ...]:
        return tuple(int(x) for x in torch.randint(around // 2, around, (n,), generator=gen))

    shapes = {
        f"prefill-8k-at-{p // 1024}k": cases.StepShape(prefills=((p, 8192),))
        for p in (0, 32768, 90112, 122880)
    }
    shapes["prefill-2x4k-at-0k-60k"] = cases.StepShape(prefills=((0, 4096), (61440, 4096)))
    shapes["decode-32x32k"] = cases.StepShape(decode_seq_lens=lens(32, 32768))
    shapes["decode-64x8k"] = cases.StepShape(decode_seq_lens=lens(64, 8192))
    shapes["decode-8x128k"] = cases.StepShape(decode_seq_lens=lens(8, 131072))
    shapes["mtp3-32x32k"] = cases.StepShape(decode_seq_lens=lens(32, 32768), decode_query_len=3)
    shapes["mixed-16x32k+8k-at-32k"] = cases.StepShape(
        decode_seq_lens=lens(16, 32768), prefills=((32768, 8192),)
    )
    return {
        name: cases.StepShape(**{**vars(s), "num_heads": num_heads, "block_table_width": WIDTH})
        for name, s in shapes.items()
    }


class Arm:
    """One impl with its metadata, cache and output for one step."""

    def __init__(self, name: str, batch: cases.SparseBatch, fa: Any, common: Any, config: Any):
        fp8 = name.endswith("fp8")
        impl_cls = (
            fa.MiniMaxM3SparseFlashInferImpl
            if name.startswith("flashinfer")
            else (common.MiniMaxM3SparseTritonImpl)
        )
        builder = (
            fa.MiniMaxM3SparseFlashInferMetadataBuilder
            if name.startswith("flashinfer")
            else common.MiniMaxM3SparseMetadataBuilder
        )
        self.impl = cases.make_impl(
            impl_cls, batch.shape, scale=SCALE, kv_cache_dtype="fp8" if fp8 else "auto"
        )
        self.metadata = cases.build_metadata(batch, builder, config)
        self.layer = cases.make_layer(batch)
        self.query = batch.query
        if fp8:
            self.kv = batch.kv_fp8
        else:
            self.kv = batch.kv_fp8.view(torch.float8_e4m3fn).to(torch.bfloat16)
        self.out = torch.empty_like(batch.query)

    def call(self) -> None:
        self.impl.forward(self.layer, self.query, self.kv, self.out)


def measure(arm: Arm, iters: int) -> tuple[float, float]:
    """(eager ms, graph-replay ms) per call. The output is poisoned before each timed loop,
    so what the replays leave unwritten stays NaN for the check after the rounds."""
    with cases.forward_context(arm.metadata):
        timing.poison(arm.out)
        eager = timing.per_call_ms(arm.call, iters)
        graph = timing.capture_graph(arm.call, warmup=1)
    timing.poison(arm.out)
    replay = timing.per_call_ms(graph.replay, iters, warmup=1)
    return eager, replay


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--heads", type=int, nargs="+", default=[8, 16])
    args = parser.parse_args(argv)

    import importlib

    from vllm.config import VllmConfig, set_current_vllm_config

    fa = importlib.import_module(cases.FA_MODULE)
    common = importlib.import_module(cases.COMMON_MODULE)
    device = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    with set_current_vllm_config(VllmConfig()):
        for heads in args.heads:
            for name, shape in step_cases(heads).items():
                batch = cases.make_batch(shape, seed=len(rows), device=device)
                ref = cases.reference_attention(batch, scale=SCALE)
                arms = {a: Arm(a, batch, fa, common, VllmConfig()) for a in ARMS}
                pairs = timing.alternated_rounds(
                    {a: partial(measure, arms[a], args.iters) for a in ARMS}, args.rounds
                )
                samples = {
                    a: {"eager": [e for e, _ in pairs[a]], "graph": [g for _, g in pairs[a]]}
                    for a in ARMS
                }
                errors = {a: cases.rel_l2(arms[a].out, ref) for a in ARMS}
                unwritten = {a: timing.unwritten(arms[a].out) for a in ARMS}
                row = {
                    "heads": heads,
                    "case": name,
                    "samples_ms": samples,
                    "rel_l2": errors,
                    "unwritten": unwritten,
                }
                rows.append(row)
                med = {a: timing.Spread.of(samples[a]["graph"]).median for a in ARMS}
                print(
                    f"h{heads} {name:28s} graph ms "
                    + " ".join(f"{a}={med[a]:.4f}" for a in ARMS)
                    + f"  bf16/fi={med['triton-bf16'] / med['flashinfer-fp8']:.2f}x",
                    flush=True,
                )
                del arms, batch, ref
                torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": "python -m benchmarks.sparse_attention_bench " + " ".join(argv or sys.argv[1:]),
        "rounds": args.rounds,
        "iters": args.iters,
    }
    (args.out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "table.md").write_text(render(rows, meta))
    print(render(rows, meta))
    unwritten = [f"h{r['heads']} {r['case']}" for r in rows if any(r["unwritten"].values())]
    if unwritten:
        print(f"outputs left unwritten by the timed calls: {', '.join(unwritten)}", file=sys.stderr)
        return 1
    return 0


def _spread(values: list[float]) -> str:
    return timing.Spread.of(values).text()


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"{meta['device']}, torch {meta['torch']}; {meta['rounds']} rounds x "
        f"{meta['iters']} calls, ms per layer call, median (min..max of round medians)",
        "",
        "| heads | case | mode | Triton bf16 KV | Triton fp8 KV | FlashInfer fp8 KV | "
        "Triton bf16 / FlashInfer | rel L2 (bf16, fp8, FI) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        s = row["samples_ms"]
        for mode in ("graph", "eager"):
            ratio = timing.median_ratio(s["triton-bf16"][mode], s["flashinfer-fp8"][mode])
            err = ", ".join(f"{row['rel_l2'][a]:.1e}" for a in ARMS)
            lines.append(
                f"| {row['heads']}/1 | {row['case']} | {mode} | "
                + " | ".join(_spread(s[a][mode]) for a in ARMS)
                + f" | {ratio:.2f}x | {err} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
