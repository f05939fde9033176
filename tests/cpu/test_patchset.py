"""apply / status / revert against scratch copies of the installed vLLM and synthetic series."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from patchset_helpers import (
    REAL_SERIES_DIR,
    REPO_ROOT,
    SyntheticSeries,
    build_and_unpack_wheel,
    installed_vllm_site,
    real_series_paths,
    tree_manifest,
)

from vllm_minimax import patchset
from vllm_minimax.cli import main
from vllm_minimax.patchset import STATE_FILE, PatchError, find_vllm_root, series_state

CONFIG_FILE = "vllm/config/attention.py"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_clean_failure(code: int, err: str, *needles: str) -> None:
    assert code != 0
    assert err.startswith("vllm-minimax: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def created_paths() -> list[str]:
    patches = patchset.read_series(REAL_SERIES_DIR)
    return sorted(set().union(*(patch.created for patch in patches)))


# ------------------------------------------------------------------------------------------
# The real series
# ------------------------------------------------------------------------------------------


def test_real_series_is_well_formed() -> None:
    patches = patchset.read_series(REAL_SERIES_DIR)
    assert patches, "patches/vllm-0.34.0/series lists no patches"
    for patch in patches:
        assert patch.name[:5].rstrip("-").isdigit() and patch.name.endswith(".patch")
        assert all(path.startswith("vllm/") for path in patch.paths)


def test_apply_status_revert_on_full_copy(
    full_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = tree_manifest(full_target)
    started = time.monotonic()
    code, out, err = run_cli(capsys, "apply", "--target", str(full_target))
    assert code == 0, err
    assert "applied vllm-0.34.0" in out
    assert time.monotonic() - started < 30
    after = tree_manifest(full_target)
    changed = {path for path in set(before) | set(after) if before.get(path) != after.get(path)}
    expected = {*real_series_paths(), str(STATE_FILE)}
    expected |= {f"{Path(path).parent}/" for path in created_paths()}
    assert changed <= expected
    assert set(real_series_paths()) <= changed

    code, out, _ = run_cli(capsys, "status", "--target", str(full_target))
    assert code == 0
    assert "vLLM version: 0.34.0" in out
    assert "state:        applied (vllm-0.34.0)" in out
    for path in real_series_paths():
        assert f"as-applied  {path}" in out

    code, out, err = run_cli(capsys, "revert", "--target", str(full_target))
    assert code == 0, err
    assert tree_manifest(full_target) == before


def test_status_before_apply_is_pristine_and_absent(
    small_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's files are pristine; those the series creates are absent, and said to be."""
    code, out, _ = run_cli(capsys, "status", "--target", str(small_target))
    assert code == 1
    assert "state:        not applied" in out
    assert f"series:       {REAL_SERIES_DIR}" in out
    created = created_paths()
    assert created, "the real series creates no file; the absent state goes untested"
    for path in real_series_paths():
        if path in created:
            assert f"  absent      {path} (created by the series)\n" in out, out
        else:
            assert f"  pristine    {path}\n" in out, out


def test_status_before_apply_names_each_file_that_is_not_vllms(
    small_target: Path, pristine_vllm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before apply, each file is checked on its own against the blob the series was made on,
    not only those git apply blamed first: an edit outside every hunk's context, a deleted
    file, a replaced file, and a file where the series creates one."""
    paths = real_series_paths()
    created = created_paths()
    modified = [path for path in paths if path not in created]
    edited_outside_hunks, deleted, replaced = modified[:3]
    with (small_target / edited_outside_hunks).open("a") as handle:
        handle.write("# appended by hand\n")
    (small_target / deleted).unlink()
    (small_target / replaced).write_text("REPLACED = 1\n")
    (small_target / created[0]).parent.mkdir(parents=True, exist_ok=True)
    (small_target / created[0]).write_text("# someone else's\n")
    expected = {edited_outside_hunks: "edited", deleted: "missing", replaced: "edited"}
    expected[created[0]] = "edited"
    code, out, _ = run_cli(capsys, "status", "--target", str(small_target))
    assert code == 2
    for path in paths:
        default = "absent" if path in created else "pristine"
        assert f"  {expected.get(path, default):<10}  {path}" in out, out
    # Only the appended comment: the series still applies, and says which file is not vLLM's.
    (small_target / created[0]).unlink()
    for path in (deleted, replaced):
        (small_target / path).write_bytes((pristine_vllm / path).read_bytes())
    code, out, _ = run_cli(capsys, "status", "--target", str(small_target))
    assert code == 1 and "problem:" not in out, out
    assert f"  edited      {edited_outside_hunks}" in out
    assert out.count("  pristine    ") == len(modified) - 1
    assert out.count("  absent      ") == len(created)


def test_second_apply_changes_nothing(
    small_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(capsys, "apply", "--target", str(small_target))[0] == 0
    applied = tree_manifest(small_target)
    code, out, err = run_cli(capsys, "apply", "--target", str(small_target))
    assert code == 0, err
    assert "already applied" in out
    assert tree_manifest(small_target) == applied


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_ctrl_c_while_reporting_says_the_writes_finished(
    small_target: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    """Ctrl-C once apply or revert has written (its report's print blocked on a full pipe, say)
    says what the tree now is, not that nothing was changed."""
    from vllm_minimax import cli

    pristine = tree_manifest(small_target)
    if command == "revert":
        patchset.apply_series(small_target)

    def print_interrupted_on_stdout(*args: object, **kwargs: object) -> None:
        if "file" not in kwargs:
            raise KeyboardInterrupt
        print(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(cli, "print", print_interrupted_on_stdout, raising=False)
    code, out, err = run_cli(capsys, command, "--target", str(small_target))
    assert (code, out) == (130, "")
    done = "applied to" if command == "apply" else "reverted on"
    assert err == (
        "vllm-minimax: interrupted while reporting, after the writes finished: vllm-0.34.0 is"
        f" {done} {small_target.resolve()}\n"
    )
    state = series_state(small_target)
    if command == "apply":
        assert state.applied and state.clean
    else:
        assert not state.applied and tree_manifest(small_target) == pristine


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_sigterm_before_any_write_says_nothing_was_changed(
    small_target: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    """SIGTERM while apply or revert still reads (before its transaction) exits 130 with the
    same line as Ctrl-C, not silently."""
    import signal

    from vllm_minimax import cli

    if command == "revert":
        patchset.apply_series(small_target)
    before = tree_manifest(small_target)

    def terminated(target: Path | None) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM did not interrupt")

    def unhandled(signum: int, frame: object) -> None:
        raise AssertionError(f"{command} left SIGTERM to the process's previous handler")

    monkeypatch.setattr(cli, f"{command}_series", terminated)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        code, out, err = run_cli(capsys, command, "--target", str(small_target))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (code, out) == (130, "")
    assert err == "vllm-minimax: interrupted before any write: nothing was changed\n"
    assert tree_manifest(small_target) == before


def test_revert_restores_bytes_and_modes(
    small_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.chmod(small_target / CONFIG_FILE, 0o640)
    before = tree_manifest(small_target)
    assert run_cli(capsys, "apply", "--target", str(small_target))[0] == 0
    assert tree_manifest(small_target) != before
    assert (small_target / CONFIG_FILE).stat().st_mode & 0o777 == 0o640
    code, out, err = run_cli(capsys, "revert", "--target", str(small_target))
    assert code == 0, err
    assert f"restored {CONFIG_FILE}" in out
    for path in created_paths():
        assert f"removed  {path}" in out
    assert tree_manifest(small_target) == before


def test_state_file_records_series_and_hashes(small_target: Path) -> None:
    patchset.apply_series(small_target)
    state = json.loads((small_target / STATE_FILE).read_text())
    assert state["format"] == 1
    assert state["vllm_version"] == "0.34.0"
    assert state["series"] == "vllm-0.34.0"
    assert [entry["name"] for entry in state["patches"]] == [
        patch.name for patch in patchset.read_series(REAL_SERIES_DIR)
    ]
    by_path = {entry["path"]: entry for entry in state["files"]}
    assert set(by_path) == set(real_series_paths())
    for path in created_paths():
        assert by_path[path]["before"] is None
    config = by_path[CONFIG_FILE]
    assert config["before"]["sha256"] != config["after"]["sha256"]
    applied_bytes = (small_target / CONFIG_FILE).read_bytes()
    assert config["after"]["sha256"] == hashlib.sha256(applied_bytes).hexdigest()


def test_series_state_api(small_target: Path) -> None:
    state = series_state(small_target)
    assert state.target == small_target.resolve()
    assert state.vllm_version == "0.34.0"
    assert state.series_dir == REAL_SERIES_DIR
    assert not state.applied and not state.clean
    assert {s for _, s in state.files} == {"pristine", "absent"}
    patchset.apply_series(small_target)
    state = series_state(small_target)
    assert state.applied and state.clean
    assert [path for path, _ in state.files] == real_series_paths()
    (small_target / CONFIG_FILE).write_text("# edited\n")
    (small_target / created_paths()[0]).unlink()
    states = dict(series_state(small_target).files)
    assert states[CONFIG_FILE] == "edited"
    assert states[created_paths()[0]] == "missing"
    assert not series_state(small_target).clean


def test_find_vllm_root_defaults_to_installed_vllm_without_importing_it() -> None:
    code = (
        "import sys; from vllm_minimax.patchset import find_vllm_root, read_vllm_version;"
        "root = find_vllm_root(None); print(root); print(read_vllm_version(root));"
        "print('vllm' in sys.modules, 'torch' in sys.modules)"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    )
    root, version, imported = completed.stdout.splitlines()
    assert Path(root) == installed_vllm_site().resolve()
    assert version == "0.34.0"
    assert imported == "False False"
    assert find_vllm_root(None) == installed_vllm_site().resolve()


# ------------------------------------------------------------------------------------------
# Bad input: clear message, non-zero exit, nothing changed
# ------------------------------------------------------------------------------------------


def test_unknown_version_lists_supported(
    small_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (small_target / "vllm/_version.py").write_text("__version__ = version = '0.0.1'\n")
    before = tree_manifest(small_target)
    code, _, err = run_cli(capsys, "apply", "--target", str(small_target))
    assert_clean_failure(code, err, "no patch series for vLLM 0.0.1", "supported", "0.34.0")
    assert tree_manifest(small_target) == before
    code, out, _ = run_cli(capsys, "status", "--target", str(small_target))
    assert code == 2
    assert "no patch series for vLLM 0.0.1" in out


def test_edited_file_names_file_and_hunk(
    small_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = small_target / CONFIG_FILE
    text = config.read_text()
    anchor = 'MiniMaxM3MSADecodeBackend = Literal["triton", "cutlass"]'
    assert anchor in text
    config.write_text(text.replace(anchor, 'MiniMaxM3MSADecodeBackend = Literal["triton"]'))
    before = tree_manifest(small_target)
    code, _, err = run_cli(capsys, "apply", "--target", str(small_target))
    first_patch = patchset.read_series(REAL_SERIES_DIR)[0].name
    assert_clean_failure(code, err, first_patch, f"{CONFIG_FILE}:", "nothing was changed")
    assert tree_manifest(small_target) == before
    state = series_state(small_target)
    assert dict(state.files)[CONFIG_FILE] == "edited"
    assert state.problem is not None
    assert run_cli(capsys, "status", "--target", str(small_target))[0] == 2


def test_created_file_already_present_without_state(
    small_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    created = small_target / created_paths()[0]
    created.parent.mkdir(parents=True, exist_ok=True)
    created.write_text("# someone else's copy\n")
    before = tree_manifest(small_target)
    code, _, err = run_cli(capsys, "apply", "--target", str(small_target))
    assert_clean_failure(code, err, created_paths()[0], "already exists", "no state file")
    assert tree_manifest(small_target) == before


def test_state_file_whose_files_no_longer_match(
    small_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(capsys, "apply", "--target", str(small_target))[0] == 0
    (small_target / CONFIG_FILE).write_text("# rewritten by hand\n")
    before = tree_manifest(small_target)
    code, _, err = run_cli(capsys, "apply", "--target", str(small_target))
    assert_clean_failure(code, err, "do not match", f"{CONFIG_FILE} (edited)")
    assert tree_manifest(small_target) == before
    code, _, err = run_cli(capsys, "revert", "--target", str(small_target))
    assert_clean_failure(code, err, "refusing to revert", f"{CONFIG_FILE} (edited)")
    assert tree_manifest(small_target) == before
    code, out, _ = run_cli(capsys, "status", "--target", str(small_target))
    assert code == 2
    assert f"edited      {CONFIG_FILE}" in out
    assert "files changed since" in out


def test_corrupt_state_file(small_target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (small_target / STATE_FILE).write_text("{not json")
    before = tree_manifest(small_target)
    for command in ("apply", "revert"):
        code, _, err = run_cli(capsys, command, "--target", str(small_target))
        assert_clean_failure(code, err, str(STATE_FILE), "unreadable")
    assert tree_manifest(small_target) == before


def test_missing_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("apply", "revert", "status"):
        code, _, err = run_cli(capsys, command, "--target", str(tmp_path / "nope"))
        assert_clean_failure(code, err, "does not exist")
    assert not (tmp_path / "nope").exists()


def test_unreachable_target_is_named_for_what_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "dangling").symlink_to("nowhere")
    (tmp_path / "file").write_text("x")
    cases = [
        ("loop", "cannot be reached: Too many levels of symbolic links"),
        ("dangling", "is a symbolic link to nowhere, which does not exist"),
        ("file/sub", "cannot be reached: Not a directory"),
    ]
    before = sorted(p.name for p in tmp_path.iterdir())
    for command in ("apply", "revert", "status"):
        for name, message in cases:
            code, _, err = run_cli(capsys, command, "--target", str(tmp_path / name))
            assert_clean_failure(code, err, f"target {tmp_path / name} {message}")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "file").read_text() == "x"


def test_target_without_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "apply", "--target", str(tmp_path))
    assert_clean_failure(code, err, "has no vllm/ directory")
    assert list(tmp_path.iterdir()) == []


def test_revert_when_nothing_applied(
    small_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = tree_manifest(small_target)
    code, _, err = run_cli(capsys, "revert", "--target", str(small_target))
    assert_clean_failure(code, err, "nothing to revert")
    assert tree_manifest(small_target) == before


def test_git_not_installed(
    small_target: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    before = tree_manifest(small_target)
    code, _, err = run_cli(capsys, "apply", "--target", str(small_target))
    assert_clean_failure(code, err, "git is not installed")
    assert tree_manifest(small_target) == before


def _writes_are_refused(directory: Path) -> bool:
    probe = directory / ".probe"
    try:
        probe.write_text("x")
    except PermissionError:
        return True
    probe.unlink()
    return False


def _drop_file_capabilities() -> None:
    """preexec_fn: drop CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH/CAP_FOWNER from the bounding set,
    so that a root child process obeys file permissions after exec."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop = 24
    for capability in (1, 2, 3):
        if libc.prctl(pr_capbset_drop, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def test_unwritable_target(small_target: Path) -> None:
    before = tree_manifest(small_target)
    directories = [Path(d) for d, _, _ in os.walk(small_target)]
    files = [Path(d) / f for d, _, names in os.walk(small_target) for f in names]
    for path in files:
        path.chmod(0o444)
    for directory in directories:
        directory.chmod(0o555)
    command = [sys.executable, "-m", "vllm_minimax", "apply", "--target", str(small_target)]
    try:
        preexec: Callable[[], None] | None = None
        if os.geteuid() == 0:
            # chmod does not stop root; a child without the DAC capabilities is stopped.
            preexec = _drop_file_capabilities
            probe = subprocess.run(
                [sys.executable, "-c", f"open({str(small_target / 'vllm' / 'p')!r}, 'w')"],
                preexec_fn=preexec,
                capture_output=True,
            )
            if probe.returncode == 0:
                (small_target / "vllm" / "p").unlink()
                pytest.skip("running as root and cannot drop CAP_DAC_OVERRIDE: chmod can't bite")
        else:
            assert _writes_are_refused(small_target / "vllm")
        completed = subprocess.run(
            command, capture_output=True, text=True, preexec_fn=preexec, cwd=REPO_ROOT
        )
        assert_clean_failure(completed.returncode, completed.stderr, "not writable")
        assert "nothing was changed" in completed.stderr
    finally:
        for directory in directories:
            directory.chmod(0o755)
        for path in files:
            path.chmod(0o644)
    after = tree_manifest(small_target)
    assert {k: v.split()[0] for k, v in after.items()} == {
        k: v.split()[0] for k, v in before.items()
    }


# ------------------------------------------------------------------------------------------
# Synthetic series
# ------------------------------------------------------------------------------------------

BASE_FILES = {
    "vllm/__init__.py": "",
    "vllm/alpha.py": "".join(f"alpha line {i}\n" for i in range(40)),
    "vllm/beta.py": "".join(f"beta line {i}\n" for i in range(40)),
}


def alpha_and_beta_series(make_series: Callable[..., SyntheticSeries]) -> SyntheticSeries:
    alpha = BASE_FILES["vllm/alpha.py"].replace("alpha line 5\n", "alpha line 5 patched\n")
    beta = BASE_FILES["vllm/beta.py"].replace("beta line 30\n", "beta line 30 patched\n")
    return make_series(
        BASE_FILES,
        [
            ("Patch alpha", {"vllm/alpha.py": alpha, "vllm/new/pkg/gamma.py": "gamma = 1\n"}),
            ("Patch beta", {"vllm/beta.py": beta}),
        ],
    )


def test_second_patch_failing_leaves_every_file_untouched(
    make_series: Callable[..., SyntheticSeries],
    use_patches_root: Callable[[Path], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    series = alpha_and_beta_series(make_series)
    use_patches_root(series.patches_root)
    beta = series.target / "vllm/beta.py"
    beta.write_text(beta.read_text().replace("beta line 29\n", "beta line 29 edited\n"))
    before = tree_manifest(series.target)
    code, _, err = run_cli(capsys, "apply", "--target", str(series.target))
    assert_clean_failure(code, err, series.patch_names[1], "vllm/beta.py:")
    assert series.patch_names[0] not in err
    assert tree_manifest(series.target) == before


def test_new_directory_is_created_and_removed_again(
    make_series: Callable[..., SyntheticSeries],
    use_patches_root: Callable[[Path], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    series = alpha_and_beta_series(make_series)
    use_patches_root(series.patches_root)
    before = tree_manifest(series.target)
    assert run_cli(capsys, "apply", "--target", str(series.target))[0] == 0
    assert (series.target / "vllm/new/pkg/gamma.py").read_text() == "gamma = 1\n"
    assert "alpha line 5 patched" in (series.target / "vllm/alpha.py").read_text()
    assert run_cli(capsys, "revert", "--target", str(series.target))[0] == 0
    assert not (series.target / "vllm/new").exists()
    assert tree_manifest(series.target) == before


def test_file_deleted_by_series_is_restored(
    make_series: Callable[..., SyntheticSeries],
    use_patches_root: Callable[[Path], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    series = make_series(BASE_FILES, [("Drop beta", {"vllm/beta.py": None})])
    use_patches_root(series.patches_root)
    before = tree_manifest(series.target)
    assert run_cli(capsys, "apply", "--target", str(series.target))[0] == 0
    assert not (series.target / "vllm/beta.py").exists()
    assert run_cli(capsys, "revert", "--target", str(series.target))[0] == 0
    assert tree_manifest(series.target) == before


def test_status_before_apply_on_renames_deletions_and_created_then_changed_files(
    make_series: Callable[..., SyntheticSeries],
    use_patches_root: Callable[[Path], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each path is checked against what its first patch expects: a rename's new path and a
    created file are expected absent, a deleted or renamed-away file as vLLM's."""
    alpha = BASE_FILES["vllm/alpha.py"].replace("alpha line 5\n", "alpha line 5 patched\n")
    series = make_series(
        BASE_FILES,
        [
            ("Rename alpha", {"vllm/alpha.py": None, "vllm/renamed.py": alpha}),
            ("Drop beta, add gamma", {"vllm/beta.py": None, "vllm/gamma.py": "gamma = 1\n"}),
            ("Change gamma", {"vllm/gamma.py": "gamma = 2\n"}),
        ],
    )
    assert "rename to vllm/renamed.py" in (series.series_dir / series.patch_names[0]).read_text()
    use_patches_root(series.patches_root)
    code, out, _ = run_cli(capsys, "status", "--target", str(series.target))
    assert code == 1, out
    paths = ["vllm/alpha.py", "vllm/renamed.py", "vllm/beta.py", "vllm/gamma.py"]
    for path in paths:
        state = "absent" if path in ("vllm/renamed.py", "vllm/gamma.py") else "pristine"
        assert f"  {state:<10}  {path}" in out, out
    (series.target / "vllm/beta.py").unlink()
    (series.target / "vllm/beta.py").symlink_to("alpha.py")
    (series.target / "vllm/renamed.py").write_text("someone else's\n")
    (series.target / "vllm/alpha.py").write_text("edited\n")
    code, out, _ = run_cli(capsys, "status", "--target", str(series.target))
    assert code == 2
    for path in paths[:3]:
        assert f"  edited      {path}" in out, out
    assert "  absent      vllm/gamma.py (created by the series)" in out


def test_changed_series_revision_asks_for_revert(
    make_series: Callable[..., SyntheticSeries],
    use_patches_root: Callable[[Path], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    series = alpha_and_beta_series(make_series)
    use_patches_root(series.patches_root)
    assert run_cli(capsys, "apply", "--target", str(series.target))[0] == 0
    second = series.series_dir / series.patch_names[1]
    second.write_text(second.read_text().replace("Subject: [PATCH", "Subject: [PATCH v2"))
    before = tree_manifest(series.target)
    code, _, err = run_cli(capsys, "apply", "--target", str(series.target))
    assert_clean_failure(code, err, "different revision", "revert")
    assert tree_manifest(series.target) == before
    state = series_state(series.target)
    assert state.applied and not state.clean
    assert state.problem is not None and "has changed since it was applied" in state.problem
    code, out, _ = run_cli(capsys, "status", "--target", str(series.target))
    assert code == 2
    assert "has changed since it was applied" in out
    # The files are as that revision left them: the verdict names the series, not the files.
    assert "state:        applied, but not the current series" in out
    assert "files changed since" not in out


def test_device_scripts_reapply_a_series_whose_revision_changed(
    make_series: Callable[..., SyntheticSeries],
    use_patches_root: Callable[[Path], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """scripts/ensure-series-applied, which the device scripts run on a staged site that a
    warm machine keeps between calls: it applies an unpatched site, leaves a current one
    alone, and takes a site patched by an earlier revision back to the originals before
    applying the series as it is now."""
    series = alpha_and_beta_series(make_series)
    use_patches_root(series.patches_root)
    script = Path(__file__).resolve().parents[2] / "scripts" / "ensure-series-applied"
    env = {**os.environ, "PYTHON": sys.executable}

    def ensure() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(script), str(series.target)], env=env, capture_output=True, text=True
        )

    pristine = tree_manifest(series.target)
    assert ensure().returncode == 0
    assert series_state(series.target).clean
    applied = tree_manifest(series.target)
    assert applied != pristine
    assert ensure().returncode == 0
    assert tree_manifest(series.target) == applied

    beta = series.target / "vllm/beta.py"
    second = series.series_dir / series.patch_names[1]
    second.write_text(second.read_text().replace("+beta line 30 patched", "+beta line 30 v2"))
    assert run_cli(capsys, "status", "--target", str(series.target))[0] == 2
    done = ensure()
    assert done.returncode == 0, done.stderr
    state = series_state(series.target)
    assert state.applied and state.clean
    assert "beta line 30 v2\n" in beta.read_text()
    assert "patched" not in beta.read_text()
    assert run_cli(capsys, "status", "--target", str(series.target))[0] == 0


def test_series_outside_vllm_package_is_rejected(
    make_series: Callable[..., SyntheticSeries],
    use_patches_root: Callable[[Path], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    series = make_series({**BASE_FILES, "setup.py": "x = 1\n"}, [("Touch setup", {"setup.py": ""})])
    use_patches_root(series.patches_root)
    before = tree_manifest(series.target)
    code, _, err = run_cli(capsys, "apply", "--target", str(series.target))
    assert_clean_failure(code, err, "'setup.py' is not under vllm/")
    assert tree_manifest(series.target) == before


def test_series_naming_missing_patch(
    make_series: Callable[..., SyntheticSeries],
    use_patches_root: Callable[[Path], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    series = alpha_and_beta_series(make_series)
    use_patches_root(series.patches_root)
    (series.series_dir / series.patch_names[1]).unlink()
    code, _, err = run_cli(capsys, "apply", "--target", str(series.target))
    assert_clean_failure(code, err, series.patch_names[1], "does not exist")


def test_series_file_comments_and_blank_lines() -> None:
    text = "# header\n\n0001-a.patch  # first\n   \n0002-b.patch\n"
    assert patchset.parse_series_file(text) == ["0001-a.patch", "0002-b.patch"]
    with pytest.raises(PatchError):
        patchset.parse_series_file("../evil.patch\n")


# ------------------------------------------------------------------------------------------
# Version detection and locating the series
# ------------------------------------------------------------------------------------------


def test_version_from_dist_info_when_version_file_absent(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    info = tmp_path / "vllm-0.34.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.4\nName: vllm\nVersion: 0.34.0\n\nBody\n")
    assert patchset.read_vllm_version(tmp_path) == "0.34.0"


def test_version_from_pkg_info_of_source_tree(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "PKG-INFO").write_text("Metadata-Version: 2.4\nName: vllm\nVersion: 0.33.1\n")
    assert patchset.read_vllm_version(tmp_path) == "0.33.1"


def test_version_of_another_packages_pkg_info_is_not_vllms(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "PKG-INFO").write_text("Metadata-Version: 2.4\nName: vllm-addon\nVersion: 0.34.0\n")
    with pytest.raises(PatchError, match="cannot tell the vLLM version"):
        patchset.read_vllm_version(tmp_path)


def test_version_unknown(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    with pytest.raises(PatchError, match="cannot tell the vLLM version"):
        patchset.read_vllm_version(tmp_path)


def test_patches_root_in_source_tree() -> None:
    assert patchset.patches_root() == REPO_ROOT / "patches"
    assert {"0.33.0", "0.34.0"} <= set(patchset.supported_versions())


def test_patches_ship_inside_the_wheel(tmp_path: Path) -> None:
    installed = build_and_unpack_wheel(tmp_path)
    assert (installed / "vllm_minimax/_patches/vllm-0.34.0/series").is_file()
    probe = "from vllm_minimax import patchset; print(patchset.patches_root())"
    env = {**os.environ, "PYTHONPATH": str(installed)}
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(result.stdout.strip()) == installed / "vllm_minimax" / "_patches"
    shipped = installed / "vllm_minimax/_patches/vllm-0.34.0"
    for path in REAL_SERIES_DIR.iterdir():
        if path.name == "series" or path.suffix == ".patch":
            assert (shipped / path.name).read_bytes() == path.read_bytes()


def test_state_file_mode_is_ordinary(small_target: Path) -> None:
    patchset.apply_series(small_target)
    mode = (small_target / STATE_FILE).stat().st_mode
    assert stat.S_ISREG(mode)
    assert not list((small_target / "vllm").glob(".*vllm-minimax-tmp"))
