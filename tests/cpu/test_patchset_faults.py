"""apply and revert under faults and hostile input (issue 17).

Faults are injected at every call apply or revert makes to the os functions that change the
target (open for writing, write, fchmod, fsync, replace, rename, unlink, mkdir, rmdir): an
OSError (ENOSPC, once or from then on), a KeyboardInterrupt, a real SIGINT, or a SIGKILL in a
forked child. Each case asserts the tree is byte-identical to pristine or to applied, that no
temporary file is left, that nothing outside the target changed, one clear line, and the exit
code. A real full file system is not used: mounting one needs privileges CI may not have.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from patchset_helpers import RecordedSeries, tree_manifest

from vllm_minimax import patchset
from vllm_minimax.cli import main
from vllm_minimax.errors import PatchError, describe_os_error
from vllm_minimax.patchset import STATE_FILE
from vllm_minimax.patchset.tree import TargetTree

BASE_FILES = {
    "vllm/__init__.py": "",
    "vllm/alpha.py": "".join(f"alpha line {i}\n" for i in range(40)),
    "vllm/beta.py": "".join(f"beta line {i}\n" for i in range(40)),
    "vllm/delta.py": "delta = 1\n",
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


@dataclass
class Scene(RecordedSeries):
    """The recorded target, and a directory beside it that must never change."""

    outside: Path

    def outside_manifest(self) -> dict[str, str]:
        return tree_manifest(self.outside)


@pytest.fixture
def scene(make_recorded_series: Callable[..., RecordedSeries]) -> Scene:
    alpha = BASE_FILES["vllm/alpha.py"].replace("alpha line 5\n", "alpha line 5 patched\n")
    beta = BASE_FILES["vllm/beta.py"].replace("beta line 30\n", "beta line 30 patched\n")
    recorded = make_recorded_series(
        BASE_FILES,
        [
            ("Patch alpha", {"vllm/alpha.py": alpha, "vllm/new/pkg/gamma.py": "gamma = 1\n"}),
            ("Patch beta, drop delta", {"vllm/beta.py": beta, "vllm/delta.py": None}),
        ],
    )
    outside = recorded.target.parent / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("someone else's file\n")
    (outside / "victim.txt").chmod(0o600)
    (outside / "emptydir").mkdir()
    return Scene(recorded.series, recorded.pristine, recorded.applied, outside)


def litter(root: Path) -> list[str]:
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            if name.endswith(patchset.TEMP_SUFFIX):
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

    def inside(self, path: object, dir_fd: int | None = None) -> str | None:
        """The absolute path a call's ``path`` (and ``dir_fd``) names, if it is in the target."""
        if isinstance(path, int):
            try:
                path = os.readlink(f"/proc/self/fd/{path}")
            except OSError:
                return None
        text = os.fspath(path)  # type: ignore[arg-type]
        if isinstance(text, bytes):
            text = text.decode()
        if dir_fd is not None and not os.path.isabs(text):
            text = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), text)
        text = os.path.abspath(text)
        return text if text.startswith(str(self.target) + os.sep) else None

    def hit(self, name: str, path: object, creates: bool, dir_fd: int | None = None) -> None:
        where = self.inside(path, dir_fd)
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
            dir_fd = kwargs.get("dir_fd", kwargs.get("src_dir_fd"))
            if name == "open":
                flags = args[1] if len(args) > 1 else kwargs.get("flags", 0)
                if flags & WRITE_FLAGS:
                    faults.hit(name, args[0], bool(flags & os.O_CREAT), dir_fd)
            else:
                faults.hit(name, args[0], name in ("write", "mkdir"), dir_fd)
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


@pytest.mark.usefixtures("sigint_raises")
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


def killed_run(scene: Scene, command: str, at: int) -> tuple[int, int]:
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
    return pid, status


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
        pid, status = killed_run(scene, command, index)
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
        staging = Path(tempfile.gettempdir()).glob(f"{patchset.STAGING_PREFIX}{pid}-*")
        assert list(staging) == [], call
        set_tree(scene, command)
        capsys.readouterr()
    assert left_litter > 0, "no kill left a temporary file; the cleanup went untested"


# ------------------------------------------------------------------------------------------
# Hostile state files and links: refused before anything is touched
# ------------------------------------------------------------------------------------------


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def original_of(content: bytes, mode: int = 0o755) -> dict[str, Any]:
    return {
        "sha256": hashlib.sha256(content).hexdigest(),
        "mode": mode,
        "content_base64": base64.b64encode(content).decode(),
    }


def tamper_outside_relative(state: dict[str, Any], scene: Scene) -> str:
    victim = (scene.outside / "victim.txt").read_text()
    state["files"].append(
        {"path": "../outside/victim.txt", "before": None, "after": {"sha256": sha256_text(victim)}}
    )
    return "'../outside/victim.txt' is not a relative path inside vllm/"


def tamper_absolute(state: dict[str, Any], scene: Scene) -> str:
    victim = scene.outside / "victim.txt"
    state["files"].append(
        {
            "path": str(victim),
            "before": original_of(b"attacker's bytes\n"),
            "after": {"sha256": sha256_text(victim.read_text())},
        }
    )
    return "is not a relative path inside vllm/"


def tamper_dotdot_inside_vllm(state: dict[str, Any], scene: Scene) -> str:
    state["files"][0]["path"] = "vllm/../../outside/victim.txt"
    return "is not a relative path inside vllm/"


def tamper_outside_vllm(state: dict[str, Any], scene: Scene) -> str:
    """A file of the target root beside vllm/ (site-packages holds other packages there)."""
    sibling = scene.target / "otherpkg" / "__init__.py"
    sibling.parent.mkdir()
    sibling.write_text("# another package's file\n")
    state["files"].append(
        {
            "path": "otherpkg/__init__.py",
            "before": original_of(b"import os  # planted\n"),
            "after": {"sha256": sha256_text(sibling.read_text())},
        }
    )
    return "'otherpkg/__init__.py' is not a relative path inside vllm/"


def tamper_lists_itself(state: dict[str, Any], scene: Scene) -> str:
    state["files"].append(
        {"path": str(STATE_FILE), "before": original_of(b"{}\n", 0o644), "after": None}
    )
    return "the state file lists itself"


def tamper_other_format(state: dict[str, Any], scene: Scene) -> str:
    state["format"] = 2
    return "has format 2; this vllm-minimax understands format 1"


def tamper_version_not_a_number(state: dict[str, Any], scene: Scene) -> str:
    state["vllm_version"] = "0.34.0 (patched)"
    return "'vllm_version' '0.34.0 (patched)' is not a version number"


def tamper_path_not_printable(state: dict[str, Any], scene: Scene) -> str:
    state["files"][0]["path"] = "vllm/alpha\x1b[2J.py"
    return "holds a character that cannot be shown"


def tamper_after_and_before_null(state: dict[str, Any], scene: Scene) -> str:
    state["files"].append({"path": "vllm/ghost.py", "before": None, "after": None})
    return "has neither 'before' nor 'after'"


def tamper_after_not_a_sha(state: dict[str, Any], scene: Scene) -> str:
    state["files"][0]["after"] = {"sha256": 5}
    return "is not an object with a sha256"


def tamper_setuid_mode(state: dict[str, Any], scene: Scene) -> str:
    entry = next(e for e in state["files"] if e["before"] is not None)
    entry["before"]["mode"] = 0o4755
    return "not 0..0o777"


def tamper_corrupt_original(state: dict[str, Any], scene: Scene) -> str:
    entry = next(e for e in state["files"] if e["before"] is not None)
    entry["before"]["content_base64"] = base64.b64encode(b"other bytes\n").decode()
    return "does not match its sha256"


def tamper_created_dir_outside(state: dict[str, Any], scene: Scene) -> str:
    state["created_dirs"].append("../outside/emptydir")
    return "'../outside/emptydir' is not a relative path inside vllm/"


def tamper_created_dir_not_created(state: dict[str, Any], scene: Scene) -> str:
    state["created_dirs"].append("vllm")
    return "is not a relative path inside vllm/"


def tamper_created_dir_unrelated(state: dict[str, Any], scene: Scene) -> str:
    (scene.target / "vllm" / "keep").mkdir()
    state["created_dirs"].append("vllm/keep")
    return "'vllm/keep' holds no file the series created"


def tamper_path_through_link(state: dict[str, Any], scene: Scene) -> str:
    (scene.target / "vllm" / "link").symlink_to(scene.outside)
    victim = (scene.outside / "victim.txt").read_text()
    state["files"].append(
        {"path": "vllm/link/victim.txt", "before": None, "after": {"sha256": sha256_text(victim)}}
    )
    return "vllm/link is a symbolic link"


def tamper_duplicate(state: dict[str, Any], scene: Scene) -> str:
    state["files"].append(dict(state["files"][0]))
    return "a file is listed twice"


def tamper_entry_not_object(state: dict[str, Any], scene: Scene) -> str:
    state["files"].append("vllm/alpha.py")
    return "a files entry is str, not an object"


def tamper_files_missing(state: dict[str, Any], scene: Scene) -> str:
    del state["files"]
    return "no 'files'"


TAMPERINGS = [
    tamper_outside_relative,
    tamper_absolute,
    tamper_dotdot_inside_vllm,
    tamper_outside_vllm,
    tamper_lists_itself,
    tamper_other_format,
    tamper_version_not_a_number,
    tamper_path_not_printable,
    tamper_after_and_before_null,
    tamper_after_not_a_sha,
    tamper_setuid_mode,
    tamper_corrupt_original,
    tamper_created_dir_outside,
    tamper_created_dir_not_created,
    tamper_created_dir_unrelated,
    tamper_path_through_link,
    tamper_duplicate,
    tamper_entry_not_object,
    tamper_files_missing,
]


@pytest.mark.parametrize("tamper", TAMPERINGS, ids=lambda f: f.__name__.removeprefix("tamper_"))
def test_tampered_state_file_is_refused(
    scene: Scene, capsys: pytest.CaptureFixture[str], tamper: Callable[..., str]
) -> None:
    assert main(["apply", "--target", str(scene.target)]) == 0
    state_path = scene.target / STATE_FILE
    state = json.loads(state_path.read_text())
    needle = tamper(state, scene)
    state_path.write_text(json.dumps(state))
    before, outside = scene.manifest(), scene.outside_manifest()
    capsys.readouterr()
    for command in ("revert", "apply", "status"):
        code = main([command, "--target", str(scene.target)])
        line = one_line(capsys.readouterr().err)
        assert code == 2, (command, line)
        assert line.startswith("vllm-minimax: error: "), line
        assert needle in line, (command, line)
        assert scene.manifest() == before, command
        assert scene.outside_manifest() == outside, command
    assert (scene.outside / "victim.txt").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "text", ["{not json", "[]", '{"format": 1}', "\xff".encode("latin-1").decode("latin-1")]
)
def test_malformed_state_file_is_one_line(
    scene: Scene, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    state_path = scene.target / STATE_FILE
    state_path.write_bytes(text.encode("latin-1"))
    before = scene.manifest()
    for command in ("revert", "apply", "status"):
        code = main([command, "--target", str(scene.target)])
        line = one_line(capsys.readouterr().err)
        assert code == 2 and "is unreadable or was tampered with" in line, (command, line)
        assert scene.manifest() == before


def test_state_file_that_is_a_link_is_refused(
    scene: Scene, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["apply", "--target", str(scene.target)]) == 0
    state_path = scene.target / STATE_FILE
    moved = scene.outside / "state.json"
    shutil.move(state_path, moved)
    state_path.symlink_to(moved)
    before, outside = scene.manifest(), scene.outside_manifest()
    capsys.readouterr()
    for command in ("revert", "apply", "status"):
        assert main([command, "--target", str(scene.target)]) == 2
        assert "is a symbolic link" in one_line(capsys.readouterr().err)
    assert scene.manifest() == before and scene.outside_manifest() == outside


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_symlinked_file_in_the_target_is_refused(
    scene: Scene, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    set_tree(scene, command)
    alpha = scene.target / "vllm/alpha.py"
    copy = scene.outside / "alpha.py"
    shutil.copy2(alpha, copy)
    alpha.unlink()
    alpha.symlink_to(copy)
    before, outside = scene.manifest(), scene.outside_manifest()
    capsys.readouterr()
    assert main([command, "--target", str(scene.target)]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"{alpha} is a symbolic link" in line and "Nothing was changed" in line, line
    assert alpha.is_symlink()
    assert scene.manifest() == before and scene.outside_manifest() == outside


def test_temp_name_planted_as_link_is_not_followed(
    scene: Scene, capsys: pytest.CaptureFixture[str]
) -> None:
    """An old fixed temp name, linked to an outside file, is removed as litter; the outside
    file keeps its bytes and mode."""
    victim = scene.outside / "victim.txt"
    planted = scene.target / "vllm" / f".{Path(STATE_FILE).name}{patchset.TEMP_SUFFIX}"
    planted.symlink_to(victim)
    outside = scene.outside_manifest()
    assert main(["apply", "--target", str(scene.target)]) == 0
    assert f"removed  {planted.relative_to(scene.target)}" in capsys.readouterr().out
    assert not os.path.lexists(planted)
    assert scene.outside_manifest() == outside
    assert scene.manifest() == scene.applied


def test_revert_refuses_when_an_original_was_deleted(
    scene: Scene, capsys: pytest.CaptureFixture[str]
) -> None:
    set_tree(scene, "revert")
    (scene.target / "vllm" / "alpha.py").unlink()
    before = scene.manifest()
    capsys.readouterr()
    assert main(["revert", "--target", str(scene.target)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "refusing to revert" in line and "vllm/alpha.py (missing)" in line, line
    assert scene.manifest() == before


def test_revert_keeps_a_users_file_in_a_directory_the_series_created(
    scene: Scene, capsys: pytest.CaptureFixture[str]
) -> None:
    set_tree(scene, "revert")
    mine = scene.target / "vllm" / "new" / "pkg" / "mine.py"
    mine.write_text("# the user's\n")
    assert main(["revert", "--target", str(scene.target)]) == 0, capsys.readouterr().err
    assert mine.read_text() == "# the user's\n"
    after = scene.manifest()
    kept = {"vllm/new/", "vllm/new/pkg/", "vllm/new/pkg/mine.py"}
    assert set(after) - set(scene.pristine) == kept
    assert {path: after.get(path) for path in scene.pristine} == scene.pristine


def test_a_taken_temporary_name_is_never_written_through(
    scene: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first random name is taken by a hard link to an outside file (which no
    O_NOFOLLOW refuses): the temporary is created under another name, the file untouched."""
    victim = scene.outside / "victim.txt"
    taken = scene.target / "vllm" / f".alpha.py.aaaaaaaa{patchset.TEMP_SUFFIX}"
    os.link(victim, taken)
    tokens = iter(["aaaaaaaa", "bbbbbbbb"])
    monkeypatch.setattr("vllm_minimax.patchset.tree.secrets.token_hex", lambda _n: next(tokens))
    outside = scene.outside_manifest()
    with TargetTree(scene.target) as tree:
        temporary = tree.write_temporary("vllm/alpha.py", b"new bytes\n", 0o644)
    assert temporary == f"vllm/.alpha.py.bbbbbbbb{patchset.TEMP_SUFFIX}"
    assert (scene.target / temporary).read_bytes() == b"new bytes\n"
    assert scene.outside_manifest() == outside
    assert victim.stat().st_mode & 0o777 == 0o600


def test_a_file_swapped_after_its_check_is_read_only_if_regular(scene: Scene) -> None:
    """What a race can put at a checked path between the check and the read: a link to an
    outside file is refused, not followed; a FIFO is refused, not read as empty."""
    link = scene.target / "vllm" / "alpha.py"
    link.unlink()
    link.symlink_to(scene.outside / "victim.txt")
    (scene.target / "vllm" / "beta.py").unlink()
    os.mkfifo(scene.target / "vllm" / "beta.py")
    with TargetTree(scene.target) as tree:
        with pytest.raises(PatchError, match=r"alpha\.py is a symbolic link"):
            tree.read("vllm/alpha.py")
        with pytest.raises(PatchError, match=r"beta\.py is not a regular file"):
            tree.read("vllm/beta.py")


def test_revert_removes_litter_even_with_nothing_to_revert(
    scene: Scene, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in (".alpha.py.vllm-minimax-tmp", ".alpha.py.x2.vllm-minimax-tmp"):
        (scene.target / "vllm" / name).write_text("patched code\n")
    (scene.target / "vllm/new/pkg").mkdir(parents=True)
    (scene.target / "vllm/new/pkg/.gamma.py.x1.vllm-minimax-tmp").write_text("x")
    assert main(["revert", "--target", str(scene.target)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "nothing to revert" in line and "removed 3 leftover temporary file(s)" in line
    assert litter(scene.target) == []


def test_target_whose_vllm_is_a_link_is_refused(
    scene: Scene, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    linked = tmp_path / "linked-site"
    linked.mkdir()
    (linked / "vllm").symlink_to(scene.target / "vllm")
    assert main(["apply", "--target", str(linked)]) == 2
    assert "is a symbolic link" in one_line(capsys.readouterr().err)
    assert scene.manifest() == scene.pristine


# ------------------------------------------------------------------------------------------
# OS errors outside a transaction, and their advice
# ------------------------------------------------------------------------------------------


def test_name_too_long_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("apply", "revert", "status"):
        assert main([command, "--target", str(tmp_path / ("x" * 300))]) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith("vllm-minimax: error: file name too long: "), line


@pytest.mark.parametrize(
    ("code", "vllm_tree", "advice"),
    [
        (errno.ENOSPC, True, "no free inodes on the file system of /t/x"),
        (errno.EDQUOT, True, "disk quota exceeded writing /t/x"),
        (errno.EACCES, True, "permission denied: /t/x: the target is not writable by this user"),
        (errno.EROFS, True, "/t/x is on a read-only file system"),
        # Commands that write files of their own (a model, a checkout, a cache) get advice
        # about the path, not about the vLLM install.
        (errno.EACCES, False, "permission denied: /t/x: run as a user who may use it, or choose"),
        (errno.EROFS, False, "/t/x is on a read-only file system: remount it writable or choose"),
        (errno.ENAMETOOLONG, False, "file name too long: /t/x: use a shorter one"),
        (errno.ELOOP, False, "/t/x: Too many levels of symbolic links"),
    ],
)
def test_os_error_advice(
    monkeypatch: pytest.MonkeyPatch, code: int, vllm_tree: bool, advice: str
) -> None:
    no_inodes = os.statvfs_result((4096, 4096, 100, 50, 50, 1000, 0, 0, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda _: no_inodes)
    error = OSError(code, os.strerror(code), "/t/x")
    message = describe_os_error(error, vllm_tree=vllm_tree)
    assert message.startswith(advice), message
    if not vllm_tree:
        assert "vLLM" not in message and "target" not in message


def test_no_space_when_inodes_remain(monkeypatch: pytest.MonkeyPatch) -> None:
    some_inodes = os.statvfs_result((4096, 4096, 100, 0, 0, 1000, 10, 10, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda _: some_inodes)
    message = describe_os_error(OSError(errno.ENOSPC, "No space", "/t/x"))
    assert message.startswith("no space left on the device of /t/x: free some space")


def test_a_write_that_fills_the_disk_names_the_file_it_was_for(
    scene: Scene, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """os.write's OSError carries no file name; the message names the file being written."""
    real_write = os.write

    def full_disk(descriptor: int, data: Any) -> int:
        if len(data) and os.fstat(descriptor).st_size == 0 and not os.isatty(descriptor):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(descriptor, data)

    monkeypatch.setattr(os, "write", full_disk)
    assert main(["apply", "--target", str(scene.target)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "(unknown path)" not in line
    assert line.startswith(f"vllm-minimax: error: no space left on the device of {scene.target}/")
    assert "nothing was changed" in line
    assert scene.manifest() == scene.pristine


@pytest.mark.parametrize(
    ("where", "code", "advice"),
    [
        ("copy", errno.ENOSPC, "no space left on the device of"),
        ("git apply", errno.ENOSPC, "no space left on the device of"),
        ("git apply", errno.EDQUOT, "disk quota exceeded writing"),
    ],
)
def test_a_full_tmpdir_is_named_as_the_staging_place(
    small_target: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    where: str,
    code: int,
    advice: str,
) -> None:
    """No room under $TMPDIR for the staging copy: the message names the staging directory and
    TMPDIR, not '(unknown path)' nor a patch that 'does not apply' to the target."""
    before = tree_manifest(small_target)
    if where == "copy":
        real_write_bytes = Path.write_bytes

        def full(path: Path, data: bytes) -> int:
            if patchset.STAGING_PREFIX in str(path):
                raise OSError(code, os.strerror(code))  # as write() raises it
            return real_write_bytes(path, data)

        monkeypatch.setattr(Path, "write_bytes", full)
    else:
        real_run = subprocess.run

        def git_apply_out_of_room(command: list[str], *args: Any, **kwargs: Any) -> Any:
            if "apply" in command:
                stderr = f"error: unable to write file 'vllm/x.py': {os.strerror(code)}\n"
                return subprocess.CompletedProcess(command, 128, "", stderr)
            return real_run(command, *args, **kwargs)

        monkeypatch.setattr(subprocess, "run", git_apply_out_of_room)
    for command in ("apply", "status"):
        assert main([command, "--target", str(small_target)]) == 2
        captured = capsys.readouterr()
        line = one_line(captured.err) if command == "apply" else captured.out.splitlines()[-1]
        staging = f"{tempfile.gettempdir()}/{patchset.STAGING_PREFIX}"
        assert f"could not stage the series under {tempfile.gettempdir()} (set TMPDIR" in line
        assert f"{advice} {staging}" in line, line
        assert line.endswith("; nothing was changed")
    assert tree_manifest(small_target) == before


def test_a_version_file_with_a_stray_byte_still_gives_the_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "_version.py").write_bytes(b"# \xff\n__version__ = '9.9.9'\n")
    assert main(["apply", "--target", str(tmp_path)]) == 2
    assert "no patch series for vLLM 9.9.9" in one_line(capsys.readouterr().err)
    assert main(["status", "--target", str(tmp_path)]) == 2
    shown = capsys.readouterr()
    assert "problem: no patch series for vLLM 9.9.9" in shown.out and not shown.err
    assert sorted(p.name for p in (tmp_path / "vllm").iterdir()) == ["_version.py"]


def test_stale_staging_dir_of_a_dead_run_is_removed(
    scene: Scene, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", None)
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    stale = tmp_path / "tmp" / f"{patchset.STAGING_PREFIX}{dead.pid}-abcd1234"
    alive = tmp_path / "tmp" / f"{patchset.STAGING_PREFIX}{os.getpid()}-efgh5678"
    not_a_pid = tmp_path / "tmp" / f"{patchset.STAGING_PREFIX}notes"
    for directory in (stale, alive, not_a_pid):
        (directory / "tree").mkdir(parents=True)
    assert main(["status", "--target", str(scene.target)]) == 1
    assert not stale.exists()
    assert sorted(p.name for p in (tmp_path / "tmp").iterdir()) == [alive.name, not_a_pid.name]


# ------------------------------------------------------------------------------------------
# Concurrent runs
# ------------------------------------------------------------------------------------------


def test_a_held_lock_turns_the_second_run_away(
    scene: Scene, capsys: pytest.CaptureFixture[str]
) -> None:
    """Held by apply or revert (exclusive), the lock turns every command away; apply and revert
    are not told that an apply or revert runs, since a status or doctor may hold it."""
    descriptor = os.open(scene.target / "vllm", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        for command in ("apply", "revert", "status"):
            assert main([command, "--target", str(scene.target)]) == 2
            line = one_line(capsys.readouterr().err)
            if command == "status":
                assert "another vllm-minimax apply or revert is running" in line, line
            else:
                assert "another vllm-minimax command (apply or revert writing it, or status" in line
        assert scene.manifest() == scene.pristine
    finally:
        os.close(descriptor)


def test_a_lock_held_by_status_is_not_called_an_apply(
    scene: Scene, capsys: pytest.CaptureFixture[str]
) -> None:
    """status and doctor hold the lock shared: apply and revert are turned away without being
    told that another apply or revert is running; a second status runs."""
    descriptor = os.open(scene.target / "vllm", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH)
        for command in ("apply", "revert"):
            assert main([command, "--target", str(scene.target)]) == 2
            line = one_line(capsys.readouterr().err)
            assert "apply or revert is running" not in line, line
            assert "or status or doctor reading it" in line, line
        assert main(["status", "--target", str(scene.target)]) == 1
        assert scene.manifest() == scene.pristine
    finally:
        os.close(descriptor)


def test_two_processes_racing_apply_and_revert(scene: Scene) -> None:
    command = [
        sys.executable,
        "-c",
        "import sys; from vllm_minimax.cli import main\n"
        "for i in range(8):\n"
        "    for c in ('apply', 'revert'):\n"
        "        print(c, main([c, '--target', sys.argv[1]]), flush=True)\n",
        str(scene.target),
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(patchset.__file__).parents[1])}
    runs = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(2)
    ]
    results = [run.communicate(timeout=120) for run in runs]
    busy = 0
    for (out, err), run in zip(results, runs, strict=True):
        assert run.returncode == 0, err
        assert "Traceback" not in err
        codes = [line.split() for line in out.splitlines() if line.endswith((" 0", " 2"))]
        assert len(codes) == 16
        assert {code for _, code in codes} <= {"0", "2"}, out
        for line in err.splitlines():
            assert "another vllm-minimax" in line or "nothing to revert" in line, line
            busy += "another vllm-minimax" in line
    assert scene.manifest() in (scene.pristine, scene.applied)
    assert litter(scene.target) == []
    print(f"{busy} of 32 runs found the lock held")
