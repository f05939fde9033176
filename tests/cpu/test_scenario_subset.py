"""benchmarks.scenario_subset: the rounds of scripts/gpu-rank-slice and scripts/gpu-tp send
exactly the scenarios named, in the order named, and an unknown name stops the round."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from benchmarks.scenario_subset import main

REPO = Path(__file__).resolve().parents[2]
RANK_PRESET = REPO / "evals" / "throughput" / "m3-rank.yaml"


def _names(path: Path) -> list[str]:
    return [scenario["name"] for scenario in yaml.safe_load(path.read_text())["scenarios"]]


def test_the_named_scenarios_in_the_order_named(tmp_path):
    target = tmp_path / "subset.yaml"
    assert (
        main([str(RANK_PRESET), str(target), "prefill-64k-c1", "decode-32k-c32", "prefill-64k-c1"])
        == 0
    )
    assert _names(target) == ["prefill-64k-c1", "decode-32k-c32"]
    source = yaml.safe_load(RANK_PRESET.read_text())
    subset = yaml.safe_load(target.read_text())
    assert subset["seed"] == source["seed"]
    by_name = {scenario["name"]: scenario for scenario in source["scenarios"]}
    assert subset["scenarios"] == [by_name["prefill-64k-c1"], by_name["decode-32k-c32"]]


def test_no_names_keeps_every_scenario(tmp_path):
    target = tmp_path / "all.yaml"
    assert main([str(RANK_PRESET), str(target)]) == 0
    assert _names(target) == _names(RANK_PRESET)


def test_an_unknown_name_writes_nothing(tmp_path):
    target = tmp_path / "subset.yaml"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.scenario_subset",
            str(RANK_PRESET),
            str(target),
            "decode-32k-c32",
            "decode-1m-c1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr.startswith(
        "scenario_subset: unknown scenario(s) decode-1m-c1; known: decode-8k-c1,"
    )
    assert not target.exists()
