"""The Triton side of the end-to-end tests' in-engine audit
(`selection_audit.install_triton`), on the CPU.

vLLM's Triton builder runs as is; the Triton impl's kernels are replaced by a
forward that writes a selection computed from the raw batch with the per-token
reference loops (`reference.topk_select`), blocks in descending id order, as a
stand-in for Triton's own order. The audit must count a clean step's rows as
reference top-ks, record its rows at `RECORDED_POSITIONS` whole (request,
position, layer, head, exactness, the reference's gap at its 16th block, the
blocks), mark a changed row as not exact, give a tied step's rows a gap of 0,
and number the requests across steps in the order they start.
"""

from __future__ import annotations

import types

import pytest
import torch
from indexer_helpers import PAGE, make_batch, make_builder, make_impl
from vllm.models.minimax_m3.common import indexer as indexer_mod

from vllm_minimax.testing import reference, selection_audit

HEADS = 2
LAYER = 1  # make_impl's prefix: model.layers.1.self_attn.attn
# What each forward writes: the selection for the step about to run.
SELECTIONS: list[torch.Tensor] = []


pytestmark = pytest.mark.usefixtures("single_rank")


def stand_in_forward(self, index_query, **kwargs):
    """Writes the next queued selection into the shared buffer, highest block first."""
    selection = SELECTIONS.pop(0)
    descending = torch.where(selection < 0, -1, selection).sort(-1, descending=True).values
    self.topk_indices_buffer[: selection.shape[0]] = descending
    return None, None


@pytest.fixture
def audit(monkeypatch):
    fresh = selection_audit.Audit(enabled=True)
    monkeypatch.setattr(selection_audit, "AUDIT", fresh)
    monkeypatch.setattr(indexer_mod.MiniMaxM3IndexerTritonImpl, "forward", stand_in_forward)
    SELECTIONS.clear()
    restore = selection_audit.install_triton()
    yield fresh
    restore()


def make_triton_impl(num_pages: int):
    impl, _ = make_impl(heads=HEADS, dtype="fp8", impl_cls=indexer_mod.MiniMaxM3IndexerTritonImpl)
    keys = torch.randn(num_pages, 1, PAGE, 128).to(torch.float8_e4m3fn)
    impl.index_cache.bind_kv_cache(keys)
    return impl, keys


def reference_selection(batch, q, keys) -> torch.Tensor:
    scores = reference.proxy_score(
        q.view(-1, HEADS, 128),
        keys,
        torch.tensor([0, *torch.tensor(batch.query_lens).cumsum(0).tolist()]),
        page_table=batch.metadata.block_table_tensor,
        seqused_k=torch.tensor(batch.seq_lens),
        max_k_tiles=-(-max(batch.seq_lens) // PAGE),
    )
    pages = torch.tensor([p // PAGE + 1 for p in batch.positions], dtype=torch.int32)
    return reference.topk_select(scores, 16, pages, force_end_blocks=1)


def run_step(monkeypatch, impl, batch, q, selection) -> None:
    builder = make_builder(HEADS, builder_cls=indexer_mod.MiniMaxM3IndexerTritonMetadataBuilder)
    md = builder.build(0, batch.metadata)
    context = types.SimpleNamespace(attn_metadata={impl.index_cache.prefix: md})
    monkeypatch.setattr(indexer_mod, "get_forward_context", lambda: context)
    SELECTIONS.append(selection)
    impl(q)


def one_step(monkeypatch, context_lens, query_lens, *, tie=False):
    torch.manual_seed(11)
    batch = make_batch(context_lens, query_lens)
    impl, keys = make_triton_impl(batch.num_pages)
    if tie:
        keys[:] = keys[0]  # every page the same keys: every full block scores the same
    q = torch.randn(sum(query_lens), HEADS * 128).to(torch.bfloat16)
    return impl, batch, q, reference_selection(batch, q, keys)


def recorded(audit) -> dict[tuple[int, int, int, int], list]:
    return {tuple(row[:4]): row[4:] for row in audit.summary()["recorded"]}


def test_a_clean_step_is_counted_and_its_window_recorded(monkeypatch, audit):
    impl, batch, q, selection = one_step(monkeypatch, [0, 3000], [2100, 1])
    run_step(monkeypatch, impl, batch, q, selection)
    summary = audit.summary()
    counts = summary["triton"]
    assert counts["num_problems"] == 0, counts["problems"]
    assert counts["rows"] == 2101 * HEADS and counts["value_rows"] == counts["rows"]
    # Request 0 started in this step; request 1 (a decode at 3000) was never seen starting.
    assert summary["request_extents"] == [2100]
    rows = recorded(audit)
    assert set(rows) == {(0, p, LAYER, h) for p in range(16 * PAGE, 2100) for h in range(HEADS)}
    for (_, position, _, head), (exact, gap, *blocks) in rows.items():
        assert exact == 1 and gap > 0
        assert blocks == [b for b in selection[position, head].tolist() if b >= 0]


def test_a_changed_row_is_recorded_as_not_exact(monkeypatch, audit):
    impl, batch, q, selection = one_step(monkeypatch, [0], [2200])
    token, head = 2050, 1  # 17 blocks of context: one of them is left out
    row = selection[token, head]
    kept = row.tolist()
    left_out = sorted(set(range(17)) - set(kept))
    row[kept.index(max(set(kept) - {16}))] = left_out[0]
    run_step(monkeypatch, impl, batch, q, selection)
    counts = audit.summary()["triton"]
    assert counts["value_rows"] == counts["rows"] - 1
    rows = recorded(audit)
    assert [key for key, (exact, *_) in rows.items() if not exact] == [(0, token, LAYER, head)]


def test_a_tied_step_records_a_zero_gap(monkeypatch, audit):
    impl, batch, q, selection = one_step(monkeypatch, [0], [2100], tie=True)
    run_step(monkeypatch, impl, batch, q, selection)
    rows = recorded(audit)
    assert len(rows) == (2100 - 16 * PAGE) * HEADS
    # Every full block scores the same: the top-k keeps 15 of 16 equal blocks.
    assert all(exact == 1 and gap == 0.0 for exact, gap, *_ in rows.values())


def test_requests_are_numbered_in_the_order_they_start(monkeypatch, audit):
    torch.manual_seed(3)
    first = make_batch([0], [2060])
    impl, keys = make_triton_impl(first.num_pages + 64)
    q = torch.randn(2060, HEADS * 128).to(torch.bfloat16)
    run_step(monkeypatch, impl, first, q, reference_selection(first, q, keys))
    # The next step: request 0 decodes at 2060 (its first block unchanged), a new
    # request starts on other pages.
    second = make_batch([2060, 0], [1, 2100])
    table = second.metadata.block_table_tensor
    table[0] = first.metadata.block_table_tensor[0, : table.shape[1]]
    table[1] = torch.arange(first.num_pages, first.num_pages + table.shape[1])
    q2 = torch.randn(2101, HEADS * 128).to(torch.bfloat16)
    run_step(monkeypatch, impl, second, q2, reference_selection(second, q2, keys))
    assert audit.summary()["request_extents"] == [2061, 2100]
    requests = {}
    for request, position, *_ in recorded(audit):
        requests.setdefault(request, set()).add(position)
    assert requests == {0: set(range(2048, 2061)), 1: set(range(2048, 2100))}
