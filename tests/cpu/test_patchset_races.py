"""apply and revert against a tree whose directories are swapped for symbolic links meanwhile.

Whoever can write the target can exchange a directory apply or revert has checked with a
link to somewhere else (``renameat2(RENAME_EXCHANGE)`` in a loop, from another process). Each
try runs the command while a swapper process exchanges ``vllm/sub`` with ``vllm/sub-link``
(a link to ``outside/sub``), then stops the swapper, puts the directory back and checks: not
a byte, mode or name changed outside the target, no temporary file left anywhere, and a
command that said it succeeded left its work inside the target. The tries are bounded in
time (``RACE_SECONDS`` per command), so the test costs the same on any machine; the count of
tries and of escapes is printed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from patchset_helpers import SyntheticSeries, tree_manifest

from vllm_minimax.cli import main

RACE_SECONDS = float(os.environ.get("VLLM_MINIMAX_RACE_SECONDS", "3"))
MIN_TRIES = 5
STATE_FILE = "vllm/.vllm_minimax_state.json"
TEMP_SUFFIX = ".vllm-minimax-tmp"
MODULE = "".join(f"sub line {i}\n" for i in range(40))
VICTIM = "someone else's file\n"
BASE_FILES = {"vllm/__init__.py": "", "vllm/sub/mod.py": MODULE, "vllm/sub/keep.py": "k = 1\n"}

# Exchanges two names as fast as it can; falls back to three renames where the kernel or
# file system has no RENAME_EXCHANGE. Runs until killed.
SWAPPER = r"""
import ctypes, os, sys
first, second = (name.encode() for name in sys.argv[1:3])
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
exchange = getattr(libc, "renameat2", None)
if exchange is None or exchange(AT_FDCWD, first, AT_FDCWD, second, RENAME_EXCHANGE) != 0:
    spare = first + b".spare"
    while True:
        try:
            os.rename(first, spare); os.rename(second, first); os.rename(spare, second)
        except OSError:
            pass
while True:
    exchange(AT_FDCWD, first, AT_FDCWD, second, RENAME_EXCHANGE)
"""


@dataclass
class Arena:
    template: Path
    target: Path
    outside: Path

    @property
    def sub(self) -> Path:
        return self.target / "vllm" / "sub"

    @property
    def link(self) -> Path:
        return self.target / "vllm" / "sub-link"

    def reset(self) -> None:
        shutil.rmtree(self.target)
        shutil.copytree(self.template, self.target, symlinks=True)

    def straighten(self) -> None:
        """Put the real directory back at vllm/sub (the swapper is stopped)."""
        spare = self.target / "vllm" / "sub.spare"
        if spare.exists() or spare.is_symlink():
            if not self.sub.exists() and not self.sub.is_symlink():
                spare.rename(self.sub)
            elif not self.link.exists() and not self.link.is_symlink():
                spare.rename(self.link)
        if self.sub.is_symlink():
            self.sub.rename(spare)
            self.link.rename(self.sub)
            spare.rename(self.link)
        assert self.sub.is_dir() and not self.sub.is_symlink()
        assert self.link.is_symlink()

    def litter(self) -> list[str]:
        return [
            os.path.join(directory, name)
            for directory, _, names in os.walk(self.target.parent)
            for name in names
            if name.endswith(TEMP_SUFFIX)
        ]


@pytest.fixture
def arena(
    make_series: Callable[..., SyntheticSeries], use_patches_root: Callable[[Path], None]
) -> Arena:
    patched = MODULE.replace("sub line 7\n", "sub line 7 patched\n")
    series = make_series(
        BASE_FILES,
        [("Patch sub", {"vllm/sub/mod.py": patched, "vllm/sub/new.py": "new = 1\n"})],
    )
    use_patches_root(series.patches_root)
    outside = series.target.parent / "outside"
    (outside / "sub").mkdir(parents=True)
    # What the link leads to looks like the real directory, so every check passes through it.
    for name, content in (("mod.py", MODULE), ("keep.py", "k = 1\n")):
        (outside / "sub" / name).write_text(content)
    for name in ("victim-write.txt", "victim-delete.txt"):
        (outside / "sub" / name).write_text(VICTIM)
        (outside / "sub" / name).chmod(0o600)
    (series.target / "vllm" / "sub-link").symlink_to(outside / "sub")
    template = series.target.parent / "template"
    shutil.copytree(series.target, template, symlinks=True)
    return Arena(template, series.target, outside)


@pytest.fixture
def swapper(arena: Arena) -> Iterator[Callable[[bool], None]]:
    """``run(True)`` lets the swapper exchange vllm/sub and vllm/sub-link, ``run(False)``
    stops it (and waits until it has stopped)."""
    process = subprocess.Popen(
        [sys.executable, "-c", SWAPPER, str(arena.sub), str(arena.link)],
        start_new_session=True,
    )
    os.kill(process.pid, signal.SIGSTOP)
    os.waitpid(process.pid, os.WUNTRACED)

    def run(going: bool) -> None:
        if going:
            os.kill(process.pid, signal.SIGCONT)
        else:
            os.kill(process.pid, signal.SIGSTOP)
            os.waitpid(process.pid, os.WUNTRACED)

    try:
        yield run
    finally:
        process.kill()
        process.wait()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def craft_state(arena: Arena) -> None:
    """One entry that revert would overwrite with chosen bytes and one it would delete, each
    a copy of an outside file placed in vllm/sub (what someone who can write the tree can do)."""
    state_path = arena.target / STATE_FILE
    state = json.loads(state_path.read_text())
    chosen = b"attacker's bytes\n"
    state["files"].append(
        {
            "path": "vllm/sub/victim-write.txt",
            "before": {
                "sha256": hashlib.sha256(chosen).hexdigest(),
                "mode": 0o644,
                "content_base64": base64.b64encode(chosen).decode(),
            },
            "after": {"sha256": sha256_text(VICTIM)},
        }
    )
    state["files"].append(
        {
            "path": "vllm/sub/victim-delete.txt",
            "before": None,
            "after": {"sha256": sha256_text(VICTIM)},
        }
    )
    state_path.write_text(json.dumps(state))
    for name in ("victim-write.txt", "victim-delete.txt"):
        (arena.sub / name).write_text(VICTIM)


def race(
    arena: Arena,
    swapper: Callable[[bool], None],
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> tuple[int, int, list[str]]:
    outside = tree_manifest(arena.outside)
    tries = escapes = 0
    problems: list[str] = []
    deadline = time.monotonic() + RACE_SECONDS
    while time.monotonic() < deadline or tries < MIN_TRIES:
        arena.reset()
        if command == "revert":
            assert main(["apply", "--target", str(arena.target)]) == 0
            craft_state(arena)
        capsys.readouterr()
        swapper(True)
        try:
            code = main([command, "--target", str(arena.target)])
        finally:
            swapper(False)
        err = capsys.readouterr().err
        arena.straighten()
        tries += 1
        escaped = tree_manifest(arena.outside) != outside
        escapes += escaped
        left = arena.litter()
        if escaped:
            problems.append(f"try {tries}: {command} changed {arena.outside} (exit {code})")
        if left:
            problems.append(f"try {tries}: temporary files left: {left}")
        if code == 0 and command == "apply":
            if "sub line 7 patched" not in (arena.sub / "mod.py").read_text():
                problems.append(f"try {tries}: apply said it applied, but vllm/sub is unpatched")
        elif code != 0:
            assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        if escaped:  # put the outside back for the next try
            shutil.rmtree(arena.outside / "sub")
            (arena.outside / "sub").mkdir()
            for name, content in (("mod.py", MODULE), ("keep.py", "k = 1\n")):
                (arena.outside / "sub" / name).write_text(content)
            for name in ("victim-write.txt", "victim-delete.txt"):
                (arena.outside / "sub" / name).write_text(VICTIM)
                (arena.outside / "sub" / name).chmod(0o600)
        for path in arena.litter():
            os.unlink(path)
    return tries, escapes, problems


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_swapping_a_checked_directory_for_a_link_never_reaches_outside(
    arena: Arena,
    swapper: Callable[[bool], None],
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    tries, escapes, problems = race(arena, swapper, capsys, command)
    with capsys.disabled():
        print(f"\n{command}: {tries} tries in {RACE_SECONDS:g} s, {escapes} reached outside")
    assert problems == [], problems
