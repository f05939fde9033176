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

`selection_matches` compares two selections the way ties allow: the same valid
slots, and the same multiset of selected scores.
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
