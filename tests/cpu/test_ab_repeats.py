"""benchmarks/ab_repeats.py: medians and ranges over repeated eval ab runs, arms matched by
name whatever their order, ratios taken within each run."""

from __future__ import annotations

import json

import pytest

from benchmarks import ab_repeats


def _level(concurrency: int, tok_s: float, ttft: float, tpot: float) -> dict:
    return {
        "concurrency": concurrency,
        "output_tokens_per_s": tok_s,
        "ttft_ms": {"p50": ttft, "p99": 2 * ttft},
        "tpot_ms": {"p50": tpot, "p99": 2 * tpot},
    }


def _run(order: list[str], tok_s: dict[str, float]) -> dict:
    return {
        "arms": [
            {
                "name": name,
                "throughput": {
                    "scenarios": [
                        {"name": "decode-32k-c32", "levels": [_level(32, tok_s[name], 900, 20)]}
                    ]
                },
            }
            for name in order
        ]
    }


@pytest.fixture
def run_dirs(tmp_path):
    runs = [
        _run(["triton", "flashinfer"], {"triton": 800.0, "flashinfer": 880.0}),
        _run(["flashinfer", "triton"], {"triton": 760.0, "flashinfer": 836.0}),
        _run(["triton", "flashinfer"], {"triton": 840.0, "flashinfer": 840.0}),
    ]
    for index, run in enumerate(runs, 1):
        (tmp_path / "runs" / f"rep{index}").mkdir(parents=True)
        (tmp_path / "runs" / f"rep{index}" / "ab.json").write_text(json.dumps(run))
    return tmp_path


def test_medians_ranges_and_per_run_ratios(run_dirs, capsys):
    out = run_dirs / "out"
    assert ab_repeats.main([str(run_dirs / "runs"), "--out", str(out)]) == 0
    summary = json.loads((out / "repeats.json").read_text())
    assert summary["runs"] == 3
    (point,) = summary["points"]
    triton = point["arms"]["triton"]
    assert triton["tok/s"] == {"median": 800.0, "min": 760.0, "max": 840.0, "n": 3}
    assert triton["tok/s per GPU"]["median"] == pytest.approx(100.0)
    assert point["arms"]["flashinfer"]["tok/s"]["median"] == 840.0
    # 880/800, 836/760 and 840/840, each within its own run.
    assert point["ratio"]["median"] == pytest.approx(1.1)
    assert point["ratio"]["min"] == pytest.approx(1.0)
    assert point["arms"]["triton"]["TTFT p99 ms"]["median"] == 1800
    text = (out / "repeats.md").read_text()
    assert "| decode-32k-c32 | 32 | 100.0 [95.0-105.0] (n=3) |" in text
    assert "1.100 [1.000-1.100] (n=3) |" in text
    assert "| flashinfer / triton tok/s (paired) |" in text
    assert "one ratio per round that measured both arms, not the ratio of the arms' medians" in text
    assert text in capsys.readouterr().out


def test_no_runs_exit_2(tmp_path, capsys):
    assert ab_repeats.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "no ab.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_rounds_of_one_run_pair_by_round_and_itl_is_reported(tmp_path):
    """`eval ab --repeat 2` in one ab.json: each round's ratio comes from that round."""
    run = _run(["triton", "flashinfer"], {"triton": 800.0, "flashinfer": 880.0})
    for arm, second in zip(run["arms"], (400.0, 600.0), strict=True):
        (scenario,) = arm["throughput"]["scenarios"]
        first = scenario["levels"][0]
        first["round"] = 0
        first["itl_ms"] = {"p50": 17.0}
        scenario["levels"].append({**_level(32, second, 900, 20), "round": 1})
    (tmp_path / "ab.json").write_text(json.dumps(run))
    assert ab_repeats.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    (point,) = json.loads((tmp_path / "out" / "repeats.json").read_text())["points"]
    # 880/800 in round 0 and 600/400 in round 1, never 600/800 or 880/400.
    assert sorted(point["ratio"][k] for k in ("min", "max")) == pytest.approx([1.1, 1.5])
    assert point["arms"]["triton"]["tok/s"]["n"] == 2
    assert point["arms"]["triton"]["ITL p50 ms"] == {
        "median": 17.0,
        "min": 17.0,
        "max": 17.0,
        "n": 1,
    }
    assert "triton ITL p50 ms" in (tmp_path / "out" / "repeats.md").read_text()


def test_ran_at_once_max_is_each_levels_max(tmp_path):
    """The 'ran at once max' figure pools each level's max of requests running at once, not
    its median (a level ramps up: its median is lower)."""
    run = _run(["triton", "flashinfer"], {"triton": 800.0, "flashinfer": 880.0})
    for arm, peak in zip(run["arms"], (18.0, 30.0), strict=True):
        (level,) = arm["throughput"]["scenarios"][0]["levels"]
        level["running_requests"] = {"max": peak, "median": peak / 3, "waiting_max": 0.0}
    (tmp_path / "ab.json").write_text(json.dumps(run))
    assert ab_repeats.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    (point,) = json.loads((tmp_path / "out" / "repeats.json").read_text())["points"]
    assert point["arms"]["triton"]["ran at once max"]["median"] == 18.0
    assert point["arms"]["flashinfer"]["ran at once max"]["median"] == 30.0


def test_latency_ratios_pair_within_each_round(tmp_path):
    """ITL and TTFT ratios come from one round's two arms; a round where one arm has no ITL
    gives no ITL ratio."""
    itl = [(17.5, 17.1), (17.8, 17.4), (None, 17.0)]  # (triton, flashinfer) per run
    ttft = [(1100.0, 1056.0), (1600.0, 1560.0), (1000.0, 990.0)]
    for index, ((itl_t, itl_f), (ttft_t, ttft_f)) in enumerate(zip(itl, ttft, strict=True)):
        run = _run(["flashinfer", "triton"], {"triton": 800.0, "flashinfer": 800.0})
        for arm in run["arms"]:
            (level,) = arm["throughput"]["scenarios"][0]["levels"]
            own_itl, own_ttft = (itl_t, ttft_t) if arm["name"] == "triton" else (itl_f, ttft_f)
            level["ttft_ms"]["p50"] = own_ttft
            if own_itl is not None:
                level["itl_ms"] = {"p50": own_itl}
        (tmp_path / f"r{index}").mkdir()
        (tmp_path / f"r{index}" / "ab.json").write_text(json.dumps(run))
    out = tmp_path / "out"
    assert ab_repeats.main([str(tmp_path), "--out", str(out)]) == 0
    (point,) = json.loads((out / "repeats.json").read_text())["points"]
    ratios = point["ratios"]
    assert ratios["ITL p50 ms"]["n"] == 2
    assert ratios["ITL p50 ms"]["min"] == pytest.approx(17.1 / 17.5)
    assert ratios["ITL p50 ms"]["max"] == pytest.approx(17.4 / 17.8)
    # 0.96, 0.975, 0.99: the median of the per-round ratios, not a ratio of medians.
    assert ratios["TTFT p50 ms"]["median"] == pytest.approx(1560.0 / 1600.0)
    assert ratios["tok/s"]["median"] == pytest.approx(1.0)
    text = (out / "repeats.md").read_text()
    assert "paired within each round" in text
    assert "0.975 [0.960-0.990] (n=3)" in text


def _bench_run(
    tok_s: dict[str, tuple[float, float]], seeded: bool, itl: dict[str, float] | None = None
) -> dict:
    """Two vllm-bench scenarios on each arm's server, with or without per-level seeds; each
    level's ITL p50 is the arm's `itl`."""
    arms = []
    for name, (first, second) in tok_s.items():
        scenarios = []
        for scenario, value, seed in (("decode-8k-c1", first, 11), ("decode-8k-c8", second, 12)):
            level = {**_level(1, value, 200, 6), "round": 0}
            level["itl_ms"] = {"p50": (itl or {}).get(name, 9.0)}
            if seeded:
                level["prompt_seed"] = seed
            scenarios.append({"name": scenario, "client": "vllm-bench", "levels": [level]})
        arms.append({"name": name, "throughput": {"scenarios": scenarios}})
    return {"arms": arms}


def test_levels_that_resent_prompts_are_pooled_apart(tmp_path):
    """Before level seeds, a bench level after the first on a server re-sent its prompts:
    it is its own point, and its ratio pairs only with levels like it."""
    runs = {
        "old": _bench_run(
            {"triton": (100.0, 400.0), "flashinfer": (110.0, 600.0)},
            seeded=False,
            itl={"triton": 10.0, "flashinfer": 9.0},
        ),
        "new": _bench_run(
            {"triton": (100.0, 500.0), "flashinfer": (120.0, 500.0)},
            seeded=True,
            itl={"triton": 10.0, "flashinfer": 9.5},
        ),
    }
    for name, run in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "ab.json").write_text(json.dumps(run))
    out = tmp_path / "out"
    assert ab_repeats.main([str(tmp_path), "--out", str(out)]) == 0
    points = {p["scenario"]: p for p in json.loads((out / "repeats.json").read_text())["points"]}
    assert sorted(points) == [
        "decode-8k-c1",
        "decode-8k-c8",
        f"decode-8k-c8{ab_repeats.RESENT}",
    ]
    assert points["decode-8k-c1"]["arms"]["triton"]["tok/s"]["n"] == 2
    assert points["decode-8k-c8"]["ratio"] == {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1}
    assert points[f"decode-8k-c8{ab_repeats.RESENT}"]["ratio"]["median"] == pytest.approx(1.5)
    text = (out / "repeats.md").read_text()
    assert "re-sent prompts an earlier level" in text
    # The decode step pools every round: the prompts a level sent do not change it.
    steps = {
        p["scenario"]: p for p in json.loads((out / "repeats.json").read_text())["decode_steps"]
    }
    assert sorted(steps) == ["decode-8k-c1", "decode-8k-c8"]
    c8 = steps["decode-8k-c8"]
    assert c8["arms"]["flashinfer"] == {"median": 9.25, "min": 9.0, "max": 9.5, "n": 2}
    assert (c8["ratio"]["min"], c8["ratio"]["max"], c8["ratio"]["n"]) == (0.9, 0.95, 2)
    assert "| decode-8k-c8 | 1 | 10.00 [10.00-10.00] (n=2) | 9.25 [9.00-9.50] (n=2) |" in text


def test_no_decode_step_table_without_resent_levels(tmp_path):
    run = _bench_run({"triton": (100.0, 500.0), "flashinfer": (120.0, 500.0)}, seeded=True)
    (tmp_path / "ab.json").write_text(json.dumps(run))
    assert ab_repeats.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert "decode_steps" not in json.loads((tmp_path / "out" / "repeats.json").read_text())
    assert "over every round" not in (tmp_path / "out" / "repeats.md").read_text()


def test_own_client_scenario_named_bench_is_its_own_pool(tmp_path):
    """A scenario run by this project's client re-sent only its own earlier levels' prompts,
    whatever its name; vllm bench's levels share one pool per round."""
    run = _bench_run({"triton": (100.0, 400.0), "flashinfer": (110.0, 600.0)}, seeded=False)
    for arm in run["arms"]:
        own = {**_level(1, 50.0, 200, 6), "round": 0}
        arm["throughput"]["scenarios"].insert(
            0, {"name": "bench", "client": "own", "levels": [own]}
        )
    (tmp_path / "ab.json").write_text(json.dumps(run))
    assert ab_repeats.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    points = json.loads((tmp_path / "out" / "repeats.json").read_text())["points"]
    assert sorted(p["scenario"] for p in points) == [
        "bench",
        "decode-8k-c1",
        f"decode-8k-c8{ab_repeats.RESENT}",
    ]


def test_the_plot_draws_each_metrics_paired_ratios(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    for index, flashinfer in enumerate((880.0, 800.0, 960.0), 1):
        run = _run(["triton", "flashinfer"], {"triton": 800.0, "flashinfer": flashinfer})
        (tmp_path / "runs" / f"rep{index}").mkdir(parents=True)
        (tmp_path / "runs" / f"rep{index}" / "ab.json").write_text(json.dumps(run))

    drawn = []
    bars = []
    original = plt.Figure.savefig

    def capture(figure, *args, **kwargs):
        drawn.append(
            [
                (
                    axis.get_title(),
                    [list(line.get_xdata()) for line in axis.lines if line.get_marker() == "o"],
                )
                for axis in figure.axes
            ]
        )
        first = figure.axes[0].collections[0].get_segments()
        bars.extend([float(x) for x, _ in segment] for segment in first)
        return original(figure, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", capture)
    out = tmp_path / "out"
    assert ab_repeats.main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert (out / "repeats.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![The paired ratios of every point](repeats.png)" in (out / "repeats.md").read_text()
    (panels,) = drawn
    # tok/s 1.1 (median of 1.1, 1.0, 1.2); TTFT and TPOT equal in both arms; no ITL measured.
    assert panels == [
        ("tok/s", [[pytest.approx(1.1)]]),
        ("TTFT p50", [[1.0]]),
        ("TPOT p50", [[1.0]]),
        ("ITL p50", []),
    ]
    assert bars == [[pytest.approx(1.0), pytest.approx(1.2)]]  # tok/s's min..max


def test_no_plot_for_one_arm(run_dirs):
    out = run_dirs / "out"
    assert ab_repeats.main([str(run_dirs / "runs"), "--out", str(out), "--arms", "triton"]) == 0
    assert not (out / "repeats.png").exists()
    assert "repeats.png" not in (out / "repeats.md").read_text()


def test_ratio_series_labels_and_the_pooled_decode_step():
    assert ab_repeats.point_label("decode-8k-c8", 8) == "decode-8k-c8"
    assert ab_repeats.point_label(f"decode-8k-c8{ab_repeats.RESENT}", 8) == (
        f"decode-8k-c8{ab_repeats.RESENT}"
    )
    assert ab_repeats.point_label("decode-8k-c16", 1) == "decode-8k-c16, c=1"
    assert ab_repeats.point_label("decode", 32) == "decode, c=32"
    runs = [
        _bench_run(
            {"triton": (100.0, 400.0), "flashinfer": (110.0, 600.0)},
            seeded=False,
            itl={"triton": 10.0, "flashinfer": 9.0},
        ),
        _bench_run(
            {"triton": (100.0, 500.0), "flashinfer": (120.0, 500.0)},
            seeded=True,
            itl={"triton": 10.0, "flashinfer": 9.5},
        ),
    ]
    summary = ab_repeats.summarise(runs, ["triton", "flashinfer"], 8)
    tok = dict(ab_repeats.ratio_series(summary, "tok/s"))
    assert list(tok) == [
        "decode-8k-c1",
        f"decode-8k-c8{ab_repeats.RESENT}, c=1",
        "decode-8k-c8, c=1",
    ]
    assert tok[f"decode-8k-c8{ab_repeats.RESENT}, c=1"]["median"] == pytest.approx(1.5)
    # ITL pools every round, re-sent prompts or not, as the decode-step table does.
    itl = dict(ab_repeats.ratio_series(summary, "ITL p50 ms"))
    assert list(itl) == ["decode-8k-c1", "decode-8k-c8, c=1"]
    assert (itl["decode-8k-c8, c=1"]["min"], itl["decode-8k-c8, c=1"]["n"]) == (0.9, 2)
