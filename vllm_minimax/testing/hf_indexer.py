"""transformers' MiniMax-M3 indexer as an independent selection oracle.

`MiniMaxM3VLIndexer` is an eager, dense implementation (one causal score matrix
per request, its own block max-pool, local-block boost and top-k) that shares no
code with `vllm_minimax.testing.reference` or the patch. `StepCase.expected`
runs it with its projections replaced by identity maps (the hidden state of a
position is its index query beside its index key), its norms and rotary off, so
it selects from exactly the queries and keys a test hands the code under test.

transformers has no forced leading blocks. A case with `init_blocks = b` gives
every query a positive first component and the keys of blocks `0..b-1` a very
negative one, so no query would pick those blocks: transformers' top-(16 - b)
plus blocks `0..b-1` is then the one right answer for a forced selection.

A case with `page_start_keys` gives every query a positive second component and
the first key of every block a large one, so a query on a block's first
position scores that block as high as any full block: with no local window
(`local_blocks = 0`) the block competes on that one key, and a causal extent
shifted by one key (the block scored empty) changes the selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_minimax.testing.scheduled_step import ScheduledStep

BLOCK = 128
HEAD_DIM = 128
TOPK = 16
REPELLING_KEY = -1000.0
ATTRACTING_KEY = 8.0


@dataclass(frozen=True)
class StepCase:
    """One scheduled step: per request, tokens already cached and tokens now."""

    name: str
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    heads: int = 1
    init_blocks: int = 0
    local_blocks: int = 1
    decode_threshold: int = 1
    page_start_keys: bool = False

    @property
    def step(self) -> ScheduledStep:
        return ScheduledStep.of(self.context_lens, self.query_lens)

    @property
    def seq_lens(self) -> list[int]:
        return self.step.seq_lens

    @property
    def positions(self) -> list[int]:
        return self.step.positions

    def inputs(self, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """bf16 index queries `(total_q, heads, 128)` and, per request, its keys
        `(seq_len, 128)`."""
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(sum(self.query_lens), self.heads, HEAD_DIM, generator=g)
        keys = [torch.randn(s, HEAD_DIM, generator=g) for s in self.seq_lens]
        if self.init_blocks:
            q[..., 0] = q[..., 0].abs() + 1
            for k in keys:
                k[: self.init_blocks * BLOCK, 0] = REPELLING_KEY
        if self.page_start_keys:
            q[..., 1] = q[..., 1].abs() + 1
            for k in keys:
                k[::BLOCK, 1] = ATTRACTING_KEY
        return q.to(torch.bfloat16), [k.to(torch.bfloat16) for k in keys]

    def expected(self, q: torch.Tensor, keys: list[torch.Tensor]) -> torch.Tensor:
        """`(total_q, heads, 16)` int32 ascending, `-1` tail: transformers' selection."""
        rows = []
        start = 0
        for context, q_len, k in zip(self.context_lens, self.query_lens, keys, strict=True):
            positions = list(range(context, context + q_len))
            chosen = transformers_selection(
                q[start : start + q_len].float(),
                positions,
                k.float(),
                local_blocks=self.local_blocks,
                topk=TOPK - self.init_blocks,
            )
            for row, position in zip(chosen, positions, strict=True):
                extent = position // BLOCK + 1
                forced = torch.arange(min(self.init_blocks, extent), dtype=torch.int32)
                rows.append(torch.stack([_ascending(torch.cat([h, forced])) for h in row]))
            start += q_len
        return torch.stack(rows)


def _ascending(blocks: torch.Tensor) -> torch.Tensor:
    unique = torch.unique(blocks[blocks >= 0]).to(torch.int32)
    out = torch.full((TOPK,), -1, dtype=torch.int32)
    out[: unique.numel()] = unique
    return out


def transformers_selection(
    q_rows: torch.Tensor,
    positions: list[int],
    keys: torch.Tensor,
    *,
    local_blocks: int,
    topk: int = TOPK,
) -> torch.Tensor:
    """transformers' selection `(len(positions), heads, topk)` (top-k order, `-1`
    for empty slots) for queries `q_rows` `(n, heads, 128)` at `positions` over
    the keys `(seq_len, 128)` of positions `0..seq_len-1`."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import (
        MiniMaxM3VLTextConfig,
    )
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLIndexer

    n, heads, _ = q_rows.shape
    seq_len = keys.shape[0]
    q_width = heads * HEAD_DIM
    config = MiniMaxM3VLTextConfig(
        hidden_size=q_width + HEAD_DIM,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=HEAD_DIM,
        index_n_heads=heads,
        index_head_dim=HEAD_DIM,
        index_block_size=BLOCK,
        index_topk_blocks=topk,
        index_local_blocks=local_blocks,
    )
    indexer = MiniMaxM3VLIndexer(config, layer_idx=0).eval()
    with torch.no_grad():
        eye = torch.eye(q_width + HEAD_DIM)
        indexer.q_proj.weight.copy_(eye[:q_width])
        indexer.k_proj.weight.copy_(eye[q_width:])
    indexer.q_norm = nn.Identity()
    indexer.k_norm = nn.Identity()
    hidden = torch.zeros(1, seq_len, q_width + HEAD_DIM)
    hidden[0, :, q_width:] = keys
    hidden[0, positions, :q_width] = q_rows.reshape(n, q_width)
    identity_rotary = (torch.ones(1, seq_len, HEAD_DIM), torch.zeros(1, seq_len, HEAD_DIM))
    with torch.no_grad():
        selection = indexer(hidden, identity_rotary, None, torch.arange(seq_len)[None])
    return selection[0][:, positions].transpose(0, 1)  # (n, heads, topk)


PAGE_BOUNDARY_CONTEXTS = (127, 128, 129, 2047, 2048, 2049)

# The steps both the reference and the patch's forward are checked on.
STEP_CASES = [
    StepCase("decode-page-boundaries", PAGE_BOUNDARY_CONTEXTS, (1,) * 6),
    StepCase("decode-page-boundaries-h4", PAGE_BOUNDARY_CONTEXTS, (1,) * 6, heads=4),
    StepCase(
        "mtp3-page-boundaries-h2", PAGE_BOUNDARY_CONTEXTS, (3,) * 6, heads=2, decode_threshold=3
    ),
    StepCase(
        "decode-init2-local2", (2047, 3000, 200, 2600), (1,) * 4, init_blocks=2, local_blocks=2
    ),
    StepCase("chunked-prefill-on-context-h2", (2048, 2049), (300, 129), heads=2),
    StepCase(
        "mixed-decode-and-prefills-h2", (2047, 3000, 128, 2049, 0), (1, 1, 1, 400, 250), heads=2
    ),
    StepCase(
        "mixed-mtp2-and-chunk-init1-h4",
        (2048, 129, 2100),
        (2, 2, 500),
        heads=4,
        init_blocks=1,
        decode_threshold=2,
    ),
    StepCase("prefills-from-empty", (0, 0, 0), (129, 2049, 1800)),
    # No local window: the query's own block competes on the keys it sees.
    StepCase(
        "decode-block-starts-local0-h2",
        (2048, 2176, 2304, 2049),
        (1,) * 4,
        heads=2,
        local_blocks=0,
        page_start_keys=True,
    ),
    StepCase(
        "chunk-over-block-starts-local0",
        (1990, 0),
        (700, 2200),
        local_blocks=0,
        page_start_keys=True,
    ),
    StepCase("chunk-local0-h2", (2100,), (500,), heads=2, local_blocks=0),
]
