"""vLLM 0.34.0's Triton indexer, run on a batch the way vLLM runs it.

`load_index_topk()` returns the module of
`vllm/models/minimax_m3/common/ops/index_topk.py`: the installed vLLM's when
one imports, else the unmodified file that `$VLLM_MINIMAX_TRITON_INDEX_TOPK` names,
loaded under a test-only shim of the three names it imports
(`vllm.platforms.current_platform`, `vllm.triton_utils`,
`vllm.utils.math_utils.round_up`).

`triton_build` / `triton_forward` mirror `MiniMaxM3IndexerTritonMetadataBuilder.build`
and `MiniMaxM3IndexerTritonImpl.forward` of vLLM 0.34.0's
`common/indexer.py`: decode rows first through `minimax_m3_index_decode`,
then prefill rows through `minimax_m3_index_score` + `minimax_m3_index_topk`,
both writing the shared buffer's `[H, tokens, topk]` transposed view.

`sort_rows_ascending_` / `install_ascending_rows` put the engine's Triton rows in the
order FlashInfer writes them (ascending block ids, `-1` padding last), for engine
comparisons on the releases in `ROW_ORDER_PREFILL_RELEASES`.
"""

from __future__ import annotations

import importlib.util
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_minimax.testing.patched_module import split_decodes_and_prefills, temporary_modules

TRITON_INDEX_TOPK_ENV = "VLLM_MINIMAX_TRITON_INDEX_TOPK"
# Releases whose Hopper prefill attend sums a row's blocks in row order (vLLM 0.33.0's
# generic `common/ops/sparse_attn.py` kernel). 0.34.0's Hopper prefill kernel walks the
# blocks in ascending id whatever the row order, so its prefill logprobs do not depend on
# it; the engine comparisons there were calibrated with the rows as the Triton top-k
# writes them, and keep them so.
ROW_ORDER_PREFILL_RELEASES = frozenset({"0.33.0"})


class _CudaPlatform:
    """The `current_platform` methods index_topk.py calls, as vLLM's CUDA
    platform answers them."""

    @staticmethod
    def is_cuda() -> bool:
        return True

    @staticmethod
    def is_rocm() -> bool:
        return False

    @staticmethod
    def _cap() -> tuple[int, int]:
        return torch.cuda.get_device_capability()

    @classmethod
    def is_device_capability(cls, capability, device_id: int = 0) -> bool:
        major, minor = cls._cap()
        if isinstance(capability, tuple):
            return (major, minor) == tuple(capability)
        return major * 10 + minor == capability

    @classmethod
    def is_device_capability_family(cls, capability: int, device_id: int = 0) -> bool:
        major, minor = cls._cap()
        return (major * 10 + minor) // 10 == capability // 10

    @classmethod
    def is_arch_support_pdl(cls) -> bool:
        try:
            return cls._cap()[0] >= 9
        except Exception:
            return False


def _round_up(x: int, y: int) -> int:
    return ((x + y - 1) // y) * y


def _shim() -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    return {
        "vllm": mod("vllm"),
        "vllm.platforms": mod("vllm.platforms", current_platform=_CudaPlatform()),
        "vllm.triton_utils": mod("vllm.triton_utils", tl=tl, triton=triton),
        "vllm.utils": mod("vllm.utils"),
        "vllm.utils.math_utils": mod("vllm.utils.math_utils", round_up=_round_up),
    }


_LOADED: dict[str, types.ModuleType] = {}


def load_index_topk(path: str | Path | None = None) -> types.ModuleType:
    """vLLM's Triton indexer module (see the module docstring for the order)."""
    key = str(path)
    if key in _LOADED:
        return _LOADED[key]
    path = path or os.environ.get(TRITON_INDEX_TOPK_ENV)
    if path is None:
        try:
            from vllm.models.minimax_m3.common.ops import index_topk  # type: ignore
        except Exception as exc:
            raise FileNotFoundError(
                "vLLM 0.34.0's index_topk.py: vLLM does not import here"
                f" ({type(exc).__name__}: {exc}); set {TRITON_INDEX_TOPK_ENV} to a copy of"
                " vllm/models/minimax_m3/common/ops/index_topk.py"
            ) from exc
        _LOADED[key] = index_topk
        return index_topk
    name = "vllm_minimax._vllm_index_topk"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with temporary_modules(_shim()):
        spec.loader.exec_module(module)
    _LOADED[key] = module
    return module


@dataclass
class TritonPrefill:
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int


@dataclass
class TritonDecode:
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_seq_len: int
    decode_query_len: int
    max_decode_query_len: int


@dataclass
class TritonMetadata:
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    prefill: TritonPrefill | None
    decode: TritonDecode | None


def triton_build(cm, *, reorder_batch_threshold: int = 1) -> TritonMetadata:
    """`MiniMaxM3IndexerTritonMetadataBuilder.build` of vLLM 0.34.0."""
    num_reqs = cm.num_reqs
    num_tokens = cm.num_actual_tokens
    qsl = cm.query_start_loc
    seq_lens = cm.seq_lens
    bt = cm.block_table_tensor
    nd_req, np_req, nd, npt = split_decodes_and_prefills(
        cm, decode_threshold=reorder_batch_threshold, require_uniform=True
    )
    assert nd_req + np_req == num_reqs and nd + npt == num_tokens
    context_lens = torch.empty(num_reqs, dtype=torch.int32, device=seq_lens.device)
    context_lens.copy_(cm.compute_num_computed_tokens(), non_blocking=True)
    prefill = None
    if np_req > 0:
        prefill = TritonPrefill(
            cu_seqlens_q=(qsl[nd_req:] - nd).to(torch.int32),
            seq_lens=seq_lens[nd_req:],
            context_lens=context_lens[nd_req:],
            block_table=bt[nd_req:],
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
        )
    decode = None
    if nd_req > 0:
        qsl_cpu = cm.query_start_loc_cpu
        qlens = qsl_cpu[1 : nd_req + 1] - qsl_cpu[:nd_req]
        dql = int(qlens[0].item())
        assert torch.all((qlens == dql) | (qlens == 0))
        assert nd == nd_req * dql
        decode = TritonDecode(
            seq_lens[:nd_req], bt[:nd_req], cm.max_seq_len, dql, reorder_batch_threshold
        )
    return TritonMetadata(num_tokens, nd_req, nd, np_req, npt, prefill, decode)


def triton_forward(
    ops: types.ModuleType,
    md: TritonMetadata,
    index_query: torch.Tensor,
    kv_cache: torch.Tensor,
    buf: torch.Tensor,
    *,
    num_index_heads: int,
    topk_blocks: int = 16,
    init_blocks: int = 0,
    local_blocks: int = 1,
    index_head_dim: int = 128,
) -> None:
    """`MiniMaxM3IndexerTritonImpl.forward` of vLLM 0.34.0 (CUDA, no fused
    sparse-table arguments): writes `buf` ([tokens, H, topk]) in place."""
    num_tokens = md.num_actual_tokens
    nd = md.num_decode_tokens
    iq = index_query[:num_tokens].view(-1, num_index_heads, index_head_dim)
    buf_htk = buf.transpose(0, 1)
    num_kv_heads = num_index_heads  # "M3 expects num_idx_heads == num_kv_heads"
    if md.num_decodes > 0:
        d = md.decode
        ops.minimax_m3_index_decode(
            iq[:nd],
            kv_cache,
            d.block_table,
            d.seq_lens,
            d.max_seq_len,
            topk_blocks,
            init_blocks,
            local_blocks,
            num_kv_heads,
            d.decode_query_len,
            d.max_decode_query_len,
            out=buf_htk,
        )
    if md.num_prefills > 0:
        p = md.prefill
        score = ops.minimax_m3_index_score(
            iq[nd:],
            kv_cache,
            p.block_table,
            p.cu_seqlens_q,
            p.seq_lens,
            p.context_lens,
            p.max_query_len,
            p.max_seq_len,
            num_kv_heads,
        )
        ops.minimax_m3_index_topk(
            score,
            p.cu_seqlens_q,
            p.context_lens,
            p.max_query_len,
            topk_blocks,
            init_blocks,
            local_blocks,
            out=buf_htk[:, nd:, :],
        )


def sort_rows_ascending_(topk: torch.Tensor) -> None:
    """Sort every row of a top-k buffer (last dimension) in place: the selected blocks
    ascending, the `-1` padding last. The set of blocks, which is the selection, is
    unchanged; only the order changes, and it carries no meaning in the indexer's
    contract. vLLM's Triton top-k writes a row by descending score, FlashInfer's by
    ascending block id. An attend that sums the blocks in row order (vLLM 0.33.0's
    Hopper prefill kernel, the split-K decode kernel) rounds differently for the two
    orders, so an engine comparison sorts both the same way first. Capturable in a CUDA
    graph (no host sync, no data-dependent shapes)."""
    sentinel = torch.iinfo(topk.dtype).max
    ordered = torch.where(topk < 0, sentinel, topk).sort(dim=-1).values
    topk.copy_(torch.where(ordered == sentinel, -1, ordered))


def install_ascending_rows() -> Callable[[], None]:
    """Make the installed vLLM's `MiniMaxM3IndexerTritonImpl.forward` sort the shared
    top-k buffer's rows ascending after it writes them (`sort_rows_ascending_`).
    Returns the undo."""
    from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerTritonImpl

    original = MiniMaxM3IndexerTritonImpl.forward

    def forward(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if self.topk_indices_buffer is not None:
            sort_rows_ascending_(self.topk_indices_buffer)
        return result

    MiniMaxM3IndexerTritonImpl.forward = forward

    def undo() -> None:
        MiniMaxM3IndexerTritonImpl.forward = original

    return undo
