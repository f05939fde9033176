"""The patched vLLM's FlashInfer indexer (its builder's build() and its impl's
forward(), with the kernels replaced by the float32 reference) against
transformers' dense MiniMax-M3 indexer (`vllm_minimax.testing.hf_indexer`).

The reference stand-ins are checked against transformers separately
(tests/cpu/test_reference_vs_transformers.py); here transformers judges the
whole path: the scheduler's batch as vLLM hands it over (random page table,
decode-first order, mixed batches split into a decode and a prefill pair), the
builder's per-token page counts and window, the impl's forced regions and its
writes into the shared top-k buffer.
"""

from __future__ import annotations

import pytest
import torch
from indexer_helpers import PAGE, POISON, make_batch, make_builder, make_impl, run_forward

from vllm_minimax.testing import reference
from vllm_minimax.testing.hf_indexer import STEP_CASES, StepCase
from vllm_minimax.testing.scheduled_step import write_keys

pytestmark = pytest.mark.usefixtures("single_rank")


@pytest.mark.parametrize("case", STEP_CASES, ids=lambda c: c.name)
def test_patched_forward_selects_what_transformers_selects(monkeypatch, kernels, case: StepCase):
    q, keys = case.inputs(seed=len(case.name))
    theirs = case.expected(q, keys)

    batch = make_batch(list(case.context_lens), list(case.query_lens))
    num_tokens = sum(case.query_lens)
    impl, buffer = make_impl(
        heads=case.heads, dtype="bf16", init_blocks=case.init_blocks, local_blocks=case.local_blocks
    )
    cache = torch.randn(batch.num_pages, 1, PAGE, 128).to(torch.bfloat16)  # garbage elsewhere
    table = batch.metadata.block_table_tensor
    write_keys(cache, table, keys)
    impl.index_cache.bind_kv_cache(cache)
    index_query = torch.randn(num_tokens + 3, case.heads * 128).to(torch.bfloat16)
    index_query[:num_tokens] = q.reshape(num_tokens, -1)
    builder = make_builder(
        index_heads=case.heads, local_blocks=case.local_blocks, threshold=case.decode_threshold
    )
    md = builder.build(0, batch.metadata)

    run_forward(monkeypatch, impl, md, index_query)

    got = buffer[:num_tokens]
    assert torch.all(buffer[num_tokens:] == POISON), "rows past num_tokens were written"
    mixed = md.num_decodes > 0 and md.num_prefills > 0
    assert len(kernels.proxy_calls) == (2 if mixed else 1)
    # Ties are judged on the reference's scores of the raw step (no metadata).
    scores = reference.proxy_score(
        q.float(),
        cache.float(),
        torch.tensor([0, *case.query_lens]).cumsum(0),
        page_table=table,
        seqused_k=torch.tensor(case.seq_lens),
        max_k_tiles=-(-max(case.seq_lens) // PAGE),
    )
    comparison = reference.compare_selections(got, theirs, scores)
    assert comparison.all_values_match, comparison.first_mismatch
    assert comparison.exact_rate > 0.99, comparison
