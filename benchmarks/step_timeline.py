"""The engine's step timeline as ``vllm bench serve``'s client saw it, per arm and scenario.

    python -m benchmarks.step_timeline ROUNDS [ROUNDS ...] [--out FILE.md]

ROUNDS is one ``eval ab`` output directory, or the ``rounds.tar.gz`` that
``scripts/m3-rank-h200`` collects from one: it holds ``<arm>/round-<N>/bench/
<scenario>-c<concurrency>-round<N>.json``, the client's per-request results (start time,
TTFT and every inter-token gap).

Every streamed token of a request is emitted at the end of an engine step, and all requests
running in a step get their token together. So the union of the requests' token times,
grouped where consecutive times lie closer than a quarter of the median inter-token gap,
gives one group per step; the gaps between groups are the step durations. A step more than
twice the median is a *long step*: it held prefill tokens (or stalled, e.g. on a kernel
compiled during inference). The table gives per arm the median step (the decode step), and
the long steps' count, median, maximum and summed time, so that a TTFT or tok/s difference
can be told apart as decode, prefill-step or stall time. Steps before the first token of the
scenario are not seen (the first requests' TTFT holds them).
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import re
import statistics
import sys
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_NAME = re.compile(
    r"^(?P<arm>[^/]+)/round-(?P<round>\d+)/bench/"
    r"(?P<scenario>.+)-c(?P<concurrency>\d+)-round\d+\.json$"
)
LONG_STEP_FACTOR = 2.0
GROUPING_FRACTION = 0.25


@dataclass(frozen=True)
class StepSummary:
    """One scenario's steps on one arm in one round (durations in ms)."""

    arm: str
    round: int
    scenario: str
    concurrency: int
    steps: int
    step_p50_ms: float
    long_steps: int
    long_step_p50_ms: float | None
    long_step_max_ms: float | None
    long_step_total_s: float


def token_times(bench: dict[str, Any]) -> list[float]:
    """Every streamed token's arrival time (s), over all requests, sorted."""
    times: list[float] = []
    for start, ttft, gaps in zip(bench["start_times"], bench["ttfts"], bench["itls"], strict=True):
        if ttft is None:
            continue
        moment = start + ttft
        times.append(moment)
        for gap in gaps:
            moment += gap
            times.append(moment)
    return sorted(times)


def step_starts(times: Sequence[float], tolerance: float) -> list[float]:
    """The first time of each group of times no further than ``tolerance`` apart."""
    starts: list[float] = []
    previous: float | None = None
    for moment in times:
        if previous is None or moment - previous > tolerance:
            starts.append(moment)
        previous = moment
    return starts


def summarise(
    bench: dict[str, Any], arm: str, round_number: int, scenario: str, concurrency: int
) -> StepSummary | None:
    """The step summary of one client result; None when it streamed fewer than two steps."""
    itls = [gap for gaps in bench["itls"] for gap in gaps]
    times = token_times(bench)
    if not itls or len(times) < 2:
        return None
    tolerance = GROUPING_FRACTION * statistics.median(itls)
    starts = step_starts(times, tolerance)
    durations = [later - earlier for earlier, later in itertools.pairwise(starts)]
    if not durations:
        return None
    median = statistics.median(durations)
    long = [duration for duration in durations if duration > LONG_STEP_FACTOR * median]
    return StepSummary(
        arm=arm,
        round=round_number,
        scenario=scenario,
        concurrency=concurrency,
        steps=len(durations),
        step_p50_ms=median * 1e3,
        long_steps=len(long),
        long_step_p50_ms=statistics.median(long) * 1e3 if long else None,
        long_step_max_ms=max(long) * 1e3 if long else None,
        long_step_total_s=sum(long),
    )


def bench_files(source: Path) -> Iterable[tuple[str, dict[str, Any]]]:
    """(relative name, parsed JSON) of every bench result in a directory or a tar.gz."""
    if source.is_dir():
        for path in sorted(source.glob("*/round-*/bench/*.json")):
            yield path.relative_to(source).as_posix(), json.loads(path.read_text())
        return
    with tarfile.open(source, "r:gz") as archive:
        for member in sorted(archive.getmembers(), key=lambda member: member.name):
            name = member.name.removeprefix("./")
            if member.isfile() and BENCH_NAME.match(name):
                handle = archive.extractfile(member)
                assert handle is not None
                yield name, json.load(io.TextIOWrapper(handle, encoding="utf-8"))


def summaries(source: Path) -> list[StepSummary]:
    found: list[StepSummary] = []
    for name, bench in bench_files(source):
        match = BENCH_NAME.match(name)
        if match is None:
            continue
        summary = summarise(
            bench,
            arm=match["arm"],
            round_number=int(match["round"]),
            scenario=match["scenario"],
            concurrency=int(match["concurrency"]),
        )
        if summary is not None:
            found.append(summary)
    return found


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render(sources: Sequence[Path], found: Sequence[Sequence[StepSummary]]) -> str:
    lines = [
        "# Engine steps as the client saw them",
        "",
        f"A long step is one over {LONG_STEP_FACTOR:g}x the scenario's median step: it held "
        "prefill tokens or stalled. Steps before a scenario's first token are not seen.",
        "",
        "| source | scenario | concurrency | arm | steps | step p50 ms | long steps "
        "| long p50 ms | long max ms | time in long steps s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for source, rows in zip(sources, found, strict=True):
        label = source.name if source.is_dir() else source.parent.name
        order = sorted(rows, key=lambda row: (row.scenario, row.concurrency, row.arm, row.round))
        for row in order:
            lines.append(
                f"| {label} | {row.scenario} | {row.concurrency} | {row.arm} | {row.steps} | "
                f"{row.step_p50_ms:.2f} | {row.long_steps} | {_ms(row.long_step_p50_ms)} | "
                f"{_ms(row.long_step_max_ms)} | {row.long_step_total_s:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.step_timeline", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "rounds", nargs="+", type=Path, help="eval ab output directories or rounds.tar.gz files"
    )
    parser.add_argument("--out", type=Path, help="write the table here as well as to stdout")
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.rounds if not path.exists()]
    if missing:
        print(f"step_timeline: no such file or directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    found = []
    for source in args.rounds:
        try:
            rows = summaries(source)
        except (tarfile.TarError, OSError, json.JSONDecodeError, KeyError) as error:
            print(f"step_timeline: cannot read {source}: {error}", file=sys.stderr)
            return 2
        if not rows:
            print(f"step_timeline: {source} holds no vllm bench serve results", file=sys.stderr)
            return 2
        found.append(rows)
    table = render(args.rounds, found)
    sys.stdout.write(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
