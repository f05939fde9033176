"""benchmarks/step_timeline.py: the engine's steps recovered from the client's per-request
token times, checked against a simulated engine whose steps are known."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import tarfile
from pathlib import Path

import pytest

from benchmarks import host_sampler, step_timeline


def simulate(
    seed: int, concurrency: int, prefill_steps: dict[int, float]
) -> tuple[dict, list[float]]:
    """A client result of `concurrency` requests decoding 200 tokens in lockstep, each token
    reaching the client up to 1.5 ms late; step i lasts prefill_steps.get(i) or ~10 ms.
    Returns the bench JSON and the true step end times."""
    rng = random.Random(seed)
    ends, moment = [], 100.0
    for step in range(201):
        moment += prefill_steps.get(step, 0.010 + rng.uniform(-0.0005, 0.0005))
        ends.append(moment)
    bench: dict = {"start_times": [], "ttfts": [], "itls": []}
    for _ in range(concurrency):
        arrivals = [end + rng.uniform(0, 0.0015) for end in ends]
        start = 99.9 - rng.uniform(0, 0.05)
        bench["start_times"].append(start)
        bench["ttfts"].append(arrivals[0] - start)
        bench["itls"].append([later - earlier for earlier, later in itertools.pairwise(arrivals)])
    return bench, ends


def test_long_steps_recovered_against_the_simulated_engine():
    long = {20: 0.150, 21: 0.160, 90: 1.4}
    bench, ends = simulate(seed=1, concurrency=16, prefill_steps=long)
    summary = step_timeline.summarise(
        bench, arm="flashinfer", round_number=1, scenario="s", concurrency=16
    )
    assert summary is not None
    true_durations = [later - earlier for earlier, later in itertools.pairwise(ends)]
    assert summary.steps == len(true_durations)
    assert summary.step_p50_ms == pytest.approx(10.0, abs=1.0)
    assert summary.long_steps == 3
    assert summary.long_step_max_ms == pytest.approx(1400, abs=3)
    assert summary.long_step_p50_ms == pytest.approx(160, abs=3)
    assert summary.long_step_total_s == pytest.approx(sum(long.values()), abs=0.006)


def test_no_long_steps_when_the_engine_only_decodes():
    bench, _ = simulate(seed=2, concurrency=4, prefill_steps={})
    summary = step_timeline.summarise(
        bench, arm="triton", round_number=2, scenario="s", concurrency=4
    )
    assert summary is not None
    assert summary.long_steps == 0
    assert summary.long_step_p50_ms is None
    assert summary.long_step_total_s == 0


def _write_round(root, arm: str, bench: dict) -> None:
    path = root / arm / "round-1" / "bench"
    path.mkdir(parents=True)
    (path / "decode-8k-c8-c8-round1.json").write_text(json.dumps(bench))
    (path / "decode-8k-c8-c8-round1.log").write_text("not json")


def test_directory_and_tarball_give_the_same_table(tmp_path, capsys):
    fast, _ = simulate(seed=3, concurrency=8, prefill_steps={50: 0.150})
    slow, _ = simulate(seed=4, concurrency=8, prefill_steps={50: 0.280})
    rounds = tmp_path / "2026-12-04-ab-8k-rep1"
    _write_round(rounds, "triton", fast)
    _write_round(rounds, "flashinfer", slow)
    with tarfile.open(tmp_path / "rounds.tar.gz", "w:gz") as archive:
        archive.add(rounds / "triton", arcname="triton")
        archive.add(rounds / "flashinfer", arcname="flashinfer")
    out = tmp_path / "out" / "steps.md"
    assert step_timeline.main([str(rounds), "--out", str(out)]) == 0
    from_dir = capsys.readouterr().out
    assert step_timeline.main([str(tmp_path / "rounds.tar.gz")]) == 0
    from_tar = capsys.readouterr().out
    assert out.read_text() == from_dir
    rows = [line for line in from_dir.splitlines() if line.startswith("| 2026-12-04-ab-8k-rep1 |")]
    assert [row.split(" | ")[3] for row in rows] == ["flashinfer", "triton"]
    cells = [row.split(" | ") for row in rows]
    # Columns 6 and 7: the long steps' count and median.
    assert [cell[6] for cell in cells] == ["1", "1"]
    assert float(cells[0][7]) == pytest.approx(280, abs=3)
    assert float(cells[1][7]) == pytest.approx(150, abs=3)
    # The tarball's rows are labelled by the directory holding it.
    assert from_tar.replace(f"| {tmp_path.name} |", "| 2026-12-04-ab-8k-rep1 |") == from_dir


def test_bad_sources_exit_2_and_write_nothing(tmp_path, capsys):
    out = tmp_path / "out.md"
    assert step_timeline.main([str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert step_timeline.main([str(tmp_path / "empty"), "--out", str(out)]) == 2
    assert "holds no vllm bench serve results" in capsys.readouterr().err
    (tmp_path / "broken.tar.gz").write_bytes(b"not a tarball")
    assert step_timeline.main([str(tmp_path / "broken.tar.gz"), "--out", str(out)]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert not out.exists()


def _telemetry(rows: list[tuple[str, float, float, int, float, int]]) -> str:
    header = (
        "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,"
        "clocks_event_reasons.active,loadavg_1min"
    )
    lines = [header]
    for moment, clock, power, reasons, load, busy in rows:
        lines.append(f"{moment}, {clock}, 3201, {power}, 60, {busy}, {reasons:#018x}, {load}")
    return "\n".join(lines) + "\n"


def test_each_level_gets_the_gpu_state_of_its_own_window(tmp_path, capsys):
    """telemetry.csv's samples are matched to a level by bench's end time and duration:
    only the samples inside a level's run count, and the power-cap bit is named."""
    first, _ = simulate(seed=5, concurrency=4, prefill_steps={})
    second, _ = simulate(seed=6, concurrency=4, prefill_steps={})
    first |= {"date": "20261204-200010", "duration": 5.0}  # ran 20:00:05 to 20:00:10
    second |= {"date": "20261204-200030", "duration": 5.0}  # ran 20:00:25 to 20:00:30
    rounds = tmp_path / "round"
    for name, bench in (("decode-8k-c1", first), ("decode-8k-c8", second)):
        path = rounds / "triton" / "round-1" / "bench"
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{name}-c4-round1.json").write_text(json.dumps(bench))
    samples = [
        ("2026/12/04 20:00:00.500", 900.0, 100.0, 0x1, 9.0, 0),  # idle, before both
        ("2026/12/04 20:00:06.000", 1980.0, 500.0, 0x0, 1.0, 100),
        ("2026/12/04 20:00:08.000", 1960.0, 520.0, 0x0, 2.0, 98),
        ("2026/12/04 20:00:26.000", 1500.0, 699.0, 0x4, 3.0, 81),
        ("2026/12/04 20:00:29.000", 1400.0, 700.0, 0x4, 4.0, 76),
        ("2026/12/04 20:00:40.000", 100.0, 50.0, 0x40, 9.0, 0),  # after both
    ]
    (rounds / "telemetry.csv").write_text(_telemetry(samples))
    with tarfile.open(tmp_path / "rounds.tar.gz", "w:gz") as archive:
        archive.add(rounds / "triton", arcname="triton")
        archive.add(rounds / "telemetry.csv", arcname="telemetry.csv")
    by_scenario = {row.scenario: row.gpu for row in step_timeline.summaries(rounds)}
    assert by_scenario == {
        row.scenario: row.gpu for row in step_timeline.summaries(tmp_path / "rounds.tar.gz")
    }
    quiet, capped = by_scenario["decode-8k-c1"], by_scenario["decode-8k-c8"]
    assert quiet is not None and capped is not None
    assert (quiet.samples, quiet.sm_mhz_p50, quiet.sm_mhz_min) == (2, 1970.0, 1960.0)
    assert (quiet.power_w_max, quiet.events, quiet.load_max) == (520.0, (), 2.0)
    assert (quiet.busy_pct_p50, capped.busy_pct_p50) == (99.0, 78.5)
    assert (capped.samples, capped.sm_mhz_min, capped.power_w_p50) == (2, 1400.0, 699.5)
    assert capped.events == ("power cap",)
    assert step_timeline.main([str(rounds)]) == 0
    table = capsys.readouterr().out
    assert (
        "| SM MHz p50 [min] | power W p50 [max] | GPU busy % p50 | clock events | load max |"
        in table
    )
    assert "| 1450.0 [1400.0] | 699.5 [700.0] | 78.5 | power cap | 4.0 |" in table


def test_unreadable_telemetry_values_are_left_out():
    text = _telemetry([("2026/12/04 20:00:06.000", 1980.0, 500.0, 0x0, 1.0, 99)])
    text += "2026/12/04 20:00:07.000, [N/A], 3201, [N/A], 60, [N/A], [N/A], 1.5\n"
    text += "not a timestamp, 1, 2, 3, 4, 5, 0x0, 1\n"
    samples = step_timeline.parse_telemetry(text)
    assert len(samples) == 2
    assert (samples[1].sm_mhz, samples[1].power_w, samples[1].reasons) == (None, None, None)
    assert (samples[0].busy_pct, samples[1].busy_pct) == (99.0, None)
    window = (samples[0].moment, samples[1].moment)
    state = step_timeline.gpu_state(samples, window)
    assert state is not None
    assert (state.samples, state.sm_mhz_min, state.load_max, state.busy_pct_p50) == (
        2,
        1980.0,
        1.5,
        99.0,
    )


@pytest.mark.parametrize("reasons_field", ["clocks_event_reasons", "clocks_throttle_reasons"])
def test_the_device_scripts_telemetry_parses(tmp_path, reasons_field):
    """scripts/gpu-rank-slice's sampler, run with a stand-in nvidia-smi that knows only one
    name of the clock-event field, writes what parse_telemetry reads."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu-rank-slice"
    stub = tmp_path / "bin" / "nvidia-smi"
    stub.parent.mkdir()
    stub.write_text(
        "#!/bin/bash\n"
        f'case "$*" in *{reasons_field}*) ;; *) exit 6 ;; esac\n'
        'echo "2026/12/04 20:30:00.250, 1755, 3201, 612.50, 55, 97, 0x0000000000000004"\n'
    )
    stub.chmod(0o755)
    out = tmp_path / "round"
    out.mkdir()
    sampler = (
        f"source <(sed -n '/^sample_gpu() {{/,/^}}/p' {script}); "
        f"sample_gpu {out} {out}/stop & sleep 1.5; touch {out}/stop; wait"
    )
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", sampler], check=True, env=env, timeout=30)
    text = (out / "telemetry.csv").read_text()
    assert text.splitlines()[0].split(",")[-2] == f"{reasons_field}.active"
    samples = step_timeline.parse_telemetry(text)
    assert samples, text
    first = samples[0]
    assert (first.sm_mhz, first.power_w, first.reasons, first.busy_pct) == (
        1755.0,
        612.5,
        0x4,
        97.0,
    )
    assert first.load is not None


def _host_row(moment: str, **figures: float) -> str:
    """A host.csv line with ``figures`` (by column name) and every other cell empty."""
    cells = [moment] + [
        "" if (value := figures.get(name)) is None else str(value)
        for name in host_sampler.COLUMNS[1:]
    ]
    return ",".join(cells)


def test_each_level_gets_the_hosts_cpu_use_of_its_own_window(tmp_path, capsys):
    """host.csv (benchmarks.host_sampler) is matched to levels as telemetry.csv is, less the
    level's first second (a row covers the second before it); an empty cell (no server yet,
    or its first sample) is left out of the median, and a row cut short is left out."""
    first, _ = simulate(seed=7, concurrency=4, prefill_steps={})
    second, _ = simulate(seed=8, concurrency=4, prefill_steps={})
    first |= {"date": "20261204-200010", "duration": 5.0}  # ran 20:00:05 to 20:00:10
    second |= {"date": "20261204-200030", "duration": 5.0}  # ran 20:00:25 to 20:00:30
    rounds = tmp_path / "round"
    path = rounds / "flashinfer" / "round-1" / "bench"
    path.mkdir(parents=True)
    (path / "prefill-64k-c8-c8-round1.json").write_text(json.dumps(first))
    (path / "decode-32k-c64-c64-round1.json").write_text(json.dumps(second))
    busy = {
        "api_server_cpu_pct": 45.5,
        "api_server_main_thread_pct": 40.0,
        "client_main_thread_pct": 7.0,
        "engine_core_main_thread_pct": 99.0,
        "engine_core_busiest_other_thread_pct": 20.0,
        "engine_core_main_thread_runqueue_wait_pct": 4.0,
        "machine_cpu_busy_pct": 13.0,
        "machine_cpu_steal_pct": 0.5,
    }
    rows = [
        _host_row("2026/12/04 20:00:01.000"),  # before the server
        # the level's first second, which the row's interval mostly precedes
        _host_row("2026/12/04 20:00:05.500", **{name: 1000.0 for name in busy}),
        _host_row(  # the engine core's first reading
            "2026/12/04 20:00:06.000", api_server_cpu_pct=40.0, machine_cpu_busy_pct=12.0
        ),
        _host_row("2026/12/04 20:00:07.000", **busy),
        _host_row("2026/12/04 20:00:08.000", **{name: value + 2 for name, value in busy.items()}),
        _host_row("2026/12/04 20:00:27.000", **{name: value / 2 for name, value in busy.items()}),
        "2026/12/04 20:00:28.000,10,11,12,3",  # cut short as the file was copied
    ]
    text = ",".join(host_sampler.COLUMNS) + "\n" + "\n".join(rows) + "\n"
    (rounds / "host.csv").write_text(text)
    assert len(step_timeline.parse_host(text)) == 6
    with tarfile.open(tmp_path / "rounds.tar.gz", "w:gz") as archive:
        archive.add(rounds / "flashinfer", arcname="flashinfer")
        archive.add(rounds / "host.csv", arcname="host.csv")
    by_scenario = {row.scenario: row for row in step_timeline.summaries(rounds)}
    assert {row.scenario: row.host for row in by_scenario.values()} == {
        row.scenario: row.host for row in step_timeline.summaries(tmp_path / "rounds.tar.gz")
    }
    prefill = by_scenario["prefill-64k-c8"].host
    assert prefill is not None and prefill.samples == 3
    assert prefill.p50["api_server_cpu_pct"] == 45.5  # of 40.0, 45.5 and 47.5
    assert prefill.p50["machine_cpu_busy_pct"] == 13.0  # of 12.0, 13.0 and 15.0
    assert prefill.p50["engine_core_main_thread_pct"] == 100.0  # of 99.0 and 101.0
    assert prefill.p50["client_main_thread_pct"] == 8.0
    decode = by_scenario["decode-32k-c64"].host
    assert decode is not None and decode.samples == 1
    assert decode.p50["engine_core_main_thread_pct"] == 49.5
    assert by_scenario["prefill-64k-c8"].gpu is None  # no telemetry.csv in this source
    assert step_timeline.main([str(rounds)]) == 0
    table = capsys.readouterr().out
    assert "GPU busy % p50" not in table
    assert (
        "| API server CPU % p50 | API server main thread % p50 | client main thread % p50 "
        "| engine core main thread % p50 | engine core busiest other thread % p50 "
        "| engine core main thread waiting for a CPU % p50 | machine CPU busy % p50 "
        "| machine CPU steal % p50 |" in table
    )
    assert "| 45.5 | 41.0 | 8.0 | 100.0 | 21.0 | 5.0 | 13.0 | 1.5 |" in table
    assert "| 22.8 | 20.0 | 3.5 | 49.5 | 10.0 | 2.0 | 6.5 | 0.2 |" in table
    header, rule, *lines = table.splitlines()[4:]
    assert all(line.count("|") == header.count("|") == rule.count("|") for line in lines)
