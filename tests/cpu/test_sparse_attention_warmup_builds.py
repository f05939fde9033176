"""benchmarks.sparse_attention_warmup_builds, its host side: the rounds, the log line, which
starts count, the summary and the option checks (the starts themselves need an SM90 GPU)."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import sparse_attention_warmup_builds as bench

LINE = (
    "MiniMax M3 sparse attention warm-up: 1025 FlashInfer launches ready in 14.2s, holding"
    " 2.11 GiB of decode scratch, 2.36 GiB less free GPU memory; 7 programs built or loaded"
    " side by side in 11.9s first [SparseAttentionWarmupGeometry(num_heads=8, ...)]"
)


def _start(arm: str, seconds: float, **changes) -> dict:
    row = {
        "arm": arm,
        "seconds": seconds,
        "programs": [f"cake_hopper_msa_{i}" for i in range(7)],
        "so_before": 0,
        "so_after": 7,
        "line": bench.parse_warmup_line(
            LINE if arm == "side-by-side" else LINE.replace("; 7 programs", "; 0 programs")
        ),
    }
    row.update(changes)
    return row


def test_the_rounds_alternate_the_arms():
    orders = [bench.arm_order(i) for i in range(4)]
    assert orders[0] == orders[2] == ("side-by-side", "serial")
    assert orders[1] == orders[3] == ("serial", "side-by-side")


def test_the_log_line_is_read_and_an_older_one_is_not():
    assert bench.parse_warmup_line(f"INFO 12-07 [x.py:1] {LINE}\n") == {
        "launches": 1025,
        "logged_s": 14.2,
        "side_by_side_programs": 7,
        "side_by_side_s": 11.9,
    }
    older = LINE.split(";")[0] + " [geometry]"
    assert bench.parse_warmup_line(older) is None


@pytest.mark.parametrize(
    "changes,fragment",
    [
        ({"so_before": 3}, "held 3 programs before"),
        ({"so_after": 5}, "5 programs built of the 7"),
        ({"line": None}, "did not finish"),
        ({"error": ["over 240s"]}, "over 240s"),
    ],
)
def test_a_start_that_does_not_count_says_why(changes, fragment):
    assert bench.start_errors(_start("side-by-side", 12.0)) == []
    assert bench.start_errors(_start("serial", 44.0)) == []
    (error,) = bench.start_errors(_start("side-by-side", 12.0, **changes))
    assert fragment in error


def test_each_arm_must_have_built_as_its_name_says():
    serial_built_at_once = _start("serial", 44.0, line=_start("side-by-side", 1.0)["line"])
    assert "side by side" in bench.start_errors(serial_built_at_once)[0]
    at_once_built_none = _start("side-by-side", 44.0, line=_start("serial", 1.0)["line"])
    assert "0 programs built side by side" in bench.start_errors(at_once_built_none)[0]


def test_the_summary_is_each_arms_median_with_its_extremes():
    rng = random.Random(64)
    fast = [round(rng.uniform(8, 16), 1) for _ in range(3)]
    slow = [round(rng.uniform(40, 48), 1) for _ in range(3)]
    rows = [_start("side-by-side", s) for s in fast] + [_start("serial", s) for s in slow]
    rows.append(_start("serial", 1.0, so_before=7))  # a warm workspace: left out
    summary = bench.summarise(rows)
    arms = summary["arms"]
    assert arms["side-by-side"]["seconds"] == fast and arms["serial"]["seconds"] == slow
    assert arms["serial"]["median_s"] == round(statistics.median(slow), 1)
    assert (arms["side-by-side"]["min_s"], arms["side-by-side"]["max_s"]) == (min(fast), max(fast))
    expected = round(round(statistics.median(slow), 1) / round(statistics.median(fast), 1), 2)
    assert summary["serial_over_side_by_side"] == expected
    assert summary["failed_starts"] == 1


def test_an_arm_without_a_start_that_counts_has_no_ratio():
    summary = bench.summarise([_start("serial", 44.0)])
    assert summary["arms"]["side-by-side"]["median_s"] is None
    assert summary["serial_over_side_by_side"] is None


@pytest.mark.parametrize(
    "option", [["--rounds", "0"], ["--max-num-seqs", "0"], ["--mtp", "-1"], ["--heads", "0"]]
)
def test_bad_options_stop_before_any_start(tmp_path: Path, option):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.sparse_attention_warmup_builds",
            "--out",
            str(out),
            *option,
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2
    assert option[0] in proc.stderr
    assert not out.exists()


def test_every_start_is_written_as_it_ends_and_a_failed_one_fails_the_run(
    tmp_path: Path, monkeypatch, capsys
):
    """The starts are subprocesses: stood in for here by ones that print a start's JSON (or
    exit 1), each with its own empty workspace."""
    seen = []

    def run(command, **kwargs):
        arm = command[command.index("--child") + 1]
        workspace = Path(kwargs["env"]["FLASHINFER_WORKSPACE_BASE"])
        seen.append((arm, workspace))
        assert workspace.is_dir() and not any(workspace.iterdir())
        if len(seen) == 4:
            return subprocess.CompletedProcess(command, 1, "", "Traceback\nRuntimeError: nvcc\n")
        row = _start(arm, 12.0 if arm == "side-by-side" else 44.0, gpu="NVIDIA H100 80GB HBM3")
        return subprocess.CompletedProcess(command, 0, json.dumps(row) + "\n", "")

    monkeypatch.setattr(bench.subprocess, "run", run)
    monkeypatch.setenv("COMMIT", "abc1234")
    code = bench.main(["--out", str(tmp_path), "--rounds", "2"])
    assert code == 1
    assert [arm for arm, _ in seen] == ["side-by-side", "serial", "serial", "side-by-side"]
    assert len({workspace for _, workspace in seen}) == 4
    written = json.loads((tmp_path / "warmup_builds.json").read_text())
    assert written["commit"] == "abc1234" and len(written["starts"]) == 4
    assert written["starts"][3]["error"][0] == "exit 1"
    assert written["summary"]["serial_over_side_by_side"] == round(44.0 / 12.0, 2)
    printed = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3, commit abc1234, 2 rounds" in printed
