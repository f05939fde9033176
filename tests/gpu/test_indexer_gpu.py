"""The patch's FlashInfer indexer (its real build() + forward(), through
`vllm_minimax.testing.patched_module`, with FlashInfer 0.7.4's kernels) against the
float32 reference, and against vLLM 0.34.0's Triton indexer, over the issue's
matrix (`vllm_minimax.testing.indexer_cases.cases_for_tests`).

Fresh random inputs every run (the seed is printed and written to the report);
the top-k buffer is poisoned (-7) before each kernel writes it. Checked on every
token: invariants and the selected blocks' reference scores (vectorized). The
per-token loops of `vllm_minimax.reference` (`topk_select`,
`compare_selections`, `check_selection_invariants`) run on a subsample of at
most 192 tokens per case (all tokens where the case has fewer), which is where
the reported exact-set rate comes from. On every token whose selection no tie
can make ambiguous (`untied_exact_check`: the last free pick more than 1e-3
relative above the best block left out; the report also counts 1e-5), the
selected set must be exactly the reference's; the forced regions come from the
case (`forced_counts`), not from the metadata under test. Reference scores are
float32 torch on the GPU.

Set VLLM_MINIMAX_GPU_REPORT=path to append one TSV line per case.
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_minimax.testing import reference
from vllm_minimax.testing.indexer_cases import (
    TOPK,
    cases_for_tests,
    forced_counts,
    make_batch,
    normalize_selection,
    patched_run,
    reference_scores,
    reference_subsample,
)
from vllm_minimax.testing.reference import (
    expected_topk_values,
    selection_values,
    untied_exact_check,
    value_check,
    vector_invariants,
)

CASES = cases_for_tests()


@pytest.fixture(scope="module")
def fi_module():
    from vllm_minimax.testing.patched_module import load_patched_module

    torch.backends.cuda.matmul.allow_tf32 = False
    return load_patched_module()


@pytest.fixture(scope="module")
def triton_ops():
    from vllm_minimax.testing.triton_indexer import load_index_topk

    try:
        return load_index_topk()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def _report(*fields) -> None:
    path = os.environ.get("VLLM_MINIMAX_GPU_REPORT")
    line = "\t".join(str(f) for f in fields)
    print(line)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def _check_against_reference(got, batch, scores, fb, fe, label):
    nvp = batch.num_valid_pages
    problems = vector_invariants(got, nvp, fb=fb, fe=fe)
    sub = reference_subsample(batch)
    sub_dev = sub.to(got.device)
    ref_sel = reference.topk_select(
        scores[:, :, sub_dev], TOPK, nvp[sub_dev], force_begin_blocks=fb, force_end_blocks=fe
    )
    cmp = reference.compare_selections(got[sub_dev], ref_sel, scores[:, :, sub_dev])
    problems += reference.check_selection_invariants(
        got[sub_dev], nvp[sub_dev], topk=TOPK, force_begin_blocks=fb, force_end_blocks=fe
    )[:5]
    vc = value_check(got, expected_topk_values(scores, nvp, fb=fb, fe=fe), scores)
    untied = untied_exact_check(got, scores, nvp, fb=fb, fe=fe)
    assert not problems, f"{label}: " + "\n".join(problems[:10])
    assert cmp.all_values_match, f"{label} vs reference (subsample): {cmp.first_mismatch}"
    assert vc.all_values_match, f"{label} vs reference (all tokens): {vc.first_mismatch}"
    # Where no tie can explain a miss, the set is exact, on every such row.
    assert untied.rows >= vc.rows // 2, f"{label}: only {untied.rows} of {vc.rows} rows untied"
    assert untied.exact_rate == 1.0, f"{label} untied rows: {untied.first_mismatch}"
    fine = untied_exact_check(got, scores, nvp, fb=fb, fe=fe, rtol=1e-5)
    return cmp, vc, (untied, fine), len(sub)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_flashinfer_patched_forward_matches_reference(case, fi_module):
    batch = make_batch(case, "cuda")
    run = patched_run(fi_module, batch)
    got = run.forward().clone()
    torch.cuda.synchronize()
    assert (batch.topk_buffer[batch.total_q :] == -7).all(), "wrote past num_tokens"
    scores = reference_scores(batch)
    fb, fe = forced_counts(case)
    cmp, vc, untied, n_sub = _check_against_reference(got, batch, scores, fb, fe, "flashinfer")
    _report(
        "flashinfer",
        case.name,
        f"seed={batch.seed}",
        f"tokens={batch.total_q}",
        f"value_rows={vc.value_rows}/{vc.rows}",
        f"ref_subsample={n_sub}",
        f"exact_rate={cmp.exact_rate:.4f}",
        f"untied_1e-3_exact={untied[0].exact_rows}/{untied[0].rows}",
        f"untied_1e-5_exact={untied[1].exact_rows}/{untied[1].rows}",
    )


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_triton_agrees_with_flashinfer(case, fi_module, triton_ops):
    from vllm_minimax.testing.triton_indexer import triton_build, triton_forward

    batch = make_batch(case, "cuda")
    run = patched_run(fi_module, batch)
    fi = run.forward().clone()
    batch.poison()
    md = triton_build(batch.common, reorder_batch_threshold=case.reorder_batch_threshold)
    triton_forward(
        triton_ops,
        md,
        batch.index_query,
        batch.kv_cache,
        batch.topk_buffer,
        num_index_heads=case.heads,
        init_blocks=case.init_blocks,
        local_blocks=case.local_blocks,
    )
    tri = normalize_selection(batch.topk_buffer[: batch.total_q])
    torch.cuda.synchronize()
    scores = reference_scores(batch)
    fb, fe = forced_counts(case)
    _, tvc, _, _ = _check_against_reference(tri, batch, scores, fb, fe, "triton")
    agree = value_check(fi, selection_values(tri, scores), scores, want_sel=tri)
    _report(
        "fi_vs_triton",
        case.name,
        f"seed={batch.seed}",
        f"tokens={batch.total_q}",
        f"value_rows={agree.value_rows}/{agree.rows}",
        f"exact_rate={agree.exact_rate:.4f}",
        f"triton_value_rows={tvc.value_rows}/{tvc.rows}",
    )
    assert agree.all_values_match, f"FlashInfer vs Triton: {agree.first_mismatch}"


def test_bf16_prefill_is_refused_on_sm90(fi_module):
    """FINDINGS: SM90's prefill proxy score needs an fp8 index cache, so the
    hardware gating must keep bf16 + prefill off this impl on Hopper."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("SM90 only")
    from vllm_minimax.testing.indexer_cases import IndexerCase

    case = IndexerCase("prefill_bf16", "prefill", ((600, 600),), 1, "bf16")
    run = patched_run(fi_module, make_batch(case, "cuda"))
    with pytest.raises(NotImplementedError, match="fp8"):
        run.forward()


def test_prefills_scored_in_query_chunks_match_reference(fi_module, monkeypatch):
    """The score cap forces 384-row chunks that cut requests (a chunk scores its rows
    of a request against that request's keys up to its last row there): FlashInfer's
    selection over the chunked calls still matches the reference on every token."""
    from vllm_minimax.testing.indexer_cases import IndexerCase

    case = IndexerCase(
        "chunked_2dec_700_900_on_ctx_h2",
        "mixed",
        ((1, 9000), (1, 11000), (700, 700), (900, 2900)),
        2,
    )
    monkeypatch.setattr(fi_module, "_SCORE_CHUNK_ELEMENTS", 3 * 128 * 89)
    batch = make_batch(case, "cuda")
    run = patched_run(fi_module, batch)
    assert [c.token_end - c.token_start for c in run.metadata.calls] == [2, 384, 384, 384, 384, 64]
    got = run.forward().clone()
    torch.cuda.synchronize()
    assert (batch.topk_buffer[batch.total_q :] == -7).all(), "wrote past num_tokens"
    fb, fe = forced_counts(case)
    _check_against_reference(got, batch, reference_scores(batch), fb, fe, "flashinfer chunked")
