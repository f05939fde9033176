"""The patch's FlashInfer indexer module, loaded through the vLLM shim, with
the kernels replaced by the float32 reference: its build() + forward() must
give the reference's selection on a small decode + prefill batch."""

from __future__ import annotations

import pytest
import torch

from vllm_minimax.testing import patched_module as pm
from vllm_minimax.testing import reference
from vllm_minimax.testing.indexer_cases import (
    IndexerCase,
    forced_counts,
    make_batch,
    patched_run,
    reference_scores,
)
from vllm_minimax.testing.reference import (
    boundary_gap,
    expected_topk_values,
    untied_exact_check,
    value_check,
    vector_invariants,
)


def test_extracts_the_new_file():
    src = pm.patched_source()
    assert "class MiniMaxM3IndexerFlashInferImpl" in src
    assert "from flashinfer.msa_ops import msa_proxy_score, msa_topk_select" in src
    compile(src, "indexer_flashinfer.py", "exec")


def test_shim_leaves_sys_modules_alone():
    import sys

    before = {k for k in sys.modules if k == "vllm" or k.startswith("vllm.")}
    pm.load_patched_module(pm.reference_msa_ops())
    after = {k for k in sys.modules if k == "vllm" or k.startswith("vllm.")}
    assert before == after


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("init_blocks", [0, 1])
def test_patched_forward_matches_reference(heads, init_blocks, monkeypatch):
    module = pm.load_patched_module(pm.reference_msa_ops())
    calls = []
    ref_ops = pm.reference_msa_ops()

    def proxy(*args, **kwargs):
        calls.append(("proxy", kwargs))
        return ref_ops.msa_proxy_score(*args, **kwargs)

    def topk(*args, **kwargs):
        calls.append(("topk", kwargs))
        return ref_ops.msa_topk_select(*args, **kwargs)

    monkeypatch.setitem(module.__dict__, "msa_proxy_score", proxy)
    monkeypatch.setitem(module.__dict__, "msa_topk_select", topk)
    # Three decodes (one under 16 blocks, ragged), then a prefill with context
    # and one without, all ending mid-page.
    case = IndexerCase(
        "cpu_mixed",
        "mixed",
        ((1, 300), (1, 2500), (1, 4000), (200, 1100), (150, 150)),
        heads,
        init_blocks=init_blocks,
    )
    batch = make_batch(case, "cpu", seed=1234)
    run = patched_run(module, batch)
    md = run.metadata
    assert (md.num_decodes, md.num_prefills) == (3, 2)
    assert md.max_k_tiles == -(-4000 // 128)
    assert torch.equal(torch.cat([c.num_valid_pages for c in md.calls]), batch.num_valid_pages)
    got = run.forward()
    # A mixed batch runs one pair for the decode rows and one for the prefill rows.
    assert [c[0] for c in calls] == ["proxy", "topk", "proxy", "topk"]
    decode_kwargs, prefill_kwargs = calls[0][1], calls[2][1]
    assert decode_kwargs["causal"] is True and decode_kwargs["max_seqlen_q"] == 1
    assert prefill_kwargs["causal"] is True and prefill_kwargs["max_seqlen_q"] == 200
    # The poisoned rows past the batch stay poisoned; the batch's are written.
    assert (batch.topk_buffer[batch.total_q :] == -7).all()
    scores = reference_scores(batch)
    nvp = batch.num_valid_pages
    fb, fe = min(init_blocks, 16), 1
    want = reference.topk_select(scores, 16, nvp, force_begin_blocks=fb, force_end_blocks=fe)
    cmp = reference.compare_selections(got, want, scores)
    assert cmp.all_values_match, cmp.first_mismatch
    assert cmp.exact_rate == 1.0
    assert not reference.check_selection_invariants(
        got, nvp, topk=16, force_begin_blocks=fb, force_end_blocks=fe
    )
    assert not vector_invariants(got, nvp, fb=fb, fe=fe)
    # The vectorized all-token check the GPU tests use agrees.
    vc = value_check(got, expected_topk_values(scores, nvp, fb=fb, fe=fe), scores, want_sel=want)
    assert vc.all_values_match, vc.first_mismatch
    assert vc.exact_rate == 1.0
    # The exact-set check on untied rows, with the forced regions from the case.
    assert forced_counts(case) == (init_blocks, 1)
    untied = untied_exact_check(got, scores, nvp, fb=fb, fe=fe, rtol=0.0)
    assert untied.rows == vc.rows and untied.exact_rate == 1.0, untied.first_mismatch
    # A wrong pick is caught by both: on a decode row with 32 pages, swap the
    # lowest-scoring free pick for a left-out block that scores lower.
    token = 2
    assert int(nvp[token]) == 32
    bad = plant_wrong_pick(got, scores, token, fb=fb, fe=fe, extent=int(nvp[token]))
    assert not reference.compare_selections(bad, want, scores).all_values_match
    assert not value_check(
        bad, expected_topk_values(scores, nvp, fb=fb, fe=fe), scores
    ).all_values_match
    caught = untied_exact_check(bad, scores, nvp, fb=fb, fe=fe)
    assert caught.exact_rows == caught.rows - 1 and caught.first_mismatch.startswith("token 2")


def plant_wrong_pick(
    selection: torch.Tensor, scores: torch.Tensor, token: int, *, fb: int, fe: int, extent: int
) -> torch.Tensor:
    """`selection` with head 0 of `token` picking a left-out block with a
    strictly lower score instead of its lowest-scoring non-forced pick."""
    bad = selection.clone()
    row = bad[token, 0]
    picked = set(row[row >= 0].tolist())
    forced = {*range(min(fb, extent)), *range(extent - fe, extent)}
    row_scores = scores[0, :, token]
    free = sorted(picked - forced, key=lambda b: float(row_scores[b]))
    left_out = [b for b in range(extent) if b not in picked]
    assert free and left_out, "the row must have more pages than picks"
    worst_pick = free[0]
    worse = [b for b in left_out if float(row_scores[b]) < float(row_scores[worst_pick]) - 1e-2]
    assert worse, "no left-out block scores lower than the picks"
    bad[token, 0] = torch.tensor(sorted(picked - {worst_pick} | {worse[0]}), dtype=row.dtype)
    return bad


def test_vector_invariants_catch_poison_and_order():
    nvp = torch.tensor([3, 20], dtype=torch.int32)
    sel = torch.full((2, 1, 16), -1, dtype=torch.int32)
    sel[0, 0, :3] = torch.tensor([0, 1, 2])
    sel[1, 0] = torch.arange(16)
    assert any("forced block missing" in p for p in vector_invariants(sel, nvp, fb=0, fe=1))
    sel[1, 0, 15] = 19
    assert not vector_invariants(sel, nvp, fb=0, fe=1)
    sel[0, 0, 5] = -7
    assert any("unwritten" in p for p in vector_invariants(sel, nvp, fb=0, fe=1))


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_series_version_env_picks_the_series(monkeypatch, version):
    """`VLLM_MINIMAX_SERIES_VERSION` (what tests/gpu runs under for another release) makes
    the loader build the file from that release's series."""
    monkeypatch.setenv(pm.SERIES_VERSION_ENV, version)
    module = pm.load_patched_module(pm.reference_msa_ops(), name=f"_pm_{version[2:4]}")
    assert module.__file__ == f"vllm-{version} series::{pm.NEW_FILE}"
    assert hasattr(module, "MiniMaxM3IndexerFlashInferImpl")


def test_series_version_env_without_a_series_lists_the_supported(monkeypatch):
    monkeypatch.setenv(pm.SERIES_VERSION_ENV, "0.35.0")
    supported = r"supported vLLM versions: 0\.33\.0, 0\.34\.0"
    with pytest.raises(pm.patchset.PatchError, match=supported):
        pm.load_patched_module(pm.reference_msa_ops())


def test_boundary_gap_by_hand():
    """18 blocks, the last forced (the local window): 15 of the other 17 kept on their
    scores, so the gap is the 15th best less the 16th best of blocks 0 to 16."""
    scores = torch.arange(18, dtype=torch.float32).view(1, 18, 1).repeat(1, 1, 3)
    scores[0, 1, 1] = 2.0  # token 1: blocks 1 and 2 tie at the boundary
    scores[0, 17, 0] = -100.0  # token 0: the forced block's own score does not count
    nvp = torch.tensor([18, 18, 16])
    gap = boundary_gap(scores, nvp, fb=0, fe=1)
    assert gap[0, 0] == 1.0  # keeps 2..16 and 17, leaves 0 and 1
    assert gap[1, 0] == 0.0
    assert gap[2, 0] == float("inf")  # 16 blocks of extent: every one is kept
