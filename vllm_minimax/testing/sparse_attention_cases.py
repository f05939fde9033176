"""Batches for MiniMax M3's sparse attend, a float32 reference, and the patched impls.

A `SparseBatch` is one engine step as the sparse layers see it: decode requests
first (each `decode_query_len` tokens), then prefill chunks (`context`, `query`
tokens), a paged fp8 KV cache in vLLM's layout (random pages, scattered page
tables whose unused entries point at live pages of other requests), the
indexer's top-k (ascending, `-1` padded, the current and the first block always
chosen) and bf16 queries. `reference_attention` is float32 torch over the same
inputs; `run_impl` drives a patched impl's `forward` with metadata from the
impl's own builder. Used on a GPU (tests/gpu_e2e, benchmarks) and on the CPU with
FlashInfer's ops recorded (tests/cpu/patched_vllm/test_sparse_attention_forward.py);
needs the series applied to the vLLM this Python imports.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch

PAGE = 128
HEAD_DIM = 128
TOPK = 16
FA_MODULE = "vllm.models.minimax_m3.nvidia.sparse_attention_flashinfer"
COMMON_MODULE = "vllm.models.minimax_m3.common.sparse_attention"


@dataclass(frozen=True)
class StepShape:
    """The requests of one step and the rank's attention geometry."""

    num_heads: int = 8
    num_kv_heads: int = 1
    decode_seq_lens: tuple[int, ...] = ()
    decode_query_len: int = 1
    prefills: tuple[tuple[int, int], ...] = ()  # (context tokens, query tokens)
    block_table_width: int = 1024
    layout: str = "NHD"  # vLLM's default per-layer layout; "HND" = LBHNC
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def seq_lens(self) -> list[int]:
        return list(self.decode_seq_lens) + [c + q for c, q in self.prefills]

    @property
    def query_lens(self) -> list[int]:
        return [self.decode_query_len] * len(self.decode_seq_lens) + [q for _, q in self.prefills]


@dataclass
class SparseBatch:
    shape: StepShape
    query: torch.Tensor  # [T, Hq * D] bf16
    kv_fp8: torch.Tensor  # [pages, Hkv, PAGE, 2D] uint8 view in the shape's layout
    block_table: torch.Tensor  # [reqs, width] int32
    topk: torch.Tensor  # [T, Hkv, TOPK] int32 (vLLM's topk_indices_buffer)
    positions: torch.Tensor  # [T] int64 absolute position of each query token
    token_req: torch.Tensor  # [T] int64 request of each query token
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.query.shape[0])


def _cache_storage(pages: int, heads: int, layout: str, device: torch.device) -> torch.Tensor:
    if layout == "HND":
        return torch.empty(pages, heads, PAGE, 2 * HEAD_DIM, dtype=torch.uint8, device=device)
    if layout == "NHD":
        raw = torch.empty(pages, PAGE, heads, 2 * HEAD_DIM, dtype=torch.uint8, device=device)
        return raw.transpose(1, 2)
    raise ValueError(f"layout {layout!r}")


def make_batch(shape: StepShape, *, seed: int, device: torch.device) -> SparseBatch:
    """Fresh random inputs for `shape`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    seq_lens, query_lens = shape.seq_lens, shape.query_lens
    pages_per_req = [-(-s // PAGE) for s in seq_lens]
    if max(pages_per_req) > shape.block_table_width:
        raise ValueError("a sequence needs more pages than the block table holds")
    total_pages = sum(pages_per_req) + 1
    perm = torch.randperm(total_pages, generator=gen, device=device).to(torch.int32)
    # Unused entries name live pages of other requests: a read past a
    # sequence's end reads wrong data instead of zeros.
    block_table = perm[
        torch.randint(
            0, total_pages, (len(seq_lens), shape.block_table_width), generator=gen, device=device
        )
    ].contiguous()
    start = 0
    for r, n in enumerate(pages_per_req):
        block_table[r, :n] = perm[start : start + n]
        start += n
    hkv = shape.num_kv_heads
    kv = _cache_storage(total_pages, hkv, shape.layout, device)
    values = torch.randn(kv.shape, generator=gen, device=device).to(torch.float8_e4m3fn)
    kv.copy_(values.view(torch.uint8))
    qlen = torch.tensor(query_lens, device=device)
    slen = torch.tensor(seq_lens, device=device)
    token_req = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), qlen)
    starts = torch.cumsum(qlen, 0) - qlen
    offset = torch.arange(int(qlen.sum()), device=device) - starts[token_req]
    positions = slen[token_req] - qlen[token_req] + offset
    total = int(qlen.sum())
    query = torch.randn(total, shape.num_heads * HEAD_DIM, generator=gen, device=device)
    return SparseBatch(
        shape=shape,
        query=query.to(torch.bfloat16),
        kv_fp8=kv,
        block_table=block_table,
        topk=select_blocks(positions, hkv, gen),
        positions=positions,
        token_req=token_req,
    )


def select_blocks(positions: torch.Tensor, heads: int, gen: torch.Generator) -> torch.Tensor:
    """An indexer-like top-k: per token and head, 16 of the causally valid
    blocks (all when fewer), always the first and the current one."""
    current = positions // PAGE
    width = int(current.max()) + 1
    out = torch.empty((positions.numel(), heads, TOPK), dtype=torch.int32, device=positions.device)
    chunk = max(1, (1 << 24) // (heads * width))
    blocks = torch.arange(width, device=positions.device)
    for lo in range(0, positions.numel(), chunk):
        cur = current[lo : lo + chunk, None, None]
        score = torch.rand((cur.shape[0], heads, width), generator=gen, device=positions.device)
        score = torch.where(blocks > cur, -1.0, score)
        score = torch.where((blocks == cur) | (blocks == 0), 2.0, score)
        k = min(TOPK, width)
        top = torch.topk(score, k, dim=-1)
        idx = torch.where(top.values >= 0, top.indices, width + 1)
        idx = torch.sort(idx, dim=-1).values
        idx = torch.where(idx > width, -1, idx).to(torch.int32)
        out[lo : lo + chunk, :, :k] = idx
        out[lo : lo + chunk, :, k:] = -1
    return out


def selected_block_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    blocks: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """float32 attention of each token over the keys of the blocks selected for it.

    ``q`` is ``(t, kv_heads, group, D)``; ``keys`` and ``values`` are ``(t, kv_heads, 16 *
    PAGE, D)``, the rows of each token's selected blocks in selection order; ``blocks`` is
    ``(t, kv_heads, 16)`` block ids (``-1``: none); ``positions`` ``(t,)``. A key counts when
    its block is selected and its position (``block * PAGE + offset``) is at most the token's
    (so never past the token's sequence). Returns ``(t, kv_heads, group, D)``. Checked against
    torch's scaled_dot_product_attention in tests/cpu/test_reference_oracles.py; both
    references of the sparse attend call it."""
    t, kv_heads, _ = blocks.shape
    offsets = torch.arange(PAGE, device=blocks.device)
    key_pos = (blocks[..., None] * PAGE + offsets).reshape(t, kv_heads, TOPK * PAGE)
    valid = (blocks[..., None] >= 0).expand(t, kv_heads, TOPK, PAGE).reshape(key_pos.shape)
    valid &= key_pos <= positions[:, None, None]
    logits = torch.einsum("thgd,thkd->thgk", q, keys) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    return torch.einsum("thgk,thkd->thgd", torch.softmax(logits, dim=-1), values)


def reference_attention(
    batch: SparseBatch, *, scale: float, topk: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 block-sparse attention: `[T, Hq * D]`. `topk` replaces the batch's
    selection (a control run)."""
    shape = batch.shape
    hq, hkv = shape.num_heads, shape.num_kv_heads
    group = hq // hkv
    sel = (batch.topk if topk is None else topk).long()  # [T, Hkv, 16]
    cache = batch.kv_fp8.view(torch.float8_e4m3fn)
    out = torch.empty(batch.num_tokens, hq, HEAD_DIM, dtype=torch.float32, device=sel.device)
    q_all = batch.query.view(-1, hq, HEAD_DIM).float()
    heads = torch.arange(hkv, device=sel.device)
    step = 64
    for lo in range(0, batch.num_tokens, step):
        s = sel[lo : lo + step]  # [t, Hkv, 16]
        t = s.shape[0]
        req = batch.token_req[lo : lo + step]
        pages = batch.block_table[req[:, None, None], s.clamp(min=0)].long()  # [t, Hkv, 16]
        rows = cache[pages, heads[None, :, None]]  # [t, Hkv, 16, PAGE, 2D]
        rows = rows.float().view(t, hkv, TOPK * PAGE, 2 * HEAD_DIM)
        k = rows[..., :HEAD_DIM] * shape.k_scale
        v = rows[..., HEAD_DIM:] * shape.v_scale
        q = q_all[lo : lo + step].view(t, hkv, group, HEAD_DIM)
        attended = selected_block_attention(q, k, v, s, batch.positions[lo : lo + step], scale)
        out[lo : lo + step] = attended.reshape(t, hq, HEAD_DIM)
    return out.view(batch.num_tokens, hq * HEAD_DIM)


def drop_last_block(topk: torch.Tensor) -> torch.Tensor:
    """The selection with each token's highest valid block removed (a control)."""
    out = topk.clone()
    last = (out >= 0).sum(-1, keepdim=True) - 1
    keep_one = last > 0
    out.scatter_(
        -1, last.clamp(min=0), torch.where(keep_one, -1, out.gather(-1, last.clamp(min=0)))
    )
    return out


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def build_metadata(batch: SparseBatch, builder_cls: type, vllm_config: Any) -> Any:
    """Metadata for the batch from `builder_cls`, the impl's own builder."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    shape = batch.shape
    device = batch.query.device
    spec = FullAttentionSpec(
        block_size=PAGE,
        num_kv_heads=shape.num_kv_heads,
        head_size=HEAD_DIM,
        head_size_v=HEAD_DIM,
        dtype=torch.uint8,
        kv_quant_mode=get_kv_quant_mode("fp8"),
    )
    builder = builder_cls(spec, ["layer"], vllm_config, device)
    builder.reorder_batch_threshold = max(1, shape.decode_query_len)
    qlens = torch.tensor([0, *shape.query_lens], dtype=torch.int32)
    qsl_cpu = torch.cumsum(qlens, 0, dtype=torch.int32)
    seq_cpu = torch.tensor(shape.seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl_cpu.to(device),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_cpu.to(device),
        num_reqs=len(shape.seq_lens),
        num_actual_tokens=batch.num_tokens,
        max_query_len=max(shape.query_lens),
        max_seq_len=max(shape.seq_lens),
        block_table_tensor=batch.block_table,
        slot_mapping=torch.zeros(batch.num_tokens, dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=seq_cpu,
    )
    return builder.build(0, common)


def make_layer(batch: SparseBatch) -> types.SimpleNamespace:
    device = batch.query.device
    shape = batch.shape
    return types.SimpleNamespace(
        layer_name="layer",
        topk_indices_buffer=batch.topk,
        _k_scale_float=shape.k_scale,
        _v_scale_float=shape.v_scale,
        _k_scale=torch.tensor(shape.k_scale, dtype=torch.float32, device=device),
        _v_scale=torch.tensor(shape.v_scale, dtype=torch.float32, device=device),
    )


def make_impl(impl_cls: type, shape: StepShape, *, scale: float, kv_cache_dtype: str) -> Any:
    return impl_cls(
        shape.num_heads,
        HEAD_DIM,
        scale,
        shape.num_kv_heads,
        kv_cache_dtype=kv_cache_dtype,
        topk_blocks=TOPK,
        sparse_block_size=PAGE,
    )


class forward_context:
    """Make the impls' `get_forward_context()` return `metadata` for "layer"."""

    def __init__(self, metadata: Any) -> None:
        import importlib

        self._modules = [importlib.import_module(m) for m in (FA_MODULE, COMMON_MODULE)]
        self._context = types.SimpleNamespace(attn_metadata={"layer": metadata})
        self._saved: list[Any] = []

    def __enter__(self) -> None:
        for module in self._modules:
            self._saved.append(module.get_forward_context)
            module.get_forward_context = lambda: self._context

    def __exit__(self, *exc: object) -> None:
        for module, saved in zip(self._modules, self._saved, strict=True):
            module.get_forward_context = saved
