"""Markdown (and, for ``eval ab``, PNG) reports from the JSON that the eval commands write.

Reports are made from the JSON files only, so a report can be rebuilt from a results
directory, and what a report says is what the files say.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_minimax.evals.accuracy import Comparison
from vllm_minimax.evals.common import require


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _with_error(value: float | None, stderr: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4f} ± {stderr:.4f}" if stderr is not None else f"{value:.4f} (no stderr)"


def comparison_table(
    comparisons: Sequence[Comparison], scores: list[dict], baseline: list[dict], labels: tuple
) -> list[str]:
    """One row per score: both numbers, their difference, the bound and pass/fail."""
    errors = {(s["task"], s["metric"]): s.get("stderr") for s in scores}
    baseline_errors = {(s["task"], s["metric"]): s.get("stderr") for s in baseline}
    lines = [
        f"| task | metric | {labels[0]} | {labels[1]} | difference | bound | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        key = (c.task, c.metric)
        result = "PASS" if c.passed else "FAIL"
        if c.note:
            result += f" ({c.note})"
        lines.append(
            f"| {c.task} | `{c.metric}` | {_with_error(c.baseline, baseline_errors.get(key))}"
            f" | {_with_error(c.value, errors.get(key))} | {_number(c.difference)}"
            f" | {_number(c.bound)} | {result} |"
        )
    return lines


def accuracy_markdown(summary: dict[str, Any]) -> str:
    lines = [f"# Accuracy: preset `{summary['preset']}`", ""]
    lines += [f"Server `{summary['base_url']}`, model `{summary['model']}`.", ""]
    lines += ["| task | metric | value ± stderr | samples |", "|---|---|---|---|"]
    for score in summary["scores"]:
        lines.append(
            f"| {score['task']} | `{score['metric']}` |"
            f" {_with_error(score['value'], score['stderr'])} | {score['samples']} |"
        )
    baseline = summary.get("baseline")
    if baseline:
        comparisons = [Comparison(**entry) for entry in baseline["comparisons"]]
        verdict = "all scores pass" if baseline["passed"] else "some scores FAIL"
        lines += ["", f"## Against the baseline `{baseline['file']}`: {verdict}", ""]
        lines += [
            f"A score passes when |difference| <= {baseline['z']} x sqrt(stderr^2 +"
            " stderr_baseline^2).",
            "",
        ]
        lines += comparison_table(
            comparisons, summary["scores"], baseline["scores"], ("baseline", "this run")
        )
    references = summary.get("references")
    if references:
        lines += ["", "## Against published references", ""]
        lines += ["A score matches when |value - reference| <= the preset's tolerance.", ""]
        lines += [
            "| task | metric | reference | tolerance | this run | result | source |",
            "|---|---|---|---|---|---|---|",
        ]
        for ref in references:
            result = "MATCH" if ref["passed"] else "DIFFERS"
            lines.append(
                f"| {ref['task']} | `{ref['metric']}` | {ref['reference']:.4f}"
                f" | {ref['tolerance']:.4f} | {_number(ref['value'])} | {result}"
                f" | {ref['source']} |"
            )
    if summary.get("error"):
        lines += ["", f"**Stopped early:** {summary['error']}"]
    if summary.get("interrupted"):
        lines += ["", f"**Interrupted:** {summary['interrupted']}"]
    return "\n".join(lines) + "\n"


def _ms(summary: dict[str, float], key: str) -> str:
    return _number(summary.get(key), 1)


@dataclass(frozen=True)
class Spread:
    """The median of a level's rounds and their range."""

    median: float
    low: float
    high: float
    rounds: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        finite = [value for value in values if value is not None and math.isfinite(value)]
        if not finite:
            return None
        return cls(statistics.median(finite), min(finite), max(finite), len(finite))

    def text(self, digits: int = 1, suffix: str = "") -> str:
        median = f"{number_text(self.median, digits)}{suffix}"
        if self.rounds == 1:
            return median
        return f"{median} ({number_text(self.low, digits)}..{number_text(self.high, digits)})"


def number_text(value: float, digits: int) -> str:
    """`value` with `digits` decimals, or with two significant ones where `digits` would
    show a value that is not 0 as 0 (a TPOT of 0.013 ms was printed "0.0")."""
    text = f"{value:.{digits}f}"
    if value != 0 and float(text) == 0:
        text = f"{value:.{1 - math.floor(math.log10(abs(value)))}f}"
    return text


METRICS: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "tok/s": lambda level: level["output_tokens_per_s"],
    "TTFT p50 ms": lambda level: level["ttft_ms"].get("p50"),
    "TPOT p50 ms": lambda level: level["tpot_ms"].get("p50"),
    "ITL p50 ms": lambda level: level["itl_ms"].get("p50"),
}


def levels_by_concurrency(scenario: dict[str, Any] | None) -> dict[int, list[dict[str, Any]]]:
    """A scenario's level records grouped by concurrency (one per round), in sweep order."""
    grouped: dict[int, list[dict[str, Any]]] = {}
    for level in (scenario or {}).get("levels", []):
        grouped.setdefault(level["concurrency"], []).append(level)
    return grouped


def metric_spread(levels: Sequence[dict[str, Any]], metric: str) -> Spread | None:
    return Spread.of([METRICS[metric](level) for level in levels])


def running_text(levels: Sequence[dict[str, Any]]) -> str:
    """How many requests the server ran at once during the levels (their rounds): the max,
    then the median, each over the rounds; ``-`` where the server had no ``/metrics``;
    with ``, N waited`` when requests queued (the most that waited in any round)."""
    sampled = [level["running_requests"] for level in levels if level.get("running_requests")]
    peak = Spread.of([figures["max"] for figures in sampled])
    if peak is None:
        return "-"
    middle = Spread.of([figures["median"] for figures in sampled])
    text = f"{peak.text(0)} / {_spread_text(middle, 0)}"
    waited = max(figures.get("waiting_max", 0) for figures in sampled)
    return f"{text}, {waited:.0f} waited" if waited else text


RUNNING_HEADER = "ran at once max / median"


def bunched(levels: Sequence[dict[str, Any]]) -> bool:
    """Streamed chunks arriving in bursts: the median ITL is (near) 0 while TPOT is not."""
    itl = metric_spread(levels, "ITL p50 ms")
    tpot = metric_spread(levels, "TPOT p50 ms")
    return itl is not None and tpot is not None and itl.median <= 0.01 * tpot.median


BUNCHED_NOTE = (
    "median ITL p50 is about 0 ms: tokens arrive several per streamed chunk (in bursts), so"
    " the ITL percentiles say little here; TPOT is the per-token figure"
)


CLIENT_TEXT = {
    "vllm-bench": "vLLM's `vllm bench serve` (random dataset; each level's command and JSON"
    " are in the results' `bench_command` and `bench_result`)",
    "own": "this project's client (token-id prompts)",
}


def _shapes_text(scenario: dict[str, Any]) -> str:
    return ", ".join(
        f"{s['input_tokens']} in / {s['output_tokens']} out" for s in scenario["shapes"]
    )


def throughput_markdown(results: dict[str, Any], title: str | None = None) -> str:
    rounds = results.get("repeat", 1)
    lines = [title or f"# Throughput: preset `{results['preset']}`", ""]
    lines += [f"Server `{results['base_url']}`, model `{results['model']}`.", ""]
    if rounds > 1:
        lines += [
            f"{rounds} rounds per level: each cell is the median of the rounds, (min..max).",
            "",
        ]
    for scenario in results["scenarios"]:
        lines += [
            f"## {scenario['name']} ({_shapes_text(scenario)}; {scenario['num_requests']}"
            " requests)",
            "",
        ]
        if scenario.get("client"):
            lines += [f"Client: {CLIENT_TEXT.get(scenario['client'], scenario['client'])}.", ""]
        lines += [
            "| concurrency | rounds | output tok/s | TTFT p50 ms | TPOT p50 ms | ITL p50 ms"
            f" | TTFT p99 ms | TPOT p99 ms | {RUNNING_HEADER} |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        notes = []
        for concurrency, levels in levels_by_concurrency(scenario).items():
            cells = [_spread_text(metric_spread(levels, metric)) for metric in METRICS]
            p99 = [
                _spread_text(Spread.of([level[key].get("p99") for level in levels]))
                for key in ("ttft_ms", "tpot_ms")
            ]
            cells += [*p99, running_text(levels)]
            lines.append(f"| {concurrency} | {len(levels)} | {' | '.join(cells)} |")
            if bunched(levels):
                notes.append(f"concurrency {concurrency}: {BUNCHED_NOTE}")
        lines.append("")
        lines += [f"Note, {note}." for note in notes]
        if notes:
            lines.append("")
    if results.get("error"):
        lines += [f"**Stopped early:** {results['error']}", ""]
    if results.get("interrupted"):
        lines += [f"**Interrupted:** {results['interrupted']}", ""]
    if results.get("missing_levels"):
        lines += [f"Not measured: {', '.join(results['missing_levels'])}.", ""]
    return "\n".join(lines)


def _spread_text(spread: Spread | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if spread is None else spread.text(digits, suffix)


def paired_ratios(
    arm: dict[str, Any], reference: dict[str, Any], scenario: int, concurrency: int
) -> Spread | None:
    """Per round, the arm's tok/s over the reference's in the same round."""

    def by_round(record: dict[str, Any]) -> dict[int, float]:
        levels = levels_by_concurrency(_scenario(record, scenario)).get(concurrency, [])
        return {level.get("round", 0): level["output_tokens_per_s"] for level in levels}

    mine, theirs = by_round(arm), by_round(reference)
    return Spread.of([mine[r] / theirs[r] for r in mine if theirs.get(r)])


def _scenario(arm: dict[str, Any], index: int) -> dict[str, Any] | None:
    scenarios = (arm.get("throughput") or {}).get("scenarios", [])
    return scenarios[index] if index < len(scenarios) else None


def missing_levels(ab: dict[str, Any]) -> list[str]:
    """Levels the plan has (scenario x concurrency x round, per arm) that no record holds."""
    plan = ab.get("throughput_plan") or []
    missing = []
    for arm in ab["arms"]:
        for index, planned in enumerate(plan):
            have = {
                (level["concurrency"], level.get("round", 0))
                for level in (_scenario(arm, index) or {}).get("levels", [])
            }
            lacking = [
                f"c={concurrency} round {r + 1}"
                for r in range(ab.get("repeat", 1))
                for concurrency in planned["concurrency"]
                if (concurrency, r) not in have
            ]
            if lacking:
                missing.append(f"`{arm['name']}` {planned['name']}: {', '.join(lacking)}")
    return missing


def ab_markdown(ab: dict[str, Any], plots: list[Path]) -> str:
    """Side by side: accuracy of each arm against the first, then speed per scenario."""
    arms = [arm["name"] for arm in ab["arms"]]
    reference = arms[0]
    repeat = ab.get("repeat", 1)
    lines = [f"# A/B: {' vs '.join(f'`{name}`' for name in arms)}", ""]
    lines += [f"Model `{ab['model']}`, serve config `{ab['config']}`.", ""]
    if ab.get("interrupted"):
        lines += [f"**Interrupted:** {ab['interrupted']}.", ""]
    for arm in ab["arms"]:
        if arm.get("error"):
            lines += [f"**Arm `{arm['name']}` stopped early:** {arm['error']}", ""]
    missing = missing_levels(ab)
    if missing and not ab.get("complete"):
        lines += ["**Not measured:** " + "; ".join(missing) + ".", ""]
    lines += [f"{repeat} round(s); each round starts each arm's server anew, in the order shown."]
    lines += [
        "",
        "| arm | server arguments | start-up s (per round) | KV cache tokens (per round) |",
        "|---|---|---|---|",
    ]
    for arm in ab["arms"]:
        rounds = arm.get("rounds", [])
        startups = ", ".join(_number(r.get("startup_seconds"), 0) for r in rounds) or "-"
        tokens = ", ".join(
            f"{r['kv_cache_tokens']:,}" if r.get("kv_cache_tokens") else "-" for r in rounds
        )
        arguments = f"`{arm['server_args']}`"
        if arm.get("server_env"):
            arguments += ", environment " + ", ".join(
                f"`{key}={value}`" for key, value in arm["server_env"].items()
            )
        lines.append(f"| `{arm['name']}` | {arguments} | {startups} | {tokens or '-'} |")
    lines.append("")
    if ab.get("round_order"):
        orders = [" then ".join(order) for order in ab["round_order"]]
        lines += ["Round order: " + "; ".join(
            f"{i + 1}: {order}" for i, order in enumerate(orders)
        ) + ".", ""]  # fmt: skip
    if ab.get("accuracy_comparisons"):
        lines += [f"## Accuracy (each arm against `{reference}`, first round only)", ""]
        lines += [
            f"A score passes when |difference| <= {ab['z']} x sqrt(stderr_a^2 + stderr_b^2).",
            "",
        ]
        scores = {arm["name"]: arm.get("accuracy", {}).get("scores", []) for arm in ab["arms"]}
        for name, entries in ab["accuracy_comparisons"].items():
            comparisons = [Comparison(**entry) for entry in entries]
            lines += [f"### `{name}` vs `{reference}`", ""]
            lines += comparison_table(
                comparisons, scores[name], scores[reference], (reference, name)
            )
            lines.append("")
    lines += _ab_throughput(ab, repeat)
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{plot.stem}]({plot.name})" for plot in plots]
        lines.append("")
    return "\n".join(lines)


def _ab_throughput(ab: dict[str, Any], repeat: int) -> list[str]:
    records = ab["arms"]
    reference = records[0]
    plan = ab.get("throughput_plan") or []
    if not plan or not any(record.get("throughput") for record in records):
        return []
    lines = ["## Throughput", ""]
    lines += [
        "Each cell: the median over the rounds, (min..max). The ratio is per round (the arm's"
        f" tok/s over `{reference['name']}`'s in the same round), median (min..max)."
        if repeat > 1
        else "One round: no spread (run with --repeat 3 for one).",
        "",
    ]
    for index, planned in enumerate(plan):
        lines += [f"### {planned['name']} ({_shapes_text(planned)})", ""]
        header = "| concurrency |"
        rule = "|---|"
        for record in records:
            for metric in ("tok/s", "TTFT p50 ms", "TPOT p50 ms", RUNNING_HEADER):
                header += f" {record['name']} {metric} |"
                rule += "---|"
        for record in records[1:]:
            header += f" {record['name']} / {reference['name']} tok/s |"
            rule += "---|"
        lines += [header, rule]
        notes = []
        for concurrency in planned["concurrency"]:
            row = f"| {concurrency} |"
            for record in records:
                levels = levels_by_concurrency(_scenario(record, index)).get(concurrency, [])
                for metric in ("tok/s", "TTFT p50 ms", "TPOT p50 ms"):
                    row += f" {_spread_text(metric_spread(levels, metric))} |"
                row += f" {running_text(levels)} |"
                if levels and bunched(levels):
                    notes.append(f"`{record['name']}` concurrency {concurrency}: {BUNCHED_NOTE}")
            for record in records[1:]:
                ratio = paired_ratios(record, reference, index, concurrency)
                row += f" {_spread_text(ratio, 2, 'x')} |"
            lines.append(row)
        lines.append("")
        lines += [f"Note, {note}." for note in notes]
        if notes:
            lines.append("")
    return lines


def ab_plots(ab: dict[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per throughput scenario (tok/s, TTFT, TPOT against concurrency: the median of
    the rounds, bars from min to max, y from 0), one for accuracy unless every score is 0."""
    if not any(arm.get("throughput") or arm.get("accuracy") for arm in ab["arms"]):
        return []  # nothing to draw yet (and matplotlib's import takes a while)
    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    arms = [arm for arm in ab["arms"] if arm.get("throughput")]
    for index, planned in enumerate(ab.get("throughput_plan") or [] if arms else []):
        figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for axis, metric in zip(axes, ("tok/s", "TTFT p50 ms", "TPOT p50 ms"), strict=True):
            for arm in arms:
                points = [
                    (concurrency, spread)
                    for concurrency, levels in levels_by_concurrency(_scenario(arm, index)).items()
                    if (spread := metric_spread(levels, metric)) is not None
                ]
                if not points:
                    continue
                axis.errorbar(
                    [c for c, _ in points],
                    [s.median for _, s in points],
                    yerr=[
                        [s.median - s.low for _, s in points],
                        [s.high - s.median for _, s in points],
                    ],
                    marker="o",
                    capsize=4,
                    label=arm["name"],
                )
            concurrencies = planned["concurrency"]
            axis.set_xscale("log", base=2)
            axis.set_xticks(sorted(concurrencies), [str(c) for c in sorted(concurrencies)])
            axis.minorticks_off()
            axis.set_ylim(bottom=0)
            axis.set_xlabel("concurrency")
            axis.set_title(metric)
            axis.grid(alpha=0.3)
        axes[0].legend()
        rounds = ab.get("repeat", 1)
        figure.suptitle(
            f"{planned['name']}: median of {rounds} round(s), bars min..max"
            if rounds > 1
            else planned["name"]
        )
        figure.tight_layout()
        path = out_dir / f"throughput-{planned['name']}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    scored = [arm for arm in ab["arms"] if arm.get("accuracy", {}).get("scores")]
    values_seen = [s["value"] for arm in scored for s in arm["accuracy"]["scores"]]
    if scored and any(value != 0 for value in values_seen):
        keys = [(s["task"], s["metric"]) for s in scored[0]["accuracy"]["scores"]]
        figure, axis = plt.subplots(figsize=(max(5, 1.6 * len(keys) * len(scored)), 3.8))
        width = 0.8 / len(scored)
        for arm_index, arm in enumerate(scored):
            by_key = {(s["task"], s["metric"]): s for s in arm["accuracy"]["scores"]}
            values = [by_key.get(key, {}).get("value", 0.0) for key in keys]
            errors = [1.96 * (by_key.get(key, {}).get("stderr") or 0.0) for key in keys]
            positions = [i + arm_index * width for i in range(len(keys))]
            axis.bar(positions, values, width, yerr=errors, capsize=4, label=arm["name"])
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
        axis.set_xticklabels([f"{task}\n{metric}" for task, metric in keys], fontsize=8)
        axis.set_ylim(bottom=0)
        axis.set_ylabel("score (error bar: 1.96 x stderr)")
        axis.legend()
        figure.tight_layout()
        path = out_dir / "accuracy.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written
