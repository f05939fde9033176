"""Check every selection the FlashInfer indexer makes inside a running engine.

`install()` wraps `MiniMaxM3IndexerFlashInferImpl.forward` of the patched vLLM:
after each real forward (kernels, metadata and index cache exactly as the engine
produced them), each proxy-score + top-k call of the step is recomputed with the
float32 reference (`vllm_minimax.reference.proxy_score` over the same index
query, the same paged index-K cache and the call's page table) and the shared
top-k buffer is checked against it on every row: the selection invariants, and
the selected blocks' reference scores equal to the reference top-k scores (a
multiset, so two selections that pass differ only by tied scores). Each call's
`num_valid_pages` is also checked against the causal extent recomputed from its
`cu_seqlens_q` and `seqused_k` (right-aligned queries, as vLLM places them).

Kinds are `decode`, `prefill`, or `mixed-` either in a step with both; an MTP
draft's layers (`mtp_draft`) count as `draft-` kinds. Decode calls also count
their rows by query length (`decode_query_lens`): 1 + K for a target verifying K
speculated tokens.

Only while `AUDIT.enabled` (the driver turns it on around its own requests;
warm-up, profiling and capture batches run over uninitialised cache pages).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm_minimax.testing import mtp_draft, reference
from vllm_minimax.testing.indexer_cases import expected_topk_values, value_check, vector_invariants

PAGE = 128


@dataclass
class AuditCounts:
    calls: int = 0
    rows: int = 0
    value_rows: int = 0
    problems: list[str] = field(default_factory=list)
    decode_query_lens: dict[int, int] = field(default_factory=dict)


@dataclass
class Audit:
    enabled: bool = False
    steps: int = 0
    mixed_steps: int = 0
    by_kind: dict[str, AuditCounts] = field(default_factory=dict)

    def counts(self, kind: str) -> AuditCounts:
        return self.by_kind.setdefault(kind, AuditCounts())

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "mixed_steps": self.mixed_steps,
            "by_kind": {
                kind: {
                    "calls": c.calls,
                    "rows": c.rows,
                    "value_rows": c.value_rows,
                    "problems": c.problems[:10],
                    "num_problems": len(c.problems),
                    "decode_query_lens": {
                        str(q): rows for q, rows in sorted(c.decode_query_lens.items())
                    },
                }
                for kind, c in self.by_kind.items()
            },
        }


AUDIT = Audit()


def expected_num_valid_pages(cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor) -> torch.Tensor:
    """Per token: (its position // 128) + 1, positions right-aligned on seqused_k."""
    parts = []
    cu = cu_seqlens_q.tolist()
    for req, kv_len in enumerate(seqused_k.tolist()):
        q_len = cu[req + 1] - cu[req]
        positions = torch.arange(kv_len - q_len, kv_len)
        parts.append(positions // PAGE + 1)
    return torch.cat(parts).to(torch.int32) if parts else torch.zeros(0, dtype=torch.int32)


def _audit_step(impl, index_query: torch.Tensor) -> None:
    from vllm.models.minimax_m3.nvidia import indexer_flashinfer

    attn_metadata = indexer_flashinfer.get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return
    md = attn_metadata[impl.index_cache.prefix]
    num_tokens = md.num_actual_tokens
    q_all = index_query[:num_tokens].view(-1, impl.num_index_heads, impl.index_head_dim)
    kv = impl.index_cache.kv_cache
    k_pages = kv.view(kv.shape[0], 1, PAGE, impl.index_head_dim)
    force_begin = min(impl.init_blocks, md.max_k_tiles, impl.topk_blocks)
    force_end = min(impl.local_blocks, impl.topk_blocks - force_begin)
    AUDIT.steps += 1
    kinds = {call.is_prefill for call in md.calls}
    mixed = len(kinds) == 2
    AUDIT.mixed_steps += int(mixed)
    layer = "draft-" if mtp_draft.is_draft_layer_name(impl.index_cache.prefix) else ""
    covered = 0
    for call in md.calls:
        side = "prefill" if call.is_prefill else "decode"
        kind = layer + ("mixed-" if mixed else "") + side
        counts = AUDIT.counts(kind)
        counts.calls += 1
        if not call.is_prefill:
            rows = call.token_end - call.token_start
            lens = counts.decode_query_lens
            lens[call.max_seqlen_q] = lens.get(call.max_seqlen_q, 0) + rows
        if call.token_start != covered:
            counts.problems.append(f"calls leave a gap at token {covered}")
        covered = call.token_end
        nvp = call.num_valid_pages
        want_nvp = expected_num_valid_pages(call.cu_seqlens_q, call.seqused_k)
        if not torch.equal(nvp.cpu(), want_nvp):
            counts.problems.append(
                f"num_valid_pages {nvp.tolist()[:8]}... != causal extent {want_nvp.tolist()[:8]}..."
            )
            continue
        q = q_all[call.token_start : call.token_end]
        scores = reference.proxy_score(
            q,
            k_pages,
            call.cu_seqlens_q,
            page_table=call.page_table,
            seqused_k=call.seqused_k,
            max_k_tiles=md.max_k_tiles,
        )
        got = impl.topk_indices_buffer[call.token_start : call.token_end]
        counts.problems += vector_invariants(got, nvp, fb=force_begin, fe=force_end)
        want = expected_topk_values(scores, nvp, fb=force_begin, fe=force_end)
        check = value_check(got, want, scores)
        counts.rows += check.rows
        counts.value_rows += check.value_rows
        if check.first_mismatch:
            counts.problems.append(check.first_mismatch)
    if covered != num_tokens:
        AUDIT.counts("coverage").problems.append(f"calls end at {covered} of {num_tokens} tokens")


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def install() -> Callable:
    """Wrap the patched impl's forward (class-wide, before or after the engine
    starts); returns the original."""
    from vllm.models.minimax_m3.nvidia.indexer_flashinfer import MiniMaxM3IndexerFlashInferImpl

    original = MiniMaxM3IndexerFlashInferImpl.forward

    def audited_forward(self, index_query):
        result = original(self, index_query)
        if AUDIT.enabled and not _capturing(index_query):
            _audit_step(self, index_query)
        return result

    MiniMaxM3IndexerFlashInferImpl.forward = audited_forward
    return original
