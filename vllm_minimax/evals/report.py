"""Markdown (and, for ``eval ab``, PNG) reports from the JSON that the eval commands write.

Reports are made from the JSON files only, so a report can be rebuilt from a results
directory, and what a report says is what the files say.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    return "\n".join(lines) + "\n"


def _ms(summary: dict[str, float], key: str) -> str:
    return _number(summary.get(key), 1)


def throughput_markdown(results: dict[str, Any], title: str | None = None) -> str:
    lines = [title or f"# Throughput: preset `{results['preset']}`", ""]
    lines += [f"Server `{results['base_url']}`, model `{results['model']}`.", ""]
    for scenario in results["scenarios"]:
        shapes = ", ".join(
            f"{s['input_tokens']} in / {s['output_tokens']} out" for s in scenario["shapes"]
        )
        lines += [f"## {scenario['name']} ({shapes}; {scenario['num_requests']} requests)", ""]
        lines += [
            "| concurrency | output tok/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms"
            " | ITL p50 / p99 ms |",
            "|---|---|---|---|---|",
        ]
        for level in scenario["levels"]:
            ttft, tpot, itl = level["ttft_ms"], level["tpot_ms"], level["itl_ms"]
            lines.append(
                f"| {level['concurrency']} | {level['output_tokens_per_s']:.1f}"
                f" | {_ms(ttft, 'p50')} / {_ms(ttft, 'p90')} / {_ms(ttft, 'p99')}"
                f" | {_ms(tpot, 'p50')} / {_ms(tpot, 'p90')} / {_ms(tpot, 'p99')}"
                f" | {_ms(itl, 'p50')} / {_ms(itl, 'p99')} |"
            )
        lines.append("")
    if results.get("error"):
        lines += [f"**Stopped early:** {results['error']}", ""]
    return "\n".join(lines)


def ab_markdown(ab: dict[str, Any], plots: list[Path]) -> str:
    """Side by side: accuracy of each arm against the first, then speed per scenario."""
    arms = [arm["name"] for arm in ab["arms"]]
    reference = arms[0]
    lines = [f"# A/B: {' vs '.join(f'`{name}`' for name in arms)}", ""]
    lines += [f"Model `{ab['model']}`, serve config `{ab['config']}`.", ""]
    lines += ["| arm | server arguments | start-up s |", "|---|---|---|"]
    for arm in ab["arms"]:
        startup = arm.get("startup_seconds")
        lines.append(f"| `{arm['name']}` | `{arm['server_args']}` | {_number(startup, 0)} |")
    lines.append("")
    if ab.get("accuracy_comparisons"):
        lines += [f"## Accuracy (each arm against `{reference}`)", ""]
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
    throughput = {arm["name"]: arm.get("throughput") for arm in ab["arms"]}
    first = throughput.get(reference)
    if first:
        lines += ["## Throughput", ""]
        for index, scenario in enumerate(first["scenarios"]):
            lines += [f"### {scenario['name']}", ""]
            header = "| concurrency |"
            rule = "|---|"
            for name in arms:
                header += f" {name} tok/s | {name} TTFT p50 ms | {name} TPOT p50 ms |"
                rule += "---|---|---|"
            for name in arms[1:]:
                header += f" {name} / {reference} tok/s |"
                rule += "---|"
            lines += [header, rule]
            for level_index, level in enumerate(scenario["levels"]):
                row = f"| {level['concurrency']} |"
                speeds = {}
                for name in arms:
                    other = _level(throughput.get(name), index, level_index)
                    if other is None:
                        row += " - | - | - |"
                        continue
                    speeds[name] = other["output_tokens_per_s"]
                    row += (
                        f" {other['output_tokens_per_s']:.1f} | {_ms(other['ttft_ms'], 'p50')}"
                        f" | {_ms(other['tpot_ms'], 'p50')} |"
                    )
                for name in arms[1:]:
                    both = name in speeds and speeds.get(reference)
                    ratio = speeds[name] / speeds[reference] if both else None
                    row += f" {_number(ratio, 2)}x |" if ratio is not None else " - |"
                lines.append(row)
            lines.append("")
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{plot.stem}]({plot.name})" for plot in plots]
        lines.append("")
    for arm in ab["arms"]:
        if arm.get("error"):
            lines += [f"**Arm `{arm['name']}` stopped early:** {arm['error']}", ""]
    return "\n".join(lines)


def _level(results: dict | None, scenario: int, level: int) -> dict | None:
    try:
        return results["scenarios"][scenario]["levels"][level] if results else None
    except (IndexError, KeyError):
        return None


def _levels(arm: dict[str, Any], scenario: int) -> list[dict[str, Any]]:
    scenarios = arm["throughput"]["scenarios"]
    return scenarios[scenario]["levels"] if scenario < len(scenarios) else []


def ab_plots(ab: dict[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per throughput scenario (tok/s, TTFT, TPOT against concurrency), one for accuracy."""
    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    arms = [arm for arm in ab["arms"] if arm.get("throughput")]
    if arms:
        for index, scenario in enumerate(arms[0]["throughput"]["scenarios"]):
            figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
            panels = (
                ("output tokens/s", lambda level: level["output_tokens_per_s"]),
                ("TTFT p50 (ms)", lambda level: level["ttft_ms"].get("p50")),
                ("TPOT p50 (ms)", lambda level: level["tpot_ms"].get("p50")),
            )
            for axis, (label, pick) in zip(axes, panels, strict=True):
                for arm in arms:
                    levels = _levels(arm, index)
                    axis.plot(
                        [level["concurrency"] for level in levels],
                        [pick(level) for level in levels],
                        marker="o",
                        label=arm["name"],
                    )
                concurrencies = sorted(
                    {level["concurrency"] for arm in arms for level in _levels(arm, index)}
                )
                axis.set_xscale("log", base=2)
                axis.set_xticks(concurrencies, [str(c) for c in concurrencies])
                axis.minorticks_off()
                axis.set_xlabel("concurrency")
                axis.set_title(label)
                axis.grid(alpha=0.3)
            axes[0].legend()
            figure.suptitle(f"{scenario['name']}")
            figure.tight_layout()
            path = out_dir / f"throughput-{scenario['name']}.png"
            figure.savefig(path, dpi=110)
            plt.close(figure)
            written.append(path)
    scored = [arm for arm in ab["arms"] if arm.get("accuracy", {}).get("scores")]
    if scored:
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
        axis.set_ylabel("score (error bar: 1.96 x stderr)")
        axis.legend()
        figure.tight_layout()
        path = out_dir / "accuracy.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written
