"""The decode scratch FlashInfer's SM90 sparse decode keeps after patch 0007's warm-up, planned
on the CPU, and what it would be if decode batches were padded to buckets.

    python -m benchmarks.decode_scratch_plan --max-num-seqs 1024 --mtp 3 [--sms 132]
        [--heads 8 --kv-heads 1] [--max-num-batched-tokens 8192] [--max-model-len 131072]
        [--bucket 16]

Run where vLLM 0.34.0 carries the series and FlashInfer 0.7.4 is installed; no GPU is needed.
The launches are the warm-up's own (``warmup_launches`` of the patched
``sparse_attention_flashinfer``), each planned by FlashInfer's ``plan_sparse_decode`` for
``--sms`` SMs (132: H100 SXM and H200). FlashInfer 0.7.4 keeps three buffers per
``(items, splits, nc)`` of a plan that does not persist (``cake_hopper_sm90._scratch``): the
split partials, the merge statistics and the per-item counters, for the life of the process.
Those bytes are summed over the distinct keys; the H100 measurement of 2026-12-06
(``benchmarks.sparse_attention_warmup_memory``) is the check of this sum.

``--bucket N`` pads every decode batch to a bucket first: the powers of two below N, then the
multiples of N. The series does not pad today; the figure says what padding would hold.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from benchmarks.sparse_attention_warmup_memory import WarmupCase

GIB = 1 << 30
# cake_hopper_sm90._scratch's element sizes: uint32 partials, float32 statistics, uint32
# counters.
_BYTES = 4


@dataclass(frozen=True)
class ScratchPlan:
    """The decode scratch of one warm-up geometry: its distinct keys and their bytes."""

    launches: int
    entries: int
    bytes: int

    @property
    def gib(self) -> float:
        return self.bytes / GIB


def bucket_of(batch: int, bucket: int) -> int:
    """``batch`` padded to the powers of two below ``bucket``, then the multiples of it."""
    if batch >= bucket:
        return -(-batch // bucket) * bucket
    padded = 1
    while padded < batch:
        padded *= 2
    return padded


def decode_batches(
    launches: Iterable[tuple[str, int, int]], bucket: int | None
) -> set[tuple[int, int]]:
    """The ``(batch, query_len)`` of the decode launches, padded to buckets when asked."""
    return {
        (batch if bucket is None else bucket_of(batch, bucket), query_len)
        for kind, batch, query_len in launches
        if kind == "decode"
    }


def plan_scratch(geometry: object, num_sms: int, bucket: int | None = None) -> ScratchPlan:
    """The scratch FlashInfer keeps after the warm-up of ``geometry`` (a
    ``SparseAttentionWarmupGeometry``) on a GPU of ``num_sms`` SMs."""
    from flashinfer.msa_ops import cake_hopper_sm90
    from vllm.models.minimax_m3.nvidia import sparse_attention_flashinfer as sa

    launches = sa.warmup_launches(geometry)
    keys = {}
    for batch, query_len in decode_batches(launches, bucket):
        plan = cake_hopper_sm90.plan_sparse_decode(
            total_q=batch * query_len,
            num_q_heads=geometry.num_heads,
            num_kv_heads=geometry.num_kv_heads,
            num_sms=num_sms,
            seqlen_q=query_len,
            max_pages=geometry.block_table_width,
        )
        if plan.persist:
            continue
        items = batch * query_len * geometry.num_kv_heads * plan.chunks
        partials = items * plan.splits * cake_hopper_sm90._WARPGROUP * (plan.nc // 2)
        statistics = items * plan.splits * 2 * plan.nc
        keys[(items, plan.splits, plan.nc)] = (partials + statistics + items) * _BYTES
    return ScratchPlan(launches=len(launches), entries=len(keys), bytes=sum(keys.values()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--mtp", type=int, default=0, help="num_speculative_tokens")
    parser.add_argument("--heads", type=int, default=8, help="query heads per rank")
    parser.add_argument("--kv-heads", type=int, default=1, help="KV heads per rank")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--sms", type=int, default=132, help="the GPU's SM count")
    parser.add_argument("--bucket", type=int, help="pad decode batches to buckets of this")
    args = parser.parse_args(argv)
    geometry = WarmupCase.from_args("command line", args).geometry()
    plans = {"as launched": plan_scratch(geometry, args.sms)}
    if args.bucket:
        plans[f"buckets of {args.bucket}"] = plan_scratch(geometry, args.sms, args.bucket)
    for name, plan in plans.items():
        print(
            f"{name}: {plan.entries} scratch entries, {plan.gib:.3f} GiB ({plan.launches} launches)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
