"""MTP speculative decoding on the tiny MiniMax M3: the target's sparse indexer
verifying 1 + K query tokens per decoding request.

The `mtp-*` runs (conftest.py) are the eager runs of test_engine.py with the
tiny checkpoint's MTP draft (`make-tiny-model --mtp-modules 1`, in `DIR/mtp`)
speculating K tokens a step. The draft is random, so few drafts are accepted;
what matters is that every decode step of the target verifies K + 1 tokens per
request, through the same indexer.

- The engine ran the draft (`speculative` in the JSON) and vLLM counted drafts
  and draft tokens (its spec-decode metrics).
- The forced indexer serves every sparse layer, the target's and the draft's
  (the draft's MTP layer is a sparse-attention layer built from the same
  attention config).
- The FlashInfer MTP run's audit (selection_audit.py) checks every row, among
  them decode calls of K + 1 query tokens per request (the target's
  verification) and the draft's own rows.
- Greedy tokens of an MTP run equal the same backend's run without MTP, except
  where that run's top two lay within test_engine.py's fixed `GREEDY_PART_TOL`
  (the verify batches differ in shape from plain decode, and so do the prefill
  chunks that share a step with them). Triton with and without MTP is the
  control that bound comes from; it is re-checked here.
- FlashInfer against Triton, both with MTP: test_engine.py's criteria, the
  sampled-token logprob bounds included.
- With CUDA graphs on (the `mtp-*-graphs` runs): uniform verification batches
  of K + 1 tokens per request are captured in full graphs with the indexer
  inside, so the FlashInfer run's audit sees far fewer pure decode calls than
  the eager run's; every row it does see is a reference top-k; graphs reproduce
  eager's prompt logprobs bit for bit, its sampled-token logprobs within
  `GRAPH_DECODE_TOL` (graph replays round differently, a few hundredths of a
  nat), and its greedy tokens part only at a near-tie within that bound.
"""

from __future__ import annotations

import pytest
import test_engine

from vllm_minimax.testing.mtp_draft import is_draft_layer_name

# The MTP runs of conftest.ENGINE_RUNS -> the same backend's run without
# speculation, eager or with graphs. K and the backend come from each run's own
# recorded config (`--mtp K`, `--backend`).
WITHOUT_MTP = {
    "mtp-triton-eager": "triton-eager",
    "mtp-flashinfer-eager": "flashinfer-eager",
    "mtp-triton-graphs": "triton-graphs",
    "mtp-flashinfer-graphs": "auto-graphs",
}
MTP_RUNS = sorted(WITHOUT_MTP)
BACKEND_PAIRS = {
    "mtp-eager": ("mtp-flashinfer-eager", "mtp-triton-eager"),
    "mtp-graphs": ("mtp-flashinfer-graphs", "mtp-triton-graphs"),
}
GRAPHS_OF_EAGER = {
    "mtp-triton-eager": "mtp-triton-graphs",
    "mtp-flashinfer-eager": "mtp-flashinfer-graphs",
}
INDEXER_IMPL = {
    "triton": "MiniMaxM3IndexerTritonImpl",
    "flashinfer": "MiniMaxM3IndexerFlashInferImpl",
}
FULL_GRAPH_CAPTURE = "Capturing CUDA graphs (FULL)"
# Graph replay against eager, sampled-token logprobs (test_mtp_graphs_reproduce_eager).
GRAPH_DECODE_TOL = 0.1
SPEC_DECODE_PREFIX = "vllm:spec_decode_"


def speculated_tokens(run) -> int:
    return int(run.data["config"]["mtp"])


def spec_decode_counter(counters: dict, name: str):
    """A spec-decode counter by its short name (`num_drafts`, `num_draft_tokens`, ...),
    with or without Prometheus's `_total` suffix."""
    for full_name, value in counters.items():
        short = full_name.removeprefix(SPEC_DECODE_PREFIX).removesuffix("_total")
        if short == name:
            return value
    raise AssertionError(f"no spec-decode counter {name!r} in {sorted(counters)}")


@pytest.mark.parametrize("name", MTP_RUNS)
def test_engine_ran_the_mtp_draft(engine_results, name):
    run = test_engine._ok(engine_results, name)
    spec = run.data["speculative"]
    assert speculated_tokens(run) > 0, run.data["config"]
    assert spec["method"] == "mtp", spec
    assert spec["num_speculative_tokens"] == speculated_tokens(run), spec
    assert spec["draft_model_type"] == "minimax_m3_mtp", spec
    assert spec["draft_architectures"] == ["MiniMaxM3MTP"], spec
    assert spec["draft_model"].rstrip("/").endswith("/mtp"), spec


@pytest.mark.parametrize("name", MTP_RUNS)
def test_speculative_decoding_ran(engine_results, e2e_dir, name):
    run = test_engine._ok(engine_results, name)
    counters = run.data["spec_decode"]
    test_engine._summary(e2e_dir, f"spec_decode/{name}", counters)
    drafts = spec_decode_counter(counters, "num_drafts")
    draft_tokens = spec_decode_counter(counters, "num_draft_tokens")
    accepted = spec_decode_counter(counters, "num_accepted_tokens")
    assert drafts > 0 and draft_tokens > 0, counters
    assert draft_tokens <= speculated_tokens(run) * drafts, counters
    assert 0 <= accepted <= draft_tokens, counters


@pytest.mark.parametrize("name", MTP_RUNS)
def test_forced_indexer_serves_target_and_draft(engine_results, name):
    run = test_engine._ok(engine_results, name)
    base = WITHOUT_MTP[name]
    lines = [line for line in run.log.splitlines() if "MiniMax M3 indexer: selected" in line]
    assert lines, f"{name}: no selection line in the engine log"
    assert all(test_engine.EXPECTED_LOG[base] in line for line in lines), lines
    assert "sparse_layers_error" not in run.data, run.data["sparse_layers_error"]
    layers = run.data["sparse_layers"]
    draft = {n: impl for n, impl in layers.items() if is_draft_layer_name(n)}
    target = {n: impl for n, impl in layers.items() if not is_draft_layer_name(n)}
    assert draft and target, layers
    assert set(layers.values()) == {INDEXER_IMPL[run.data["config"]["backend"]]}, layers


def audited_kinds(engine_results, e2e_dir, name: str) -> dict:
    """The run's audit by kind, after checking every audited row is clean."""
    audit = test_engine._ok(engine_results, name).data["audit"]
    test_engine._summary(e2e_dir, f"audit/{name}", test_engine.audit_counts(audit))
    assert audit["steps"] > 0 and audit["mixed_steps"] > 0, audit
    for kind, counts in audit["by_kind"].items():
        assert counts["num_problems"] == 0, (kind, counts["problems"])
        assert counts["rows"] > 0 and counts["value_rows"] == counts["rows"], (kind, counts)
    return audit["by_kind"]


def test_mtp_audit_covers_multi_token_decode(engine_results, e2e_dir):
    name = "mtp-flashinfer-eager"
    run = test_engine._ok(engine_results, name)
    kinds = audited_kinds(engine_results, e2e_dir, name)
    verify_len = str(1 + speculated_tokens(run))
    assert kinds["decode"]["decode_query_lens"].get(verify_len, 0) > 0, kinds["decode"]
    draft_kinds = {kind for kind in kinds if kind.startswith("draft-")}
    assert "draft-decode" in draft_kinds, sorted(kinds)
    # The draft's own steps after its first: one query token per request.
    assert kinds["draft-decode"]["decode_query_lens"].get("1", 0) > 0, kinds["draft-decode"]


@pytest.mark.parametrize("name", MTP_RUNS)
def test_greedy_tokens_match_the_run_without_mtp(engine_results, e2e_dir, name):
    base = WITHOUT_MTP[name]
    test_engine.assert_greedy_tokens_agree(engine_results, e2e_dir, f"{name}-vs-{base}", name, base)


def test_same_indexer_control_is_within_the_fixed_bounds(engine_results, e2e_dir):
    """The control test_engine.py's fixed decode bounds come from: Triton with and
    without MTP, the same indexer under other batching."""
    stats = test_engine.decode_comparison(engine_results, "mtp-triton-eager", "triton-eager")
    test_engine._summary(e2e_dir, "sampled_logprobs/control-triton-mtp-vs-not", stats)
    assert stats["max"] <= test_engine.GREEDY_PART_TOL, stats
    assert stats["mean"] <= test_engine.DECODE_MEAN_TOL, stats


def test_mtp_verification_replays_in_full_graphs(engine_results, e2e_dir):
    """Pure verification steps replay inside full CUDA graphs, with the FlashInfer
    indexer captured for K + 1 query tokens per request: no Python runs there, so
    the graph run's audit sees at most half the eager run's pure decode calls."""
    eager, graphs = "mtp-flashinfer-eager", "mtp-flashinfer-graphs"
    graph_run = test_engine._ok(engine_results, graphs)
    assert FULL_GRAPH_CAPTURE in graph_run.log, f"{graphs}: no full-graph capture in the log"
    assert "is not supported with spec-decode" not in graph_run.log
    eager_calls = test_engine._ok(engine_results, eager).data["audit"]["by_kind"]["decode"]["calls"]
    kinds = audited_kinds(engine_results, e2e_dir, graphs)
    graph_calls = kinds.get("decode", {}).get("calls", 0)
    assert eager_calls > 0 and graph_calls <= eager_calls // 2, (graph_calls, eager_calls)


@pytest.mark.parametrize("eager", sorted(GRAPHS_OF_EAGER))
def test_mtp_graphs_reproduce_eager(engine_results, e2e_dir, eager):
    """Prompt logprobs bit for bit; greedy tokens equal except at a near-tie.

    Decode steps replayed in graphs carry other kernels' rounding (compiled
    norms, padded GEMMs): their sampled-token logprobs differ from eager by a few
    hundredths of a nat, without MTP too (`triton-eager` against `triton-graphs`:
    7 steps, at most 0.060 on the H200). So the sampled logprobs must stay within
    `GRAPH_DECODE_TOL`, and tokens may part only where the eager run's top two
    lay within it."""
    graphs = GRAPHS_OF_EAGER[eager]
    assert test_engine.prompt_comparison(engine_results, eager, graphs)["max"] == 0.0
    decode_delta = test_engine.decode_comparison(engine_results, graphs, eager)["max"]
    assert decode_delta <= GRAPH_DECODE_TOL, decode_delta
    test_engine.assert_greedy_tokens_agree(
        engine_results, e2e_dir, f"{graphs}-vs-{eager}", graphs, eager, GRAPH_DECODE_TOL
    )


@pytest.mark.parametrize("mode", sorted(BACKEND_PAIRS))
def test_prompt_logprobs_agree_flashinfer_vs_triton_with_mtp(engine_results, e2e_dir, mode):
    test_engine.assert_prompt_logprobs_agree(engine_results, e2e_dir, mode, BACKEND_PAIRS[mode])


@pytest.mark.parametrize("mode", sorted(BACKEND_PAIRS))
def test_greedy_tokens_agree_flashinfer_vs_triton_with_mtp(engine_results, e2e_dir, mode):
    test_engine.assert_greedy_tokens_agree(engine_results, e2e_dir, mode, *BACKEND_PAIRS[mode])


@pytest.mark.parametrize("mode", sorted(BACKEND_PAIRS))
def test_sampled_logprobs_agree_flashinfer_vs_triton_with_mtp(engine_results, e2e_dir, mode):
    test_engine.assert_sampled_logprobs_agree(engine_results, e2e_dir, mode, BACKEND_PAIRS[mode])
