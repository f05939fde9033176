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
