"""The engine comparison's ordering of the Triton arm's top-k rows
(`triton_indexer.sort_rows_ascending_`, `install_ascending_rows`)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_minimax.testing import triton_indexer


def _rows_as_triton_writes_them(tokens: int, heads: int, topk: int, seed: int) -> torch.Tensor:
    """Each row: min(topk, visible) distinct blocks in a random (score) order, -1 after."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.full((tokens, heads, topk), -1, dtype=torch.int32)
    for t in range(tokens):
        visible = int(torch.randint(1, 3 * topk, (1,), generator=generator))
        for h in range(heads):
            chosen = torch.randperm(visible, generator=generator)[: min(topk, visible)]
            rows[t, h, : chosen.numel()] = chosen.to(torch.int32)
    return rows


def test_rows_become_ascending_with_the_padding_last_and_the_same_blocks():
    rows = _rows_as_triton_writes_them(tokens=64, heads=2, topk=16, seed=3)
    before = rows.clone()
    assert not torch.equal(rows, rows.sort(dim=-1).values)  # the input is not sorted already
    triton_indexer.sort_rows_ascending_(rows)
    for got, was in zip(rows.reshape(-1, 16), before.reshape(-1, 16), strict=True):
        valid = int((was >= 0).sum())
        assert torch.equal(got[:valid], was[was >= 0].sort().values)
        assert bool((got[valid:] == -1).all())
    assert torch.equal(rows.ne(-1).sum(-1), before.ne(-1).sum(-1))


def test_the_installed_forward_sorts_the_shared_buffer_and_undo_restores_it(monkeypatch):
    from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerTritonImpl

    written = _rows_as_triton_writes_them(tokens=8, heads=1, topk=16, seed=4)

    def fake_forward(self, index_query):
        self.topk_indices_buffer.copy_(written)
        return "result"

    monkeypatch.setattr(MiniMaxM3IndexerTritonImpl, "forward", fake_forward)
    undo = triton_indexer.install_ascending_rows()
    impl = SimpleNamespace(topk_indices_buffer=torch.zeros_like(written))
    assert MiniMaxM3IndexerTritonImpl.forward(impl, None) == "result"
    expected = written.clone()
    triton_indexer.sort_rows_ascending_(expected)
    assert torch.equal(impl.topk_indices_buffer, expected)
    undo()
    assert MiniMaxM3IndexerTritonImpl.forward is fake_forward
