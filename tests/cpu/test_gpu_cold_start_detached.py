"""scripts/gpu-cold-start's detached phases: `start` outlives its call, `wait` collects.

The phase itself is a stand-in (``COLD_START_SELF``): the script's `start` and `wait` come
before anything that needs a GPU, so what is tested is theirs: the phase runs on after the
call that started it returns, a second `start` is refused while it runs, `wait` copies what
the phase has written so far and ends with the phase's own exit status.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from patchset_helpers import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu-cold-start"

# Writes a first file, waits for `go`, then writes its summary and exits 3.
STAND_IN = """#!/usr/bin/env bash
echo "$*" > "$OUT/args.txt"
echo partial > "$OUT/partial.txt"
while [ ! -f "$GO_FILE" ]; do sleep 0.2; done
echo '{"done": true}' > "$OUT/summary.json"
exit 3
"""


def _call(tmp_path: Path, out: str, *args: str) -> subprocess.CompletedProcess[str]:
    stand_in = tmp_path / "phase"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    env = {
        **os.environ,
        "COLD_START_SELF": str(stand_in),
        "COLD_START_WORK": str(tmp_path / "work"),
        "GO_FILE": str(tmp_path / "go"),
        "OUT": str(tmp_path / out),
        "WAIT_S": "1",
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_a_detached_phase_outlives_its_call_and_wait_collects_it(tmp_path: Path) -> None:
    started = _call(tmp_path, "out1", "start", "run", "rank-mxfp8-ep", "empty")
    assert started.returncode == 0, started.stderr
    assert "still running after" in started.stdout
    assert (tmp_path / "out1" / "partial.txt").read_text() == "partial\n"
    assert not (tmp_path / "out1" / "summary.json").exists()
    again = _call(tmp_path, "out2", "start", "run", "rank-mxfp8-ep", "carried")
    assert again.returncode == 2 and "'run rank-mxfp8-ep empty' is still running" in again.stderr
    (tmp_path / "go").touch()
    waited = _call(tmp_path, "out3", "wait", "30")
    assert waited.returncode == 3, waited.stdout + waited.stderr
    assert "run rank-mxfp8-ep empty finished: exit status 3" in waited.stdout
    assert (tmp_path / "out3" / "summary.json").read_text() == '{"done": true}\n'
    assert (tmp_path / "out3" / "args.txt").read_text() == "run rank-mxfp8-ep empty\n"
    # Once it ended, another phase may start (this one ends within the call's wait).
    after = _call(tmp_path, "out4", "start", "report")
    assert after.returncode == 3 and "report finished: exit status 3" in after.stdout


def test_bad_calls_are_one_message_and_change_nothing(tmp_path: Path) -> None:
    nothing = _call(tmp_path, "out", "wait", "10")
    assert nothing.returncode == 2 and "no detached phase was started here" in nothing.stderr
    unknown = _call(tmp_path, "out", "start", "bogus")
    assert unknown.returncode == 2 and "no phase 'bogus'" in unknown.stderr
    assert not (tmp_path / "work" / "detached").exists()
    (tmp_path / "go").touch()
    assert _call(tmp_path, "out", "start", "report").returncode == 3
    garbled = _call(tmp_path, "out", "wait", "soon")
    assert garbled.returncode == 2 and "SECONDS must be a number" in garbled.stderr
