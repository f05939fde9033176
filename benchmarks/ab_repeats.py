"""Repeated ``vllm-minimax eval ab`` runs of the same arms, summarised with their spread.

    python -m benchmarks.ab_repeats DIR [DIR ...] --out OUT [--tensor-parallel-size 8]

Each DIR holds one ``ab.json`` (``scripts/gpu-rank-slice ab REP ...`` writes one per call);
a DIR with sub-directories holding ``ab.json`` stands for all of them. A run may hold several
rounds (``eval ab --repeat``); every measured level counts once. For every scenario and
concurrency the table gives, per arm, the median over the measurements of output tok/s, of
TTFT and TPOT p50 / p99 and of ITL p50 (the median gap between two tokens of a request,
i.e. the decode step as a client sees it, where TPOT also carries the prefill chunks
scheduled beside the decodes), each with its range (min to max). The ratios of the arms'
tok/s, TTFT p50, TPOT p50 and ITL p50 are taken within each round of a run (same machine,
back to back) and summarised the same way. The arms are matched by name, whatever their
order in a run. A level that re-sent an earlier level's prompts (``named_levels``) is pooled
apart from its scenario.

A TP-N rank's slice produces every output token the whole deployment produces: its tok/s
is an upper bound on the deployment's (the collectives are left out) and tok/s per GPU is
that divided by N (``--tensor-parallel-size``). Writes OUT/repeats.json and OUT/repeats.md,
and with two arms OUT/repeats.png: the paired ratios of every point with their range.
Each arm's KV cache size per server and, per level, the most requests its server ran at
once are given beside them. ``--targets fp8kv --gpu h100|h200`` adds issue 53's lean table
of targets (:mod:`benchmarks.fp8kv_targets`: (c)/(d) direct, (c) never below (a) or (b)) to
both files.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

METRICS = (
    ("tok/s", lambda level: level["output_tokens_per_s"]),
    ("TTFT p50 ms", lambda level: level["ttft_ms"]["p50"]),
    ("TTFT p99 ms", lambda level: level["ttft_ms"]["p99"]),
    ("TPOT p50 ms", lambda level: level.get("tpot_ms", {}).get("p50")),
    ("TPOT p99 ms", lambda level: level.get("tpot_ms", {}).get("p99")),
    ("ITL p50 ms", lambda level: level.get("itl_ms", {}).get("p50")),
    # How many requests the server ran at once during the level (its /metrics, sampled).
    ("ran at once max", lambda level: (level.get("running_requests") or {}).get("max")),
)


def find_runs(paths: Sequence[Path]) -> list[Path]:
    runs: list[Path] = []
    for path in paths:
        if (path / "ab.json").is_file():
            runs.append(path / "ab.json")
        else:
            runs += sorted(path.glob("*/ab.json"))
    return runs


RESENT = " (re-sent prompts)"


def named_levels(
    throughput: dict[str, Any], merge_resent: bool = False
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each level of one arm's throughput record, with the point it is pooled under: its
    scenario's name, plus RESENT for a level that re-sent an earlier level's prompts to the
    same server. That happened before each level had its own seed (levels without
    ``prompt_seed``): vllm bench drew every level's prompts from the preset's one seed, and
    the same seed gives the same first prompts, so each bench level after the first of a
    round re-sent those (prefix caching served them); this project's client re-sent its
    scenario's prompts at each level. Such levels measured another workload, so they are
    kept apart from levels with prompts of their own, unless ``merge_resent`` (for the
    decode step, which the prompts a level sent do not change)."""
    # Per round: None stands for all of vllm bench's levels, a name for one scenario's own.
    seen: set[tuple[str | None, int]] = set()
    for scenario in throughput.get("scenarios", []):
        for level in scenario["levels"]:
            name = scenario["name"]
            if "prompt_seed" not in level:
                pool = None if scenario.get("client") == "vllm-bench" else name
                key = (pool, level.get("round", 0))
                if key in seen and not merge_resent:
                    name += RESENT
                seen.add(key)
            yield name, level


def collect(
    runs: Sequence[dict[str, Any]], merge_resent: bool = False
) -> dict[tuple[str, int], dict[str, list]]:
    """(point, concurrency) -> arm -> one level per run that measured it."""
    table: dict[tuple[str, int], dict[str, list]] = {}
    for run in runs:
        for arm in run["arms"]:
            for name, level in named_levels(arm.get("throughput") or {}, merge_resent):
                key = (name, level["concurrency"])
                table.setdefault(key, {}).setdefault(arm["name"], []).append(level)
    return table


# The metrics whose arm-to-arm ratio is taken within each round.
PAIRED = ("tok/s", "TTFT p50 ms", "TPOT p50 ms", "ITL p50 ms")


def ratios(
    runs: Sequence[dict[str, Any]],
    numerator: str,
    denominator: str,
    metric: str = "tok/s",
    merge_resent: bool = False,
) -> dict:
    """(scenario, concurrency) -> numerator / denominator of `metric` (a METRICS label), one
    per round of a run that measured both arms (a run's rounds are its `--repeat` rounds,
    each level tagged with it)."""
    read = dict(METRICS)[metric]
    out: dict[tuple[str, int], list[float]] = {}
    for run in runs:
        by_arm = {arm["name"]: arm.get("throughput") or {} for arm in run["arms"]}
        if numerator not in by_arm or denominator not in by_arm:
            continue
        levels = {
            arm: {
                (point, level["concurrency"], level.get("round", 0)): read(level)
                for point, level in named_levels(by_arm[arm], merge_resent)
            }
            for arm in (numerator, denominator)
        }
        for (scenario, concurrency, round_), value in sorted(levels[numerator].items()):
            other = levels[denominator].get((scenario, concurrency, round_))
            if value is not None and other:
                out.setdefault((scenario, concurrency), []).append(value / other)
    return out


def spread(values: Sequence[float | None]) -> dict[str, float] | None:
    present = [value for value in values if value is not None]
    if not present:
        return None
    return {
        "median": statistics.median(present),
        "min": min(present),
        "max": max(present),
        "n": len(present),
    }


def cell(summary: dict[str, float] | None, digits: int) -> str:
    if summary is None:
        return "-"
    if summary["n"] == 1:
        return f"{summary['median']:.{digits}f} (n=1)"
    return (
        f"{summary['median']:.{digits}f} [{summary['min']:.{digits}f}-"
        f"{summary['max']:.{digits}f}] (n={summary['n']})"
    )


def points(
    runs: Sequence[dict[str, Any]], arms: Sequence[str], tp: int, merge_resent: bool = False
) -> list[dict[str, Any]]:
    """Per (point, concurrency): each arm's spread of every METRICS label and of tok/s per
    GPU, and the spread of the per-round ratios of the PAIRED metrics."""
    table = collect(runs, merge_resent)
    paired = (
        {m: ratios(runs, arms[1], arms[0], m, merge_resent) for m in PAIRED}
        if len(arms) > 1
        else {}
    )
    out = []
    for (scenario, concurrency), by_arm in table.items():
        entry: dict[str, Any] = {"scenario": scenario, "concurrency": concurrency, "arms": {}}
        for arm in arms:
            levels = by_arm.get(arm, [])
            entry["arms"][arm] = {
                label: spread([read(level) for level in levels]) for label, read in METRICS
            }
            tok = entry["arms"][arm]["tok/s"]
            per_gpu = None
            if tok is not None:
                per_gpu = {**tok, **{k: tok[k] / tp for k in ("median", "min", "max")}}
            entry["arms"][arm]["tok/s per GPU"] = per_gpu
        entry["ratios"] = {
            metric: spread(by_point.get((scenario, concurrency), []))
            for metric, by_point in paired.items()
        }
        entry["ratio"] = entry["ratios"].get("tok/s")
        out.append(entry)
    return out


def has_resent_levels(summary: dict[str, Any]) -> bool:
    return any(point["scenario"].endswith(RESENT) for point in summary["points"])


def kv_cache_tokens(runs: Sequence[dict[str, Any]], arms: Sequence[str]) -> dict[str, list[int]]:
    """Each arm's KV cache size in tokens, one per server (round) that logged it."""
    return {
        arm: [
            entry["kv_cache_tokens"]
            for run in runs
            for record in run["arms"]
            if record["name"] == arm
            for entry in record.get("rounds", [])
            if entry.get("kv_cache_tokens")
        ]
        for arm in arms
    }


def summarise(runs: Sequence[dict[str, Any]], arms: Sequence[str], tp: int) -> dict[str, Any]:
    summary = {
        "arms": list(arms),
        "tensor_parallel_size": tp,
        "runs": len(runs),
        "points": points(runs, arms, tp),
        "kv_cache_tokens": kv_cache_tokens(runs, arms),
    }
    if has_resent_levels(summary):
        # ITL p50 over every round, re-sent prompts or not: a level's decode steps do not
        # depend on which prompts it sent (prefix caching shortens only its prefill).
        summary["decode_steps"] = [
            {
                "scenario": point["scenario"],
                "concurrency": point["concurrency"],
                "arms": {arm: point["arms"][arm]["ITL p50 ms"] for arm in arms},
                "ratio": point["ratios"].get("ITL p50 ms"),
            }
            for point in points(runs, arms, tp, merge_resent=True)
        ]
    return summary


def markdown(summary: dict[str, Any]) -> str:
    arms = summary["arms"]
    lines = [
        f"# {' vs '.join(arms)}: {summary['runs']} runs, median [min-max] (n = measurements)",
        "",
        f"tok/s per GPU is the slice's tok/s / {summary['tensor_parallel_size']}.",
        "",
    ]
    if len(arms) > 1:
        lines += [
            f"The last column, {arms[1]} / {arms[0]} tok/s (paired), summarises one ratio per"
            " round that measured both arms, not the ratio of the arms' medians: an arm's"
            " columns can also hold rounds the other arm did not reach.",
            "",
        ]
    servers = summary.get("kv_cache_tokens") or {}
    if any(servers.values()):
        lines += [
            "KV cache per server (tokens, the server log's `KV cache size`): "
            + "; ".join(
                f"{arm} {', '.join(f'{tokens:,}' for tokens in sorted(set(servers[arm])))}"
                for arm in arms
                if servers.get(arm)
            )
            + ".",
            "",
        ]
    if has_resent_levels(summary):
        lines += [
            f"A point marked{RESENT} is a level that re-sent prompts an earlier level of its"
            " server had sent (runs from before each level had a seed of its own), so prefix"
            " caching served part of its prefill: it is kept apart from the same scenario"
            " measured with prompts of its own.",
            "",
        ]
    header = "| scenario | concurrency |"
    for arm in arms:
        header += f" {arm} tok/s per GPU |"
        header += "".join(f" {arm} {label} |" for label, _ in METRICS[1:])
    if len(arms) > 1:
        header += f" {arms[1]} / {arms[0]} tok/s (paired) |"
    lines += [header, "|---" * (header.count("|") - 1) + "|"]
    for point in summary["points"]:
        row = f"| {point['scenario']} | {point['concurrency']} |"
        for arm in arms:
            metrics = point["arms"][arm]
            row += f" {cell(metrics['tok/s per GPU'], 1)} |"
            row += "".join(f" {cell(metrics[label], 1)} |" for label, _ in METRICS[1:])
        if len(arms) > 1:
            row += f" {cell(point['ratio'], 3)} |"
        lines.append(row)
    if len(arms) > 1:
        lines += [
            "",
            f"## {arms[1]} / {arms[0]}, paired within each round",
            "",
            "One ratio per round that measured both arms (same machine, back to back);"
            " below 1 is lower for "
            f"{arms[1]}: faster for the latencies, slower for tok/s.",
            "",
            "| scenario | concurrency |" + "".join(f" {metric} |" for metric in PAIRED),
            "|---|---|" + "---|" * len(PAIRED),
        ]
        for point in summary["points"]:
            cells = "".join(f" {cell(point['ratios'][m], 3)} |" for m in PAIRED)
            lines.append(f"| {point['scenario']} | {point['concurrency']} |{cells}")
    if "decode_steps" in summary:
        header = "| scenario | concurrency |" + "".join(f" {arm} ITL p50 ms |" for arm in arms)
        if len(arms) > 1:
            header += f" {arms[1]} / {arms[0]}, paired |"
        lines += [
            "",
            "## The decode step over every round",
            "",
            f"ITL p50 with the{RESENT} levels pooled in: which prompts a level sent changes"
            " its prefill, not its decode steps.",
            "",
            header,
            "|---" * (header.count("|") - 1) + "|",
        ]
        for point in summary["decode_steps"]:
            row = f"| {point['scenario']} | {point['concurrency']} |"
            row += "".join(f" {cell(point['arms'][arm], 2)} |" for arm in arms)
            if len(arms) > 1:
                row += f" {cell(point['ratio'], 3)} |"
            lines.append(row)
    return "\n".join(lines) + "\n"


def point_label(scenario: str, concurrency: int) -> str:
    """The scenario's name, with the concurrency unless the name already says it (c8)."""
    if re.search(rf"\bc{concurrency}\b", scenario):
        return scenario
    return f"{scenario}, c={concurrency}"


def ratio_series(summary: dict[str, Any], metric: str) -> list[tuple[str, dict[str, float]]]:
    """(point label, spread) of the paired ratio of `metric` (a PAIRED label) at every point
    that has one, in the tables' order. ITL p50 comes from the decode-step table when there
    is one, as there every round is pooled."""
    if metric == "ITL p50 ms" and "decode_steps" in summary:
        rows = [(p["scenario"], p["concurrency"], p["ratio"]) for p in summary["decode_steps"]]
    else:
        rows = [
            (p["scenario"], p["concurrency"], p["ratios"].get(metric)) for p in summary["points"]
        ]
    return [(point_label(scenario, c), ratio) for scenario, c, ratio in rows if ratio]


def plot_ratios(summary: dict[str, Any], path: Path) -> bool:
    """One panel per PAIRED metric: each point's median ratio, bars from min to max, n beside
    it, and a line at 1. Returns whether there was anything to draw."""
    arms = summary["arms"]
    series = {metric: ratio_series(summary, metric) for metric in PAIRED}
    if len(arms) < 2 or not any(series.values()):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(label for rows in series.values() for label, _ in rows))
    figure, axes = plt.subplots(
        1, len(PAIRED), figsize=(3.6 * len(PAIRED) + 2.5, 0.32 * len(labels) + 1.6), sharey=True
    )
    for axis, metric in zip(axes, PAIRED, strict=True):
        rows = series[metric]
        if rows:
            ys = [labels.index(label) for label, _ in rows]
            medians = [ratio["median"] for _, ratio in rows]
            axis.errorbar(
                medians,
                ys,
                xerr=[
                    [ratio["median"] - ratio["min"] for _, ratio in rows],
                    [ratio["max"] - ratio["median"] for _, ratio in rows],
                ],
                fmt="o",
                capsize=3,
            )
            for y, (_, ratio) in zip(ys, rows, strict=True):
                axis.annotate(
                    f"n={ratio['n']}",
                    (ratio["max"], y),
                    xytext=(4, -3),
                    textcoords="offset points",
                    fontsize=7,
                )
        axis.axvline(1.0, color="grey", linestyle="--", linewidth=1)
        axis.set_title(metric.removesuffix(" ms"))
        axis.grid(alpha=0.3)
    axes[0].set_yticks(range(len(labels)), labels)
    axes[0].set_ylim(len(labels) - 0.5, -0.5)
    figure.suptitle(
        f"{arms[1]} / {arms[0]}, paired within each round: median, bars min..max"
        f" (below 1 is lower for {arms[1]})",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ab_repeats", description=__doc__.splitlines()[0]
    )
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arms", nargs="+", default=["triton", "flashinfer"])
    parser.add_argument("--tensor-parallel-size", type=int, default=8)
    parser.add_argument(
        "--targets",
        choices=["fp8kv"],
        help="add a table of targets: fp8kv, issue 53's lean A/B (benchmarks/fp8kv_targets.py)",
    )
    parser.add_argument("--gpu", choices=["h100", "h200"], help="the GPU the runs ran on")
    args = parser.parse_args(argv)
    if args.targets and not args.gpu:
        print("ab_repeats: --targets needs --gpu (h100 or h200)", file=sys.stderr)
        return 2
    if args.tensor_parallel_size <= 0:
        print("ab_repeats: --tensor-parallel-size must be positive", file=sys.stderr)
        return 2
    paths = find_runs(args.dirs)
    if not paths:
        print(f"ab_repeats: no ab.json in {', '.join(map(str, args.dirs))}", file=sys.stderr)
        return 2
    runs = [json.loads(path.read_text()) for path in paths]
    summary = summarise(runs, args.arms, args.tensor_parallel_size)
    if args.targets == "fp8kv":
        from benchmarks import fp8kv_targets

        summary["targets"] = fp8kv_targets.summarise(runs, args.gpu)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "repeats.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(summary)
    if "targets" in summary:
        text += "\n" + fp8kv_targets.markdown(summary["targets"])
    if plot_ratios(summary, args.out / "repeats.png"):
        text += "\n![The paired ratios of every point](repeats.png)\n"
    (args.out / "repeats.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
