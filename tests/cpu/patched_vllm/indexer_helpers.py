"""What the indexer tests of the patched vLLM share: a scheduled batch as vLLM's
`CommonAttentionMetadata` (`vllm_minimax.testing.scheduled_step`), the FlashInfer
builder and impl as the engine constructs them, FlashInfer's two kernels replaced by
the float32 reference behind FlashInfer's argument checks (`ReferenceKernels`), one
forward under a forward context, and the selection computed from the raw batch.

The fixtures `single_rank` and `kernels` are in conftest.py.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.models.minimax_m3.nvidia import indexer_flashinfer as fi_mod
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_minimax.testing import reference
from vllm_minimax.testing.patched_module import indexer_text_config
from vllm_minimax.testing.scheduled_step import (
    PAGE,
    ScheduledStep,
    common_metadata,
    random_page_table,
)

POISON = -7
MAX_TOKENS = 4096
FP8 = torch.float8_e4m3fn


@dataclass
class Batch:
    """A scheduled step and the `CommonAttentionMetadata` vLLM's runner makes of it, over a
    pool of `num_pages` pages."""

    step: ScheduledStep
    metadata: CommonAttentionMetadata
    num_pages: int

    @property
    def context_lens(self) -> list[int]:
        return list(self.step.context_lens)

    @property
    def query_lens(self) -> list[int]:
        return list(self.step.query_lens)

    @property
    def seq_lens(self) -> list[int]:
        return self.step.seq_lens

    @property
    def positions(self) -> list[int]:
        return self.step.positions

    @property
    def num_tokens(self) -> int:
        return self.step.num_tokens


def make_batch(context_lens, query_lens, generator: torch.Generator | None = None) -> Batch:
    step = ScheduledStep.of(context_lens, query_lens)
    table, pool = random_page_table(step, generator)
    return Batch(step, common_metadata(step, table, CommonAttentionMetadata), pool)


def builder_config(index_heads: int = 1, local_blocks: int | None = 1, text_config=None):
    """The parts of a `VllmConfig` the indexer builders read."""
    text_config = text_config or indexer_text_config(
        index_n_heads=index_heads, index_local_blocks=local_blocks
    )
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(
            hf_config=types.SimpleNamespace(text_config=text_config)
        ),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=MAX_TOKENS),
        speculative_config=None,
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1),
    )


def make_builder(
    index_heads: int = 1,
    local_blocks: int = 1,
    threshold: int = 1,
    *,
    block_size: int = PAGE,
    text_config=None,
    builder_cls=None,
):
    builder_cls = builder_cls or fi_mod.MiniMaxM3IndexerFlashInferMetadataBuilder
    builder = builder_cls(
        kv_cache_spec=types.SimpleNamespace(block_size=block_size),
        layer_names=["l"],
        vllm_config=builder_config(index_heads, local_blocks, text_config),
        device=torch.device("cpu"),
    )
    # What _init_reorder_batch_threshold sets from a speculative config with
    # threshold - 1 speculative tokens.
    builder.reorder_batch_threshold = threshold
    return builder


def make_impl(
    *,
    heads: int = 1,
    dtype: str = "fp8",
    init_blocks: int = 0,
    local_blocks: int = 1,
    max_model_len: int | None = None,
    prefix: str = "model.layers.1.self_attn.attn",
    impl_cls=None,
):
    """The impl and its shared top-k buffer (poisoned). With `max_model_len`, the impl
    sees the engine config it reads at profiling (a CPU `VllmConfig` has no model)."""
    impl_cls = impl_cls or fi_mod.MiniMaxM3IndexerFlashInferImpl
    buffer = torch.full((MAX_TOKENS, heads, 16), POISON, dtype=torch.int32)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        impl = impl_cls(
            num_kv_heads=heads,
            scale=128**-0.5,
            topk_blocks=16,
            sparse_block_size=128,
            num_index_heads=heads,
            index_head_dim=128,
            prefix=prefix,
            init_blocks=init_blocks,
            local_blocks=local_blocks,
            indexer_kv_dtype=dtype,
            topk_indices_buffer=buffer,
        )
    if max_model_len is not None:
        impl.vllm_config = types.SimpleNamespace(
            model_config=types.SimpleNamespace(max_model_len=max_model_len),
            scheduler_config=types.SimpleNamespace(
                max_num_batched_tokens=MAX_TOKENS, max_num_seqs=64
            ),
            speculative_config=None,
        )
    return impl, buffer


def bind_cache(impl, batch: Batch, dtype: torch.dtype = FP8) -> torch.Tensor:
    """A random index cache over the batch's page pool, bound to the impl; the
    `(pool, 1, 128, 128)` view the kernels read."""
    impl.index_cache.bind_kv_cache(torch.randn(batch.num_pages, 1, PAGE, 128).to(dtype))
    return impl.index_cache.kv_cache.view(-1, 1, PAGE, 128)


class ReferenceKernels:
    """msa_proxy_score / msa_topk_select stand-ins: FlashInfer's argument checks, then
    the float32 reference. Records what the impl passed."""

    def __init__(self) -> None:
        self.proxy_calls: list[dict] = []
        self.topk_calls: list[dict] = []

    def msa_proxy_score(self, q, k, cu_seqlens_q, *, page_table, seqused_k, causal,
                        max_seqlen_q, max_k_tiles, output=None):  # fmt: skip
        assert causal is True
        assert q.ndim == 3 and q.shape[2] == 128 and k.shape[1:] == (1, PAGE, 128)
        if q.dtype == FP8:
            assert k.dtype == FP8, "fp8 q requires fp8 k"
        for t in (cu_seqlens_q, page_table, seqused_k):
            assert t.dtype == torch.int32
        scores = reference.proxy_score(
            q, k, cu_seqlens_q, page_table=page_table, seqused_k=seqused_k, max_k_tiles=max_k_tiles
        )
        self.proxy_calls.append(
            dict(
                q=q,
                q_ptr=q.data_ptr(),
                q_rows=q.shape[0],
                # Bytes from q's first row to the end of its storage.
                q_storage=q.untyped_storage().nbytes() - q.storage_offset() * q.element_size(),
                max_seqlen_q=max_seqlen_q,
                max_k_tiles=max_k_tiles,
                batch=seqused_k.numel(),
                output=output,
            )
        )
        if output is None:
            return scores
        assert output.shape == scores.shape and output.dtype == torch.float32
        return output.copy_(scores)

    def msa_topk_select(self, max_score, topk, *, num_valid_pages, force_begin_blocks,
                        force_end_blocks, output):  # fmt: skip
        heads, _, total_q = max_score.shape
        assert topk == 16 and max_score.dtype == torch.float32 and max_score.is_contiguous()
        assert num_valid_pages.dtype == torch.int32 and num_valid_pages.shape == (total_q,)
        assert force_begin_blocks >= 0 and force_end_blocks >= 0
        assert force_begin_blocks + force_end_blocks <= topk
        assert output.shape == (total_q, heads, topk) and output.dtype == torch.int32
        self.topk_calls.append(
            dict(
                force_begin=force_begin_blocks,
                force_end=force_end_blocks,
                score_ptr=max_score.data_ptr(),
            )
        )
        return output.copy_(
            reference.topk_select(
                max_score,
                topk,
                num_valid_pages,
                force_begin_blocks=force_begin_blocks,
                force_end_blocks=force_end_blocks,
            )
        )


def run_forward(monkeypatch, impl, md, index_query):
    context = types.SimpleNamespace(attn_metadata={impl.index_cache.prefix: md})
    monkeypatch.setattr(fi_mod, "get_forward_context", lambda: context)
    return impl(index_query)


def expected_scores(batch: Batch, q: torch.Tensor, k_pages: torch.Tensor, heads: int):
    """The reference's block scores of the raw batch (no builder metadata)."""
    md = batch.metadata
    return reference.proxy_score(
        q[: batch.num_tokens].reshape(-1, heads, 128),
        k_pages,
        md.query_start_loc_cpu,
        page_table=md.block_table_tensor,
        seqused_k=md.seq_lens,
        max_k_tiles=-(-max(batch.seq_lens) // PAGE),
    )


def expected_selection(batch: Batch, q, k_pages, heads: int, force_begin: int, force_end: int):
    """The selection computed from the raw batch, bypassing the metadata."""
    return reference.topk_select(
        expected_scores(batch, q, k_pages, heads),
        16,
        batch.step.valid_pages(),
        force_begin_blocks=force_begin,
        force_end_blocks=force_end,
    )
