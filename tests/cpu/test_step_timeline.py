"""benchmarks/step_timeline.py: the engine's steps recovered from the client's per-request
token times, checked against a simulated engine whose steps are known."""

from __future__ import annotations

import itertools
import json
import random
import tarfile

import pytest

from benchmarks import step_timeline


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
