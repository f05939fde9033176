"""The patched vLLM serving the tiny MiniMax M3: FlashInfer indexer against Triton.

Every pair of runs sees the same prompts, the same scheduling (prefix caching
off, the same chunk budget) and the same weights; only the indexer differs. The
runs are deterministic (`test_graphs_reproduce_eager`). Triton leaves its top-k
in score order and the sparse attend sums blocks in the order given, so the
Triton runs compared here sort each selection into FlashInfer's ascending order
(`engine_run --ascending-triton`; `test_block_order_alone_moves_logprobs` shows
what the order alone does). Then equal selections give equal logits, and the
logprob differences measure the blocks on which the selections differ. The
FlashInfer runs also audit every selection they make outside full CUDA graphs
against the float32 reference inside the engine (`selection_audit`): every row
must be a reference top-k by value, so what differs from Triton is tied blocks.

Tolerances (prompt logprobs, per pair, over every prompt token after the first):
mean |delta| <= 1e-3 nats and at most 1% of tokens off by more than 1e-3.
Greedy tokens must be equal, except that the two runs may part where the first
run's top two candidates lie within `NEAR_TIE` nats of each other (a near-tie
in the logits, which one tied block can tip); the comparison stops there.
The control pair (Triton with an fp8 index cache against Triton with a bf16
one, whose selections differ wherever fp8 rounding reorders blocks) must move
the logprobs clearly more, or these tolerances could not fail.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

PAIRS = {
    "eager": ("flashinfer-eager", "triton-eager"),
    "graphs": ("auto-graphs", "triton-graphs"),
}
CONTROL = ("triton-eager", "bf16-auto-eager")
MEAN_TOL = 1e-3
TOKEN_TOL = 1e-3
MAX_OFF_FRACTION = 0.01
NEAR_TIE = 0.05
WORKLOADS = ("long", "mixed")


def _sm90() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def _ok(results, name):
    run = results[name]
    assert run.error is None, f"{name} failed: {run.error}"
    return run


def prompt_logprob_deltas(a: list[dict], b: list[dict]) -> list[float]:
    deltas = []
    for ra, rb in zip(a, b, strict=True):
        assert ra["prompt_tokens"] == rb["prompt_tokens"]
        for la, lb in zip(ra["prompt_logprobs"][1:], rb["prompt_logprobs"][1:], strict=True):
            deltas.append(abs(la - lb))
    return deltas


def token_comparison(a: dict, b: dict) -> dict:
    """Where two greedy completions part, and how close run a's top two were there."""
    for step, (sa, sb) in enumerate(zip(a["steps"], b["steps"], strict=True)):
        if sa["token"] != sb["token"]:
            top = sa["top"]
            gap = top[0][1] - top[1][1] if len(top) > 1 else math.inf
            return {"parted_at": step, "a_top2_gap": gap}
    return {"parted_at": None, "a_top2_gap": None}


def _summary(e2e_dir, key: str, value) -> None:
    path = e2e_dir / "summary.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=2, sort_keys=True))
    print(key, json.dumps(value))


EXPECTED_LOG = {
    "triton-eager": "selected Triton (FlashInfer not used: minimax_m3_indexer_backend='triton')",
    "triton-graphs": "selected Triton (FlashInfer not used: minimax_m3_indexer_backend='triton')",
    "flashinfer-eager": "selected FlashInfer (msa_proxy_score + msa_topk_select)",
    "auto-graphs": "selected FlashInfer (msa_proxy_score + msa_topk_select)",
}


@pytest.mark.parametrize("name", sorted(EXPECTED_LOG))
def test_selected_indexer_is_logged(engine_results, name):
    run = _ok(engine_results, name)
    lines = [line for line in run.log.splitlines() if "MiniMax M3 indexer: selected" in line]
    assert lines, f"{name}: no selection line in the engine log"
    assert all(EXPECTED_LOG[name] in line for line in lines), lines
    assert "indexer_kv_dtype=fp8" in lines[0]


def test_bf16_index_cache_with_auto(engine_results):
    run = _ok(engine_results, "bf16-auto-eager")
    lines = [line for line in run.log.splitlines() if "MiniMax M3 indexer: selected" in line]
    assert lines
    if _sm90():
        assert "selected Triton (FlashInfer not used: index cache is bf16" in lines[0], lines
        assert "set indexer_kv_dtype=fp8" in lines[0]
    else:
        assert "selected FlashInfer" in lines[0], lines


def test_bf16_index_cache_with_forced_flashinfer(engine_results):
    run = engine_results["bf16-flashinfer-eager"]
    if _sm90():
        assert run.error is not None, "SM90 engine started with a bf16 cache and forced FlashInfer"
        assert "minimax_m3_indexer_backend='flashinfer' cannot run here" in run.error
        assert "index cache is bf16" in run.error
    else:
        assert run.error is None


# Pure decode steps replay inside full CUDA graphs (the indexer is captured with
# the attend), where no Python runs, so only the eager run audits them; the graph
# runs' decodes are checked by test_graphs_reproduce_eager.
AUDITED_KINDS = {
    "flashinfer-eager": {"decode", "prefill", "mixed-decode", "mixed-prefill"},
    "auto-graphs": {"prefill", "mixed-decode", "mixed-prefill"},
}


@pytest.mark.parametrize("name", sorted(AUDITED_KINDS))
def test_every_selection_matches_the_reference(engine_results, e2e_dir, name):
    audit = _ok(engine_results, name).data["audit"]
    _summary(e2e_dir, f"audit/{name}", audit)
    kinds = audit["by_kind"]
    assert audit["steps"] > 0
    assert set(kinds) == AUDITED_KINDS[name], kinds
    assert audit["mixed_steps"] > 0
    for kind, counts in kinds.items():
        assert counts["num_problems"] == 0, (kind, counts["problems"])
        assert counts["rows"] > 0 and counts["value_rows"] == counts["rows"], (kind, counts)


def _pair_deltas(engine_results, a_name, b_name):
    a, b = _ok(engine_results, a_name), _ok(engine_results, b_name)
    return [d for w in WORKLOADS for d in prompt_logprob_deltas(a.workload(w), b.workload(w))]


def _stats(deltas: list[float]) -> dict:
    t = torch.tensor(deltas, dtype=torch.float64)
    return {
        "tokens": len(deltas),
        "mean": float(t.mean()),
        "max": float(t.max()),
        "exact_fraction": float((t == 0).double().mean()),
        "off_fraction": float((t > TOKEN_TOL).double().mean()),
    }


@pytest.mark.parametrize("mode", sorted(PAIRS))
def test_prompt_logprobs_agree(engine_results, e2e_dir, mode):
    stats = _stats(_pair_deltas(engine_results, *PAIRS[mode]))
    _summary(e2e_dir, f"prompt_logprobs/{mode}", stats)
    assert stats["mean"] <= MEAN_TOL, stats
    assert stats["off_fraction"] <= MAX_OFF_FRACTION, stats


@pytest.mark.parametrize("mode", sorted(PAIRS))
def test_greedy_tokens_agree(engine_results, e2e_dir, mode):
    a_name, b_name = PAIRS[mode]
    a, b = _ok(engine_results, a_name), _ok(engine_results, b_name)
    report = []
    for w in WORKLOADS:
        for i, (triton, flashinfer) in enumerate(zip(b.workload(w), a.workload(w), strict=True)):
            cmp = token_comparison(triton, flashinfer)
            report.append({"workload": w, "request": i, "tokens": len(triton["token_ids"]), **cmp})
    _summary(e2e_dir, f"greedy/{mode}", report)
    for row in report:
        if row["parted_at"] is not None:
            assert row["a_top2_gap"] <= NEAR_TIE, row


@pytest.mark.parametrize(
    ("eager", "graphs"), [("flashinfer-eager", "auto-graphs"), ("triton-eager", "triton-graphs")]
)
def test_graphs_reproduce_eager(engine_results, eager, graphs):
    """Same backend with and without CUDA graphs: identical prompt logprobs and
    tokens (so full-graph decode replays select what eager decode selects)."""
    assert max(_pair_deltas(engine_results, eager, graphs)) == 0.0
    for w in WORKLOADS:
        for ra, rb in zip(
            _ok(engine_results, eager).workload(w),
            _ok(engine_results, graphs).workload(w),
            strict=True,
        ):
            assert ra["token_ids"] == rb["token_ids"]


def test_block_order_alone_moves_logprobs(engine_results, e2e_dir):
    stats = _stats(_pair_deltas(engine_results, "triton-eager", "triton-eager-score-order"))
    _summary(e2e_dir, "prompt_logprobs/triton-ascending-vs-score-order", stats)
    assert stats["mean"] > 0


def test_a_different_selection_is_visible(engine_results, e2e_dir):
    control = _stats(_pair_deltas(engine_results, *CONTROL))
    candidate = _stats(_pair_deltas(engine_results, *PAIRS["eager"]))
    _summary(e2e_dir, "prompt_logprobs/control-fp8-vs-bf16-index", control)
    assert control["mean"] > MEAN_TOL, control
    assert control["mean"] > 10 * candidate["mean"], (control, candidate)
