"""The patched vLLM serving the tiny MiniMax M3: FlashInfer indexer against Triton.

Every pair of runs sees the same prompts, the same scheduling (prefix caching
off, the same chunk budget) and the same weights; only the indexer differs. The
runs are deterministic (`test_graphs_reproduce_eager`), so where two runs'
selections agree on every row, their logits agree bit for bit.

What a different selection does, and so what the tolerances are: a changed
block at one token of a sparse layer changes that token's hidden state, and the
full-attention layer above carries the change into every later token of the
request. Prompt logprobs therefore agree exactly up to the first row whose
selection differs, and differ (a little) after it. Hence, per pair:

- every prompt token whose context is at most 16 blocks (all blocks kept, the
  indexer cannot differ) has exactly equal logprobs;
- the first difference comes at least `MIN_EXACT_PAST_DROP` tokens after
  blocks start being dropped (position 2048), in every request: differing
  selections are sporadic, not systematic. The control pair (Triton with an fp8
  index cache against Triton with a bf16 one, whose scores differ everywhere)
  parts within a couple of tokens of 2048, so this can fail. A request may
  part earlier only where the two runs' audits show their selections differing
  at or before the parting, FlashInfer's row being a reference top-k there
  (below);
- mean |delta| over all prompt tokens <= `MEAN_TOL` nats.

The Triton indexer writes a row's blocks by descending score, FlashInfer by
ascending block id. vLLM 0.33.0's Hopper prefill attend sums the blocks in row
order, so there the same selection in another order rounds differently, and the
runs sort the Triton rows ascending (`engine_run.py`, `triton_rows`); a 0.33.0 run
made without that is refused. 0.34.0's prefill attend walks the blocks in id order.

Where they do differ, the FlashInfer side is audited inside the engine
(`selection_audit`): every row outside full CUDA graphs is a float32-reference
top-k by value, so the FlashInfer choice is never worse than Triton's. Two
top-ks that are both exact by value differ only in tied blocks. Both audits
record the rows at positions 2048 to 2111 whole (the Triton runs' with
`install_triton`), so a request may part before the bound above only where the
two runs' selections differ, at or before the parting.

Greedy tokens and sampled-token logprobs, with fixed bounds set by two
controls measured on the H200 (2026-12-03 runs), not by the pair under test:

- the same indexer under other batching (`mtp-triton-eager` against
  `triton-eager`, test_mtp.py re-checks it every run): where the tokens still
  agree, the sampled token's logprobs differ by up to 0.596 nats, 0.0143 on
  average. So two runs may part only at a step where the Triton run's top two
  lay within `GREEDY_PART_TOL`, and their sampled-token logprobs must stay
  within `GREEDY_PART_TOL` too;
- the control pair above (a bf16 index cache against fp8) averages 0.0198
  nats, while FlashInfer against Triton averages 0.0140 (eager and graphs)
  and 0.0143 (with MTP). `DECODE_MEAN_TOL` lies between: the control fails it
  (`test_control_pair_fails_the_decode_bound`), by a small margin.

The bf16-against-fp8 control changes every score a little and parts at 2048, so it
fails the prompt check; its tokens part only at near-ties (two thirds of the tiny
model's decode steps have a top-2 gap under `GREEDY_PART_TOL`) and its largest
sampled-token delta stays under the bound, so it cannot show that the greedy check or
the max bound can fail. `FAULT_CONTROL` is the control of every comparison: FlashInfer
with a builder that hands each token one page fewer (`engine_run.py --fault
page-count`: a token never selects its own block), against Triton. It must fail the
prompt check, the greedy check and both decode bounds
(`test_faulty_selection_fails_*`); each test records in summary.json the control's
figure over the bound (the margin), so a bound that drifts up to the control shows.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from vllm_minimax.testing.selection_audit import RECORDED_POSITIONS
from vllm_minimax.testing.triton_indexer import ROW_ORDER_PREFILL_RELEASES

PAIRS = {
    "eager": ("flashinfer-eager", "triton-eager"),
    "graphs": ("auto-graphs", "triton-graphs"),
}
CONTROL = ("triton-eager", "bf16-auto-eager")
FAULT_CONTROL = ("page-count-fault-flashinfer-eager", "triton-eager")
WORKLOADS = ("long", "mixed")
FIRST_DROPPING_POSITION = 16 * 128
MIN_EXACT_PAST_DROP = 64
MEAN_TOL = 0.01
# nats; see the module docstring for the controls they come from.
GREEDY_PART_TOL = 0.75
DECODE_MEAN_TOL = 0.017


def _ok(results, name):
    run = results[name]
    assert run.error is None, f"{name} failed: {run.error}"
    return run


def audit_counts(audit: dict) -> dict:
    """An audit summary less its recorded rows (thousands; compared, not printed)."""
    return {key: value for key, value in audit.items() if key != "recorded"}


def _summary(e2e_dir, key: str, value) -> None:
    path = e2e_dir / "summary.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=2, sort_keys=True))
    print(key, json.dumps(value))


def request_pairs(results, a_name: str, b_name: str):
    a, b = _ok(results, a_name), _ok(results, b_name)
    for run in (a, b):
        version = run.data.get("series", {}).get("vllm_version")
        if version in ROW_ORDER_PREFILL_RELEASES:
            assert run.data.get("triton_rows") == "ascending", (
                f"{run.name} ({version}) was made before the Triton rows were sorted;"
                " delete it to re-run"
            )
    for w in WORKLOADS:
        yield from zip(a.workload(w), b.workload(w), strict=True)


def prompt_comparison(results, a_name: str, b_name: str) -> dict:
    """Logprob deltas over all prompt tokens, and per request the position of the
    last token of context before the first differing logprob."""
    deltas, exact_early, first_diffs = [], True, []
    for ra, rb in request_pairs(results, a_name, b_name):
        assert ra["prompt_tokens"] == rb["prompt_tokens"]
        first = None
        # Entry i is token i's logprob, computed at position i - 1.
        pairs = zip(ra["prompt_logprobs"][1:], rb["prompt_logprobs"][1:], strict=True)
        for position, (la, lb) in enumerate(pairs):
            deltas.append(abs(la - lb))
            if la != lb:
                first = position if first is None else first
                exact_early &= position >= FIRST_DROPPING_POSITION
        first_diffs.append(first)
    t = torch.tensor(deltas, dtype=torch.float64)
    return {
        "tokens": len(deltas),
        "mean": float(t.mean()),
        "max": float(t.max()),
        "exact_while_nothing_is_dropped": exact_early,
        "first_difference_at": first_diffs,
    }


def token_comparison(triton: dict, flashinfer: dict) -> dict:
    """Where two greedy completions part, and how close Triton's top two were there."""
    for step, (st, sf) in enumerate(zip(triton["steps"], flashinfer["steps"], strict=True)):
        if st["token"] != sf["token"]:
            top = st["top"]
            gap = top[0][1] - top[1][1] if len(top) > 1 else math.inf
            return {"parted_at": step, "triton_top2_gap": gap}
    return {"parted_at": None, "triton_top2_gap": None}


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
    if run.sm90:
        assert "selected Triton (FlashInfer not used: index cache is bf16" in lines[0], lines
        assert "set indexer_kv_dtype=fp8" in lines[0]
    else:
        assert "selected FlashInfer" in lines[0], lines


def test_bf16_index_cache_with_forced_flashinfer(engine_results):
    run = engine_results["bf16-flashinfer-eager"]
    if run.sm90:
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
    _summary(e2e_dir, f"audit/{name}", audit_counts(audit))
    kinds = audit["by_kind"]
    assert audit["steps"] > 0 and audit["mixed_steps"] > 0
    assert set(kinds) == AUDITED_KINDS[name], kinds
    for kind, counts in kinds.items():
        assert counts["num_problems"] == 0, (kind, counts["problems"])
        assert counts["rows"] > 0 and counts["value_rows"] == counts["rows"], (kind, counts)


@pytest.mark.parametrize(
    ("eager", "graphs"), [("flashinfer-eager", "auto-graphs"), ("triton-eager", "triton-graphs")]
)
def test_graphs_reproduce_eager(engine_results, eager, graphs):
    """Same backend with and without CUDA graphs: identical prompt logprobs and
    tokens (so full-graph decode replays select what eager decode selects)."""
    assert prompt_comparison(engine_results, eager, graphs)["max"] == 0.0
    for ra, rb in request_pairs(engine_results, eager, graphs):
        assert ra["token_ids"] == rb["token_ids"]


def audited_requests(results, name: str) -> tuple[list[int], dict]:
    """The run's audit: per audit request (numbered in the order the requests started,
    `selection_audit.RequestOrder`), its prompt length; and its rows at
    `RECORDED_POSITIONS` by (audit request, position, layer, head): [exact, gap,
    *blocks]. Requests of one prompt length are not told apart (the scheduler need not
    start them in submission order)."""
    run = _ok(results, name)
    audit = run.data["audit"]
    requests = [request for w in WORKLOADS for request in run.workload(w)]
    # Each audit request seen over its prompt at least and not past its last token (or the
    # last speculated one: a verify step scores up to K tokens beyond what it accepts).
    speculated = (run.data.get("speculative") or {}).get("num_speculative_tokens", 0)
    spans = {
        (r["prompt_tokens"], r["prompt_tokens"] + len(r["token_ids"]) + speculated)
        for r in requests
    }
    prompts = []
    for n, extent in enumerate(audit["request_extents"]):
        fits = {prompt for prompt, end in spans if prompt <= extent <= end}
        assert len(fits) == 1, (name, n, extent, fits)
        prompts.append(fits.pop())
    expected = sorted(r["prompt_tokens"] for r in requests)
    assert sorted(prompts) == expected, (name, "the audit saw other requests", prompts)
    return prompts, {tuple(row[:4]): row[4:] for row in audit["recorded"]}


def selection_differences(a: dict, b: dict) -> dict[int, dict]:
    """Per audit request, the first recorded row (by position) where two runs'
    selected blocks differ, with both runs' exactness and the reference gap there."""
    first: dict[int, dict] = {}
    for key in sorted(set(a) & set(b)):  # (request, position, layer, head)
        request, position, layer, head = key
        if request not in first and a[key][2:] != b[key][2:]:
            first[request] = {
                "position": position,
                "layer": layer,
                "head": head,
                "exact": [a[key][0], b[key][0]],
                "reference_gap": b[key][1],
            }
    return first


def explain_early_partings(results, pair: tuple[str, str], early: dict[int, int]) -> dict:
    """For each request parting at `early[i]`, a selection difference of its own: an
    audit request of the same prompt length whose recorded selections differ between
    the runs at or before the parting, each difference used once (the earliest
    partings first take the earliest differences). None where there is none."""
    if not early or not all("recorded" in _ok(results, n).data.get("audit", {}) for n in pair):
        return {i: None for i in early}
    (prompts, a), (prompts_b, b) = (audited_requests(results, name) for name in pair)
    assert prompts == prompts_b, ("the runs started their requests in another order", pair)
    differences = selection_differences(a, b)
    explained: dict[int, dict | None] = {}
    used: set[int] = set()
    requests = [request for w in WORKLOADS for request in _ok(results, pair[0]).workload(w)]
    for i, parting in sorted(early.items(), key=lambda item: item[1]):
        prompt = requests[i]["prompt_tokens"]
        candidates = sorted(
            (diff["position"], n)
            for n, diff in differences.items()
            if n not in used and prompts[n] == prompt and diff["position"] <= parting
        )
        if not candidates:
            explained[i] = None
            continue
        _, n = candidates[0]
        used.add(n)
        explained[i] = {"audit_request": n, **differences[n]}
    return explained


def assert_prompt_logprobs_agree(engine_results, e2e_dir, mode: str, pair: tuple[str, str]):
    """Exact while nothing is dropped; each request's first difference at least
    `MIN_EXACT_PAST_DROP` tokens after 2048, unless both runs' audits recorded the
    rows there (`RECORDED_POSITIONS`) and show a selection difference of that request
    at or before it (`explain_early_partings`): then the parting is a selection
    difference, where FlashInfer's row is a reference top-k (its audit), so Triton's
    is another one (a tie within `value_check`'s tolerance, when Triton's row is
    exact too) or none. Mean |delta| bound."""
    stats = prompt_comparison(engine_results, *pair)
    earliest = FIRST_DROPPING_POSITION + MIN_EXACT_PAST_DROP
    assert range(FIRST_DROPPING_POSITION, earliest) == RECORDED_POSITIONS
    early = {
        i: first
        for i, first in enumerate(stats["first_difference_at"])
        if first is not None and first < earliest
    }
    explained = explain_early_partings(engine_results, pair, early)
    stats["parted_before_bound"] = {
        i: {"first_difference_at": first, "selections_differ": explained[i]}
        for i, first in early.items()
    }
    triton_audit = _ok(engine_results, pair[1]).data.get("audit", {}).get("triton")
    if triton_audit is not None:  # reported, not asserted: vLLM's choices, not ours
        stats["triton_rows"] = {k: triton_audit[k] for k in ("rows", "value_rows", "problems")}
    _summary(e2e_dir, f"prompt_logprobs/{mode}", stats)
    assert stats["exact_while_nothing_is_dropped"], stats
    for i in early:
        differ = explained[i]
        assert differ is not None, (i, stats)
        assert differ["exact"][0] == 1, (i, differ)  # FlashInfer's row: a reference top-k
    assert stats["mean"] <= MEAN_TOL, stats


@pytest.mark.parametrize("mode", sorted(PAIRS))
def test_prompt_logprobs_agree(engine_results, e2e_dir, mode):
    assert_prompt_logprobs_agree(engine_results, e2e_dir, mode, PAIRS[mode])


def test_control_pair_parts_at_the_first_dropped_block(engine_results, e2e_dir):
    """The prompt-logprob criteria can fail: a pair whose selections differ
    systematically parts within a few tokens of position 2048."""
    stats = prompt_comparison(engine_results, *CONTROL)
    _summary(e2e_dir, "prompt_logprobs/control-fp8-vs-bf16-index", stats)
    assert stats["exact_while_nothing_is_dropped"], stats
    earliest = FIRST_DROPPING_POSITION + MIN_EXACT_PAST_DROP
    assert all(f is not None and f < earliest for f in stats["first_difference_at"]), stats


def greedy_report(engine_results, flashinfer_name: str, triton_name: str) -> list[dict]:
    """Per request: its tokens, where the two greedy completions part and Triton's top-2
    gap there."""
    return [
        {"request": i, "tokens": len(triton["token_ids"]), **token_comparison(triton, flashinfer)}
        for i, (flashinfer, triton) in enumerate(
            request_pairs(engine_results, flashinfer_name, triton_name)
        )
    ]


def greedy_violations(report: list[dict], tolerance: float) -> list[dict]:
    """The requests that parted where Triton's top two lay further apart than `tolerance`."""
    return [
        row for row in report if row["parted_at"] is not None and row["triton_top2_gap"] > tolerance
    ]


def assert_greedy_tokens_agree(
    engine_results,
    e2e_dir,
    mode: str,
    flashinfer_name: str,
    triton_name: str,
    tolerance: float = GREEDY_PART_TOL,
):
    """Greedy completions equal, or parted only where the `triton_name` run's top
    two lay within `tolerance` nats (a fixed bound, not one the pair sets)."""
    report = greedy_report(engine_results, flashinfer_name, triton_name)
    _summary(e2e_dir, f"greedy/{mode}", {"tolerance": tolerance, "requests": report})
    assert not greedy_violations(report, tolerance), report


@pytest.mark.parametrize("mode", sorted(PAIRS))
def test_greedy_tokens_agree(engine_results, e2e_dir, mode):
    assert_greedy_tokens_agree(engine_results, e2e_dir, mode, *PAIRS[mode])


def sampled_logprob_deltas(a: dict, b: dict) -> list[float]:
    """|logprob| differences of the sampled token over the steps where two greedy
    completions still agree (each step records its top two and the sampled token)."""
    deltas = []
    for step_a, step_b in zip(a["steps"], b["steps"], strict=False):
        if step_a["token"] != step_b["token"]:
            break
        lp_a = dict((tok, lp) for tok, lp in step_a["top"]).get(step_a["token"])
        lp_b = dict((tok, lp) for tok, lp in step_b["top"]).get(step_b["token"])
        assert lp_a is not None and lp_b is not None, "sampled token missing from its logprobs"
        deltas.append(abs(lp_a - lp_b))
    return deltas


def decode_comparison(results, a_name: str, b_name: str) -> dict:
    """Sampled-token logprob deltas of every decode step the two runs share."""
    deltas, steps = [], 0
    for ra, rb in request_pairs(results, a_name, b_name):
        steps += len(rb["steps"])
        deltas += sampled_logprob_deltas(ra, rb)
    return {
        "steps": steps,
        "compared": len(deltas),
        # No step compared (every pair parted at once): as far apart as can be.
        "mean": sum(deltas) / len(deltas) if deltas else math.inf,
        "max": max(deltas, default=math.inf),
    }


def sampled_violations(stats: dict) -> list[str]:
    """The decode bounds a pair's sampled-token deltas break."""
    broken = []
    if stats["compared"] < stats["steps"] // 2:
        broken.append(f"compared {stats['compared']} of {stats['steps']} steps")
    if stats["mean"] > DECODE_MEAN_TOL:
        broken.append(f"mean {stats['mean']:.4f} > {DECODE_MEAN_TOL}")
    if stats["max"] > GREEDY_PART_TOL:
        broken.append(f"max {stats['max']:.4f} > {GREEDY_PART_TOL}")
    return broken


def assert_sampled_logprobs_agree(engine_results, e2e_dir, mode: str, pair: tuple[str, str]):
    stats = decode_comparison(engine_results, *pair)
    _summary(e2e_dir, f"sampled_logprobs/{mode}", stats)
    assert not sampled_violations(stats), stats


@pytest.mark.parametrize("mode", sorted(PAIRS))
def test_sampled_logprobs_agree(engine_results, e2e_dir, mode):
    """Decode rows have no prompt logprobs: the sampled token's logprob, step by
    step over the 24- and 96-token decodes, against Triton within fixed bounds."""
    assert_sampled_logprobs_agree(engine_results, e2e_dir, mode, PAIRS[mode])


def test_control_pair_fails_the_decode_bound(engine_results, e2e_dir):
    """The decode bound can fail: the fp8-vs-bf16 index control exceeds it."""
    stats = decode_comparison(engine_results, *CONTROL)
    _summary(e2e_dir, "sampled_logprobs/control-fp8-vs-bf16-index", stats)
    assert stats["mean"] > DECODE_MEAN_TOL, stats


def test_faulty_selection_fails_the_prompt_check(engine_results, e2e_dir):
    """Every request of the faulty run parts before the bound, unexplained by any audit
    (the faulty run has none), and the mean |delta| exceeds `MEAN_TOL`."""
    stats = prompt_comparison(engine_results, *FAULT_CONTROL)
    earliest = FIRST_DROPPING_POSITION + MIN_EXACT_PAST_DROP
    stats["mean_over_bound"] = stats["mean"] / MEAN_TOL
    _summary(e2e_dir, "prompt_logprobs/control-page-count-fault", stats)
    parted_early = [f for f in stats["first_difference_at"] if f is not None and f < earliest]
    assert parted_early, stats
    with pytest.raises(AssertionError):
        assert_prompt_logprobs_agree(engine_results, e2e_dir, "control-page-count-fault-checked",
                                     FAULT_CONTROL)  # fmt: skip


def test_faulty_selection_fails_the_greedy_check(engine_results, e2e_dir):
    """Some request of the faulty run parts where Triton's top two lay further apart than
    `GREEDY_PART_TOL`."""
    report = greedy_report(engine_results, *FAULT_CONTROL)
    violations = greedy_violations(report, GREEDY_PART_TOL)
    widest = max((row["triton_top2_gap"] for row in violations), default=0.0)
    _summary(e2e_dir, "greedy/control-page-count-fault", {
        "tolerance": GREEDY_PART_TOL, "requests": report,
        "violations": len(violations), "widest_gap_over_bound": widest / GREEDY_PART_TOL,
    })  # fmt: skip
    assert violations, report


def test_faulty_selection_fails_both_decode_bounds(engine_results, e2e_dir):
    """The faulty run's sampled-token deltas exceed the mean bound and the max bound."""
    stats = decode_comparison(engine_results, *FAULT_CONTROL)
    stats["mean_over_bound"] = stats["mean"] / DECODE_MEAN_TOL
    stats["max_over_bound"] = stats["max"] / GREEDY_PART_TOL
    _summary(e2e_dir, "sampled_logprobs/control-page-count-fault", stats)
    assert stats["mean"] > DECODE_MEAN_TOL and stats["max"] > GREEDY_PART_TOL, stats
