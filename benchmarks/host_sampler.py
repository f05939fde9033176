"""The CPU use of a vLLM server's processes, sampled once a second while a round runs.

    python -m benchmarks.host_sampler OUT.csv --stop-file PATH [--interval SECONDS]
        [--server-module vllm.entrypoints.openai.api_server]

nvidia-smi's ``utilization.gpu`` says that the GPU waited on the host, not on what. A
one-GPU server started as ``python -m SERVER_MODULE`` (as ``eval ab`` runs it on the device;
a ``vllm serve`` command line is not matched) runs two busy processes: the API server (HTTP,
tokenization, detokenization) and its engine core (the scheduler's loop, which also launches
the model's kernels). Each row of OUT.csv gives, over the interval before it, the CPU time of

- the API server, all threads and its main thread (the asyncio loop);
- the API server's parent, its main thread: in a round, ``eval ab``, whose asyncio loop
  runs ``vllm bench serve``'s client;
- the engine core, all threads, its main thread (the busy loop) and its busiest other
  thread;

in percent of one core; the share of the interval the engine core's main thread was ready
to run but waited for a CPU (its ``schedstat``, where the kernel keeps it); and the whole
machine's CPU time that was busy, and that a hypervisor took from it (steal), in percent of
all its CPUs. A main thread waiting for a CPU, or stolen time, says the host was short of
CPU rather than the loop having more to do.

The engine core's main thread may read busy while the GPU works too (CUDA's default
synchronization spins), so it is the GPU's idle stretches that tell: with the main thread
near 100% the step loop itself held the GPU up; with the main thread idle as well it waited
for requests, and the API server's and the client's columns say whether one of those was
saturated (a main thread near 100%).

A cell is empty where there is no such process, and in the first reading of each process or
thread (the sampler's first row, a server that started since the last one). The server is
looked up again at every sample, so the rows follow a round's servers as they stop and
start. Sampling stops once PATH exists; if no server was seen by then, it says so on stderr.

The engine core is the API server's child whose command line or name says ``EngineCore``
(vLLM sets that title when ``setproctitle`` is installed), else its child with the most CPU
time, multiprocessing's resource tracker left out.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TextIO

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
ENGINE_CORE_NAME = "EngineCore"
RESOURCE_TRACKER = "multiprocessing.resource_tracker"
COLUMNS = (
    "timestamp",
    "api_server_pid",
    "engine_core_pid",
    "client_pid",
    "api_server_cpu_pct",
    "api_server_main_thread_pct",
    "client_main_thread_pct",
    "engine_core_cpu_pct",
    "engine_core_main_thread_pct",
    "engine_core_busiest_other_thread_pct",
    "engine_core_main_thread_runqueue_wait_pct",
    "machine_cpu_busy_pct",
    "machine_cpu_steal_pct",
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
    client: int | None = None  # the API server's parent


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
    parent = stats[api_server].ppid
    commands = {
        pid: " ".join(read_argv(proc, pid))
        for pid, stat in stats.items()
        if stat.ppid == api_server
    }
    children = [pid for pid, command in commands.items() if RESOURCE_TRACKER not in command]
    named = [
        pid
        for pid in children
        if ENGINE_CORE_NAME in commands[pid] or ENGINE_CORE_NAME in read_name(proc, pid)
    ]
    candidates = named or children
    engine_core = max(candidates, key=lambda pid: stats[pid].cpu_ticks) if candidates else None
    return ServerProcesses(
        api_server=api_server, engine_core=engine_core, client=parent if parent > 1 else None
    )


class RateMeter:
    """Per-second rates of cumulative counters between one sample and the next."""

    def __init__(self) -> None:
        self._previous: dict[Hashable, tuple[float, float]] = {}
        self._seen: dict[Hashable, tuple[float, float]] = {}

    def rate(self, key: Hashable, value: float, now: float) -> float | None:
        """The counter's growth per second since its last reading under ``key``; None at
        the first, or when it went down (another task under a reused key)."""
        self._seen[key] = (value, now)
        previous = self._previous.get(key)
        if previous is None or now <= previous[1] or value < previous[0]:
            return None
        return (value - previous[0]) / (now - previous[1])

    def next_sample(self) -> None:
        """Keep this sample's readings for the next one; forget counters it did not read."""
        self._previous, self._seen = self._seen, {}


class HostMeter:
    """The figures of one row, from ``/proc`` (or a stand-in tree) and a rate meter. Each
    counter is timed by ``clock`` as it is read, so that a slow scan of ``/proc`` does not
    skew the rates."""

    def __init__(
        self, proc: Path, clock_ticks_per_s: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.proc = proc
        self._ticks_per_s = clock_ticks_per_s
        self._clock = clock
        self._rates = RateMeter()

    def cpu_pct(self, stat_path: Path) -> float | None:
        """A task's CPU use in percent of one core (a task is told apart from a later one at
        the same path by its start time)."""
        stat = read_stat(stat_path)
        now = self._clock()
        if stat is None:
            return None
        per_s = self._rates.rate(("cpu", stat_path, stat.start_ticks), stat.cpu_ticks, now)
        return None if per_s is None else 100.0 * per_s / self._ticks_per_s

    def runqueue_wait_pct(self, task: Path) -> float | None:
        """The share of the time a thread was ready to run but waited for a CPU, from its
        ``schedstat``; None where the kernel does not keep it (the file reads all zeros)."""
        stat = read_stat(task / "stat")
        try:
            fields = (task / "schedstat").read_text().split()
            on_cpu_ns, waited_ns = int(fields[0]), int(fields[1])
        except (OSError, IndexError, ValueError):
            return None
        now = self._clock()
        if stat is None or (on_cpu_ns == 0 and waited_ns == 0):
            return None
        per_s = self._rates.rate(("wait", task, stat.start_ticks), waited_ns, now)
        return None if per_s is None else 100.0 * per_s / 1e9

    def machine_pcts(self) -> tuple[float | None, float | None]:
        """The whole machine's CPU time that was busy, and that the hypervisor took (steal),
        in percent of all its CPUs, from the first line of ``/proc/stat``."""
        try:
            line = (self.proc / "stat").read_text().splitlines()[0]
            ticks = [int(field) for field in line.split()[1:9]]
        except (OSError, IndexError, ValueError):
            return None, None
        now = self._clock()
        ticks += [0] * (8 - len(ticks))
        idle, steal, total = ticks[3] + ticks[4], ticks[7], sum(ticks)
        rates = [
            self._rates.rate(("machine", name), value, now)
            for name, value in (("busy", total - idle - steal), ("steal", steal), ("all", total))
        ]
        busy, stolen, every = rates
        if busy is None or stolen is None or not every:
            return None, None
        return 100.0 * busy / every, 100.0 * stolen / every

    def next_sample(self) -> None:
        self._rates.next_sample()


def sample(meter: HostMeter, module: str, own_pid: int) -> dict[str, float | int | None]:
    """One row's values, less the timestamp."""
    proc = meter.proc
    server = find_server(proc, module, own_pid)
    row: dict[str, float | int | None] = {
        "api_server_pid": server.api_server,
        "engine_core_pid": server.engine_core,
        "client_pid": server.client,
    }
    row["machine_cpu_busy_pct"], row["machine_cpu_steal_pct"] = meter.machine_pcts()
    for prefix, pid in (
        ("api_server", server.api_server),
        ("client", server.client),
        ("engine_core", server.engine_core),
    ):
        if pid is None:
            continue
        main_thread = proc / str(pid) / "task" / str(pid)
        row[f"{prefix}_main_thread_pct"] = meter.cpu_pct(main_thread / "stat")
        if prefix != "client":
            row[f"{prefix}_cpu_pct"] = meter.cpu_pct(proc / str(pid) / "stat")
    if server.engine_core is not None:
        main_thread = proc / str(server.engine_core) / "task" / str(server.engine_core)
        row["engine_core_main_thread_runqueue_wait_pct"] = meter.runqueue_wait_pct(main_thread)
        try:
            others = [entry for entry in main_thread.parent.iterdir() if entry != main_thread]
        except OSError:
            others = []
        readings = [meter.cpu_pct(entry / "stat") for entry in others]
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
    """Write rows to ``out`` until ``stop_file`` exists; returns the number of rows that
    found the server."""
    meter = HostMeter(proc, os.sysconf("SC_CLK_TCK"))
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    out.flush()
    found = 0
    while not stop_file.exists():
        began = time.monotonic()
        values = sample(meter, module, os.getpid())
        stamp = datetime.now().strftime(TIMESTAMP_FORMAT)[:-3]
        writer.writerow([stamp, *(_cell(values.get(column)) for column in COLUMNS[1:])])
        out.flush()
        found += values["api_server_pid"] is not None
        time.sleep(max(0.0, interval_s - (time.monotonic() - began)))
    return found


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
        found = run(handle, args.stop_file, args.interval, args.server_module)
    if not found:
        print(
            f"host_sampler: no process ran python -m {args.server_module} while it sampled",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
