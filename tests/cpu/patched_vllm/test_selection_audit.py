"""The GPU end-to-end tests' in-engine audit (`vllm_minimax.testing.selection_audit`)
passes a correct selection and catches a wrong one, on the CPU.

The impl runs with FlashInfer's kernels replaced by the float32 reference (as in
test_flashinfer_indexer); the faulty variants change one block of one row, break
what the builder made of the engine's inputs (a token's page count, a side's
page-table rows), or force other blocks than the model config says (the local
window, the leading blocks): the audit recomputes from the engine's
`CommonAttentionMetadata` and model config, so each of these fails it. The mixed
step's prefill sees more than 16 pages, so its selection depends on the page
table it reads.
"""

from __future__ import annotations

import pytest
import torch
from indexer_helpers import bind_cache, make_batch, make_builder, make_impl, run_forward
from vllm.models.minimax_m3.nvidia import indexer_flashinfer as fi_mod

from vllm_minimax.testing import selection_audit, selection_fault

pytestmark = pytest.mark.usefixtures("single_rank")


@pytest.fixture
def audit(monkeypatch, kernels):
    fresh = selection_audit.Audit(enabled=True)
    monkeypatch.setattr(selection_audit, "AUDIT", fresh)
    restore = selection_audit.install()
    yield fresh
    restore()


DECODE = ([3000, 5, 127, 128, 40000], [1, 1, 1, 1, 1])
PREFILL = ([0, 0], [300, 2049])
# Two decodes beside a 700-token chunk on 2500 tokens of context: the chunk's tokens see 20
# to 25 pages, so blocks are dropped and the selection depends on the pages read.
MIXED = ([9000, 4096, 2500], [1, 1, 700])


def _step(steps, heads: int = 2, init_blocks: int = 0):
    torch.manual_seed(5)
    batch = make_batch(*steps)
    impl, _ = make_impl(heads=heads, dtype="fp8", init_blocks=init_blocks)
    bind_cache(impl, batch)
    index_query = torch.randn(batch.num_tokens + 3, heads * 128).to(torch.float8_e4m3fn)
    md = make_builder(index_heads=heads).build(0, batch.metadata)
    return impl, md, index_query, batch


def _problems(audit) -> list[str]:
    return [p for counts in audit.summary()["by_kind"].values() for p in counts["problems"]]


def test_a_correct_mixed_step_passes(monkeypatch, audit):
    impl, md, index_query, batch = _step(MIXED)
    assert max(batch.step.valid_pages()) > 16
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
        row = output[-1, 0]  # the prefill's last token: position 2048, 16 of 17 pages
        row[0] = 0 if row[0] != 0 else -1  # replaces or drops a block
        return output

    monkeypatch.setattr(fi_mod, "msa_topk_select", off_by_one_block)
    impl, md, index_query, _ = _step(PREFILL)
    run_forward(monkeypatch, impl, md, index_query)
    counts = audit.summary()["by_kind"]["prefill"]
    assert counts["num_problems"] > 0
    assert counts["value_rows"] < counts["rows"] or counts["problems"]


def test_a_wrong_page_count_is_caught(monkeypatch, audit):
    impl, md, index_query, _ = _step(DECODE)
    md.calls[0].num_valid_pages[0] -= 1  # request 0: 3000 tokens of context, 24 pages
    run_forward(monkeypatch, impl, md, index_query)
    assert _problems(audit), audit.summary()


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_mis_sliced_page_table_is_caught(monkeypatch, audit, side):
    """A builder that hands one side of a mixed step the page-table rows of the requests
    before its own (the decode side: request 1 reads request 0's pages; the prefill side:
    the chunk reads request 1's)."""
    builder_cls = fi_mod.MiniMaxM3IndexerFlashInferMetadataBuilder
    audited_build = builder_cls.build  # the audit keeps the engine's inputs first

    def off_by_one_request(self, common_prefix_len, common, *args, **kwargs):
        md = audited_build(self, common_prefix_len, common, *args, **kwargs)
        table = common.block_table_tensor
        decode_call, prefill_call = md.calls
        if side == "decode":
            decode_call.page_table = torch.stack([table[0], table[0]])
        else:
            prefill_call.page_table = table[1:2]
        return md

    builder_cls.build = off_by_one_request
    try:
        impl, md, index_query, _ = _step(MIXED)
        run_forward(monkeypatch, impl, md, index_query)
    finally:
        builder_cls.build = audited_build
    problems = audit.summary()["by_kind"][f"mixed-{side}"]["problems"]
    assert problems, audit.summary()


def test_a_window_other_than_the_model_configs_is_caught(monkeypatch, audit):
    impl, md, index_query, _ = _step(DECODE)
    impl.local_blocks = 0  # the model config says 1
    run_forward(monkeypatch, impl, md, index_query)
    assert any("forced block missing" in p for p in _problems(audit)), audit.summary()


def test_leading_blocks_other_than_the_model_configs_are_caught(monkeypatch, audit):
    """The model config forces no leading block (0.34.0's model passes none; 0.33.0's
    config here has no `sparse_init_block`); an impl forcing two is caught."""
    impl, md, index_query, _ = _step(DECODE, init_blocks=2)
    run_forward(monkeypatch, impl, md, index_query)
    assert _problems(audit), audit.summary()


def test_rows_at_the_recorded_positions_are_kept_whole(monkeypatch, audit):
    """The prefill's second request (2049 tokens from position 0) reaches position
    2048, the first recorded one: its row per head, numbered as the second request
    to start, with the blocks the impl wrote."""
    impl, md, index_query, _ = _step(PREFILL)
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


def test_the_end_to_end_control_runs_fault_is_a_wrong_selection(monkeypatch, audit):
    """`engine_run.py --fault page-count` (the control every engine comparison must fail)
    plants a real fault: the audit finds wrong rows on both sides of a mixed step."""
    restore = selection_fault.install_page_count_fault()
    try:
        impl, md, index_query, _ = _step(MIXED)
        run_forward(monkeypatch, impl, md, index_query)
    finally:
        restore()
    kinds = audit.summary()["by_kind"]
    for side in ("mixed-decode", "mixed-prefill"):
        assert kinds[side]["problems"], kinds
