"""Indexer cases shared by the GPU tests and the benchmark.

A case names a batch shape (per-request query and KV lengths, decode-first as
vLLM orders it), the index-head count and the index-cache dtype. `make_batch`
materializes it with fresh random index keys and queries, a random
non-contiguous page table, a poisoned top-k output buffer, and the
`CommonAttentionMetadata` vLLM's runner would hand the builders.

The GPU tests compare a selection with `reference`'s vectorized oracle on every
token, and with its per-token loops on a subsample (`reference_subsample`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from vllm_minimax.testing import reference
from vllm_minimax.testing.patched_module import CommonAttentionMetadata
from vllm_minimax.testing.scheduled_step import ScheduledStep, common_metadata, random_page_table

PAGE = 128
TOPK = 16
POISON = -7


@dataclass(frozen=True)
class IndexerCase:
    name: str
    phase: str  # decode | mtp | prefill | mixed
    # (query_len, kv_len) per request; kv_len includes the new tokens. A None
    # kv_len is drawn at random (ragged) in [kv_min, kv_max].
    requests: tuple[tuple[int, int | None], ...]
    heads: int = 1
    index_dtype: str = "fp8"  # fp8 | bf16
    kv_min: int = 1
    kv_max: int = 0
    init_blocks: int = 0  # MiniMax M3's model passes none (0); local_blocks is 1
    local_blocks: int = 1
    tags: tuple[str, ...] = field(default=())

    @property
    def batch(self) -> int:
        return len(self.requests)

    @property
    def reorder_batch_threshold(self) -> int:
        """1 + num_speculative_tokens: the decode query length of MTP rows."""
        return self.requests[0][0] if self.phase == "mtp" or self._mtp_mixed else 1

    @property
    def _mtp_mixed(self) -> bool:
        return "mtp" in self.tags

    @property
    def max_seq_len(self) -> int:
        return max(kv if kv is not None else self.kv_max for _, kv in self.requests)


def decode(name, batch, kv, *, heads=1, dtype="fp8", q=1, ragged=True, kv_min=None, **kw):
    """`batch` requests of `q` tokens; ragged: kv drawn in [kv_min, kv] with the
    first request at kv - 37 (mid-page)."""
    if ragged:
        reqs = ((q, kv - 37),) + ((q, None),) * (batch - 1)
        kmin = kv_min if kv_min is not None else max(q, kv // 2)
    else:
        reqs = ((q, kv),) * batch
        kmin = kv
    phase = "decode" if q == 1 else "mtp"
    return IndexerCase(name, phase, reqs, heads, dtype, kmin, kv, **kw)


def cases_for_tests() -> list[IndexerCase]:
    """The issue's matrix: decode 1..256 up to 256k, MTP query lengths 2, 4 and
    5, prefill with and without context, mixed, ragged mid-page ends, < 16
    blocks, 1/2/4 heads, fp8 everywhere and bf16 for decode/MTP up to query
    length 4. Query length 5 (4 speculative tokens) is FlashInfer's prefill
    regime on the decode side, which takes only fp8 on SM90."""
    out: list[IndexerCase] = []
    for dt in ("fp8", "bf16"):
        for h in (1, 2, 4):
            out.append(decode(f"decode_b1_256k_h{h}_{dt}", 1, 262144, heads=h, dtype=dt))
            out.append(decode(f"decode_b32_32k_h{h}_{dt}", 32, 32768, heads=h, dtype=dt))
            out.append(decode(f"decode_b8_short_h{h}_{dt}", 8, 2000, heads=h, dtype=dt, kv_min=1))
            out.append(decode(f"mtp2_b16_64k_h{h}_{dt}", 16, 65536, heads=h, dtype=dt, q=2))
            out.append(decode(f"mtp4_b8_32k_h{h}_{dt}", 8, 32768, heads=h, dtype=dt, q=4))
        out.append(decode(f"decode_b4_256k_h2_{dt}", 4, 262144, heads=2, dtype=dt))
        out.append(decode(f"decode_b128_32k_h1_{dt}", 128, 32768, dtype=dt))
        out.append(decode(f"decode_b256_16k_h1_{dt}", 256, 16384, dtype=dt))
        out.append(decode(f"decode_b256_16k_h4_{dt}", 256, 16384, heads=4, dtype=dt))
        out.append(decode(f"decode_b2_init2_h1_{dt}", 2, 20000, dtype=dt, init_blocks=2))
        out.append(decode(f"mtp4_b4_short_h4_{dt}", 4, 1500, heads=4, dtype=dt, q=4, kv_min=4))
    for h in (1, 2, 4):
        out.append(decode(f"mtp5_b8_32k_h{h}_fp8", 8, 32768, heads=h, q=5))
    out.append(decode("mtp5_b1_short_h1_fp8", 1, 700, q=5, kv_min=5))
    for h in (1, 2, 4):
        out.append(IndexerCase(f"prefill_3000_noctx_h{h}_fp8", "prefill", ((3000, 3000),), h))
        out.append(IndexerCase(f"prefill_2048_on_60k_h{h}_fp8", "prefill", ((2048, 62000),), h))
        out.append(
            IndexerCase(
                f"prefill_3req_ragged_h{h}_fp8",
                "prefill",
                ((1000, 1000), (2500, 12500), (700, 33700)),
                h,
            )
        )
        out.append(
            IndexerCase(
                f"mixed_16dec_2000chunk_h{h}_fp8",
                "mixed",
                ((1, None),) * 16 + ((2000, 7000),),
                h,
                kv_min=100,
                kv_max=32768,
            )
        )
    out.append(IndexerCase("prefill_1500_short_h1_fp8", "prefill", ((1500, 1500),), 1))
    out.append(IndexerCase("prefill_init1_h1_fp8", "prefill", ((1200, 9000),), 1, init_blocks=1))
    out.append(
        IndexerCase(
            "mixed_8dec_2prefill_h2_fp8",
            "mixed",
            ((1, None),) * 8 + ((1200, 1200), (900, 20900)),
            2,
            kv_min=1,
            kv_max=20000,
        )
    )
    out.append(
        IndexerCase(
            "mixed_short_h4_fp8",
            "mixed",
            ((1, None),) * 4 + ((500, 500),),
            4,
            kv_min=1,
            kv_max=1900,
        )
    )
    out.append(
        IndexerCase(
            "mixed_mtp2_8req_1000chunk_h1_fp8",
            "mixed",
            ((2, None),) * 8 + ((1000, 5000),),
            1,
            kv_min=2,
            kv_max=40000,
            tags=("mtp",),
        )
    )
    out.append(
        IndexerCase(
            "mixed_mtp5_4req_300chunk_h2_fp8",
            "mixed",
            ((5, None),) * 4 + ((300, 4300),),
            2,
            kv_min=5,
            kv_max=20000,
            tags=("mtp",),
        )
    )
    return out


def cases_for_bench() -> list[IndexerCase]:
    out: list[IndexerCase] = []
    u = {"ragged": False}
    for b, kv in (
        (1, 8192),
        (32, 32768),
        (64, 32768),
        (128, 32768),
        (256, 32768),
        (32, 131072),
        (4, 262144),
    ):
        out.append(decode(f"decode B={b} {kv // 1024}k h1 fp8", b, kv, **u))
    out.append(decode("decode B=64 32k h2 fp8", 64, 32768, heads=2, **u))
    out.append(decode("decode B=32 32k h4 fp8", 32, 32768, heads=4, **u))
    out.append(decode("decode B=128 32k h4 fp8", 128, 32768, heads=4, **u))
    for b, kv in ((1, 8192), (32, 32768), (128, 32768), (32, 131072)):
        out.append(decode(f"decode B={b} {kv // 1024}k h1 bf16", b, kv, dtype="bf16", **u))
    out.append(decode("mtp2 B=32 32k h1 fp8", 32, 32768, q=2, **u))
    out.append(decode("mtp4 B=32 32k h4 fp8", 32, 32768, q=4, heads=4, **u))
    out.append(decode("mtp2 B=32 32k h1 bf16", 32, 32768, q=2, dtype="bf16", **u))
    out.append(IndexerCase("prefill 8k on 0 ctx h1 fp8", "prefill", ((8192, 8192),), 1))
    out.append(IndexerCase("prefill 8k on 120k ctx h1 fp8", "prefill", ((8192, 131072),), 1))
    out.append(IndexerCase("prefill 4x4k h4 fp8", "prefill", ((4096, 4096),) * 4, 4))
    out.append(IndexerCase("prefill 2k on 32k ctx h2 fp8", "prefill", ((2048, 34816),), 2))
    out.append(
        IndexerCase(
            "mixed 32 dec (32k) + 2k chunk h1 fp8",
            "mixed",
            ((1, 32768),) * 32 + ((2048, 2048),),
            1,
        )
    )
    out.append(
        IndexerCase(
            "mixed 64 dec (64k) + 4k chunk h4 fp8",
            "mixed",
            ((1, 65536),) * 64 + ((4096, 4096),),
            4,
        )
    )
    return out


@dataclass
class Batch:
    case: IndexerCase
    seed: int
    query_lens: list[int]
    seq_lens: list[int]
    kv_cache: torch.Tensor  # [num_pages, 128, 128] (vLLM's index-K cache view)
    index_query: torch.Tensor  # [total_q (+ slack), heads * 128]
    topk_buffer: torch.Tensor  # [padded tokens, heads, 16] int32, poisoned
    common: object  # CommonAttentionMetadata
    page_table: torch.Tensor  # [num_reqs, width] int32

    @property
    def total_q(self) -> int:
        return sum(self.query_lens)

    @property
    def num_valid_pages(self) -> torch.Tensor:
        """Per token: position // 128 + 1 (int32, on the batch's device)."""
        return (self.common.positions // PAGE + 1).to(torch.int32)

    @property
    def index_k_bytes(self) -> int:
        """Index-K bytes one pass over every request's pages reads."""
        elem = self.kv_cache.element_size()
        return sum(math.ceil(s / PAGE) for s in self.seq_lens) * PAGE * 128 * elem

    def poison(self) -> None:
        self.topk_buffer.fill_(POISON)


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def make_batch(
    case: IndexerCase,
    device: torch.device | str,
    *,
    seed: int | None = None,
    q_slack_rows: int = 0,
    spare_pages: int = 64,
) -> Batch:
    device = torch.device(device)
    seed = fresh_seed() if seed is None else seed
    g = torch.Generator().manual_seed(seed)
    query_lens, seq_lens = [], []
    for q, kv in case.requests:
        if kv is None:
            lo = max(q, case.kv_min)
            kv = int(torch.randint(lo, case.kv_max + 1, (1,), generator=g))
        assert kv >= q
        query_lens.append(q)
        seq_lens.append(kv)
    step = ScheduledStep.of([s - q for q, s in zip(query_lens, seq_lens, strict=True)], query_lens)
    table, num_pages = random_page_table(step, g, spare_pages=spare_pages)
    dtype = torch.float8_e4m3fn if case.index_dtype == "fp8" else torch.bfloat16
    gd = torch.Generator(device=device).manual_seed(seed)
    kv_cache = torch.randn((num_pages, PAGE, 128), generator=gd, device=device).to(dtype)
    total_q = sum(query_lens)
    index_query = torch.randn(
        (total_q + q_slack_rows, case.heads * 128), generator=gd, device=device
    ).to(dtype)
    padded = -(-total_q // 4) * 4 + 4
    topk_buffer = torch.full((padded, case.heads, TOPK), POISON, dtype=torch.int32, device=device)
    common = common_metadata(step, table, CommonAttentionMetadata, device)
    return Batch(
        case,
        seed,
        query_lens,
        seq_lens,
        kv_cache,
        index_query,
        topk_buffer,
        common,
        table.to(device),
    )


def reference_scores(batch: Batch) -> torch.Tensor:
    """float32 `(H, max_k_tiles, total_q)` via `reference.proxy_score` on the
    batch's own device."""
    cm = batch.common
    q = batch.index_query[: batch.total_q].view(-1, batch.case.heads, 128)
    k = batch.kv_cache.view(batch.kv_cache.shape[0], 1, PAGE, 128)
    return reference.proxy_score(
        q,
        k,
        cm.query_start_loc,
        page_table=batch.page_table,
        seqused_k=cm.seq_lens,
        max_k_tiles=-(-cm.max_seq_len // PAGE),
    )


def normalize_selection(sel: torch.Tensor) -> torch.Tensor:
    """Rows sorted ascending with -1 at the tail (for Triton's score-ordered
    output)."""
    big = torch.iinfo(torch.int32).max
    s = torch.where(sel < 0, big, sel).sort(dim=-1).values
    return torch.where(s == big, -1, s).to(torch.int32)


def reference_subsample(batch: Batch, limit: int = 192) -> torch.Tensor:
    """Token indices for the per-token reference loops: all tokens up to
    `limit`, else each request's first and last token plus random others."""
    n_tok = batch.total_q
    if n_tok <= limit:
        return torch.arange(n_tok)
    g = torch.Generator().manual_seed(batch.seed ^ 0x5EED)
    cu = batch.common.query_start_loc_cpu.tolist()
    ends = {c for c in cu[:-1]} | {c - 1 for c in cu[1:]}
    ends = sorted(ends)[: limit // 2]
    rest = torch.randperm(n_tok, generator=g)[: limit - len(ends)].tolist()
    return torch.tensor(sorted(set(ends) | set(rest)))


@dataclass
class PatchedRun:
    """The patch's builder + impl bound to one batch; `forward()` runs the
    patched `MiniMaxM3IndexerFlashInferImpl.forward` under a forward context
    holding the patched builder's metadata."""

    module: object
    builder: object
    impl: object
    metadata: object
    batch: Batch

    def attn_metadata(self) -> dict:
        return {self.impl.index_cache.prefix: self.metadata}

    def forward(self) -> torch.Tensor:
        from vllm_minimax.testing.patched_module import forward_context

        with forward_context(self.attn_metadata()):
            self.impl.forward(self.batch.index_query)
        return self.batch.topk_buffer[: self.batch.total_q]

    def rebuild(self) -> None:
        self.metadata = self.builder.build(0, self.batch.common)


def patched_run(module, batch: Batch) -> PatchedRun:
    from vllm_minimax.testing.patched_module import make_builder, make_impl

    case = batch.case
    builder = make_builder(
        module,
        device=batch.kv_cache.device,
        num_index_heads=case.heads,
        local_blocks=case.local_blocks,
        reorder_batch_threshold=case.reorder_batch_threshold,
        max_num_batched_tokens=max(16384, batch.topk_buffer.shape[0]),
    )
    impl = make_impl(
        module,
        kv_cache=batch.kv_cache,
        num_index_heads=case.heads,
        topk_indices_buffer=batch.topk_buffer,
        init_blocks=case.init_blocks,
        local_blocks=case.local_blocks,
    )
    md = builder.build(0, batch.common)
    return PatchedRun(module, builder, impl, md, batch)


def forced_counts(case: IndexerCase) -> tuple[int, int]:
    """The forced regions the contract gives every token, from the case alone:
    the model's `init_blocks` leading and `local_blocks` trailing blocks of the
    token's own extent (the reference functions clamp them to that extent)."""
    if case.init_blocks + case.local_blocks > TOPK:
        raise ValueError(f"{case.name}: init_blocks + local_blocks exceeds {TOPK}")
    return case.init_blocks, case.local_blocks
