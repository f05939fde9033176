"""The reference's two oracles of the top-k contract agree: the per-token loops
(`topk_select`, `compare_selections`, `check_selection_invariants`) and the vectorized
one (`expected_topk_values`, `value_check`, `vector_invariants`, `boundary_gap`,
`untied_exact_check`), on ragged extents, forced regions clamped to short extents,
empty scores and tied scores, and on selections broken in each way the invariants name.
"""

from __future__ import annotations

import pytest
import torch

from vllm_minimax.testing import reference

TOPK = 16


def scores_and_extents(seed: int, *, heads: int, tiles: int, tokens: int, ties: bool):
    """`(heads, tiles, tokens)` scores, `-inf` past each token's causal extent, and the
    per-token extents (1 to `tiles` pages, the short ones included)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(heads, tiles, tokens, generator=g)
    if ties:  # few distinct values: many rows have a tie at the 16th block
        scores = (scores * 2).round() / 2
    extents = torch.randint(1, tiles + 1, (tokens,), generator=g, dtype=torch.int32)
    extents[:3] = torch.tensor([1, TOPK, TOPK + 1], dtype=torch.int32).clamp(max=tiles)
    past = torch.arange(tiles)[:, None] >= extents[None, :]
    return scores.masked_fill(past[None], float("-inf")), extents


FORCED = [(0, 0), (0, 1), (1, 1), (2, 2), (3, 0), (20, 4)]
SHAPES = [(1, 40, 60, False), (2, 25, 50, True), (4, 17, 30, False), (1, 8, 12, False)]


@pytest.mark.parametrize(("fb", "fe"), FORCED)
@pytest.mark.parametrize(("heads", "tiles", "tokens", "ties"), SHAPES)
def test_the_two_oracles_agree_on_the_reference_selection(heads, tiles, tokens, ties, fb, fe):
    scores, extents = scores_and_extents(tiles * 31 + fb, heads=heads, tiles=tiles,
                                         tokens=tokens, ties=ties)  # fmt: skip
    # The kernels clamp the forced regions to the top-k, as the impl does.
    fb_k = min(fb, TOPK)
    fe_k = min(fe, TOPK - fb_k)
    loop = reference.topk_select(scores, TOPK, extents, force_begin_blocks=fb_k,
                                 force_end_blocks=fe_k)  # fmt: skip
    # Both invariant checks pass the loop's selection.
    assert reference.check_selection_invariants(loop, extents, topk=TOPK, force_begin_blocks=fb_k,
                                                force_end_blocks=fe_k) == []  # fmt: skip
    assert reference.vector_invariants(loop, extents, fb=fb_k, fe=fe_k) == []
    # The vectorized expected scores are the loop selection's scores.
    want = reference.expected_topk_values(scores, extents, fb=fb_k, fe=fe_k)
    assert torch.equal(reference.selection_values(loop, scores), want)
    vector = reference.value_check(loop, want, scores)
    assert vector.all_values_match, vector.first_mismatch
    assert reference.compare_selections(loop, loop, scores).all_values_match
    # Where the vectorized oracle says the top-k is unique, the loop's set is its set.
    untied = reference.untied_exact_check(loop, scores, extents, fb=fb_k, fe=fe_k)
    assert untied.exact_rows == untied.rows > 0
    gap = reference.boundary_gap(scores, extents, fb=fb_k, fe=fe_k)
    assert torch.all(gap >= 0)
    if ties and fb_k + fe_k < TOPK:  # something is chosen on its score
        assert untied.rows < heads * tokens and bool((gap == 0).any())


def swapped_block(selection: torch.Tensor, scores: torch.Tensor, extents: torch.Tensor):
    """The loop's selection with, in one row that drops blocks, its best free block
    replaced by the best dropped one of lower score; and that row."""
    for token, extent in enumerate(extents.tolist()):
        if extent <= TOPK + 2:
            continue
        row = selection[token, 0]
        kept = set(row[row >= 0].tolist())
        dropped = [b for b in range(extent) if b not in kept]
        free = [b for b in kept if 0 < b < extent - 1]
        best_free = max(free, key=lambda b: float(scores[0, b, token]))
        worst_dropped = min(dropped, key=lambda b: float(scores[0, b, token]))
        broken = selection.clone()
        broken[token, 0] = torch.tensor(
            sorted((kept - {best_free}) | {worst_dropped}), dtype=torch.int32
        )
        return broken, token
    raise AssertionError("no row drops blocks")


def test_the_two_oracles_reject_the_same_wrong_selections():
    scores, extents = scores_and_extents(5, heads=2, tiles=30, tokens=40, ties=False)
    good = reference.topk_select(scores, TOPK, extents, force_begin_blocks=1, force_end_blocks=1)
    # A lower-scoring block in place of a kept one: both value checks fail, on that row.
    wrong, token = swapped_block(good, scores, extents)
    loop = reference.compare_selections(wrong, good, scores)
    vector = reference.value_check(
        wrong, reference.expected_topk_values(scores, extents, fb=1, fe=1), scores
    )
    assert not loop.all_values_match and not vector.all_values_match
    assert loop.value_rows == vector.value_rows == loop.rows - 1
    assert loop.first_mismatch.startswith(f"token {token} head 0")
    assert vector.first_mismatch.startswith(f"token {token} head 0")
    untied = reference.untied_exact_check(wrong, scores, extents, fb=1, fe=1)
    assert untied.exact_rows == untied.rows - 1
    # Broken contracts: each invariant check flags the same rows.
    breakages = {
        "poison": lambda s: s.__setitem__((3, 1, 15), -7),
        "unsorted": lambda s: s.__setitem__((4, 0), s[4, 0].flip(0)),
        "past the extent": lambda s: s.__setitem__((0, 0, 0), 5),  # token 0 has 1 page
        "forced block dropped": lambda s: s.__setitem__(
            (2, 0), torch.tensor([*range(1, 16), 16], dtype=torch.int32)
        ),
        "too few": lambda s: s.__setitem__((2, 1, 15), -1),  # token 2 has 17 pages
    }
    for name, breakage in breakages.items():
        broken = good.clone()
        breakage(broken)
        loop_problems = reference.check_selection_invariants(
            broken, extents, topk=TOPK, force_begin_blocks=1, force_end_blocks=1
        )
        vector_problems = reference.vector_invariants(broken, extents, fb=1, fe=1)
        assert loop_problems and vector_problems, (name, loop_problems, vector_problems)


@pytest.mark.parametrize(("kv_heads", "group"), [(1, 8), (2, 4)])
def test_selected_block_attention_is_masked_attention_over_the_selected_keys(kv_heads, group):
    """The float32 core both sparse-attend references use (`sparse_attention_cases.
    reference_attention` over a batch, the CPU tests' recorded FlashInfer op over its
    arguments), against torch's scaled_dot_product_attention with the mask built key by key:
    a key counts when its block is selected and it is at or before the token's position.
    Fresh random inputs each run."""
    import os

    import torch.nn.functional as F

    from vllm_minimax.testing.sparse_attention_cases import PAGE, selected_block_attention

    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    t, d, blocks_in_seq = 5, 16, 40
    positions = torch.randint(PAGE, blocks_in_seq * PAGE, (t,), generator=g)
    blocks = torch.full((t, kv_heads, TOPK), -1, dtype=torch.long)
    for i in range(t):
        extent = int(positions[i]) // PAGE + 1
        for h in range(kv_heads):
            n = int(torch.randint(1, min(TOPK, extent) + 1, (), generator=g))
            chosen = torch.randperm(extent, generator=g)[:n]
            chosen[0] = extent - 1  # the token's own block, so no row is empty
            blocks[i, h, :n] = chosen
    q = torch.randn(t, kv_heads, group, d, generator=g)
    keys = torch.randn(t, kv_heads, TOPK * PAGE, d, generator=g)
    values = torch.randn(t, kv_heads, TOPK * PAGE, d, generator=g)
    scale = 0.3
    got = selected_block_attention(q, keys, values, blocks, positions, scale)

    mask = torch.zeros(t, kv_heads, TOPK * PAGE, dtype=torch.bool)
    for i in range(t):
        for h in range(kv_heads):
            for slot in range(TOPK):
                block = int(blocks[i, h, slot])
                if block < 0:
                    continue
                key = block * PAGE + torch.arange(PAGE)
                mask[i, h, slot * PAGE : (slot + 1) * PAGE] = key <= positions[i]
    want = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask[:, :, None, :], scale=scale
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
