"""Issue 41's targets for the fp8 KV cache and FlashInfer's sparse attention, against runs.

    python -m benchmarks.ab_repeats DIR... --out OUT --targets fp8kv --gpu h100 \\
        --arms bf16 fp8-triton fp8-flashinfer stock

The arms (scripts/gpu-rank-slice's ``fp8kv_arm``): (a) ``bf16`` (bf16 KV cache, Triton sparse
attention, FlashInfer indexer), (b) ``fp8-triton``, (c) ``fp8-flashinfer`` and (d)
``stock`` (vLLM 0.34.0 unpatched). Every ratio is of medians: the median of the
numerator arm's levels at the point over the median of the denominator arm's, each over
the runs that measured both arms at that point (so the stock runs, which hold (a) and (d),
do not move (c)/(a)). Beside it, the spread of the same ratio paired within each round.

The targets, each met, missed or not measured (a point no run measured in both arms):

- TTFT p50, (c)/(a): at most 0.55 at ``prefill-128k-c1``, at most 0.65 at ``prefill-64k-c1``;
- output tok/s, (c)/(a): at least 1.3 at ``mixed-c16``;
- ITL p50 (the decode step), (c)/(a): at most 1.0 at every decode point (``decode-*``);
- output tok/s, (c)/(a): at least 1.3 at ``decode-32k-c64`` on the H100 only, where the
  bf16 cache cannot hold its 64 requests (on the H200 the row says it is not a target);
- output tok/s, (c)/(b): at least 1.0 at every point both measured ("(c) never below (b)").

Then the chain to stock at the stock points: (a)/(d), (c)/(a) and their product (c)/(d),
for output tok/s, TTFT p50 and ITL p50 (figures, no target).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

BF16, FP8_TRITON, FP8_FLASHINFER, STOCK = "bf16", "fp8-triton", "fp8-flashinfer", "stock"
ARM_LETTERS = {BF16: "a", FP8_TRITON: "b", FP8_FLASHINFER: "c", STOCK: "d"}
GPUS = ("h100", "h200")
STOCK_POINTS = ("prefill-64k-c1", "decode-32k-c8")

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


FIXED_TARGETS = (
    Target("TTFT p50 ms", "prefill-128k-c1", FP8_FLASHINFER, BF16, 0.55, AT_MOST),
    Target("TTFT p50 ms", "prefill-64k-c1", FP8_FLASHINFER, BF16, 0.65, AT_MOST),
    Target("tok/s", "mixed-c16", FP8_FLASHINFER, BF16, 1.3, AT_LEAST),
)
CAPACITY_TARGET = Target("tok/s", "decode-32k-c64", FP8_FLASHINFER, BF16, 1.3, AT_LEAST, ("h100",))


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


def measured_points(runs: Sequence[dict[str, Any]], numerator: str, denominator: str) -> list[str]:
    """The points both arms measured in some run, in the order the runs give them."""
    return list(levels_by_point(runs, numerator, denominator))


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


def running_detail(runs: Sequence[dict[str, Any]], point: str, arms: Sequence[str]) -> str:
    """How many requests ran at once at ``point``, per arm: the median over its levels of
    each level's max (eval ab's ``running_requests``)."""
    parts = []
    for arm in arms:
        peaks = [
            level["running_requests"]["max"]
            for run in runs
            for record in run.get("arms", [])
            if record["name"] == arm
            for scenario in (record.get("throughput") or {}).get("scenarios", [])
            if scenario["name"] == point
            for level in scenario.get("levels", [])
            if level.get("running_requests")
        ]
        if peaks:
            parts.append(f"{arm} ran {statistics.median(peaks):.0f} at once")
    return "; ".join(parts)


def target_rows(runs: Sequence[dict[str, Any]], gpu: str) -> list[dict[str, Any]]:
    if gpu not in GPUS:
        raise ValueError(f"gpu must be one of {', '.join(GPUS)}, got {gpu!r}")
    rows = [evaluate(target, runs, gpu) for target in FIXED_TARGETS]
    decode_points = [
        point
        for point in measured_points(runs, FP8_FLASHINFER, BF16)
        if point.startswith("decode-")
    ]
    for point in decode_points or ["decode-*"]:
        rows.append(
            evaluate(Target("ITL p50 ms", point, FP8_FLASHINFER, BF16, 1.0, AT_MOST), runs, gpu)
        )
    capacity = evaluate(CAPACITY_TARGET, runs, gpu)
    capacity["detail"] = running_detail(runs, CAPACITY_TARGET.point, (BF16, FP8_FLASHINFER))
    rows.append(capacity)
    rows.append(never_below(runs))
    return rows


def never_below(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """(c)/(b) tok/s at every point both measured: met when none is below 1; the lowest
    point named."""
    target = Target("tok/s", "every point", FP8_FLASHINFER, FP8_TRITON, 1.0, AT_LEAST)
    row = evaluate(target, [], "h100") | {"status": NOT_MEASURED}
    found = {
        point: ratio_of_medians(runs, "tok/s", point, FP8_FLASHINFER, FP8_TRITON)
        for point in measured_points(runs, FP8_FLASHINFER, FP8_TRITON)
    }
    found = {point: entry for point, entry in found.items() if entry is not None}
    if not found:
        return row
    lowest = min(found, key=lambda point: found[point]["ratio"])
    below = [point for point, entry in found.items() if not target.holds(entry["ratio"])]
    return row | {
        "ratio": found[lowest]["ratio"],
        "status": MISSED if below else MET,
        "detail": f"lowest at {lowest} of {len(found)} points"
        + (f"; below 1 at {', '.join(below)}" if below else ""),
        "points": {point: entry["ratio"] for point, entry in found.items()},
    }


def stock_chain(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per stock point and metric: (a)/(d), (c)/(a) and the chained (c)/(d)."""
    rows = []
    for point in STOCK_POINTS:
        for metric in METRIC_READERS:
            patched = ratio_of_medians(runs, metric, point, BF16, STOCK)
            fp8 = ratio_of_medians(runs, metric, point, FP8_FLASHINFER, BF16)
            chained = patched["ratio"] * fp8["ratio"] if patched and fp8 else None
            rows.append(
                {
                    "point": point,
                    "metric": metric,
                    "a/d": patched["ratio"] if patched else None,
                    "c/a": fp8["ratio"] if fp8 else None,
                    "c/d": chained,
                }
            )
    return rows


def summarise(runs: Sequence[dict[str, Any]], gpu: str) -> dict[str, Any]:
    return {"gpu": gpu, "targets": target_rows(runs, gpu), "stock_chain": stock_chain(runs)}


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _paired(spread: dict[str, float] | None) -> str:
    if not spread:
        return "-"
    return f"{spread['median']:.3f} [{spread['min']:.3f}-{spread['max']:.3f}] (n={spread['n']})"


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"## Issue 41's targets on the {summary['gpu'].upper()}",
        "",
        "Ratio of medians (each arm's median over the runs that measured both arms at the"
        " point); beside it, the same ratio paired within each round, median [min-max]. Arms:"
        " (a) bf16, (b) fp8-triton, (c) fp8-flashinfer, (d) stock.",
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
    lines += [
        "",
        "### The chain to stock vLLM 0.34.0",
        "",
        "(a)/(d) from the runs holding both, (c)/(a) from those holding both, (c)/(d) their"
        " product; below 1 is faster for the latencies, above 1 more tok/s.",
        "",
        "| point | metric | (a)/(d) | (c)/(a) | (c)/(d), chained |",
        "|---|---|---|---|---|",
    ]
    for row in summary["stock_chain"]:
        lines.append(
            f"| {row['point']} | {row['metric']} | {_ratio(row['a/d'])} | {_ratio(row['c/a'])} |"
            f" {_ratio(row['c/d'])} |"
        )
    return "\n".join(lines) + "\n"
