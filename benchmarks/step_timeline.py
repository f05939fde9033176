"""The engine's step timeline as ``vllm bench serve``'s client saw it, per arm and scenario.

    python -m benchmarks.step_timeline ROUNDS [ROUNDS ...] [--out FILE.md]

ROUNDS is one ``eval ab`` output directory, or the ``rounds.tar.gz`` that
``scripts/gpu-rank-slice`` collects from one: it holds ``<arm>/round-<N>/bench/
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

Where the source also holds ``telemetry.csv`` (``scripts/gpu-rank-slice`` samples the GPU once a
second during a round), each level gets the GPU's state over its run: the median and lowest
SM clock, the median and highest power draw, the median of nvidia-smi's ``utilization.gpu``
(the share of each sample's period in which a kernel ran: below 100 the GPU waited on the
host), the clock-event reasons that were active (power cap, thermal, hardware slowdown) and
the host's highest 1-minute load. Where it also holds ``host.csv`` (``benchmarks.host_sampler``,
run beside it), each level gets the medians of its figures (HOST_FIGURES): the CPU use of the
API server, of the client's main thread and of the engine core's main thread and busiest other
thread, in percent of one core; the share of time the engine core's main thread waited for a
CPU; and the machine's CPU time that was busy, and stolen by a hypervisor, in percent of all
its CPUs. A host row covers the second before it, so a level takes the rows from a second
after its start.
A level's window is bench's ``date`` (written when the level ended, to the second) less its
``duration``.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import re
import statistics
import sys
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.host_sampler import TIMESTAMP_FORMAT

BENCH_NAME = re.compile(
    r"^(?P<arm>[^/]+)/round-(?P<round>\d+)/bench/"
    r"(?P<scenario>.+)-c(?P<concurrency>\d+)-round\d+\.json$"
)
LONG_STEP_FACTOR = 2.0
GROUPING_FRACTION = 0.25


# nvidia-smi's clock-event reasons that slow the clocks under load (idle, application and
# display clocks left out).
CLOCK_EVENTS = {
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake",
}
TELEMETRY_NAME = "telemetry.csv"
HOST_NAME = "host.csv"


@dataclass(frozen=True)
class GpuSample:
    """One line of ``telemetry.csv``; None where nvidia-smi had no value."""

    moment: datetime
    sm_mhz: float | None
    power_w: float | None
    busy_pct: float | None
    reasons: int | None
    load: float | None


@dataclass(frozen=True)
class GpuState:
    """The GPU over one level's run."""

    samples: int
    sm_mhz_p50: float | None
    sm_mhz_min: float | None
    power_w_p50: float | None
    power_w_max: float | None
    busy_pct_p50: float | None
    events: tuple[str, ...]
    load_max: float | None


# host.csv's figures (benchmarks.host_sampler) that the table gives, with their headers: CPU
# use in percent of one core, the machine's in percent of all its CPUs.
HOST_FIGURES = {
    "api_server_cpu_pct": "API server CPU %",
    "api_server_main_thread_pct": "API server main thread %",
    "client_main_thread_pct": "client main thread %",
    "engine_core_main_thread_pct": "engine core main thread %",
    "engine_core_busiest_other_thread_pct": "engine core busiest other thread %",
    "engine_core_main_thread_runqueue_wait_pct": "engine core main thread waiting for a CPU %",
    "machine_cpu_busy_pct": "machine CPU busy %",
    "machine_cpu_steal_pct": "machine CPU steal %",
}
# A host.csv row covers the second before its time.
HOST_INTERVAL = timedelta(seconds=1)


@dataclass(frozen=True)
class HostSample:
    """One line of ``host.csv``: HOST_FIGURES' values, None where a cell is empty."""

    moment: datetime
    figures: dict[str, float | None]


@dataclass(frozen=True)
class HostState:
    """The medians of HOST_FIGURES over one level's run (None where no sample had one)."""

    samples: int
    p50: dict[str, float | None]


Sample = TypeVar("Sample", GpuSample, HostSample)


@dataclass(frozen=True)
class RoundFiles:
    """What one source holds: (BENCH_NAME's match of its relative name, parsed JSON) of every
    bench result, and the GPU's and the host's samples (none where it has no such file)."""

    benches: list[tuple[re.Match, dict[str, Any]]]
    gpu: list[GpuSample]
    host: list[HostSample]


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
    gpu: GpuState | None = None
    host: HostState | None = None


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_telemetry(text: str) -> list[GpuSample]:
    """The samples of a ``telemetry.csv`` (either name nvidia-smi gives the reasons)."""
    samples = []
    for row in csv.DictReader(io.StringIO(text), skipinitialspace=True):
        try:
            moment = datetime.strptime(row["timestamp"], TIMESTAMP_FORMAT)
        except (KeyError, TypeError, ValueError):
            continue
        reasons = row.get("clocks_event_reasons.active") or row.get(
            "clocks_throttle_reasons.active"
        )
        try:
            reason_bits = int(reasons, 16) if reasons else None
        except ValueError:
            reason_bits = None
        samples.append(
            GpuSample(
                moment=moment,
                sm_mhz=_number(row.get("clocks.sm")),
                power_w=_number(row.get("power.draw")),
                busy_pct=_number(row.get("utilization.gpu")),
                reasons=reason_bits,
                load=_number(row.get("loadavg_1min")),
            )
        )
    return samples


def parse_host(text: str) -> list[HostSample]:
    """The samples of a ``host.csv``; a row cut short (the file copied while it was being
    written) is left out."""
    samples = []
    for row in csv.DictReader(io.StringIO(text)):
        if None in row.values() or None in row:
            continue
        try:
            moment = datetime.strptime(row["timestamp"], TIMESTAMP_FORMAT)
        except (KeyError, TypeError, ValueError):
            continue
        figures = {name: _number(row.get(name) or None) for name in HOST_FIGURES}
        samples.append(HostSample(moment=moment, figures=figures))
    return samples


def level_window(bench: dict[str, Any]) -> tuple[datetime, datetime] | None:
    """When a level ran: bench writes ``date`` as it ends, truncated to the second."""
    try:
        end = datetime.strptime(bench["date"], "%Y%m%d-%H%M%S")
        duration = float(bench["duration"])
    except (KeyError, TypeError, ValueError):
        return None
    return end - timedelta(seconds=duration), end + timedelta(seconds=1)


def within(samples: Sequence[Sample], window: tuple[datetime, datetime]) -> list[Sample]:
    return [sample for sample in samples if window[0] <= sample.moment <= window[1]]


def _median(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def gpu_state(samples: Sequence[GpuSample], window: tuple[datetime, datetime]) -> GpuState | None:
    """The samples within ``window``, summarised; None when there are none."""
    inside = within(samples, window)
    if not inside:
        return None
    clocks = [sample.sm_mhz for sample in inside if sample.sm_mhz is not None]
    powers = [sample.power_w for sample in inside if sample.power_w is not None]
    loads = [sample.load for sample in inside if sample.load is not None]
    seen = 0
    for sample in inside:
        seen |= sample.reasons or 0
    return GpuState(
        samples=len(inside),
        sm_mhz_p50=_median(clocks),
        sm_mhz_min=min(clocks) if clocks else None,
        power_w_p50=_median(powers),
        power_w_max=max(powers) if powers else None,
        busy_pct_p50=_median([sample.busy_pct for sample in inside]),
        events=tuple(name for bit, name in CLOCK_EVENTS.items() if seen & bit),
        load_max=max(loads) if loads else None,
    )


def host_state(
    samples: Sequence[HostSample], window: tuple[datetime, datetime]
) -> HostState | None:
    """The samples that cover only the level's run, summarised; None when there are none."""
    inside = within(samples, (window[0] + HOST_INTERVAL, window[1]))
    if not inside:
        return None
    return HostState(
        samples=len(inside),
        p50={name: _median([sample.figures[name] for sample in inside]) for name in HOST_FIGURES},
    )


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


def read_source(source: Path) -> RoundFiles:
    """The bench results and samples of an ``eval ab`` output directory or a tar.gz of one."""
    benches: list[tuple[re.Match, dict[str, Any]]] = []
    if source.is_dir():
        for path in sorted(source.glob("*/round-*/bench/*.json")):
            match = BENCH_NAME.match(path.relative_to(source).as_posix())
            if match is not None:
                benches.append((match, json.loads(path.read_text())))
        texts = {
            name: (source / name).read_text() if (source / name).is_file() else ""
            for name in (TELEMETRY_NAME, HOST_NAME)
        }
    else:
        texts = {TELEMETRY_NAME: "", HOST_NAME: ""}
        with tarfile.open(source, "r:gz") as archive:
            for member in sorted(archive.getmembers(), key=lambda member: member.name):
                name = member.name.removeprefix("./")
                match = BENCH_NAME.match(name)
                if not member.isfile() or not (match or name in texts):
                    continue
                handle = archive.extractfile(member)
                assert handle is not None
                if match is None:
                    texts[name] = handle.read().decode("utf-8")
                else:
                    benches.append((match, json.load(io.TextIOWrapper(handle, encoding="utf-8"))))
    return RoundFiles(
        benches=benches,
        gpu=parse_telemetry(texts[TELEMETRY_NAME]),
        host=parse_host(texts[HOST_NAME]),
    )


def summaries(source: Path) -> list[StepSummary]:
    found: list[StepSummary] = []
    files = read_source(source)
    for match, bench in files.benches:
        summary = summarise(
            bench,
            arm=match["arm"],
            round_number=int(match["round"]),
            scenario=match["scenario"],
            concurrency=int(match["concurrency"]),
        )
        if summary is None:
            continue
        window = level_window(bench)
        if window is not None:
            summary = replace(
                summary,
                gpu=gpu_state(files.gpu, window) if files.gpu else None,
                host=host_state(files.host, window) if files.host else None,
            )
        found.append(summary)
    return found


def _one_decimal(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _gpu_cells(state: GpuState | None) -> str:
    if state is None:
        return " - | - | - | - | - |"
    load = "-" if state.load_max is None else f"{state.load_max:.1f}"
    return (
        f" {_one_decimal(state.sm_mhz_p50)} [{_one_decimal(state.sm_mhz_min)}] |"
        f" {_one_decimal(state.power_w_p50)} [{_one_decimal(state.power_w_max)}] |"
        f" {_one_decimal(state.busy_pct_p50)} |"
        f" {' + '.join(state.events) or 'none'} | {load} |"
    )


def _host_cells(state: HostState | None) -> str:
    if state is None:
        return " - |" * len(HOST_FIGURES)
    return "".join(f" {_one_decimal(state.p50[name])} |" for name in HOST_FIGURES)


def render(sources: Sequence[Path], found: Sequence[Sequence[StepSummary]]) -> str:
    with_gpu = any(row.gpu is not None for rows in found for row in rows)
    with_host = any(row.host is not None for rows in found for row in rows)
    header = (
        "| source | scenario | concurrency | arm | steps | step p50 ms | long steps "
        "| long p50 ms | long max ms | time in long steps s |"
    )
    if with_gpu:
        header += (
            " SM MHz p50 [min] | power W p50 [max] | GPU busy % p50 | clock events | load max |"
        )
    if with_host:
        header += "".join(f" {title} p50 |" for title in HOST_FIGURES.values())
    lines = [
        "# Engine steps as the client saw them",
        "",
        f"A long step is one over {LONG_STEP_FACTOR:g}x the scenario's median step: it held "
        "prefill tokens or stalled. Steps before a scenario's first token are not seen.",
        "",
        header,
        "|---" * (header.count("|") - 1) + "|",
    ]
    for source, rows in zip(sources, found, strict=True):
        label = source.name if source.is_dir() else source.parent.name
        order = sorted(rows, key=lambda row: (row.scenario, row.concurrency, row.arm, row.round))
        for row in order:
            line = (
                f"| {label} | {row.scenario} | {row.concurrency} | {row.arm} | {row.steps} | "
                f"{row.step_p50_ms:.2f} | {row.long_steps} |"
                f" {_one_decimal(row.long_step_p50_ms)} |"
                f" {_one_decimal(row.long_step_max_ms)} | {row.long_step_total_s:.2f} |"
            )
            line += _gpu_cells(row.gpu) if with_gpu else ""
            lines.append(line + (_host_cells(row.host) if with_host else ""))
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
