"""apply, revert and status against hostile input and failing output (issue 44 items 2-7), and
the safety nets of the writes (an fsync of each new file, revert's verification).

Each test drives the command line (in process, or as ``python -m vllm_minimax`` where the
exit status of the whole program is the point) against a synthetic series.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from patchset_helpers import RecordedSeries

import vllm_minimax
from vllm_minimax.cli import main

STATE_FILE = "vllm/.vllm_minimax_state.json"
TEMP_SUFFIX = ".vllm-minimax-tmp"
PACKAGE_ROOT = Path(vllm_minimax.__file__).resolve().parents[1]
BASE_FILES = {
    "vllm/__init__.py": "",
    "vllm/alpha.py": "".join(f"alpha line {i}\n" for i in range(40)),
    "vllm/beta.py": "".join(f"beta line {i}\n" for i in range(40)),
}
TERMINAL_CONTROLS = ("\x1b", "\x07", "\r", "\u202e")


@pytest.fixture
def scene(make_recorded_series: Callable[..., RecordedSeries]) -> RecordedSeries:
    alpha = BASE_FILES["vllm/alpha.py"].replace("alpha line 5\n", "alpha line 5 patched\n")
    beta = BASE_FILES["vllm/beta.py"].replace("beta line 30\n", "beta line 30 patched\n")
    return make_recorded_series(
        BASE_FILES,
        [("Patch alpha and beta", {"vllm/alpha.py": alpha, "vllm/beta.py": beta})],
    )


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def edit_state(scene: RecordedSeries, change: Callable[[dict[str, Any]], None]) -> None:
    path = scene.target / STATE_FILE
    state = json.loads(path.read_text())
    change(state)
    path.write_text(json.dumps(state))


def program(
    argv: list[str], scene: RecordedSeries, **kwargs: Any
) -> subprocess.CompletedProcess[str] | subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(PACKAGE_ROOT),
        "VLLM_MINIMAX_PATCHES": str(scene.series.patches_root),
    }
    command = [sys.executable, "-m", "vllm_minimax", *argv]
    return subprocess.run(command, env=env, text=True, **kwargs)


# ------------------------------------------------------------------------------------------
# Item 2: nothing read from the target reaches the terminal raw
# ------------------------------------------------------------------------------------------


def assert_not_forged(text: str) -> None:
    for control in TERMINAL_CONTROLS:
        assert control not in text, repr(text)
    assert sum(line.startswith("state:") for line in text.splitlines()) <= 1, text


def test_a_state_file_cannot_forge_output(
    scene: RecordedSeries, capsys: pytest.CaptureFixture[str]
) -> None:
    forged = "vllm-9.9.9\x1b]0;owned\x07\x1b[2J\nstate:        applied (vllm-9.9.9)\u202e"
    assert main(["apply", "--target", str(scene.target)]) == 0
    edit_state(scene, lambda state: state.update(series=forged))
    before = scene.manifest()
    for command in ("status", "apply", "revert"):
        code, out, err = run([command, "--target", str(scene.target)], capsys)
        assert code == 2, (command, out, err)
        assert_not_forged(out + err)
        assert "is unreadable or was tampered with" in one_line(err)
    assert scene.manifest() == before


def test_a_leftover_name_cannot_forge_output(
    scene: RecordedSeries, capsys: pytest.CaptureFixture[str]
) -> None:
    name = ".x\x1b[2J\nstate:        applied (vllm-9.9.9)\r.py" + TEMP_SUFFIX
    (scene.target / "vllm" / name).write_text("left by a killed run\n")
    code, out, err = run(["status", "--target", str(scene.target)], capsys)
    assert code == 1, (out, err)
    assert_not_forged(out + err)
    assert "leftover    vllm/.x\\x1b[2J\\nstate:" in out, out
    code, out, err = run(["apply", "--target", str(scene.target)], capsys)
    assert code == 0, err
    assert_not_forged(out + err)
    assert "removed  vllm/.x\\x1b[2J\\nstate:" in out, out


def test_a_version_file_cannot_forge_output(
    scene: RecordedSeries, capsys: pytest.CaptureFixture[str]
) -> None:
    version_file = scene.target / "vllm" / "_version.py"
    version_file.write_text("__version__ = '9.9.9\x1b]0;owned\x07\nstate: applied'\n")
    before = scene.manifest()
    for command in ("status", "apply", "revert"):
        code, out, err = run([command, "--target", str(scene.target)], capsys)
        assert code == 2, (command, out, err)
        assert_not_forged(out + err)
    assert scene.manifest() == before


# ------------------------------------------------------------------------------------------
# Item 3: the target's version picks only a packaged series directory
# ------------------------------------------------------------------------------------------


def test_the_version_cannot_name_another_series_directory(
    scene: RecordedSeries, capsys: pytest.CaptureFixture[str]
) -> None:
    """A version of ``9.9.9/../../evil`` would join to a directory beside the patches root."""
    series_root = scene.series.patches_root
    evil = series_root.parent / "evil"
    evil.mkdir()
    for patch in scene.series.patch_names:
        (evil / patch).write_bytes((scene.series.series_dir / patch).read_bytes())
    (evil / "series").write_text("".join(f"{patch}\n" for patch in scene.series.patch_names))
    version_file = scene.target / "vllm" / "_version.py"
    version_file.write_text("__version__ = version = '9.9.9/../../evil'\n")
    before = scene.manifest()
    for command in ("apply", "status"):
        code, out, err = run([command, "--target", str(scene.target)], capsys)
        assert code == 2, (command, out, err)
        assert "is not a version number" in one_line(err), err
    assert scene.manifest() == before


# ------------------------------------------------------------------------------------------
# Item 4: every recorded mode comes back exactly
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o000, 0o640, 0o755])
def test_revert_restores_the_exact_mode(
    scene: RecordedSeries, capsys: pytest.CaptureFixture[str], mode: int
) -> None:
    alpha = scene.target / "vllm" / "alpha.py"
    if mode == 0 and os.geteuid() != 0:
        pytest.skip("a file of mode 000 is readable only by root, and apply must read it")
    alpha.chmod(mode)
    try:
        assert main(["apply", "--target", str(scene.target)]) == 0
        assert alpha.stat().st_mode & 0o777 == mode
        assert main(["revert", "--target", str(scene.target)]) == 0, capsys.readouterr().err
        assert oct(alpha.stat().st_mode & 0o777) == oct(mode)
    finally:
        alpha.chmod(0o644)


# ------------------------------------------------------------------------------------------
# Item 5: after the work is done, a failure to report it is said as such
# ------------------------------------------------------------------------------------------


def test_apply_into_a_full_stdout_reports_success(scene: RecordedSeries) -> None:
    with open("/dev/full", "w") as full:
        done = program(["apply", "--target", str(scene.target)], scene, stdout=full, stderr=-1)
    assert isinstance(done, subprocess.CompletedProcess)
    assert done.returncode == 0, done.stderr
    line = one_line(done.stderr)
    assert "is applied to" in line and "report could not be written" in line, line
    assert scene.manifest() == scene.applied


def test_revert_into_a_closed_pipe_reports_success(scene: RecordedSeries) -> None:
    assert main(["apply", "--target", str(scene.target)]) == 0
    read_end, write_end = os.pipe()
    os.close(read_end)  # `vllm-minimax revert | head -1` once head has exited
    try:
        done = program(
            ["revert", "--target", str(scene.target)], scene, stdout=write_end, stderr=-1
        )
    finally:
        os.close(write_end)
    assert isinstance(done, subprocess.CompletedProcess)
    assert done.returncode == 0, done.stderr
    line = one_line(done.stderr)
    assert "is reverted on" in line and "report could not be written" in line, line
    assert scene.manifest() == scene.pristine


# ------------------------------------------------------------------------------------------
# Item 6: no traceback
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [100_000])
def test_a_deeply_nested_state_file_is_one_line(
    scene: RecordedSeries, capsys: pytest.CaptureFixture[str], depth: int
) -> None:
    (scene.target / STATE_FILE).write_text(
        '{"format": 1, "files": ' + "[" * depth + "]" * depth + "}"
    )
    before = scene.manifest()
    for command in ("status", "apply", "revert"):
        code, _, err = run([command, "--target", str(scene.target)], capsys)
        assert code == 2
        assert "is unreadable or was tampered with (nested too deeply)" in one_line(err)
    assert scene.manifest() == before


def test_an_unreadable_patches_directory_is_one_line(
    scene: RecordedSeries, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Root reads a directory of mode 000, so the refusal is injected where the listing is."""
    unreadable = scene.series.patches_root
    real_listdir, real_scandir = os.listdir, os.scandir

    def refuse(function: Callable[..., Any]) -> Callable[..., Any]:
        def call(path: Any = ".", *args: Any) -> Any:
            if not isinstance(path, int) and Path(path) == unreadable:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return function(path, *args)

        return call

    monkeypatch.setattr(os, "listdir", refuse(real_listdir))
    monkeypatch.setattr(os, "scandir", refuse(real_scandir))
    for command in ("apply", "status"):
        code, _, err = run([command, "--target", str(scene.target)], capsys)
        assert code == 2
        line = one_line(err)
        assert f"cannot read the patch series directory {unreadable}" in line, line
    assert scene.manifest() == scene.pristine


@pytest.mark.usefixtures("sigint_raises")
def test_ctrl_c_while_the_program_starts_is_one_line(scene: RecordedSeries) -> None:
    """SIGINT at a sweep of moments from the start, imports included: never a traceback."""
    env = {
        **os.environ,
        "PYTHONPATH": str(PACKAGE_ROOT),
        "VLLM_MINIMAX_PATCHES": str(scene.series.patches_root),
    }
    interrupted = 0
    for delay in [0.005 * step for step in range(1, 41)]:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm_minimax", "status", "--target", str(scene.target)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
        if "Traceback" in err and f"{PACKAGE_ROOT}/vllm_minimax/" not in err:
            continue  # the interpreter's own start, before the first line of vllm-minimax
        assert "Traceback" not in err, (delay, err)
        if process.returncode == 130:
            interrupted += 1
            assert one_line(err).startswith("vllm-minimax: interrupted"), err
        else:
            # Before Python handles SIGINT, or after the command finished.
            assert process.returncode in (1, -signal.SIGINT), (delay, process.returncode, err)
    assert interrupted > 0, "no SIGINT landed while the program ran; the sweep tested nothing"


# ------------------------------------------------------------------------------------------
# Item 7: messages that say what happened
# ------------------------------------------------------------------------------------------


def test_a_failed_fsync_names_the_file(
    scene: RecordedSeries, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsync's OSError carries no file name; the message names a file of the target."""
    real_fsync = os.fsync

    def failing(descriptor: int) -> None:
        if os.readlink(f"/proc/self/fd/{descriptor}").startswith(str(scene.target)):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", failing)
    code, _, err = run(["apply", "--target", str(scene.target)], capsys)
    line = one_line(err)
    assert code == 2
    assert "(unknown path)" not in line, line
    assert f"vllm-minimax: error: {scene.target}/vllm/" in line, line
    assert "Input/output error" in line and "nothing was changed" in line, line
    assert scene.manifest() == scene.pristine


@pytest.mark.parametrize(
    "argv",
    [
        ["apply", "--target", ""],
        ["revert", "--target", ""],
        ["status", "--target", ""],
        ["warmup", "--config", "x.yaml", "--cache-dir", ""],
        ["eval", "throughput", "--base-url", "x", "--model", "m", "--preset", "p", "--out", ""],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_an_empty_path_is_refused(
    argv: list[str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "an empty path; pass . for the current directory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_bad_mode_in_the_state_file_is_shown_in_octal(
    scene: RecordedSeries, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["apply", "--target", str(scene.target)]) == 0

    def setuid(state: dict[str, Any]) -> None:
        state["files"][0]["before"]["mode"] = 0o4755

    edit_state(scene, setuid)
    code, _, err = run(["revert", "--target", str(scene.target)], capsys)
    assert code == 2
    assert "has mode 0o4755, not 0..0o777" in one_line(err), err


# ------------------------------------------------------------------------------------------
# The safety nets: each new file is fsynced before it is renamed into place, and revert
# verifies what it wrote
# ------------------------------------------------------------------------------------------


def fd_path(descriptor: int) -> str:
    return os.readlink(f"/proc/self/fd/{descriptor}")


def named_path(path: Any, dir_fd: int | None) -> str:
    text = os.fsdecode(path)
    if dir_fd is not None and not os.path.isabs(text):
        text = os.path.join(fd_path(dir_fd), text)
    return os.path.abspath(text)


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_every_new_file_is_fsynced_before_its_rename(
    scene: RecordedSeries,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    if command == "revert":
        assert main(["apply", "--target", str(scene.target)]) == 0
    synced: set[str] = set()
    renamed: list[tuple[str, bool]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor: int) -> None:
        real_fsync(descriptor)
        synced.add(fd_path(descriptor))

    def replace(source: Any, destination: Any, **kwargs: Any) -> None:
        path = named_path(source, kwargs.get("src_dir_fd"))
        if path.startswith(str(scene.target)):
            renamed.append((path, path in synced))
        real_replace(source, destination, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    code, _, err = run([command, "--target", str(scene.target)], capsys)
    assert code == 0, err
    assert renamed, f"{command} renamed nothing into the target"
    assert [path for path, was_synced in renamed if not was_synced] == []


class SyncLog:
    """Every rename into ``root`` (its destination directory) and every fsync, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        self.events: list[tuple[str, str]] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(descriptor: int) -> None:
            real_fsync(descriptor)
            self.events.append(("fsync", fd_path(descriptor)))

        def replace(source: Any, destination: Any, **kwargs: Any) -> None:
            real_replace(source, destination, **kwargs)
            path = named_path(destination, kwargs.get("dst_dir_fd"))
            if path.startswith(str(root)):
                self.events.append(("rename", os.path.dirname(path)))

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def unsynced_renames(self) -> list[str]:
        """Directories a rename went into with no fsync of that directory after it."""
        return [
            directory
            for at, (kind, directory) in enumerate(self.events)
            if kind == "rename" and ("fsync", directory) not in self.events[at + 1 :]
        ]


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_every_directory_a_rename_went_into_is_fsynced_after_it(
    scene: RecordedSeries,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    """A rename is durable once its directory is synced: without that fsync, a crash can
    bring back the old file (or no state file) although the command reported success."""
    if command == "revert":
        assert main(["apply", "--target", str(scene.target)]) == 0
    log = SyncLog(monkeypatch, scene.target)
    code, _, err = run([command, "--target", str(scene.target)], capsys)
    assert code == 0, err
    assert any(kind == "rename" for kind, _ in log.events), f"{command} renamed nothing"
    assert log.unsynced_renames() == []


def test_a_file_written_atomically_has_its_directory_fsynced(
    scene: RecordedSeries, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a rollback restores a file with (`TargetTree.write_atomically`) is durable too."""
    from vllm_minimax.patchset.tree import TargetTree

    log = SyncLog(monkeypatch, scene.target)
    with TargetTree(scene.target) as tree:
        tree.write_atomically("vllm/alpha.py", b"restored\n", 0o644)
    assert (scene.target / "vllm/alpha.py").read_bytes() == b"restored\n"
    assert [kind for kind, _ in log.events].count("rename") == 1
    assert log.unsynced_renames() == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root writes files of another owner")
@pytest.mark.parametrize("command", ["apply", "revert"])
def test_a_replaced_file_keeps_its_owner_and_a_new_one_takes_its_directorys(
    scene: RecordedSeries, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Run as root over a tree someone else owns (a site-packages of another user, files of
    yet others): each file the command replaces keeps its own owner and group, and the file it
    creates (the state file) takes those of its directory, never root's."""
    if command == "revert":
        assert main(["apply", "--target", str(scene.target)]) == 0
    owners = {"vllm": (4001, 4002), "vllm/alpha.py": (4101, 4102), "vllm/beta.py": (4201, 4202)}
    for relative, (uid, gid) in owners.items():
        os.chown(scene.target / relative, uid, gid)
    code, _, err = run([command, "--target", str(scene.target)], capsys)
    assert code == 0, err
    for relative, owner in owners.items():
        info = (scene.target / relative).stat()
        assert (info.st_uid, info.st_gid) == owner, relative
    state = scene.target / STATE_FILE
    if command == "apply":
        assert (state.stat().st_uid, state.stat().st_gid) == owners["vllm"]
    else:
        assert not state.exists()


def test_revert_that_wrote_wrong_bytes_rolls_back(
    scene: RecordedSeries, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that loses its last byte without an error (what a failing disk or a buggy
    file system can do) is caught by revert's check of what it wrote."""
    assert main(["apply", "--target", str(scene.target)]) == 0
    capsys.readouterr()
    real_write = os.write
    corrupted: list[str] = []

    def lossy(descriptor: int, data: Any) -> int:
        path = fd_path(descriptor)
        if not corrupted and os.path.basename(path).startswith(".alpha.py."):
            corrupted.append(path)
            real_write(descriptor, bytes(data)[:-1])
            return len(data)
        return real_write(descriptor, data)

    monkeypatch.setattr(os, "write", lossy)
    code, _, err = run(["revert", "--target", str(scene.target)], capsys)
    assert corrupted, "the revert wrote no new alpha.py; nothing was corrupted"
    line = one_line(err)
    assert code == 2, line
    assert "do not verify: vllm/alpha.py" in line and "rolled back" in line, line
    assert scene.manifest() == scene.applied
