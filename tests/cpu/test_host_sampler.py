"""benchmarks/host_sampler.py: the server's processes found and their CPU use measured, on a
hand-made /proc with known tick counts and on live processes with a known load."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks import host_sampler, step_timeline

MODULE = "vllm.entrypoints.openai.api_server"


def _task(
    directory: Path, ppid: int, cpu_ticks: int, start_ticks: int, name: str, waited_ns: int = 0
) -> None:
    """A proc(5) ``stat`` file (utime and stime split the ticks, starttime is field 22) and
    a ``schedstat`` (time on a CPU, time waiting for one, in ns; all zeros when the kernel
    does not keep them)."""
    directory.mkdir(parents=True, exist_ok=True)
    on_cpu_ns = cpu_ticks * 10_000_000 if waited_ns else 0
    (directory / "schedstat").write_text(f"{on_cpu_ns} {waited_ns} {cpu_ticks // 10 + 1}\n")
    utime, stime = cpu_ticks - cpu_ticks // 3, cpu_ticks // 3
    fields = ["S", ppid, 1, 1, 0, -1, 4194304, 0, 0, 0, 0, utime, stime, 0, 0, 20, 0, 1, 0]
    fields += [start_ticks, 1000, 100]
    (directory / "stat").write_text(f"{directory.name} ({name}) " + " ".join(map(str, fields)))


def _process(
    proc: Path,
    pid: int,
    ppid: int,
    argv: list[str],
    threads: dict[int, int],
    start_ticks: int = 500,
    name: str = "python3",
    waited_ns: dict[int, int] | None = None,
) -> None:
    """Process ``pid`` with ``threads`` (tid: CPU ticks, and ns waited for a CPU in
    ``waited_ns``); its own stat sums them."""
    root = proc / str(pid)
    _task(root, ppid, sum(threads.values()), start_ticks, name)
    (root / "cmdline").write_bytes(b"".join(arg.encode() + b"\0" for arg in argv))
    (root / "comm").write_text(name + "\n")
    for tid, ticks in threads.items():
        waited = (waited_ns or {}).get(tid, 0)
        _task(root / "task" / str(tid), ppid, ticks, start_ticks, name, waited)


def _server(proc: Path, step: int, engine_core_pid: int = 102, engine_start: int = 900) -> None:
    """A server whose processes have run ``step`` seconds at 100 ticks a second: the API
    server's main thread at 20%, the engine core's main thread at 90% (and waiting for a CPU
    10% of the time) and its input thread at 35%, and the API server's parent, a launcher
    that names the module in one argument, at 95%. Neither the launcher, nor an older
    server, nor the resource tracker and a busier helper beside the engine core may be
    taken for the server or its engine core. The machine's CPUs are 40% busy, and the
    hypervisor takes 5%."""
    proc.mkdir(parents=True, exist_ok=True)
    user, system, idle, iowait, steal, guest = (step * n for n in (600, 200, 1000, 100, 100, 50))
    (proc / "stat").write_text(
        f"cpu  {user} 0 {system} {idle} {iowait} 0 0 {steal} {guest} 0\ncpu0 1 2 3 4 5 6 7 8\n"
    )
    _process(proc, 100, 7, ["python3", "-m", MODULE, "--port", "8000"], {100: 20 * step})
    _process(proc, 90, 1, ["python3", "-m", MODULE, "--port", "8001"], {90: 1}, start_ticks=100)
    helper = ["python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"]
    _process(proc, 120, 100, helper, {120: 500 * step})
    _process(
        proc,
        101,
        100,
        ["python3", "-c", "from multiprocessing.resource_tracker import main;main(5)"],
        {101: 1 * step},
    )
    _process(
        proc,
        engine_core_pid,
        100,
        ["VLLM::EngineCore"],
        {engine_core_pid: 90 * step, engine_core_pid + 1: 35 * step, engine_core_pid + 2: 0},
        start_ticks=engine_start,
        name="VLLM::EngineCor",
        waited_ns={engine_core_pid: 100_000_000 * step},
    )
    _process(
        proc,
        7,
        1,
        ["python3", "-m", "vllm_minimax", "eval", "ab", "--server-command", f"python3 -m {MODULE}"],
        {7: 95 * step},
        start_ticks=800,  # newer than the server, so taken for it if matched
    )


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _meter(proc: Path, clock: FakeClock) -> host_sampler.HostMeter:
    return host_sampler.HostMeter(proc, clock_ticks_per_s=100, clock=clock)


def test_cpu_use_on_a_hand_made_proc(tmp_path):
    proc = tmp_path / "proc"
    _server(proc, step=10)
    clock = FakeClock(50.0)
    meter = _meter(proc, clock)
    first = host_sampler.sample(meter, MODULE, own_pid=4)
    assert (first["api_server_pid"], first["engine_core_pid"], first["client_pid"]) == (100, 102, 7)
    assert first["engine_core_main_thread_pct"] is None  # nothing to compare with yet
    _server(proc, step=12)
    clock.now = 52.0  # two seconds later
    second = host_sampler.sample(meter, MODULE, own_pid=4)
    assert second == {
        "api_server_pid": 100,
        "engine_core_pid": 102,
        "client_pid": 7,
        "api_server_cpu_pct": pytest.approx(20.0),
        "api_server_main_thread_pct": pytest.approx(20.0),
        "client_main_thread_pct": pytest.approx(95.0),
        "engine_core_cpu_pct": pytest.approx(125.0),
        "engine_core_main_thread_pct": pytest.approx(90.0),
        "engine_core_busiest_other_thread_pct": pytest.approx(35.0),
        "engine_core_main_thread_runqueue_wait_pct": pytest.approx(10.0),
        "machine_cpu_busy_pct": pytest.approx(40.0),
        "machine_cpu_steal_pct": pytest.approx(5.0),
    }


def test_the_sampler_itself_is_never_the_server(tmp_path):
    proc = tmp_path / "proc"
    _server(proc, step=1)
    found = host_sampler.find_server(proc, MODULE, own_pid=100)
    assert found.api_server == 90  # the older server, the only other one


def _remove(proc: Path, pid: int) -> None:
    for path in sorted((proc / str(pid)).rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    (proc / str(pid)).rmdir()


def test_a_restarted_engine_core_starts_over(tmp_path):
    """A new engine core under the same pid (started later, its counters higher or lower)
    has no previous reading, so its first sample is empty rather than a difference of two
    processes."""
    for step_after in (1, 20):
        proc = tmp_path / f"proc-{step_after}"
        _server(proc, step=10)
        clock = FakeClock(50.0)
        meter = _meter(proc, clock)
        host_sampler.sample(meter, MODULE, own_pid=4)
        _remove(proc, 102)
        _server(proc, step=step_after, engine_start=5000)
        clock.now = 51.0
        row = host_sampler.sample(meter, MODULE, own_pid=4)
        assert row["engine_core_pid"] == 102
        assert row["engine_core_main_thread_pct"] is None
        assert row["engine_core_busiest_other_thread_pct"] is None
        assert row["engine_core_main_thread_runqueue_wait_pct"] is None
        if step_after > 10:  # the same API server, its counters grown
            assert row["api_server_main_thread_pct"] is not None


def test_a_counter_that_went_down_gives_an_empty_cell(tmp_path):
    proc = tmp_path / "proc"
    _server(proc, step=10)
    clock = FakeClock(50.0)
    meter = _meter(proc, clock)
    host_sampler.sample(meter, MODULE, own_pid=4)
    _server(proc, step=5)  # the same processes by pid and start time, fewer ticks
    clock.now = 51.0
    row = host_sampler.sample(meter, MODULE, own_pid=4)
    assert row["engine_core_main_thread_pct"] is None
    assert row["api_server_cpu_pct"] is None


def test_no_server_gives_empty_cells(tmp_path):
    proc = tmp_path / "proc"
    _process(proc, 7, 1, ["python3", "-c", f"print('-m {MODULE}')"], {7: 5})
    row = host_sampler.sample(_meter(proc, FakeClock(1.0)), MODULE, own_pid=4)
    assert row == {
        "api_server_pid": None,
        "engine_core_pid": None,
        "client_pid": None,
        "machine_cpu_busy_pct": None,  # no /proc/stat in this tree
        "machine_cpu_steal_pct": None,
    }


def test_a_kernel_without_schedstats_leaves_the_wait_empty(tmp_path):
    proc = tmp_path / "proc"
    clock = FakeClock(1.0)
    meter = _meter(proc, clock)
    for now, ticks in ((1.0, 100), (2.0, 190)):
        _process(proc, 100, 1, ["python3", "-m", MODULE], {100: 1})
        _process(proc, 102, 100, ["VLLM::EngineCore"], {102: ticks})  # schedstat all zeros
        clock.now = now
        row = host_sampler.sample(meter, MODULE, own_pid=4)
    assert row["engine_core_main_thread_pct"] == pytest.approx(90.0)
    assert row["engine_core_main_thread_runqueue_wait_pct"] is None


def test_without_a_title_the_busiest_child_is_the_engine_core(tmp_path):
    proc = tmp_path / "proc"
    _process(proc, 100, 1, ["python3", "-m", MODULE], {100: 10})
    spawn = ["python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"]
    _process(proc, 110, 100, spawn, {110: 4000})
    _process(proc, 111, 100, ["python3", "-c", "resource_tracker"], {111: 3})
    found = host_sampler.find_server(proc, MODULE, own_pid=4)
    assert found == host_sampler.ServerProcesses(api_server=100, engine_core=110)


def test_the_resource_tracker_is_never_the_engine_core(tmp_path):
    """When the engine core has exited, the tracker that outlives it is not taken for it."""
    proc = tmp_path / "proc"
    _process(proc, 100, 1, ["python3", "-m", MODULE], {100: 10})
    tracker = ["python3", "-B", "-c", "from multiprocessing.resource_tracker import main;main(31)"]
    _process(proc, 111, 100, tracker, {111: 3})
    found = host_sampler.find_server(proc, MODULE, own_pid=4)
    assert found == host_sampler.ServerProcesses(api_server=100, engine_core=None)


FAKE_SERVER = """
import subprocess, sys, time
# The engine core: its main thread spins, its other thread sleeps.
core = subprocess.Popen([sys.executable, "-c", '''
import threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    pass
''', "EngineCore"])
print(core.pid, flush=True)
time.sleep(60)
"""


def test_live_processes(tmp_path):
    """A stand-in server (``python -m fake_api_server``, idle) with a spinning engine core,
    beside a launcher that only mentions the module: the sampler's CSV, read by
    step_timeline, attributes the load to the engine core's main thread. Other tests may
    hold the machine's cores, so the spinning thread's share is compared with the idle ones
    rather than with a fixed figure."""
    (tmp_path / "fake_api_server.py").write_text(textwrap.dedent(FAKE_SERVER))
    server = subprocess.Popen(
        [sys.executable, "-m", "fake_api_server"], cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
            "--server-command python -m fake_api_server",
        ]
    )
    core_pid = None
    try:
        assert server.stdout is not None
        core_pid = int(server.stdout.readline())
        out, stop = tmp_path / "host.csv", tmp_path / "stop"
        sampler = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.host_sampler",
                str(out),
                "--stop-file",
                str(stop),
                "--interval",
                "0.5",
                "--server-module",
                "fake_api_server",
            ],
            cwd=Path(__file__).resolve().parents[2],
        )
        time.sleep(3.5)
        stop.touch()
        assert sampler.wait(timeout=30) == 0
    finally:
        for process in (server, launcher):
            process.kill()
            process.wait()
        if core_pid is not None:
            os.kill(core_pid, signal.SIGKILL)
    rows = list(csv.DictReader(out.read_text().splitlines()))
    assert len(rows) >= 4
    assert {row["api_server_pid"] for row in rows} == {str(server.pid)}
    assert {row["engine_core_pid"] for row in rows} == {str(core_pid)}
    assert {row["client_pid"] for row in rows} == {str(os.getpid())}  # the server's parent
    samples = step_timeline.parse_host(out.read_text())
    assert len(samples) == len(rows)
    state = step_timeline.host_state(samples, (samples[0].moment, samples[-1].moment))
    assert state is not None and state.samples >= 3
    spinning = state.p50["engine_core_main_thread_pct"]
    idle = [
        state.p50[name] for name in ("api_server_cpu_pct", "engine_core_busiest_other_thread_pct")
    ]
    assert spinning is not None and None not in idle
    assert spinning > 5 and spinning > 5 * max(*idle, 1.0), (spinning, idle)
    # The machine's busy time holds the spinning thread's.
    stat_lines = Path("/proc/stat").read_text().splitlines()
    cpus = sum(line.startswith("cpu") and line[3].isdigit() for line in stat_lines)
    busy = state.p50["machine_cpu_busy_pct"]
    assert busy is not None and busy * cpus > 0.5 * spinning, (busy, cpus, spinning)


def test_refuses_what_it_cannot_write(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("")
    target = blocked / "host.csv"
    assert host_sampler.main([str(target), "--stop-file", str(tmp_path / "stop")]) == 2
    assert f"cannot write {target}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        host_sampler.main(["x.csv", "--stop-file", "s", "--interval", "0"])
    assert "--interval must be above 0" in capsys.readouterr().err


def test_the_device_scripts_sampler_runs(tmp_path):
    """scripts/gpu-rank-slice's sample_host, as a round starts it (from the repository root),
    writes host.csv until the stop file appears, and its message into host.err."""
    root = Path(__file__).resolve().parents[2]
    script = root / "scripts" / "gpu-rank-slice"
    out = tmp_path / "round"
    out.mkdir()
    runner = (
        f"source <(sed -n '/^sample_host() {{/,/^}}/p' {script}); "
        f"sample_host {out} {out}/exit-status --server-module no_such_server & sleep 2; "
        f"touch {out}/exit-status; wait"
    )
    subprocess.run(
        ["bash", "-c", runner],
        check=True,
        cwd=root,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
        timeout=30,
    )
    # No such server ran (other tests may run a real one), which the sampler says once.
    assert (out / "host.err").read_text() == (
        "host_sampler: no process ran python -m no_such_server while it sampled\n"
    )
    lines = (out / "host.csv").read_text().splitlines()
    assert lines[0] == ",".join(host_sampler.COLUMNS)
    assert len(lines) >= 2
