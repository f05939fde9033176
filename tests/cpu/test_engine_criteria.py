"""The end-to-end engine pair's prompt-logprob criterion (tests/gpu_e2e/test_engine.py,
`assert_prompt_logprobs_agree`) on hand-made runs: a request that parts before the
bound passes only where both runs' audits recorded the rows there and their
selections differ at or before the parting, FlashInfer's row being exact.
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

TEST_ENGINE = Path(__file__).resolve().parents[1] / "gpu_e2e" / "test_engine.py"
PROMPTS = (2200, 2300)  # requests 0 and 1
NEW_TOKENS = 4
LAYER, HEADS = 3, 2


def _load_test_engine():
    spec = importlib.util.spec_from_file_location("gpu_e2e_test_engine", TEST_ENGINE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


test_engine = _load_test_engine()


@dataclass
class Run:
    name: str
    data: dict

    @property
    def error(self) -> str | None:
        return self.data.get("error")

    def workload(self, name: str) -> list[dict]:
        return self.data["workloads"][name]["requests"]


def request(prompt: int, logprobs: list[float]) -> dict:
    return {
        "prompt_tokens": prompt,
        "prompt_logprobs": [None, *logprobs],
        "token_ids": list(range(NEW_TOKENS)),
        "steps": [],
    }


def recorded(blocks_of, exact: int) -> list[list]:
    """Rows of audit requests 0 and 1 at every recorded position."""
    rows = []
    for n in range(2):
        for position in test_engine.RECORDED_POSITIONS:
            for head in range(HEADS):
                blocks = blocks_of(n, position, head)
                rows.append([n, position, LAYER, head, exact, 0.5, *blocks])
    return rows


def same_blocks(n: int, position: int, head: int) -> list[int]:
    return [*range(15), position // 128]


def differing_at(at: int, audit_request: int):
    """Triton's blocks: one block swapped in `audit_request`'s rows from `at` on."""

    def blocks(n: int, position: int, head: int) -> list[int]:
        chosen = same_blocks(n, position, head)
        if n == audit_request and position >= at and head == 1:
            chosen[0] = 15
        return sorted(chosen)

    return blocks


def run_pair(parting, triton_blocks=same_blocks, *, fi_exact=1, audit=True, started=(0, 1)):
    """FlashInfer and Triton runs of requests 0 and 1 (prompts `PROMPTS`); request 1's
    logprobs part at `parting` (and stay parted), request 0's never do. `started`:
    the requests in the order the audit saw them start (its numbering)."""
    rng = random.Random(0)
    base = [[-rng.random() for _ in range(prompt - 1)] for prompt in PROMPTS]
    other = [list(lp) for lp in base]
    if parting is not None:
        other[1][parting:] = [lp - 0.02 for lp in other[1][parting:]]
    runs = {}
    for name, logprobs, blocks, exact in (
        ("flashinfer-eager", base, same_blocks, fi_exact),
        ("triton-eager", other, triton_blocks, 1),
    ):
        data: dict = {
            "workloads": {
                "long": {"requests": [request(PROMPTS[0], logprobs[0])]},
                "mixed": {"requests": [request(PROMPTS[1], logprobs[1])]},
            }
        }
        if audit:
            data["audit"] = {
                "request_extents": [PROMPTS[i] + NEW_TOKENS - 1 for i in started],
                "recorded": recorded(blocks, exact),
            }
        runs[name] = Run(name, data)
    return runs


def check(runs, tmp_path) -> None:
    test_engine.assert_prompt_logprobs_agree(
        runs, tmp_path, "eager", ("flashinfer-eager", "triton-eager")
    )


def test_a_parting_past_the_bound_needs_no_record(tmp_path):
    check(run_pair(2112 + 5, audit=False), tmp_path)


@pytest.mark.parametrize(("at", "started"), [(2061, (0, 1)), (2058, (0, 1)), (2061, (1, 0))])
def test_an_early_parting_at_a_recorded_selection_difference_passes(tmp_path, at, started):
    """Request 1's difference, wherever the audit numbered it (it is audit request 0
    when it started first)."""
    audit_request = started.index(1)
    check(run_pair(2061, differing_at(at, audit_request), started=started), tmp_path)


@pytest.mark.parametrize(
    "case",
    [
        "no audit",
        "same selections",
        "difference after the parting",
        "difference in a request of another length",
        "flashinfer row not exact",
        "a request missed",
        "the runs started the requests in other orders",
    ],
)
def test_an_unexplained_early_parting_fails(tmp_path, case):
    if case == "no audit":
        runs = run_pair(2061, audit=False)
    elif case == "same selections":
        runs = run_pair(2061)
    elif case == "difference after the parting":
        runs = run_pair(2061, differing_at(2070, 1))
    elif case == "difference in a request of another length":
        runs = run_pair(2061, differing_at(2061, 0))
    elif case == "flashinfer row not exact":
        runs = run_pair(2061, differing_at(2061, 1), fi_exact=0)
    elif case == "a request missed":
        runs = run_pair(2061, differing_at(2061, 1))
        runs["triton-eager"].data["audit"]["request_extents"].pop()
    else:
        runs = run_pair(2061, differing_at(2061, 1))
        runs["triton-eager"].data["audit"]["request_extents"].reverse()
    with pytest.raises(AssertionError):
        check(runs, tmp_path)


def decode_run(name: str, tokens_and_tops: list[list[tuple[int, list[tuple[int, float]]]]]) -> Run:
    """A run of one workload ("long") whose requests decode the given steps (sampled token,
    its top two with logprobs); the other workload is empty."""
    requests = [
        {"prompt_tokens": 3000, "prompt_logprobs": [None], "token_ids": [t for t, _ in steps],
         "steps": [{"token": t, "top": top} for t, top in steps]}
        for steps in tokens_and_tops
    ]  # fmt: skip
    return Run(name, {"workloads": {"long": {"requests": requests}, "mixed": {"requests": []}}})


def greedy_pair(gap_at_parting: float, delta: float) -> dict:
    """Triton decodes 0, 0, 0; the other run agrees for two steps (its logprobs off by
    `delta`), then picks token 1 where Triton's top two lay `gap_at_parting` apart."""
    triton = [(0, [(0, -0.1), (1, -0.1 - gap_at_parting)])] * 3
    other = [(0, [(0, -0.1 - delta), (1, -2.0)])] * 2 + [(1, [(1, -0.1), (0, -0.2)])]
    return {
        "flashinfer": decode_run("flashinfer", [other]),
        "triton": decode_run("triton", [triton]),
    }


@pytest.mark.parametrize(("gap", "parts_wide"), [(0.5, False), (0.75, False), (0.76, True)])
def test_greedy_check_fails_a_parting_past_the_bound(gap, parts_wide):
    report = test_engine.greedy_report(greedy_pair(gap, 0.01), "flashinfer", "triton")
    assert report == [{"request": 0, "tokens": 3, "parted_at": 2, "triton_top2_gap": gap}]
    violations = test_engine.greedy_violations(report, test_engine.GREEDY_PART_TOL)
    assert bool(violations) is parts_wide


@pytest.mark.parametrize(
    ("delta", "broken"),
    [(0.01, []), (0.02, ["mean"]), (0.8, ["mean", "max"])],
)
def test_decode_bounds_fail_a_pair_past_them(delta, broken):
    stats = test_engine.decode_comparison(greedy_pair(0.1, delta), "flashinfer", "triton")
    assert (stats["steps"], stats["compared"]) == (3, 2)
    assert stats["mean"] == pytest.approx(delta) and stats["max"] == pytest.approx(delta)
    violations = test_engine.sampled_violations(stats)
    assert [v.split()[0] for v in violations] == broken, violations
