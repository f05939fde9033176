"""Float32 torch reference of FlashInfer's MSA indexer contract.

`proxy_score` and `topk_select` restate, in plain torch, what
`flashinfer.msa_ops.msa_proxy_score` and `msa_topk_select` are documented to
compute, with the same argument names and layouts, so they can stand in for the
kernels on a CPU and be compared against them on a GPU:

- `proxy_score`: for every query token and index head, the max over each 128-key
  page of the unscaled causal `q.k`; `-inf` for pages outside the token's causal
  range or beyond its request's `seqused_k`. Queries are right-aligned on
  `seqused_k` (the last query of a request sits at position `seqused_k - 1`).
- `topk_select`: per (token, head), the forced leading blocks and the forced
  trailing blocks of the token's own extent `[0, num_valid_pages)`, then the
  best-scoring other blocks of that extent, as ascending indices with `-1` tail
  padding.

`compare_selections` compares two selections the way ties allow: the same valid
slots, and the same multiset of selected scores.

Two oracles of the top-k contract live here: the per-token loops above
(`topk_select`, `compare_selections`, `check_selection_invariants`), plain enough
to read against the contract, and a vectorized one (`expected_topk_values`,
`value_check`, `vector_invariants`, `boundary_gap`, `untied_exact_check`) that
checks every token of a GPU-sized batch at once. tests/cpu/test_reference_oracles.py
checks that they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAGE_SIZE = 128
TOPK_BLOCKS = 16


def proxy_score(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    page_table: torch.Tensor,
    seqused_k: torch.Tensor,
    max_k_tiles: int,
) -> torch.Tensor:
    """`(num_heads, max_k_tiles, total_q)` float32 block-max scores.

    `q` is `(total_q, num_heads, 128)`; `k_pages` is `(num_pages, 1, 128, 128)`
    (a one-head paged index-K cache); `page_table` is `(num_reqs, max_pages)`.
    """
    total_q, num_heads, head_dim = q.shape
    out = torch.full(
        (num_heads, max_k_tiles, total_q), float("-inf"), dtype=torch.float32, device=q.device
    )
    cu = cu_seqlens_q.tolist()
    for req, kv_len in enumerate(seqused_k.tolist()):
        q_start, q_end = cu[req], cu[req + 1]
        q_len = q_end - q_start
        if q_len == 0 or kv_len == 0:
            continue
        num_pages = -(-kv_len // PAGE_SIZE)
        pages = page_table[req, :num_pages].long()
        keys = k_pages[pages, 0].reshape(num_pages * PAGE_SIZE, head_dim).float()
        logits = torch.einsum("thd,kd->htk", q[q_start:q_end].float(), keys)
        positions = torch.arange(kv_len - q_len, kv_len, device=q.device)
        key_index = torch.arange(num_pages * PAGE_SIZE, device=q.device)
        visible = key_index[None, :] <= positions[:, None]  # also hides keys >= kv_len
        logits = logits.masked_fill(~visible[None], float("-inf"))
        block_max = logits.view(num_heads, q_len, num_pages, PAGE_SIZE).amax(-1)
        tiles = min(num_pages, max_k_tiles)
        out[:, :tiles, q_start:q_end] = block_max[:, :, :tiles].transpose(1, 2)
    return out


def topk_select(
    max_score: torch.Tensor,
    topk: int,
    num_valid_pages: torch.Tensor | int | None = None,
    *,
    force_begin_blocks: int = 0,
    force_end_blocks: int = 0,
) -> torch.Tensor:
    """`(total_q, num_heads, topk)` int32 ascending block indices, `-1` tail."""
    num_heads, max_k_tiles, total_q = max_score.shape
    if num_valid_pages is None:
        num_valid_pages = max_k_tiles
    if isinstance(num_valid_pages, int):
        num_valid_pages = torch.full((total_q,), num_valid_pages, dtype=torch.int32)
    valid_counts = num_valid_pages.clamp(0, max_k_tiles).tolist()
    scores = max_score.float().cpu()
    out = torch.full((total_q, num_heads, topk), -1, dtype=torch.int32)
    for token, extent in enumerate(valid_counts):
        begin = min(force_begin_blocks, extent)
        end_start = max(begin, extent - force_end_blocks)
        forced = [*range(begin), *range(end_start, extent)]
        room = topk - len(forced)
        for head in range(num_heads):
            chosen = list(forced)
            if room > 0 and end_start > begin:
                middle = scores[head, begin:end_start, token]
                finite = torch.isfinite(middle).nonzero().flatten()
                if finite.numel():
                    best = middle[finite].topk(min(room, finite.numel())).indices
                    chosen += (finite[best] + begin).tolist()
            chosen.sort()
            out[token, head, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out.to(max_score.device)


@dataclass(frozen=True)
class SelectionComparison:
    """How two selections of the same scores compare, token by token."""

    rows: int
    exact_rows: int
    value_rows: int
    first_mismatch: str | None

    @property
    def all_values_match(self) -> bool:
        return self.value_rows == self.rows

    @property
    def exact_rate(self) -> float:
        return self.exact_rows / self.rows if self.rows else 1.0


def compare_selections(
    got: torch.Tensor,
    want: torch.Tensor,
    max_score: torch.Tensor,
    *,
    atol: float = 1e-3,
    rtol: float = 1e-3,
) -> SelectionComparison:
    """Tie-tolerant comparison of `(total_q, num_heads, topk)` selections.

    A row matches by value when both pick the same number of blocks and the
    sorted scores of the blocks they pick agree within tolerance (forced blocks,
    which the kernels pick whatever their score, count by index).
    """
    got = got.cpu().long()
    want = want.cpu().long()
    scores = max_score.float().cpu()
    total_q, num_heads, _ = want.shape
    exact = value = 0
    first_mismatch = None
    for token in range(total_q):
        for head in range(num_heads):
            g = got[token, head]
            w = want[token, head]
            if torch.equal(g, w):
                exact += 1
                value += 1
                continue
            g_valid, w_valid = g[g >= 0], w[w >= 0]
            same = g_valid.numel() == w_valid.numel()
            if same:
                g_scores = scores[head, g_valid, token].sort().values
                w_scores = scores[head, w_valid, token].sort().values
                same = bool(torch.allclose(g_scores, w_scores, atol=atol, rtol=rtol))
            if same:
                value += 1
            elif first_mismatch is None:
                first_mismatch = f"token {token} head {head}: got {g.tolist()} want {w.tolist()}"
    return SelectionComparison(total_q * num_heads, exact, value, first_mismatch)


def check_selection_invariants(
    selection: torch.Tensor,
    num_valid_pages: torch.Tensor,
    *,
    topk: int,
    force_begin_blocks: int,
    force_end_blocks: int,
) -> list[str]:
    """Violations of the top-k output contract, as readable lines (empty: none).

    Every slot written (no poison left), ascending valid indices with `-1` only
    as tail padding, no index at or past the token's own page count, the forced
    leading and trailing blocks present, and as many blocks as the extent holds.
    """
    problems: list[str] = []
    sel = selection.cpu().long()
    counts = num_valid_pages.cpu().long().tolist()
    for token, extent in enumerate(counts):
        for head in range(sel.shape[1]):
            row = sel[token, head]
            where = f"token {token} head {head} (pages {extent}): {row.tolist()}"
            if (row < -1).any():
                problems.append(f"unwritten or negative slot, {where}")
                continue
            valid = row[row >= 0]
            n = valid.numel()
            if not torch.all(row[n:] == -1):
                problems.append(f"-1 not only as tail padding, {where}")
            if n > 1 and not torch.all(valid[1:] > valid[:-1]):
                problems.append(f"indices not strictly ascending, {where}")
            if n and int(valid.max()) >= extent:
                problems.append(f"index at or past the token's page count, {where}")
            if n != min(topk, extent):
                problems.append(f"{n} blocks selected, expected {min(topk, extent)}, {where}")
            begin = min(force_begin_blocks, extent)
            forced = {*range(begin), *range(max(begin, extent - force_end_blocks), extent)}
            missing = forced - set(valid.tolist())
            if missing:
                problems.append(f"forced blocks {sorted(missing)} missing, {where}")
    return problems


# ---------------------------------------------------------------------------
# The vectorized oracle: every token at once.
# ---------------------------------------------------------------------------
def forced_mask_counts(nvp: torch.Tensor, fb: int, fe: int):
    begin = nvp.clamp(max=fb)
    end_start = torch.maximum(begin, nvp - fe)
    return begin, end_start


def vector_invariants(sel: torch.Tensor, nvp: torch.Tensor, *, fb: int, fe: int) -> list[str]:
    """Every token at once: all slots written, -1 only as tail padding,
    strictly ascending, below the token's extent, min(16, extent) blocks, the
    forced leading/trailing blocks present. Returns violation lines."""
    sel = sel.long()
    nvp = nvp.long()
    probs: list[str] = []
    T = sel.shape[0]
    written = (sel >= -1).all(-1)
    valid = sel >= 0
    n = valid.sum(-1)
    tail_ok = (valid[..., 1:] <= valid[..., :-1]).all(-1)
    both = valid[..., 1:] & valid[..., :-1]
    asc_ok = ((sel[..., 1:] > sel[..., :-1]) | ~both).all(-1)
    range_ok = ((sel < nvp[:, None, None]) | ~valid).all(-1)
    count_ok = n == nvp.clamp(max=TOPK_BLOCKS)[:, None]
    blocks = torch.arange(TOPK_BLOCKS + fb + fe + 1, device=sel.device)
    begin, end_start = forced_mask_counts(nvp, fb, fe)
    forced_ok = torch.ones_like(written)
    for j in range(fb):
        need = (j < begin)[:, None]
        forced_ok &= ~need | (sel == j).any(-1)
    for j in range(fe):
        blk = (nvp - 1 - j)[:, None]
        need = (blk >= end_start[:, None]) & (blk >= 0)
        forced_ok &= ~need | (sel == blk[..., None]).any(-1)
    del blocks
    for label, ok in (
        ("unwritten slot", written),
        ("-1 not tail padding", tail_ok),
        ("not ascending", asc_ok),
        ("index >= extent", range_ok),
        ("wrong block count", count_ok),
        ("forced block missing", forced_ok),
    ):
        bad = (~ok).nonzero()
        if bad.numel():
            t, h = bad[0].tolist()
            probs.append(
                f"{label}: {bad.shape[0]} of {T * sel.shape[1]} rows, first token {t} head {h} "
                f"(pages {int(nvp[t])}): {sel[t, h].tolist()}"
            )
    return probs


def _ranking_keys(scores: torch.Tensor, nvp: torch.Tensor, *, fb: int, fe: int) -> torch.Tensor:
    """(T, H, tiles) float32: each block's reference score as the top-k ranks it, +inf
    for the token's forced blocks and -inf past its extent."""
    tiles = scores.shape[1]
    idx = torch.arange(tiles, device=scores.device)[None, :]
    nvp = nvp.long().clamp(max=tiles)[:, None]
    begin, end_start = forced_mask_counts(nvp, fb, fe)
    in_ext = idx < nvp
    forced = (idx < begin) | ((idx >= end_start) & in_ext)
    key = torch.where(in_ext[:, None, :], scores.permute(2, 0, 1), float("-inf"))
    return torch.where(forced[:, None, :], float("inf"), key)


def expected_topk_values(scores: torch.Tensor, nvp: torch.Tensor, *, fb: int, fe: int):
    """(T, H, 16) float32, descending: the reference selection's block scores
    (forced blocks by index, then the best others), -inf padded."""
    H, tiles, T = scores.shape
    key = _ranking_keys(scores, nvp, fb=fb, fe=fe)
    k = min(TOPK_BLOCKS, tiles)
    top = key.topk(k, dim=-1).indices  # (T, H, k)
    vals = scores.permute(2, 0, 1).gather(-1, top)
    vals = torch.where(torch.isneginf(key.gather(-1, top)), float("-inf"), vals)
    if k < TOPK_BLOCKS:
        pad = torch.full((T, H, TOPK_BLOCKS - k), float("-inf"), device=scores.device)
        vals = torch.cat([vals, pad], -1)
    return vals.sort(-1, descending=True).values


def selection_values(sel: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """(T, H, 16) float32 descending: reference scores of the selected blocks."""
    s = scores.permute(2, 0, 1)  # (T, H, tiles)
    g = s.gather(2, sel.long().clamp(min=0, max=s.shape[2] - 1))
    g = torch.where(sel < 0, float("-inf"), g)
    return g.sort(-1, descending=True).values


# value_check's tolerance: two block scores this close count as equal.
VALUE_ATOL = 1e-3
VALUE_RTOL = 1e-3


def value_rows_ok(
    got: torch.Tensor,
    want_values: torch.Tensor,
    scores: torch.Tensor,
    *,
    atol: float = VALUE_ATOL,
    rtol: float = VALUE_RTOL,
) -> torch.Tensor:
    """(T, H) bool: the row's selected blocks' reference scores equal `want_values`
    (a multiset, within the tolerance)."""
    gv = selection_values(got, scores)
    close = torch.isclose(gv, want_values, atol=atol, rtol=rtol) | (
        torch.isneginf(gv) & torch.isneginf(want_values)
    )
    return close.all(-1)


def value_check(
    got: torch.Tensor,
    want_values: torch.Tensor,
    scores: torch.Tensor,
    *,
    want_sel: torch.Tensor | None = None,
    atol: float = VALUE_ATOL,
    rtol: float = VALUE_RTOL,
) -> SelectionComparison:
    """Tie-tolerant, all rows: the selected blocks' reference scores equal
    `want_values` (a multiset, as `reference.compare_selections` does)."""
    ok = value_rows_ok(got, want_values, scores, atol=atol, rtol=rtol)
    exact = ok if want_sel is None else (got == want_sel).all(-1)
    first = None
    bad = (~ok).nonzero()
    if bad.numel():
        t, h = bad[0].tolist()
        gv = selection_values(got, scores)
        first = f"token {t} head {h}: got {got[t, h].tolist()} scores {gv[t, h].tolist()} want {want_values[t, h].tolist()}"  # noqa: E501
    return SelectionComparison(
        rows=ok.numel(), exact_rows=int(exact.sum()), value_rows=int(ok.sum()), first_mismatch=first
    )


def boundary_gap(scores: torch.Tensor, nvp: torch.Tensor, *, fb: int, fe: int) -> torch.Tensor:
    """(T, H) float32: the reference score of the weakest block the top-k keeps on
    its score (forced blocks aside) less that of the strongest block it leaves out;
    0 where the top-k is not unique, `inf` where every block of the extent is kept
    (at most 16 blocks) or nothing but forced blocks is kept."""
    H, tiles, T = scores.shape
    if tiles <= TOPK_BLOCKS:
        return torch.full((T, H), float("inf"), device=scores.device)
    top = _ranking_keys(scores, nvp, fb=fb, fe=fe).topk(TOPK_BLOCKS + 1, dim=-1).values
    kept, left = top[..., TOPK_BLOCKS - 1], top[..., TOPK_BLOCKS]
    both = torch.isfinite(kept) & torch.isfinite(left)
    return torch.where(both, kept - left, float("inf"))


# Relative margin below which two block scores may be a tie the kernels round
# either way: value_check's tolerance, since Hopper's fp8 MMA accumulates with
# fewer bits than float32 (the GPU tests also report the count at 1e-5).
UNTIED_RTOL = 1e-3


def untied_exact_check(
    got: torch.Tensor,
    scores: torch.Tensor,
    nvp: torch.Tensor,
    *,
    fb: int,
    fe: int,
    rtol: float = UNTIED_RTOL,
) -> SelectionComparison:
    """Exact-set check on every row whose selection ties cannot make ambiguous.

    A row is untied when its last free pick (the forced blocks aside) scores
    more than `rtol * (|score| + 1)` above the best block left out, or when every free
    block fits. Such a row has one right set: the forced blocks plus the free
    blocks scoring at least that last pick. `rows` counts untied rows,
    `exact_rows` those selected exactly (so `exact_rate` is the exact-set rate
    where ties cannot explain a miss); tied rows are left to `value_check`.
    """
    H, tiles, T = scores.shape
    s = scores.permute(2, 0, 1).float()  # (T, H, tiles)
    idx = torch.arange(tiles, device=scores.device)[None, :]
    nvp = nvp.long().clamp(max=tiles)[:, None]
    begin, end_start = forced_mask_counts(nvp, fb, fe)
    in_ext = idx < nvp
    forced = (idx < begin) | ((idx >= end_start) & in_ext)  # (T, tiles)
    free = (in_ext & ~forced)[:, None, :] & torch.isfinite(s)
    free_scores = torch.where(free, s, float("-inf")).sort(-1, descending=True).values
    room = (TOPK_BLOCKS - forced.sum(-1)).clamp(min=0)[:, None, None].expand(T, H, 1)
    last_pick = free_scores.gather(-1, (room - 1).clamp(min=0, max=tiles - 1))
    first_left = free_scores.gather(-1, room.clamp(max=tiles - 1))
    everything_fits = (room >= tiles) | torch.isneginf(first_left) | (room == 0)
    margin = last_pick - first_left
    untied = (everything_fits | (margin > rtol * (last_pick.abs() + 1))).squeeze(-1)
    want = forced[:, None, :] | (free & ((s >= last_pick) | everything_fits) & (room > 0))
    sel = got.long()
    valid = (sel >= 0) & (sel < tiles)
    # Padding and out-of-range slots land in a spare last column, dropped after.
    have = torch.zeros((T, H, tiles + 1), dtype=torch.bool, device=scores.device)
    have.scatter_(-1, torch.where(valid, sel, tiles), True)
    have = have[..., :tiles]
    exact = (have == want).all(-1) & (valid.sum(-1) == want.sum(-1))
    bad = (untied & ~exact).nonzero()
    first = None
    if bad.numel():
        t, h = bad[0].tolist()
        want_blocks = want[t, h].nonzero().flatten().tolist()
        first = f"token {t} head {h} (untied): got {got[t, h].tolist()} want {want_blocks}"
    rows = int(untied.sum())
    exact_rows = int((untied & exact).sum())
    return SelectionComparison(
        rows=rows, exact_rows=exact_rows, value_rows=exact_rows, first_mismatch=first
    )
