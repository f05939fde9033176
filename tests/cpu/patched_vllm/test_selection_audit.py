"""The GPU end-to-end tests' in-engine audit (`vllm_minimax.testing.selection_audit`)
passes a correct selection and catches a wrong one, on the CPU.

The impl runs with FlashInfer's kernels replaced by the float32 reference (as in
test_flashinfer_indexer); the faulty variants change one block of one row, or
break what the builder made of the engine's inputs (a token's page count, a
request's page-table row, the local window): the audit recomputes from the
engine's `CommonAttentionMetadata` and model config, so each of these fails it.
"""

from __future__ import annotations

import pytest
import test_flashinfer_indexer as indexer_tests
import torch
from test_flashinfer_indexer import BATCHES, PAGE, make_batch, make_builder, make_impl, run_forward
from vllm.models.minimax_m3.nvidia import indexer_flashinfer as fi_mod

from vllm_minimax.testing import selection_audit

# The reference kernels and the single-rank patch, as test_flashinfer_indexer uses them.
kernels = indexer_tests.kernels
single_rank = indexer_tests.single_rank


@pytest.fixture
def audit(monkeypatch, kernels):
    fresh = selection_audit.Audit(enabled=True)
    monkeypatch.setattr(selection_audit, "AUDIT", fresh)
    restore = selection_audit.install()
    yield fresh
    restore()


def _step(monkeypatch, name: str, heads: int = 2, builder_local_blocks: int = 1):
    torch.manual_seed(5)
    batch = make_batch(*BATCHES[name])
    impl, _ = make_impl(heads=heads, dtype="fp8")
    impl.index_cache.bind_kv_cache(
        torch.randn(batch.num_pages, 1, PAGE, 128).to(torch.float8_e4m3fn)
    )
    index_query = torch.randn(sum(batch.query_lens) + 3, heads * 128).to(torch.float8_e4m3fn)
    builder = make_builder(index_heads=heads, local_blocks=builder_local_blocks)
    md = builder.build(0, batch.metadata)
    return impl, md, index_query


def _problems(audit) -> list[str]:
    return [p for counts in audit.summary()["by_kind"].values() for p in counts["problems"]]


def test_a_correct_mixed_step_passes(monkeypatch, audit):
    impl, md, index_query = _step(monkeypatch, "decode+prefill")
    run_forward(monkeypatch, impl, md, index_query)
    summary = audit.summary()
    assert summary["steps"] == 1 and summary["mixed_steps"] == 1
    kinds = summary["by_kind"]
    assert set(kinds) == {"mixed-decode", "mixed-prefill"}
    for counts in kinds.values():
        assert counts["num_problems"] == 0, counts["problems"]
        assert counts["rows"] > 0 and counts["value_rows"] == counts["rows"]


def test_one_wrong_block_is_caught(monkeypatch, kernels, audit):
    real_topk = kernels.msa_topk_select

    def off_by_one_block(max_score, topk, *, output, **kw):
        real_topk(max_score, topk, output=output, **kw)
        row = output[-1, 0]  # the prefill's last token: 6 pages of context, 6 selected
        row[0] = 0 if row[0] != 0 else -1  # replaces or drops a block
        return output

    monkeypatch.setattr(fi_mod, "msa_topk_select", off_by_one_block)
    impl, md, index_query = _step(monkeypatch, "prefill")
    run_forward(monkeypatch, impl, md, index_query)
    counts = audit.summary()["by_kind"]["prefill"]
    assert counts["num_problems"] > 0
    assert counts["value_rows"] < counts["rows"] or counts["problems"]


def test_a_wrong_page_count_is_caught(monkeypatch, audit):
    impl, md, index_query = _step(monkeypatch, "decode")
    md.calls[0].num_valid_pages[0] -= 1  # request 0: 3000 tokens of context, 24 pages
    run_forward(monkeypatch, impl, md, index_query)
    assert _problems(audit), audit.summary()


def test_a_mis_sliced_page_table_is_caught(monkeypatch, audit):
    """The decode side of a mixed step reading the prefill's page-table row."""
    impl, md, index_query = _step(monkeypatch, "decode+prefill")
    decode_call = md.calls[0]
    decode_call.page_table[1] = md.calls[1].page_table[0]  # the context of request 1 swapped
    run_forward(monkeypatch, impl, md, index_query)
    problems = audit.summary()["by_kind"]["mixed-decode"]["problems"]
    assert problems, audit.summary()


def test_a_window_other_than_the_model_configs_is_caught(monkeypatch, audit):
    impl, md, index_query = _step(monkeypatch, "decode")
    impl.local_blocks = 0  # the model config says 1
    run_forward(monkeypatch, impl, md, index_query)
    assert any("forced block missing" in p for p in _problems(audit)), audit.summary()


def test_rows_at_the_recorded_positions_are_kept_whole(monkeypatch, audit):
    """The prefill's second request (2049 tokens from position 0) reaches position
    2048, the first recorded one: its row per head, numbered as the second request
    to start, with the blocks the impl wrote."""
    impl, md, index_query = _step(monkeypatch, "prefill")
    run_forward(monkeypatch, impl, md, index_query)
    summary = audit.summary()
    assert summary["request_extents"] == [300, 2049]
    token = 300 + 2048
    written = impl.topk_indices_buffer[token].tolist()
    rows = summary["recorded"]
    assert [row[:5] for row in rows] == [[1, 2048, 1, head, 1] for head in range(2)]
    assert [row[6:] for row in rows] == [sorted(b for b in w if b >= 0) for w in written]
    # 17 blocks, the last forced: 15 of 16 kept on their score, random keys leave a gap.
    assert all(len(row[6:]) == 16 and 0 < row[5] < float("inf") for row in rows)
