"""Issue 53's lean targets for the fp8 KV cache and FlashInfer's sparse attention, against runs.

    python -m benchmarks.ab_repeats DIR... --out OUT --targets fp8kv --gpu h100 \\
        --arms stock fp8-flashinfer bf16 fp8-triton

The arms (scripts/gpu-rank-slice's ``fp8kv_arm``): (a) ``bf16`` (bf16 KV cache, Triton sparse
attention, FlashInfer indexer), (b) ``fp8-triton`` (one round, paired with (c)), (c)
``fp8-flashinfer`` and (d) ``stock`` (vLLM 0.34.0 unpatched). The lean rounds (``lean-start``)
run (a), (c) and (d) at every point, so every ratio to stock is direct. Every ratio is of
medians: the median of the numerator arm's levels at the point over the median of the
denominator arm's, each over the runs that measured both arms at that point (so the (b)
round, which holds (b) and (c), does not move (c)/(d) or (c)/(a)). Beside it, the same ratio
paired within each round.

The targets, each met, missed or not measured (a point no run measured in both arms):

- TTFT p50, (c)/(d): at most 0.5 at ``prefill-128k-c1``, at most 0.6 at ``prefill-64k-c1``;
- output tok/s, (c)/(d): at least 1.5 at ``mixed-c16``;
- ITL p50, (c)/(d): at most 0.97 at ``decode-32k-c8``;
- output tok/s, (c)/(d): at least 1.4 at ``decode-32k-c64``, on the H100 only (no arm's
  cache holds its 64 requests there; the row gives how many each arm ran at once; on the
  H200 it says it is not a target);
- (c) at or above (a) at every lean point of the card, and at or above (b) at the four
  points (b) ran: not slower in TTFT p50 at a prefill point and in ITL p50 at
  ``decode-32k-c8``, not lower in output tok/s at ``mixed-c16`` and ``decode-32k-c64``; one
  row per point.

The older plan's chain to stock ((a)/(d) x (c)/(a) at two points) is retired: the lean
rounds measure (c)/(d) directly.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

BF16, FP8_TRITON, FP8_FLASHINFER, STOCK = "bf16", "fp8-triton", "fp8-flashinfer", "stock"
ARM_LETTERS = {BF16: "a", FP8_TRITON: "b", FP8_FLASHINFER: "c", STOCK: "d"}
GPUS = ("h100", "h200")
# The lean points (scripts/gpu-rank-slice's LEAN_POINTS and LEAN_H100_POINTS) and where (b)
# ran (the four both cards run).
LEAN_POINTS = ("prefill-128k-c1", "prefill-64k-c1", "decode-32k-c8", "mixed-c16")
CAPACITY_POINT = "decode-32k-c64"
POINTS = {"h100": (*LEAN_POINTS, CAPACITY_POINT), "h200": LEAN_POINTS}

Level = dict[str, Any]
METRIC_READERS: dict[str, Callable[[Level], float | None]] = {
    "tok/s": lambda level: level.get("output_tokens_per_s"),
    "TTFT p50 ms": lambda level: (level.get("ttft_ms") or {}).get("p50"),
    "ITL p50 ms": lambda level: (level.get("itl_ms") or {}).get("p50"),
}
AT_MOST, AT_LEAST = "at most", "at least"
MET, MISSED, NOT_MEASURED, NOT_A_TARGET = "met", "missed", "not measured", "not a target here"


@dataclass(frozen=True)
class Target:
    """One row: ``numerator / denominator`` of ``metric`` at ``point`` against ``bound``."""

    metric: str
    point: str
    numerator: str
    denominator: str
    bound: float
    direction: str
    gpus: tuple[str, ...] = GPUS

    def holds(self, ratio: float) -> bool:
        return ratio <= self.bound if self.direction == AT_MOST else ratio >= self.bound


TTFT, TOK_S, ITL = "TTFT p50 ms", "tok/s", "ITL p50 ms"
STOCK_TARGETS = (
    Target(TTFT, "prefill-128k-c1", FP8_FLASHINFER, STOCK, 0.5, AT_MOST),
    Target(TTFT, "prefill-64k-c1", FP8_FLASHINFER, STOCK, 0.6, AT_MOST),
    Target(TOK_S, "mixed-c16", FP8_FLASHINFER, STOCK, 1.5, AT_LEAST),
    Target(ITL, "decode-32k-c8", FP8_FLASHINFER, STOCK, 0.97, AT_MOST),
    Target(TOK_S, CAPACITY_POINT, FP8_FLASHINFER, STOCK, 1.4, AT_LEAST, ("h100",)),
)
# What "(c) at or above" reads at each point: the point's own target metric.
POINT_METRIC = {
    "prefill-128k-c1": TTFT,
    "prefill-64k-c1": TTFT,
    "decode-32k-c8": ITL,
    "mixed-c16": TOK_S,
    CAPACITY_POINT: TOK_S,
}


def never_below_target(point: str, other: str) -> Target:
    """(c) at or above ``other`` at ``point``: a latency ratio at most 1, tok/s at least 1."""
    metric = POINT_METRIC[point]
    direction = AT_LEAST if metric == TOK_S else AT_MOST
    gpus = ("h100",) if point == CAPACITY_POINT else GPUS
    return Target(metric, point, FP8_FLASHINFER, other, 1.0, direction, gpus)


def levels_by_point(
    runs: Sequence[dict[str, Any]], numerator: str, denominator: str
) -> dict[str, dict[str, list[tuple[int, int, Level]]]]:
    """point -> arm -> (run index, round, level) for the two arms, from the runs that
    measured both arms at that point."""
    table: dict[str, dict[str, list[tuple[int, int, Level]]]] = {}
    for index, run in enumerate(runs):
        by_arm = {arm["name"]: arm.get("throughput") or {} for arm in run.get("arms", [])}
        found: dict[str, dict[str, list[tuple[int, int, Level]]]] = {}
        for arm in (numerator, denominator):
            for scenario in by_arm.get(arm, {}).get("scenarios", []):
                for level in scenario.get("levels", []):
                    entry = (index, level.get("round", 0), level)
                    found.setdefault(scenario["name"], {}).setdefault(arm, []).append(entry)
        for point, arms in found.items():
            if numerator in arms and denominator in arms:
                for arm, entries in arms.items():
                    table.setdefault(point, {}).setdefault(arm, []).extend(entries)
    return table


def median_of(entries: Sequence[tuple[int, int, Level]], metric: str) -> float | None:
    values = [METRIC_READERS[metric](level) for _, _, level in entries]
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def paired_spread(
    numerators: Sequence[tuple[int, int, Level]],
    denominators: Sequence[tuple[int, int, Level]],
    metric: str,
) -> dict[str, float] | None:
    """The ratio within each round (same run, same round): median, min, max, n."""
    read = METRIC_READERS[metric]
    below = {(run, round_): read(level) for run, round_, level in denominators}
    ratios = []
    for run, round_, level in numerators:
        value, other = read(level), below.get((run, round_))
        if value is not None and other:
            ratios.append(value / other)
    if not ratios:
        return None
    return {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "n": len(ratios),
    }


def ratio_of_medians(
    runs: Sequence[dict[str, Any]], metric: str, point: str, numerator: str, denominator: str
) -> dict[str, Any] | None:
    """numerator's median over denominator's at ``point``, with each arm's n and the
    paired spread; None when no run measured both arms there."""
    arms = levels_by_point(runs, numerator, denominator).get(point)
    if not arms:
        return None
    top, bottom = median_of(arms[numerator], metric), median_of(arms[denominator], metric)
    if top is None or not bottom:
        return None
    return {
        "ratio": top / bottom,
        "medians": {numerator: top, denominator: bottom},
        "n": {numerator: len(arms[numerator]), denominator: len(arms[denominator])},
        "paired": paired_spread(arms[numerator], arms[denominator], metric),
    }


def evaluate(target: Target, runs: Sequence[dict[str, Any]], gpu: str) -> dict[str, Any]:
    row: dict[str, Any] = {
        "metric": target.metric,
        "point": target.point,
        "arms": f"{target.numerator} / {target.denominator}",
        "letters": f"({ARM_LETTERS[target.numerator]})/({ARM_LETTERS[target.denominator]})",
        "target": f"{target.direction} {target.bound:g}",
    }
    if gpu not in target.gpus:
        return {**row, "status": NOT_A_TARGET, "ratio": None}
    arms = (target.numerator, target.denominator)
    found = ratio_of_medians(runs, target.metric, target.point, *arms)
    if found is None:
        return {**row, "status": NOT_MEASURED, "ratio": None}
    return {**row, **found, "status": MET if target.holds(found["ratio"]) else MISSED}


def running_counts(runs: Sequence[dict[str, Any]], point: str, arm: str) -> dict[str, float]:
    """How many requests ``arm`` ran at once at ``point`` (eval ab's ``running_requests``):
    the median over its levels of each level's max and of each level's median; empty when
    no level recorded it."""
    records = [
        level["running_requests"]
        for run in runs
        for record in run.get("arms", [])
        if record["name"] == arm
        for scenario in (record.get("throughput") or {}).get("scenarios", [])
        if scenario["name"] == point
        for level in scenario.get("levels", [])
        if level.get("running_requests")
    ]
    if not records:
        return {}
    return {
        "max": statistics.median(r["max"] for r in records),
        "median": statistics.median(r["median"] for r in records),
    }


def running_detail(runs: Sequence[dict[str, Any]], point: str, arms: Sequence[str]) -> str:
    """Per arm, how many requests ran at once at ``point`` (max / median); arms whose maxima
    differ compare capacity, not kernels, and the detail says so."""
    parts, maxima = [], set()
    for arm in arms:
        counts = running_counts(runs, point, arm)
        if counts:
            maxima.add(counts["max"])
            parts.append(
                f"({ARM_LETTERS[arm]}) ran {counts['max']:.0f} at once"
                f" (median {counts['median']:.0f})"
            )
        else:
            parts.append(f"({ARM_LETTERS[arm]}) running not recorded")
    text = "; ".join(parts)
    if len(maxima) > 1:
        text += ": different numbers at once, so capacity, not kernels"
    return text


def target_rows(runs: Sequence[dict[str, Any]], gpu: str) -> list[dict[str, Any]]:
    """The lean table: the (c)/(d) targets, then (c) at or above (a) at the card's points
    and at or above (b) at the four points (b) ran."""
    if gpu not in GPUS:
        raise ValueError(f"gpu must be one of {', '.join(GPUS)}, got {gpu!r}")
    rows = []
    for target in STOCK_TARGETS:
        row = evaluate(target, runs, gpu)
        if target.point == CAPACITY_POINT and row["status"] != NOT_A_TARGET:
            row["detail"] = running_detail(runs, CAPACITY_POINT, (FP8_FLASHINFER, STOCK, BF16))
        rows.append(row)
    rows += [evaluate(never_below_target(point, BF16), runs, gpu) for point in POINTS[gpu]]
    rows += [evaluate(never_below_target(point, FP8_TRITON), runs, gpu) for point in LEAN_POINTS]
    return rows


def summarise(runs: Sequence[dict[str, Any]], gpu: str) -> dict[str, Any]:
    return {"gpu": gpu, "targets": target_rows(runs, gpu)}


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _paired(spread: dict[str, float] | None) -> str:
    if not spread:
        return "-"
    return f"{spread['median']:.3f} [{spread['min']:.3f}-{spread['max']:.3f}] (n={spread['n']})"


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"## Issue 53's lean targets on the {summary['gpu'].upper()}",
        "",
        "Ratio of medians (each arm's median over the runs that measured both arms at the"
        " point); beside it, the same ratio paired within each round, median [min-max]. Arms:"
        " (a) bf16, (b) fp8-triton, (c) fp8-flashinfer, (d) stock vLLM 0.34.0. Below 1 is"
        " faster for TTFT and ITL; above 1 is more tok/s.",
        "",
        "| target | point | arms | ratio of medians | paired per round | status | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in summary["targets"]:
        lines.append(
            f"| {row['metric']} {row['target']} | {row['point']} | {row['letters']} |"
            f" {_ratio(row.get('ratio'))} | {_paired(row.get('paired'))} | {row['status']} |"
            f" {row.get('detail') or ''} |"
        )
    return "\n".join(lines) + "\n"
