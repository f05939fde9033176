"""The float32 reference against transformers' MiniMax-M3 indexer.

transformers carries an eager, dense implementation of the lightning indexer;
it shares no code with the reference, which scores a paged cache the way
FlashInfer's kernels do. Both select from the same index queries and keys.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLIndexer

from vllm_minimax.testing import reference
from vllm_minimax.testing.hf_indexer import STEP_CASES, StepCase
from vllm_minimax.testing.scheduled_step import ScheduledStep, random_page_table, write_keys

BLOCK = 128


def tiny_config(index_heads: int, local_blocks: int) -> MiniMaxM3VLTextConfig:
    return MiniMaxM3VLTextConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=index_heads,
        num_key_value_heads=index_heads,
        head_dim=128,
        index_n_heads=index_heads,
        index_head_dim=128,
        index_block_size=BLOCK,
        index_topk_blocks=16,
        index_local_blocks=local_blocks,
    )


def paged(keys: list[torch.Tensor], step: ScheduledStep, generator: torch.Generator):
    """Each request's `(seq, 128)` keys in its pages of a shuffled one-head page pool
    (random keys elsewhere); the pool and the page table."""
    table, pool_size = random_page_table(step, generator)
    pool = torch.randn(pool_size, 1, BLOCK, 128, generator=generator)
    write_keys(pool, table, keys)
    return pool, table


@pytest.mark.parametrize(("seq_len", "index_heads", "local_blocks"), [(2700, 1, 1), (3001, 2, 2)])
def test_reference_selects_what_transformers_selects(seq_len, index_heads, local_blocks):
    generator = torch.Generator().manual_seed(seq_len)
    config = tiny_config(index_heads, local_blocks)
    indexer = MiniMaxM3VLIndexer(config, layer_idx=0).eval()
    hidden = torch.randn(1, seq_len, config.hidden_size, generator=generator)
    positions = torch.arange(seq_len)[None]
    # Identity rotary: selection semantics do not depend on the rotation.
    identity = (torch.ones(1, seq_len, 128), torch.zeros(1, seq_len, 128))
    with torch.no_grad():
        hf_selection = indexer(hidden, identity, None, positions)  # [1, H, S, topk]
        idx_q = indexer.q_norm(indexer.q_proj(hidden).view(1, seq_len, index_heads, 128))[0]
        idx_k = indexer.k_norm(indexer.k_proj(hidden).view(1, seq_len, 1, 128))[0, :, 0]

    pool, page_table = paged([idx_k], ScheduledStep((0,), (seq_len,)), generator)
    num_tiles = -(-seq_len // BLOCK)
    scores = reference.proxy_score(
        idx_q,
        pool,
        torch.tensor([0, seq_len]),
        page_table=page_table,
        seqused_k=torch.tensor([seq_len]),
        max_k_tiles=num_tiles,
    )
    valid_pages = (positions[0] // BLOCK + 1).to(torch.int32)
    ours = reference.topk_select(scores, 16, valid_pages, force_end_blocks=local_blocks)

    theirs = hf_selection[0].transpose(0, 1)  # [S, H, topk] in top-k order
    theirs = torch.where(theirs < 0, torch.iinfo(torch.int32).max, theirs).sort(-1).values
    theirs = torch.where(theirs == torch.iinfo(torch.int32).max, -1, theirs).to(torch.int32)
    comparison = reference.compare_selections(ours, theirs, scores)
    assert comparison.all_values_match, comparison.first_mismatch
    assert comparison.exact_rate > 0.99
    # The sequence is long enough that blocks really were dropped.
    assert num_tiles > 16 and (ours[-1] >= 0).sum() == 16 * index_heads


def test_reference_rejects_a_wrong_selection():
    """The comparison is not vacuous: a swapped block is caught."""
    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(1, 30, 4, generator=generator)
    pages = torch.full((4,), 30, dtype=torch.int32)
    good = reference.topk_select(scores, 16, pages)
    bad = good.clone()
    dropped = set(range(30)) - set(good[2, 0].tolist())
    bad[2, 0, 5] = min(dropped)
    bad[2, 0] = bad[2, 0].sort().values
    assert reference.compare_selections(good, good, scores).all_values_match
    result = reference.compare_selections(bad, good, scores)
    assert not result.all_values_match and result.first_mismatch.startswith("token 2 head 0")
    assert reference.check_selection_invariants(good, pages, topk=16, force_begin_blocks=0,
                                                force_end_blocks=0) == []  # fmt: skip
    poisoned = good.clone()
    poisoned[1, 0, 15] = -7
    problems = reference.check_selection_invariants(
        poisoned, pages, topk=16, force_begin_blocks=0, force_end_blocks=0
    )
    assert problems and "unwritten" in problems[0]


@pytest.mark.parametrize("case", STEP_CASES, ids=lambda c: c.name)
def test_reference_selects_what_transformers_selects_on_a_step(case: StepCase):
    """Decode, MTP and chunked-prefill queries after existing context, several
    requests a step, 1/2/4 heads, forced leading blocks, page-boundary contexts:
    transformers runs each request densely; the reference scores the step's
    paged cache, all requests at once."""
    q, keys = case.inputs(seed=len(case.name))
    theirs = case.expected(q, keys)
    generator = torch.Generator().manual_seed(7)
    pool, page_table = paged([k.float() for k in keys], case.step, generator)
    cu_seqlens_q = torch.tensor([0, *case.query_lens]).cumsum(0)
    scores = reference.proxy_score(
        q.float(),
        pool,
        cu_seqlens_q,
        page_table=page_table,
        seqused_k=torch.tensor(case.seq_lens),
        max_k_tiles=-(-max(case.seq_lens) // BLOCK),
    )
    valid_pages = torch.tensor([p // BLOCK + 1 for p in case.positions], dtype=torch.int32)
    ours = reference.topk_select(
        scores,
        16,
        valid_pages,
        force_begin_blocks=case.init_blocks,
        force_end_blocks=case.local_blocks,
    )
    comparison = reference.compare_selections(ours, theirs, scores)
    assert comparison.all_values_match, comparison.first_mismatch
    assert comparison.exact_rate > 0.99, comparison
    # Blocks really were dropped somewhere in the step.
    assert (valid_pages > 16).any()
