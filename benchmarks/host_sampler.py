"""The CPU use of a vLLM server's processes, sampled once a second while a round runs.

    python -m benchmarks.host_sampler OUT.csv --stop-file PATH [--interval SECONDS]
        [--server-module vllm.entrypoints.openai.api_server]

nvidia-smi's ``utilization.gpu`` says that the GPU waited on the host, not on what. A
one-GPU ``vllm serve`` runs two busy processes: the API server (``python -m SERVER_MODULE``:
HTTP, tokenization, detokenization) and its engine core (the scheduler's loop, which also
launches the model's kernels). Each row of OUT.csv gives, over the interval before it, the
CPU time of

- the API server, all threads and its main thread (the asyncio loop);
- the engine core, all threads, its main thread (the busy loop) and its busiest other
  thread;

in percent of one core. The engine core's main thread may read busy while the GPU works too
(CUDA's default synchronization spins), so it is the GPU's idle stretches that tell: with the
main thread near 100% the step loop itself held the GPU up; with the main thread idle as well
it waited for requests, and the API server's columns say whether that process was saturated
(near 100% in its main thread or in all). A cell is empty when there is no such process, or when
it started within the last interval. The server is looked up again at every sample, so the
rows follow a round's servers as they stop and start. Sampling stops once PATH exists.

The engine core is the API server's child whose command line or name says ``EngineCore``
(vLLM sets that title when ``setproctitle`` is installed), else its child with the most CPU
time: the others are multiprocessing's resource tracker and short-lived helpers.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TextIO

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
ENGINE_CORE_NAME = "EngineCore"
COLUMNS = (
    "timestamp",
    "api_server_pid",
    "engine_core_pid",
    "api_server_cpu_pct",
    "api_server_main_thread_pct",
    "engine_core_cpu_pct",
    "engine_core_main_thread_pct",
    "engine_core_busiest_other_thread_pct",
)
# nvidia-smi's timestamp format, so that both files line up on one clock.
TIMESTAMP_FORMAT = "%Y/%m/%d %H:%M:%S.%f"


@dataclass(frozen=True)
class TaskStat:
    """What the sampler reads from a process's or thread's ``stat`` (proc(5))."""

    ppid: int
    cpu_ticks: int  # utime + stime; a process's counts every thread, ended ones included
    start_ticks: int  # when it started, in clock ticks after boot


@dataclass(frozen=True)
class ServerProcesses:
    api_server: int | None
    engine_core: int | None


def read_stat(path: Path) -> TaskStat | None:
    """A ``stat`` file's fields; None when the task is gone or the file is not one."""
    try:
        text = path.read_text()
    except OSError:
        return None
    # The command name, in parentheses, may itself hold spaces and parentheses.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return TaskStat(
            ppid=int(fields[1]),
            cpu_ticks=int(fields[11]) + int(fields[12]),
            start_ticks=int(fields[19]),
        )
    except (IndexError, ValueError):
        return None


def read_argv(proc: Path, pid: int) -> list[str]:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [part for part in raw.decode(errors="replace").split("\0") if part]


def read_name(proc: Path, pid: int) -> str:
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def runs_module(argv: Sequence[str], module: str) -> bool:
    """Whether ``argv`` is ``python ... -m MODULE ...``; a command that merely mentions the
    module inside one argument (a launcher's ``--server-command``) is not."""
    return any(flag == "-m" and name == module for flag, name in itertools.pairwise(argv))


def find_server(proc: Path, module: str, own_pid: int) -> ServerProcesses:
    """The newest process running ``module`` and its engine core, as they are now."""
    stats: dict[int, TaskStat] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            stat = read_stat(entry / "stat")
            if stat is not None:
                stats[int(entry.name)] = stat
    servers = [pid for pid in stats if pid != own_pid and runs_module(read_argv(proc, pid), module)]
    if not servers:
        return ServerProcesses(api_server=None, engine_core=None)
    api_server = max(servers, key=lambda pid: stats[pid].start_ticks)
    children = [pid for pid, stat in stats.items() if stat.ppid == api_server]
    named = [
        pid
        for pid in children
        if ENGINE_CORE_NAME in " ".join(read_argv(proc, pid))
        or ENGINE_CORE_NAME in read_name(proc, pid)
    ]
    candidates = named or children
    engine_core = max(candidates, key=lambda pid: stats[pid].cpu_ticks) if candidates else None
    return ServerProcesses(api_server=api_server, engine_core=engine_core)


class CpuMeter:
    """CPU use, in percent of one core, of tasks between one reading and the next."""

    def __init__(self, clock_ticks_per_s: int) -> None:
        self._ticks_per_s = clock_ticks_per_s
        self._previous: dict[tuple[Path, int], tuple[int, float]] = {}
        self._seen: dict[tuple[Path, int], tuple[int, float]] = {}

    def percent(self, stat_path: Path, now: float) -> float | None:
        """The use since this task's last reading; None at its first (a task is told apart
        from a later one at the same path by its start time)."""
        stat = read_stat(stat_path)
        if stat is None:
            return None
        key = (stat_path, stat.start_ticks)
        self._seen[key] = (stat.cpu_ticks, now)
        previous = self._previous.get(key)
        if previous is None or now <= previous[1] or stat.cpu_ticks < previous[0]:
            return None
        ticks, then = previous
        return 100.0 * (stat.cpu_ticks - ticks) / self._ticks_per_s / (now - then)

    def next_sample(self) -> None:
        """Keep this sample's readings for the next one; forget tasks it did not see."""
        self._previous, self._seen = self._seen, {}


def sample(
    proc: Path, meter: CpuMeter, module: str, own_pid: int, now: float
) -> dict[str, float | int | None]:
    """One row's values, less the timestamp."""
    server = find_server(proc, module, own_pid)
    row: dict[str, float | int | None] = {
        "api_server_pid": server.api_server,
        "engine_core_pid": server.engine_core,
    }
    for prefix, pid in (("api_server", server.api_server), ("engine_core", server.engine_core)):
        if pid is None:
            continue
        row[f"{prefix}_cpu_pct"] = meter.percent(proc / str(pid) / "stat", now)
        row[f"{prefix}_main_thread_pct"] = meter.percent(
            proc / str(pid) / "task" / str(pid) / "stat", now
        )
    if server.engine_core is not None:
        tasks = proc / str(server.engine_core) / "task"
        try:
            others = [entry for entry in tasks.iterdir() if entry.name != str(server.engine_core)]
        except OSError:
            others = []
        readings = [meter.percent(entry / "stat", now) for entry in others]
        measured = [reading for reading in readings if reading is not None]
        row["engine_core_busiest_other_thread_pct"] = max(measured) if measured else None
    meter.next_sample()
    return row


def _cell(value: float | int | None) -> str:
    if value is None:
        return ""
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def run(
    out: TextIO,
    stop_file: Path,
    interval_s: float,
    module: str,
    proc: Path = Path("/proc"),
) -> int:
    """Write rows to ``out`` until ``stop_file`` exists; returns the number written."""
    meter = CpuMeter(os.sysconf("SC_CLK_TCK"))
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    out.flush()
    written = 0
    while not stop_file.exists():
        began = time.monotonic()
        values = sample(proc, meter, module, os.getpid(), began)
        stamp = datetime.now().strftime(TIMESTAMP_FORMAT)[:-3]
        writer.writerow([stamp, *(_cell(values.get(column)) for column in COLUMNS[1:])])
        out.flush()
        written += 1
        time.sleep(max(0.0, interval_s - (time.monotonic() - began)))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.host_sampler", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out", type=Path, help="the CSV to write (replaced)")
    parser.add_argument("--stop-file", type=Path, required=True, help="stop once this exists")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument(
        "--server-module", default=SERVER_MODULE, help="the module the API server runs with -m"
    )
    args = parser.parse_args(argv)
    if not args.interval > 0:
        parser.error(f"--interval must be above 0 seconds, got {args.interval}")
    if not Path("/proc/self/stat").is_file():
        print("host_sampler: this system has no /proc to read", file=sys.stderr)
        return 2
    try:
        handle = args.out.open("w", newline="")
    except OSError as error:
        print(f"host_sampler: cannot write {args.out}: {error}", file=sys.stderr)
        return 2
    with handle:
        run(handle, args.stop_file, args.interval, args.server_module)
    return 0


if __name__ == "__main__":
    sys.exit(main())
