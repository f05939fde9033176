"""Issue 67's served A/B against stock vLLM 0.34.0 in one GPU sitting: summary, report, starts
and the time plan (docs/served-ab.md).

    python -m benchmarks.served_ab summarise AB_DIR --gpu h200 --slice mxfp8-ep \\
        --commit SHA --device-minutes M --out OUT [--started-before FILE]
    python -m benchmarks.served_ab plan --gpu h200 --slice mxfp8-ep --arms 3 [--budget-s S]
    python -m benchmarks.served_ab fourth-arm FILE --base NAME=JSON [--name w8a8|humming-a8]

``summarise`` reads ``AB_DIR/ab.json`` (``vllm-minimax eval ab --server-rounds 3``: one server
per arm, three rounds of every point on it) and each arm's ``server.log``, and writes to OUT:

- ``repeats.json``: every arm's value at every point in every round (the point's metric:
  TTFT p50 at the prefill points, ITL p50 at ``decode-32k-c8``, output tok/s at ``mixed-c16``
  and ``decode-32k-c64``), with how many requests ran at once and each server's KV cache;
- ``summary.json``: per arm against ``stock``, ``ttft_128k_ratio``, ``ttft_32k_ratio``,
  ``itl_decode_ratio``, ``mixed_tok_s_ratio`` (and ``capacity_tok_s_ratio`` where the H100's
  capacity point ran): each the median of the arm's rounds over the median of stock's, with
  the ratio paired round by round (min, max) as its spread; ``rounds``, ``gpu``, ``commit``,
  ``device_minutes``, the targets met or missed;
- ``starts.json``: each arm's server start (``ready_s``, whether it was the arm's first start
  on the machine, and the phases vLLM logs: model loading, profiling, torch.compile, the JIT
  warm-up, graph capture, the engine's init), for issue 64;
- ``report.md``: the target table first, then each arm's figures, the starts, and what the
  design leaves unmeasured.

It exits 0 when every arm has every round of every point, 1 when some are missing (the files
are written either way, saying which), 2 for bad input.

``fourth-arm`` prints an extra arm (``--name``, default ``w8a8``) as eval ab's ``--arm`` and
``--arm-env`` values: FILE's serve arguments over the base arm's, and its ``server-env``.

``plan`` adds up the device seconds of a sitting from per-slice estimates (starts, each point's
warm-up and rounds) and says whether it fits ``--budget-s``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.cold_start import parse_log

STOCK = "stock"
ROUNDS = 3
GPUS = ("h100", "h200")
SLICES = ("mxfp8-ep", "fp8-online")
AT_MOST, AT_LEAST = "at most", "at least"


@dataclass(frozen=True)
class Goal:
    """``key``: an arm's ``metric`` at ``point`` over stock's, against ``bound``."""

    key: str
    point: str
    metric: str
    bound: float
    direction: str
    gpus: tuple[str, ...] = GPUS

    def met(self, ratio: float) -> bool:
        return ratio <= self.bound if self.direction == AT_MOST else ratio >= self.bound


TTFT, ITL, TOK_S = "TTFT p50 ms", "ITL p50 ms", "output tok/s"
GOALS = (
    Goal("ttft_128k_ratio", "prefill-128k-c1", TTFT, 0.5, AT_MOST),
    Goal("ttft_32k_ratio", "prefill-32k-c4", TTFT, 0.6, AT_MOST),
    Goal("itl_decode_ratio", "decode-32k-c8", ITL, 0.97, AT_MOST),
    Goal("mixed_tok_s_ratio", "mixed-c16", TOK_S, 1.5, AT_LEAST),
    Goal("capacity_tok_s_ratio", "decode-32k-c64", TOK_S, 1.4, AT_LEAST, ("h100",)),
)
POINTS = {gpu: tuple(goal.point for goal in GOALS if gpu in goal.gpus) for gpu in GPUS}
# benchmarks.step_profile's point nearest each served point.
PROFILE_POINT = {
    "prefill-128k-c1": "prefill",
    "prefill-32k-c4": "prefill",
    "decode-32k-c8": "decode",
    "mixed-c16": "mixed",
    "decode-32k-c64": "decode",
}
ARM_LETTERS = {STOCK: "e", "bf16": "a", "fp8-flashinfer": "c", "w8a8": "w", "humming-a8": "h"}


def metric_of(level: Mapping[str, Any], metric: str) -> float | None:
    if metric == TOK_S:
        value = level.get("output_tokens_per_s")
    else:
        value = (level.get("ttft_ms" if metric == TTFT else "itl_ms") or {}).get("p50")
    return float(value) if isinstance(value, int | float) else None


def goal_of(point: str) -> Goal:
    return next(goal for goal in GOALS if goal.point == point)


def rotation(arms: Sequence[str], rep: int) -> list[str]:
    """The arms' order in sitting REP (1, 2, ...): rotated by REP - 1 places, so that over as
    many sittings as arms each arm runs once in each place."""
    if rep < 1:
        raise ValueError(f"REP must be 1 or more, got {rep}")
    shift = (rep - 1) % len(arms)
    return [*arms[shift:], *arms[:shift]]


# --- repeats and summary ---------------------------------------------------------------------


def collect(ab: Mapping[str, Any], gpu: str) -> dict[str, Any]:
    """Every arm's value at every point of ``gpu`` in every round, from eval ab's record."""
    arms: dict[str, Any] = {}
    for record in ab.get("arms", []):
        points: dict[str, list[dict[str, Any]]] = {}
        scenarios = (record.get("throughput") or {}).get("scenarios", [])
        for scenario in scenarios:
            if scenario.get("name") not in POINTS[gpu]:
                continue
            metric = goal_of(scenario["name"]).metric
            rounds = []
            for level in scenario.get("levels", []):
                running = level.get("running_requests") or {}
                rounds.append(
                    {
                        "round": int(level.get("round", 0)),
                        "value": metric_of(level, metric),
                        "completed": level.get("completed"),
                        "duration_s": level.get("duration_s"),
                        "ttft_p50_ms": metric_of(level, TTFT),
                        "running_max": running.get("max"),
                        "waiting_max": running.get("waiting_max"),
                    }
                )
            points[scenario["name"]] = sorted(rounds, key=lambda entry: entry["round"])
        kv = [
            r.get("kv_cache_tokens") for r in record.get("rounds", []) if r.get("kv_cache_tokens")
        ]
        arms[record["name"]] = {
            "server_args": record.get("server_args"),
            "kv_cache_tokens": kv,
            "error": record.get("error"),
            "points": points,
        }
    return {
        "metrics": {point: goal_of(point).metric for point in POINTS[gpu]},
        "round_order": ab.get("round_order"),
        "arms": arms,
    }


def round_values(repeats: Mapping[str, Any], arm: str, point: str) -> dict[int, float]:
    """The arm's value at the point, by round (rounds that measured nothing left out)."""
    entries = repeats["arms"].get(arm, {}).get("points", {}).get(point, [])
    return {entry["round"]: entry["value"] for entry in entries if entry["value"] is not None}


def values(repeats: Mapping[str, Any], arm: str, point: str) -> list[float]:
    return list(round_values(repeats, arm, point).values())


def ratio_entry(
    arm_rounds: Mapping[int, float], stock_rounds: Mapping[int, float]
) -> dict[str, Any]:
    """The arm's median over stock's, and the ratio paired round by round (min, max): each
    arm's round with stock's round of the same number."""
    if not arm_rounds or not stock_rounds or not statistics.median(stock_rounds.values()):
        return {"ratio": None, "paired": [], "spread": None}
    paired = [arm_rounds[r] / stock_rounds[r] for r in sorted(arm_rounds) if stock_rounds.get(r)]
    return {
        "ratio": statistics.median(arm_rounds.values()) / statistics.median(stock_rounds.values()),
        "paired": paired,
        "spread": [min(paired), max(paired)] if paired else None,
    }


def summarise(
    repeats: Mapping[str, Any],
    gpu: str,
    slice_name: str,
    commit: str,
    device_minutes: float | None,
    rounds: int = ROUNDS,
) -> dict[str, Any]:
    missing = [
        f"{arm} {point}: {len(values(repeats, arm, point))} of {rounds} rounds"
        for arm in repeats["arms"]
        for point in POINTS[gpu]
        if len(values(repeats, arm, point)) != rounds
    ]
    if STOCK not in repeats["arms"]:
        missing.insert(0, "no stock arm: no ratio")
    arms: dict[str, Any] = {}
    targets: list[dict[str, Any]] = []
    for arm in repeats["arms"]:
        if arm == STOCK:
            continue
        figures: dict[str, Any] = {}
        spread: dict[str, Any] = {}
        for point in POINTS[gpu]:
            goal = goal_of(point)
            entry = ratio_entry(
                round_values(repeats, arm, point), round_values(repeats, STOCK, point)
            )
            figures[goal.key] = entry["ratio"]
            spread[goal.key] = entry["spread"]
            targets.append(
                {
                    "arm": arm,
                    "key": goal.key,
                    "point": point,
                    "metric": goal.metric,
                    "goal": f"{goal.direction} {goal.bound}",
                    "ratio": entry["ratio"],
                    "paired": entry["paired"],
                    "spread": entry["spread"],
                    "status": "not measured"
                    if entry["ratio"] is None
                    else ("met" if goal.met(entry["ratio"]) else "missed"),
                }
            )
        arms[arm] = {**figures, "spread": spread}
    medians = {
        arm: {
            point: statistics.median(values(repeats, arm, point))
            if values(repeats, arm, point)
            else None
            for point in POINTS[gpu]
        }
        for arm in repeats["arms"]
    }
    return {
        "gpu": gpu,
        "slice": slice_name,
        "commit": commit,
        "device_minutes": device_minutes,
        "rounds": rounds,
        "reference": STOCK,
        "complete": not missing,
        "missing": missing,
        "arms": arms,
        "medians": medians,
        "targets": targets,
    }


# --- starts ----------------------------------------------------------------------------------

EXTRA_PHASES = (
    ("profile_run_s", r"Initial profiling/warmup run took ([\d.]+) s"),
    ("torch_compile_s", r"torch\.compile took ([\d.]+) s in total"),
    ("dynamo_transform_s", r"Dynamo bytecode transform time: ([\d.]+) s"),
    ("kv_cache_gib", r"Available KV cache memory: ([\d.]+) GiB"),
    ("weights_gib", r"Model loading took ([\d.]+) GiB"),
)
PHASE_KEYS = (
    "model_loading_s", "weights_s", "memory_profiling_s", "profile_run_s", "torch_compile_s",
    "dynamo_transform_s", "jit_warmup_s", "indexer_warmup_s", "sparse_attention_warmup_s",
    "sparse_decode_warmup_s", "moe_warmup_s", "graph_capture_s", "init_engine_s",
    "kv_cache_gib", "weights_gib",
)  # fmt: skip


def start_phases(log_text: str) -> dict[str, float]:
    """The start's phases as vLLM logs them (seconds; the last of each), and its memory."""
    found = {k: v for k, v in parse_log(log_text).items() if isinstance(v, float)}
    for key, pattern in EXTRA_PHASES:
        matches = re.findall(pattern, log_text)
        if matches:
            found[key] = float(matches[-1])
    return {key: found[key] for key in PHASE_KEYS if key in found}


def starts(
    ab: Mapping[str, Any], ab_dir: Path, started_before: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Each server start of the run in the order they ran: ``ready_s`` (eval ab's seconds to
    /health), whether it was the arm's first start on the machine (``started_before``: the
    arms that started there in earlier runs), its place among the machine's starts and its
    phases."""
    by_name = {record["name"]: record for record in ab.get("arms", [])}
    seen = list(started_before)
    out: list[dict[str, Any]] = []
    for round_index, order in enumerate(ab.get("round_order") or []):
        for name in order:
            record = by_name.get(name, {})
            entries = [r for r in record.get("rounds", []) if r.get("round") == round_index]
            if not entries:
                continue
            log = ab_dir / name / f"round-{round_index + 1}" / "server.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            out.append(
                {
                    "arm": name,
                    "start": "later" if name in seen else "first",
                    "machine_start": len(seen) + 1,
                    "ready_s": entries[0].get("startup_seconds"),
                    "phases": start_phases(text),
                }
            )
            seen.append(name)
    return out


# --- report ----------------------------------------------------------------------------------


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _spread(spread: Sequence[float] | None) -> str:
    return "-" if not spread else f"{spread[0]:.3f}-{spread[1]:.3f}"


def _value(value: float | None, metric: str) -> str:
    if value is None:
        return "-"
    digits = {TOK_S: 1, ITL: 2}.get(metric, 0)
    return f"{value:.{digits}f}"


def markdown(
    summary: Mapping[str, Any], repeats: Mapping[str, Any], start_list: Sequence[Mapping[str, Any]]
) -> str:
    gpu, rounds = summary["gpu"], summary["rounds"]
    lines = [
        f"# Served A/B against stock vLLM 0.34.0: {summary['slice']} slice on one {gpu.upper()}",
        "",
        f"Commit {summary['commit']}; {rounds} rounds of every point on one server per arm"
        f" ({_minutes(summary['device_minutes'])} of device time for the whole A/B).",
        "Each ratio is the arm's median over stock's; beside it the ratio paired round by"
        " round (min-max of the rounds). Below 1 is faster for TTFT and ITL, above 1 more"
        " tok/s.",
        "",
        "| goal | arm | ratio | rounds (paired) | |",
        "|---|---|---|---|---|",
    ]
    for row in summary["targets"]:
        letter = ARM_LETTERS.get(row["arm"], "?")
        lines.append(
            f"| {row['metric']} at `{row['point']}` {row['goal']} of stock | ({letter})"
            f" {row['arm']} | {_ratio(row['ratio'])} | {_spread(row['spread'])} |"
            f" {row['status']} |"
        )
    if gpu != "h100":
        lines.append(
            "| output tok/s at `decode-32k-c64` at least 1.4 of stock | - | - | - |"
            " not a target here (the H100's capacity point) |"
        )
    missed = sorted(
        {PROFILE_POINT[row["point"]] for row in summary["targets"] if row["status"] == "missed"}
    )
    if missed:
        lines += [
            "",
            "For a missed goal, the kernel family that holds it comes from the step profile of"
            " the arms at that point: `scripts/gpu-rank-slice fp8kv-profile --points"
            f" {' '.join(missed)}` (docs/fp8-kv-ab.md).",
        ]
    if summary["missing"]:
        lines += ["", "**Incomplete:** " + "; ".join(summary["missing"]) + "."]
    lines += ["", "## Each arm, median [min-max] of the rounds", ""]
    points = list(repeats["metrics"])
    lines.append("| arm | " + " | ".join(f"`{p}` {repeats['metrics'][p]}" for p in points) + " |")
    lines.append("|---|" + "---|" * len(points))
    for arm in repeats["arms"]:
        cells = []
        for point in points:
            metric = repeats["metrics"][point]
            vals = values(repeats, arm, point)
            if not vals:
                cells.append("-")
                continue
            low, high = _value(min(vals), metric), _value(max(vals), metric)
            cells.append(f"{_value(statistics.median(vals), metric)} [{low}-{high}]")
        letter = ARM_LETTERS.get(arm, "?")
        lines.append(f"| ({letter}) {arm} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| arm | KV cache tokens | ran at once (max, per point) | `decode-32k-c8` TTFT p50 ms"
        " by round (prefix-cache hits are short) | error |",
        "|---|---|---|---|---|",
    ]
    for arm, record in repeats["arms"].items():
        kv = ", ".join(f"{t:,}" for t in record["kv_cache_tokens"]) or "-"
        running = "; ".join(
            f"{point} {max((e['running_max'] or 0) for e in entries):g}"
            for point, entries in record["points"].items()
            if entries
        )
        decode_ttft = ", ".join(
            _value(e["ttft_p50_ms"], TTFT) for e in record["points"].get("decode-32k-c8", [])
        )
        lines.append(
            f"| {arm} | {kv} | {running or '-'} | {decode_ttft or '-'} |"
            f" {record.get('error') or ''} |"
        )
    lines += ["", "## Server starts (not timed into the rounds)", ""]
    lines.append(
        "| arm | start on this machine | n-th server here | ready s | phases (s; `_gib`: GiB) |"
    )
    lines.append("|---|---|---|---|---|")
    for entry in start_list:
        phases = ", ".join(f"{k} {v:g}" for k, v in entry["phases"].items())
        ready = "-" if entry["ready_s"] is None else f"{entry['ready_s']:.0f}"
        lines.append(
            f"| {entry['arm']} | {entry['start']} | {entry['machine_start']} | {ready} |"
            f" {phases or '-'} |"
        )
    lines += [
        "",
        "The phases nest as vLLM logs them: the series' sparse-attention warm-up runs inside"
        " model loading, its indexer warm-up inside the JIT warm-up.",
        "",
        "## What this measures and what it does not",
        "",
        "- One server per arm, started once; its three rounds run back to back on it (no two"
        " servers fit the card: each holds the slice's weights). The spread is therefore"
        " round-to-round on one server, not start-to-start; the arms run one after another in"
        " the order of `round_order` (rotated between sittings by REP), not interleaved.",
        "- Each point is one wave at its concurrency (one request at c1); `decode-32k-c8`'s"
        " prompts are prefilled by its warm-up and found in the prefix cache in every round,"
        " so its ITL is of decode steps alone (a round whose TTFT p50 is not short missed"
        " the cache: see repeats.json's `ttft_p50_ms`).",
        "- KV-cache capacity is each server's logged `GPU KV cache size` (above), not a point"
        " of its own except the H100's `decode-32k-c64`. Where the arms ran different numbers"
        " of requests at once at a point (the column above), that point compares capacity,"
        " not kernels.",
    ]
    return "\n".join(lines) + "\n"


def _minutes(value: float | None) -> str:
    return "unknown minutes" if value is None else f"{value:.1f} minutes"


# --- the time plan ---------------------------------------------------------------------------

# Seconds (docs/served-ab.md, "How long"): per card, a start with the machine's compile caches
# empty (first server of the sitting) and a later arm's first start (the shared caches warm;
# the H100's is the series arm's after stock's, FlashInfer programs built), "h200" where the
# card has none measured; per point its warm-up and one round (the H200's 2026-12-06 probe).
PLAN: dict[str, dict[str, Any]] = {
    "mxfp8-ep": {
        # H200: 2026-12-06 (311 s, then 145 s); H100: the 2026-12-07 served A/B (315, 277 s).
        "starts_s": {"h200": (311, 150), "h100": (315, 277)},
        "stop_s": 10,
        "points": {
            "prefill-128k-c1": (6, 6),
            "prefill-32k-c4": (2, 5),
            "decode-32k-c8": (15, 6),
            "mixed-c16": (8, 30),
            "decode-32k-c64": (10, 80),
        },
    },
    "fp8-online": {
        "starts_s": {"h200": (300, 80)},
        "stop_s": 10,
        "points": {
            "prefill-128k-c1": (4, 4),
            "prefill-32k-c4": (1, 3),
            "decode-32k-c8": (9, 5),
            "mixed-c16": (5, 22),
            "decode-32k-c64": (10, 70),
        },
    },
}


def plan(
    gpu: str,
    slice_name: str,
    arms: int,
    rounds: int = ROUNDS,
    points: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The device seconds of one sitting: every arm's start, then each point's warm-up and
    ``rounds`` rounds, then its stop; at ``points`` only (default: every point of ``gpu``)."""
    if arms < 2:
        raise ValueError(f"an A/B needs at least two arms, got {arms}")
    table = PLAN[slice_name]
    chosen = POINTS[gpu] if points is None else tuple(points)
    unknown = [point for point in chosen if point not in POINTS[gpu]]
    if unknown:
        raise ValueError(f"no point {', '.join(unknown)} on {gpu} ({', '.join(POINTS[gpu])})")
    per_arm_points = sum(
        warmup + rounds * each
        for point, (warmup, each) in table["points"].items()
        if point in chosen
    )
    first_s, next_s = table["starts_s"].get(gpu, table["starts_s"]["h200"])
    starts_s = first_s + (arms - 1) * next_s
    total = starts_s + arms * (per_arm_points + table["stop_s"])
    return {
        "gpu": gpu,
        "slice": slice_name,
        "arms": arms,
        "rounds": rounds,
        "starts_s": starts_s,
        "starts_from": gpu if gpu in table["starts_s"] else "h200",
        "points_s_per_arm": per_arm_points,
        "total_s": total,
    }


# --- command line ----------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"served_ab: {path}: {error}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"served_ab: {path}: expected a JSON object")
    return data


def run_summarise(args: argparse.Namespace) -> int:
    ab = _read_json(args.ab_dir / "ab.json")
    started_before = []
    if args.started_before and args.started_before.exists():
        started_before = [ln for ln in args.started_before.read_text().split() if ln]
    repeats = {
        "gpu": args.gpu,
        "slice": args.slice,
        "commit": args.commit,
        "tag": args.tag,
        "rounds": args.rounds,
        **collect(ab, args.gpu),
    }
    summary = summarise(
        repeats, args.gpu, args.slice, args.commit, args.device_minutes, args.rounds
    )
    start_list = starts(ab, args.ab_dir, started_before)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "repeats.json").write_text(json.dumps(repeats, indent=1) + "\n")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "starts.json").write_text(json.dumps(start_list, indent=1) + "\n")
    report = markdown(summary, repeats, start_list)
    (args.out / "report.md").write_text(report)
    print(report)
    return 0 if summary["complete"] else 1


def run_plan(args: argparse.Namespace) -> int:
    estimate = plan(args.gpu, args.slice, args.arms, args.rounds, args.points)
    print(
        f"{args.slice} on {args.gpu}, {args.arms} arms x {args.rounds} rounds:"
        f" starts {estimate['starts_s']} s + {args.arms} x {estimate['points_s_per_arm']} s of"
        f" points (+ stops) = {estimate['total_s']} s ({estimate['total_s'] / 60:.1f} min)"
        + ("" if estimate["starts_from"] == args.gpu else "; starts as on the H200 (none measured)")
    )
    if args.budget_s is not None and estimate["total_s"] > args.budget_s:
        print(f"over the budget of {args.budget_s} s by {estimate['total_s'] - args.budget_s} s")
        return 1
    return 0


# --- the fourth arm --------------------------------------------------------------------------

# The extra arms' names (scripts/gpu-rank-slice: W8A8_ARGS, HUMMING_A8_ARGS); the first is
# fourth-arm's default.
EXTRA_ARMS = ("w8a8", "humming-a8")
FOURTH_ARM = EXTRA_ARMS[0]
ENV_KEY = "server-env"


def fourth_arm(
    base: Mapping[str, Any], extra: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The fourth arm's serve arguments (``extra``'s over ``base``'s, merged as eval ab merges an
    arm into its config) and its environment (``extra``'s ``server-env`` mapping)."""
    from vllm_minimax.evals.ab import merge_server_args

    env = extra.get(ENV_KEY, {})
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str | int | float) and not isinstance(v, bool)
        for k, v in env.items()
    ):
        raise ValueError(f"{ENV_KEY}: expected a mapping of names to strings, got {env!r}")
    args = {k: v for k, v in extra.items() if k != ENV_KEY}
    if not args and not env:
        raise ValueError("no serve arguments and no server-env: the arm would repeat its base")
    return merge_server_args(base, args), {k: str(v) for k, v in env.items()}


def run_fourth_arm(args: argparse.Namespace) -> int:
    import yaml

    try:
        extra = yaml.safe_load(args.file.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"{args.file}: {error}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"{args.file}: expected a mapping of serve arguments")
    _, separator, raw = args.base.partition("=")
    if not separator:
        raise ValueError(f"--base {args.base!r}: expected NAME=JSON")
    merged, env = fourth_arm(json.loads(raw), extra)
    print(f"{args.name}={json.dumps(merged)}")
    for key, value in env.items():
        print(f"{args.name}:{key}={value}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    both = argparse.ArgumentParser(add_help=False)
    both.add_argument("--gpu", choices=GPUS, required=True)
    both.add_argument("--slice", choices=SLICES, required=True)
    both.add_argument("--rounds", type=int, default=ROUNDS)
    summary = commands.add_parser("summarise", parents=[both])
    summary.add_argument("ab_dir", type=Path)
    summary.add_argument("--commit", required=True)
    summary.add_argument("--device-minutes", type=float)
    summary.add_argument("--started-before", type=Path)
    summary.add_argument("--tag", default="")
    summary.add_argument("--out", type=Path, required=True)
    summary.set_defaults(handler=run_summarise)
    planner = commands.add_parser("plan", parents=[both])
    planner.add_argument("--arms", type=int, default=3)
    planner.add_argument("--budget-s", type=int)
    planner.add_argument("--points", nargs="+", help="only these points (default: the card's)")
    planner.set_defaults(handler=run_plan)
    extra = commands.add_parser("fourth-arm")
    extra.add_argument("file", type=Path)
    extra.add_argument("--base", required=True)
    extra.add_argument("--name", choices=EXTRA_ARMS, default=FOURTH_ARM)
    extra.set_defaults(handler=run_fourth_arm, rounds=ROUNDS)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be 1 or more, got {args.rounds}")
    try:
        return int(args.handler(args))
    except ValueError as error:
        print(f"served_ab: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
