"""scripts/setup-cpu-server on a machine without the CPU torch wheel: one message before
anything is made; a venv already made from the lock needs no wheel."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from patchset_helpers import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "setup-cpu-server"
LOCK = REPO_ROOT / "requirements" / "cpu-server.lock"


def run_setup(venv: Path, find_links: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "VLLM_MINIMAX_CPU_SERVER_VENV": str(venv),
        "PIP_FIND_LINKS": str(find_links),
    }
    return subprocess.run(
        [str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60, check=False
    )


def test_no_cpu_torch_wheel_is_one_message_and_makes_nothing(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl").touch()  # not the lock's
    venv = tmp_path / "venv"
    done = run_setup(venv, wheels)
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(
        f"setup-cpu-server: error: no torch-2.13.0+cpu wheel in {wheels} (PIP_FIND_LINKS,"
    )
    assert line.endswith("set PIP_FIND_LINKS to it")
    assert not venv.exists()


def test_a_venv_made_from_the_current_lock_needs_no_wheel(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    stamp = venv / ".cpu-server-lock-sha256"
    stamp.write_text(hashlib.sha256(LOCK.read_bytes()).hexdigest() + "\n")
    done = run_setup(venv, tmp_path / "no-such-directory")
    assert done.returncode == 0, done.stderr
    assert "is up to date with requirements/cpu-server.lock" in done.stdout
