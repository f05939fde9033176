"""One scheduled step of the MiniMax M3 indexer, built the way vLLM's runner hands it over.

`ScheduledStep` is what the scheduler decided for a step: per request, in vLLM's
decode-first order, the tokens already in the cache and the tokens scheduled now.
Every test of the indexer builds its batch from it:

- `random_page_table`: a page table over a shuffled pool with spare pages, so pages
  are non-contiguous and the padding past a request's pages holds other, addressable
  page ids, as vLLM's block table does;
- `common_metadata`: the `CommonAttentionMetadata` the builders receive (vLLM's class,
  or `patched_module`'s stand-in with the same fields);
- `write_keys`: each request's index keys into its pages of a one-head paged cache.

What a test expects is computed from these inputs (query starts, sequence lengths,
page table, positions), never from what a builder made of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PAGE = 128


@dataclass(frozen=True)
class ScheduledStep:
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.context_lens) != len(self.query_lens) or not self.query_lens:
            raise ValueError("one context length and one query length per request")
        if min(self.context_lens) < 0 or min(self.query_lens) < 0:
            raise ValueError("lengths are not negative")

    @classmethod
    def of(cls, context_lens, query_lens) -> ScheduledStep:
        return cls(tuple(int(c) for c in context_lens), tuple(int(q) for q in query_lens))

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def seq_lens(self) -> list[int]:
        """KV length of each request, the scheduled tokens included."""
        return [c + q for c, q in zip(self.context_lens, self.query_lens, strict=True)]

    @property
    def query_start_loc(self) -> list[int]:
        starts = [0]
        for q in self.query_lens:
            starts.append(starts[-1] + q)
        return starts

    @property
    def positions(self) -> list[int]:
        """Each scheduled token's position in its request."""
        return [p for c, q in zip(self.context_lens, self.query_lens, strict=True)
                for p in range(c, c + q)]  # fmt: skip

    @property
    def page_counts(self) -> list[int]:
        """Pages each request's KV occupies."""
        return [-(-s // PAGE) for s in self.seq_lens]

    def valid_pages(self) -> torch.Tensor:
        """Per token, the pages of its causal extent: `position // 128 + 1` (int32)."""
        return torch.tensor([p // PAGE + 1 for p in self.positions], dtype=torch.int32)


def random_page_table(
    step: ScheduledStep,
    generator: torch.Generator | None = None,
    *,
    spare_pages: int = 17,
    slack_columns: int = 3,
) -> tuple[torch.Tensor, int]:
    """`(num_reqs, max pages + slack_columns)` int32 page ids, all distinct, drawn from a
    shuffled pool of that many entries plus `spare_pages`; and the pool's size."""
    width = max(step.page_counts) + slack_columns
    pool = step.num_reqs * width + spare_pages
    pages = torch.randperm(pool, generator=generator)[: step.num_reqs * width]
    return pages.view(step.num_reqs, width).to(torch.int32), pool


def common_metadata(
    step: ScheduledStep,
    page_table: torch.Tensor,
    metadata_cls: type,
    device: torch.device | str = "cpu",
) -> Any:
    """The step's `CommonAttentionMetadata`: query starts (device and CPU copies), KV
    lengths, the block table, the slot of each scheduled token and its position."""
    device = torch.device(device)
    starts = torch.tensor(step.query_start_loc, dtype=torch.int32)
    positions = torch.tensor(step.positions, dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(step.num_reqs), torch.tensor(step.query_lens))
    table = page_table.cpu().long()
    slots = table[rows, positions // PAGE] * PAGE + positions % PAGE
    return metadata_cls(
        query_start_loc=starts.to(device),
        query_start_loc_cpu=starts,
        seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32, device=device),
        num_reqs=step.num_reqs,
        num_actual_tokens=step.num_tokens,
        max_query_len=max(step.query_lens),
        max_seq_len=max(step.seq_lens),
        block_table_tensor=page_table.to(device),
        slot_mapping=slots.to(device),
        positions=positions.to(device),
    )


def write_keys(cache: torch.Tensor, page_table: torch.Tensor, keys: list[torch.Tensor]) -> None:
    """Write request r's keys `(seq_len, 128)` into its pages (`page_table[r]`) of `cache`
    `(pool, 1, 128, 128)`; the rest of each last page is zeroed, other pages untouched."""
    for row, k in enumerate(keys):
        num_pages = -(-k.shape[0] // PAGE)
        padded = torch.nn.functional.pad(k, (0, 0, 0, num_pages * PAGE - k.shape[0]))
        pages = page_table[row, :num_pages].long().to(cache.device)
        cache[pages, 0] = padded.view(num_pages, PAGE, -1).to(cache.dtype)
