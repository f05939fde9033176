"""apply and revert under faults and hostile input (issue 17).

Faults are injected at every call apply or revert makes to the os functions that change the
target (open for writing, write, fchmod, fsync, replace, rename, unlink, mkdir, rmdir): an
OSError (ENOSPC, once or from then on), a KeyboardInterrupt, a real SIGINT, or a SIGKILL in a
forked child. Each case asserts the tree is byte-identical to pristine or to applied, that no
temporary file is left, that nothing outside the target changed, one clear line, and the exit
code. A real full file system is not used: mounting one needs privileges CI may not have.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from patchset_helpers import SyntheticSeries, tree_manifest

from vllm_minimax import patchset
from vllm_minimax.cli import main
from vllm_minimax.patchset import STATE_FILE

BASE_FILES = {
    "vllm/__init__.py": "",
    "vllm/alpha.py": "".join(f"alpha line {i}\n" for i in range(40)),
    "vllm/beta.py": "".join(f"beta line {i}\n" for i in range(40)),
    "vllm/delta.py": "delta = 1\n",
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


@dataclass
class Scene:
    """A target, a directory beside it that must never change, and their manifests."""

    target: Path
    outside: Path
    pristine: dict[str, str]
    applied: dict[str, str]

    def manifest(self) -> dict[str, str]:
        return tree_manifest(self.target)

    def outside_manifest(self) -> dict[str, str]:
        return tree_manifest(self.outside)


@pytest.fixture
def scene(
    make_series: Callable[..., SyntheticSeries],
    use_patches_root: Callable[[Path], None],
    capsys: pytest.CaptureFixture[str],
) -> Scene:
    alpha = BASE_FILES["vllm/alpha.py"].replace("alpha line 5\n", "alpha line 5 patched\n")
    beta = BASE_FILES["vllm/beta.py"].replace("beta line 30\n", "beta line 30 patched\n")
    series = make_series(
        BASE_FILES,
        [
            ("Patch alpha", {"vllm/alpha.py": alpha, "vllm/new/pkg/gamma.py": "gamma = 1\n"}),
            ("Patch beta, drop delta", {"vllm/beta.py": beta, "vllm/delta.py": None}),
        ],
    )
    use_patches_root(series.patches_root)
    outside = series.target.parent / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("someone else's file\n")
    (outside / "victim.txt").chmod(0o600)
    (outside / "emptydir").mkdir()
    pristine = tree_manifest(series.target)
    assert main(["apply", "--target", str(series.target)]) == 0
    applied = tree_manifest(series.target)
    assert main(["revert", "--target", str(series.target)]) == 0
    assert tree_manifest(series.target) == pristine
    capsys.readouterr()
    return Scene(series.target, outside, pristine, applied)


def litter(root: Path) -> list[str]:
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            if name.endswith(patchset.TEMP_SUFFIX) or name.startswith(patchset.LEGACY_PROBE_PREFIX):
                found.append(os.path.join(directory, name))
    return found


# ------------------------------------------------------------------------------------------
# The injector
# ------------------------------------------------------------------------------------------


@dataclass
class Faults:
    """Counts the target-changing os calls; at call ``at`` (and, if ``persistent``, at every
    later creating call) runs ``action``."""

    target: Path
    at: int | None = None
    action: Callable[[str], None] | None = None
    persistent: bool = False
    calls: list[str] = field(default_factory=list)

    def inside(self, path: object) -> str | None:
        if isinstance(path, int):
            try:
                path = os.readlink(f"/proc/self/fd/{path}")
            except OSError:
                return None
        text = os.fspath(path)  # type: ignore[arg-type]
        if isinstance(text, bytes):
            text = text.decode()
        text = os.path.abspath(text)
        return text if text.startswith(str(self.target) + os.sep) else None

    def hit(self, name: str, path: object, creates: bool) -> None:
        where = self.inside(path)
        if where is None:
            return
        index = len(self.calls)
        self.calls.append(f"{name} {where}")
        if self.action is None or self.at is None:
            return
        if index == self.at or (self.persistent and index > self.at and creates):
            self.action(where)


def install(faults: Faults, monkeypatch: pytest.MonkeyPatch) -> None:
    real = {name: getattr(os, name) for name in WRAPPED}

    def wrap(name: str) -> Callable[..., Any]:
        function = real[name]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if name == "open":
                flags = args[1] if len(args) > 1 else kwargs.get("flags", 0)
                if flags & WRITE_FLAGS:
                    faults.hit(name, args[0], creates=bool(flags & os.O_CREAT))
            else:
                faults.hit(name, args[0], creates=name in ("write", "mkdir"))
            return function(*args, **kwargs)

        return wrapper

    for name in WRAPPED:
        monkeypatch.setattr(os, name, wrap(name))


WRAPPED = ("open", "write", "fchmod", "fsync", "replace", "rename", "unlink", "mkdir", "rmdir")


def no_space(path: str) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def keyboard_interrupt(path: str) -> None:
    raise KeyboardInterrupt


def sigint(path: str) -> None:
    os.kill(os.getpid(), signal.SIGINT)


def run_with_faults(monkeypatch: pytest.MonkeyPatch, faults: Faults, argv: list[str]) -> int:
    with monkeypatch.context() as patch:
        install(faults, patch)
        return main(argv)


def count_calls(monkeypatch: pytest.MonkeyPatch, scene: Scene, command: str) -> list[str]:
    faults = Faults(scene.target)
    assert run_with_faults(monkeypatch, faults, [command, "--target", str(scene.target)]) == 0
    assert faults.calls, f"{command} made no counted call"
    return faults.calls


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def set_tree(scene: Scene, command: str) -> None:
    """Bring the scene's target to the state before ``command``."""
    if command == "revert":
        assert main(["apply", "--target", str(scene.target)]) == 0
        assert scene.manifest() == scene.applied


def expected_before(scene: Scene, command: str) -> dict[str, str]:
    return scene.applied if command == "revert" else scene.pristine


# ------------------------------------------------------------------------------------------
# OSError / Ctrl-C at every step: rolled back, one line, exit 2 / 130
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_every_step_failing_once_rolls_back(
    scene: Scene,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    set_tree(scene, command)
    before = expected_before(scene, command)
    calls = count_calls(monkeypatch, scene, command)
    assert main(["revert" if command == "apply" else "apply", "--target", str(scene.target)]) == 0
    kinds = {call.split()[0] for call in calls}
    assert {"open", "write", "fsync", "replace"} <= kinds, kinds
    capsys.readouterr()
    outside = scene.outside_manifest()
    for index, call in enumerate(calls):
        faults = Faults(scene.target, at=index, action=no_space)
        code = run_with_faults(monkeypatch, faults, [command, "--target", str(scene.target)])
        line = one_line(capsys.readouterr().err)
        assert code == 2, (call, line)
        assert line.startswith("vllm-minimax: error: no space left on the device of "), line
        assert f"{command} was rolled back: nothing was changed" in line, (call, line)
        assert scene.manifest() == before, call
        assert litter(scene.target.parent) == [], call
        assert scene.outside_manifest() == outside


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_disk_full_from_a_step_on(
    scene: Scene,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    """Every write from step N on fails, so rolling back may fail too; then the message says
    where the tree stands and what to run, and that command brings it back."""
    set_tree(scene, command)
    before = expected_before(scene, command)
    calls = count_calls(monkeypatch, scene, command)
    assert main(["revert" if command == "apply" else "apply", "--target", str(scene.target)]) == 0
    capsys.readouterr()
    part_way = 0
    for index, call in enumerate(calls):
        faults = Faults(scene.target, at=index, action=no_space, persistent=True)
        code = run_with_faults(monkeypatch, faults, [command, "--target", str(scene.target)])
        line = one_line(capsys.readouterr().err)
        assert code == 2, (call, line)
        assert litter(scene.target.parent) == [], call
        if "nothing was changed" in line:
            assert scene.manifest() == before, call
            continue
        part_way += 1
        if not (scene.target / STATE_FILE).exists():
            assert command == "revert" and "is reverted, no state file remains" in line, line
            assert scene.manifest() == scene.pristine, call
            set_tree(scene, command)
            capsys.readouterr()
            continue
        assert "rolling back failed too" in line and "left part-way" in line, line
        assert f"vllm-minimax revert --target {scene.target}" in line, line
        # The state file is kept, so status sees an applied series (whole or in part).
        assert main(["status", "--target", str(scene.target)]) in (0, 2)
        assert main(["revert", "--target", str(scene.target)]) == 0, capsys.readouterr().err
        assert scene.manifest() == scene.pristine, call
        set_tree(scene, command)
        capsys.readouterr()
    assert part_way > 0, "no step left the tree part-way; the test exercised no recovery"


@pytest.mark.parametrize("action", [keyboard_interrupt, sigint], ids=["raised", "SIGINT"])
@pytest.mark.parametrize("command", ["apply", "revert"])
def test_ctrl_c_at_every_step_rolls_back(
    scene: Scene,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
    action: Callable[[str], None],
) -> None:
    set_tree(scene, command)
    before = expected_before(scene, command)
    calls = count_calls(monkeypatch, scene, command)
    assert main(["revert" if command == "apply" else "apply", "--target", str(scene.target)]) == 0
    capsys.readouterr()
    for index, call in enumerate(calls):
        faults = Faults(scene.target, at=index, action=action)
        code = run_with_faults(monkeypatch, faults, [command, "--target", str(scene.target)])
        line = one_line(capsys.readouterr().err)
        assert code == 130, (call, line)
        expected = "interrupted (SIGINT) during" if action is sigint else "interrupted during"
        assert line.startswith(f"vllm-minimax: {expected} {command}; "), line
        assert f"{command} was rolled back: nothing was changed" in line, (call, line)
        assert scene.manifest() == before, call
        assert litter(scene.target.parent) == [], call
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ------------------------------------------------------------------------------------------
# SIGKILL at every step (forked child): the next run recovers and cleans up
# ------------------------------------------------------------------------------------------


def killed_run(scene: Scene, command: str, at: int) -> int:
    pid = os.fork()
    if pid == 0:  # the child: die at call ``at``
        code = 99
        try:
            with pytest.MonkeyPatch.context() as patch:
                faults = Faults(
                    scene.target, at=at, action=lambda _: os.kill(os.getpid(), signal.SIGKILL)
                )
                install(faults, patch)
                sys.stderr = sys.stdout = open(os.devnull, "w")  # noqa: SIM115
                code = main([command, "--target", str(scene.target)])
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_sigkill_at_every_step_then_revert_recovers(
    scene: Scene,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    set_tree(scene, command)
    calls = count_calls(monkeypatch, scene, command)
    assert main(["revert" if command == "apply" else "apply", "--target", str(scene.target)]) == 0
    capsys.readouterr()
    outside = scene.outside_manifest()
    left_litter = 0
    for index, call in enumerate(calls):
        status = killed_run(scene, command, index)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, call
        left_litter += bool(litter(scene.target))
        state_code = main(["status", "--target", str(scene.target)])
        out = capsys.readouterr().out
        leftovers = litter(scene.target)
        for path in leftovers:
            assert f"leftover    {Path(path).relative_to(scene.target)}" in out
        tree = {k: v for k, v in scene.manifest().items() if str(scene.target / k) not in leftovers}
        assert state_code in (0, 1, 2)
        if state_code == 0:
            assert tree == scene.applied
        if state_code == 1:
            assert tree == scene.pristine
        if (scene.target / STATE_FILE).exists():
            code = main(["revert", "--target", str(scene.target)])
            assert code == 0, capsys.readouterr().err
        else:
            # Killed before the state file was renamed into place: nothing to undo.
            assert main(["revert", "--target", str(scene.target)]) == 2
        assert scene.manifest() == scene.pristine, call
        assert litter(scene.target.parent) == [], call
        assert scene.outside_manifest() == outside
        assert not [
            p
            for p in Path(os.environ.get("TMPDIR", "/tmp")).glob(
                f"{patchset.STAGING_PREFIX}{os.getpid()}-*"
            )
        ]
        set_tree(scene, command)
        capsys.readouterr()
    assert left_litter > 0, "no kill left a temporary file; the cleanup went untested"
