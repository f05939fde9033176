"""`vllm-minimax dev checkout` / `dev export` round trip.

The checkout test downloads vLLM's 51 MB sdist from PyPI once into
``${VLLM_MINIMAX_CACHE:-~/.cache/vllm-minimax}/sdist/`` and reuses it afterwards. It runs in
CI like every other test (marked ``slow`` only so it can be selected).
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from patchset_helpers import REAL_PATCHES_ROOT, REAL_SERIES_DIR, git_run

from vllm_minimax import devtree
from vllm_minimax.errors import UserError
from vllm_minimax.patchset import parse_series_file, read_series

# Fixed identity and dates make the pristine commit the same on every machine.
PRISTINE_COMMIT_0_34_0 = "52700e0d50ee1238fd95a5f3eb39aacad52a9408"


def series_bytes(series_dir: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(series_dir.iterdir())}


def copy_patches_root(destination: Path) -> Path:
    shutil.copytree(REAL_PATCHES_ROOT, destination)
    return destination


@pytest.fixture(scope="module")
def checkout_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("devtree") / "vllm-0.34.0"
    devtree.checkout("0.34.0", directory, patches_dir=REAL_PATCHES_ROOT)
    yield directory


def git_out(directory: Path, *arguments: str) -> str:
    return subprocess.run(
        ["git", *arguments], cwd=directory, capture_output=True, text=True, check=True
    ).stdout


@pytest.mark.slow
def test_checkout_is_pristine_commit_plus_one_commit_per_patch(checkout_dir: Path) -> None:
    assert (checkout_dir / "vllm" / "_version.py").is_file()
    assert (checkout_dir / "PKG-INFO").is_file()
    assert git_out(checkout_dir, "rev-parse", "vllm-0.34.0").strip() == PRISTINE_COMMIT_0_34_0
    assert git_out(checkout_dir, "status", "--porcelain") == ""
    # vLLM's .gitignore ignores vllm/_version.py; the pristine commit must still have it.
    assert "vllm/_version.py" in git_out(checkout_dir, "ls-files", "vllm/_version.py")
    names = parse_series_file((REAL_SERIES_DIR / "series").read_text())
    log = git_out(checkout_dir, "log", "--reverse", "--format=%cn|%cd|%s", "vllm-0.34.0..HEAD")
    lines = log.splitlines()
    assert len(lines) == len(names)
    for line in lines:
        committer, date, _ = line.split("|", 2)
        assert committer == devtree.COMMITTER_IDENTITY[0]
        assert date.startswith("Sat Jan 1 00:00:00 2000")


@pytest.mark.slow
def test_export_of_untouched_checkout_reproduces_series(checkout_dir: Path, tmp_path: Path) -> None:
    patches_root = copy_patches_root(tmp_path / "patches")
    exported = devtree.export(checkout_dir, patches_dir=patches_root)
    assert exported.series_dir == patches_root / "vllm-0.34.0"
    assert series_bytes(exported.series_dir) == series_bytes(REAL_SERIES_DIR)
    first = series_bytes(exported.series_dir)
    devtree.export(checkout_dir, patches_dir=patches_root)
    assert series_bytes(exported.series_dir) == first


@pytest.mark.slow
def test_export_refuses_dirty_tree_and_writes_new_commits(
    checkout_dir: Path, tmp_path: Path
) -> None:
    patches_root = copy_patches_root(tmp_path / "patches")
    before = series_bytes(patches_root / "vllm-0.34.0")
    scratch = checkout_dir / "vllm" / "minimax_scratch.py"
    head = git_out(checkout_dir, "rev-parse", "HEAD").strip()
    scratch.write_text("VALUE = 1\n")
    try:
        with pytest.raises(UserError, match="uncommitted changes"):
            devtree.export(checkout_dir, patches_dir=patches_root)
        assert series_bytes(patches_root / "vllm-0.34.0") == before
        git_run(checkout_dir, "add", str(scratch))
        git_run(checkout_dir, "commit", "--quiet", "-m", "[MiniMax M3] Scratch module")
        exported = devtree.export(checkout_dir, patches_dir=patches_root)
        names = [path.name for path in exported.patch_files]
        count = len(read_series(REAL_SERIES_DIR)) + 1
        assert names[-1] == f"{count:04d}-MiniMax-M3-Scratch-module.patch"
        series = parse_series_file((exported.series_dir / "series").read_text())
        assert series == names
        text = (exported.series_dir / names[-1]).read_text()
        assert text.startswith("From 0000000000000000000000000000000000000000 ")
        assert f"Subject: [PATCH {count}/{count}] [MiniMax M3] Scratch module" in text
        assert "+VALUE = 1" in text
        assert not text.rstrip().endswith(("2.39.5", "--"))
    finally:
        git_run(checkout_dir, "reset", "--quiet", "--hard", head)
        scratch.unlink(missing_ok=True)
    assert git_out(checkout_dir, "status", "--porcelain") == ""


@pytest.mark.slow
def test_sdist_cache_is_used_without_network(
    checkout_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached sdist should have been used")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    cached = devtree.fetch_sdist("0.34.0")
    assert cached == devtree.cache_dir() / "sdist" / "vllm-0.34.0.tar.gz"
    assert devtree.file_sha256(cached) == devtree.KNOWN_SDIST_SHA256["0.34.0"]


def test_download_with_wrong_sha256_is_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_MINIMAX_CACHE", str(tmp_path / "cache"))
    release = devtree.SdistRelease("vllm-9.9.9.tar.gz", "https://example.invalid/x", "0" * 64)
    monkeypatch.setattr(devtree, "find_sdist_release", lambda version: release)
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: io.BytesIO(b"not the sdist"))
    with pytest.raises(UserError, match="expected 0000"):
        devtree.fetch_sdist("9.9.9")
    assert list((tmp_path / "cache" / "sdist").iterdir()) == []


def test_checkout_refuses_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "file").write_text("x")
    with pytest.raises(UserError, match="not an empty directory"):
        devtree.checkout("0.34.0", tmp_path / "occupied", patches_dir=REAL_PATCHES_ROOT)


def test_checkout_of_unsupported_version(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"no patch series for vLLM 0\.0\.1.*0\.34\.0"):
        devtree.checkout("0.0.1", tmp_path / "x", patches_dir=REAL_PATCHES_ROOT)
    assert not (tmp_path / "x").exists()


def test_export_refuses_directory_that_is_not_a_checkout(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a `vllm-minimax dev checkout`"):
        devtree.export(tmp_path, patches_dir=tmp_path / "patches")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "_version.py").write_text("__version__ = version = '9.9.9'\n")
    git_run(tmp_path, "init", "--quiet")
    git_run(tmp_path, "add", "-A")
    git_run(tmp_path, "commit", "--quiet", "-m", "not tagged")
    with pytest.raises(UserError, match=r"no tag vllm-9\.9\.9"):
        devtree.export(tmp_path, patches_dir=tmp_path / "patches")
    assert not (tmp_path / "patches").exists()


def synthetic_checkout(directory: Path) -> Path:
    (directory / "vllm").mkdir(parents=True)
    (directory / "vllm" / "_version.py").write_text("__version__ = version = '9.9.9'\n")
    (directory / "vllm" / "a.py").write_text("a = 1\n")
    git_run(directory, "init", "--quiet")
    git_run(directory, "add", "-A")
    git_run(directory, "commit", "--quiet", "-m", "pristine")
    git_run(directory, "tag", "vllm-9.9.9")
    for index in range(2):
        (directory / "vllm" / "a.py").write_text(f"a = {index + 2}\n")
        git_run(directory, "commit", "--quiet", "-am", f"Change a to {index + 2}")
    return directory


def test_export_is_deterministic_and_replaces_old_patches(tmp_path: Path) -> None:
    checkout = synthetic_checkout(tmp_path / "checkout")
    patches_root = tmp_path / "patches"
    stale_dir = patches_root / "vllm-9.9.9"
    stale_dir.mkdir(parents=True)
    (stale_dir / "0001-old-name.patch").write_text("stale")
    (stale_dir / "README").write_text("kept")
    (stale_dir / "series").write_text("0001-old-name.patch\n")
    devtree.export(checkout, patches_dir=patches_root)
    first = series_bytes(stale_dir)
    assert sorted(first) == [
        "0001-Change-a-to-2.patch",
        "0002-Change-a-to-3.patch",
        "README",
        "series",
    ]
    assert (
        first["series"]
        == (devtree.SERIES_HEADER + "0001-Change-a-to-2.patch\n0002-Change-a-to-3.patch\n").encode()
    )
    devtree.export(checkout, patches_dir=patches_root)
    assert series_bytes(stale_dir) == first


PRISTINE_COMMIT_0_33_0 = "4f100a2dc5e71c6c7f9f68253e916a5ea82c6817"


@pytest.mark.slow
def test_the_0_33_0_series_round_trips_and_pristine_stops_at_the_tag(tmp_path: Path) -> None:
    """The 0.33.0 series (made by the cherry-pick port of docs/rebasing.md) goes on its
    pristine tree commit by commit and exports to the same bytes; `--pristine` gives the
    same pristine commit and nothing on top."""
    series_dir = REAL_PATCHES_ROOT / "vllm-0.33.0"
    full = tmp_path / "full"
    made = devtree.checkout("0.33.0", full, patches_dir=REAL_PATCHES_ROOT)
    assert git_out(full, "rev-parse", "vllm-0.33.0").strip() == PRISTINE_COMMIT_0_33_0
    assert len(made.patch_commits) == len(read_series(series_dir))
    patches_root = copy_patches_root(tmp_path / "patches")
    exported = devtree.export(full, patches_dir=patches_root)
    assert series_bytes(exported.series_dir) == series_bytes(series_dir)

    bare = tmp_path / "bare"
    pristine = devtree.checkout(
        "0.33.0", bare, patches_dir=tmp_path / "no-series", with_series=False
    )
    assert pristine.patch_commits == []
    assert git_out(bare, "rev-parse", "HEAD").strip() == PRISTINE_COMMIT_0_33_0


def tiny_sdist(path: Path, version: str) -> Path:
    """A gzipped tar shaped like vLLM's sdist: vllm-VERSION/vllm/_version.py and a module."""
    with tarfile.open(path, "w:gz") as archive:
        for name, text in [
            ("vllm/_version.py", f"__version__ = version = '{version}'\n"),
            ("vllm/a.py", "a = 1\n"),
        ]:
            data = text.encode()
            member = tarfile.TarInfo(f"vllm-{version}/{name}")
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    return path


@pytest.mark.parametrize("directory_existed", [False, True])
@pytest.mark.parametrize(
    ("failure", "message"),
    [
        (KeyboardInterrupt(), "interrupted: the partial checkout in {d} was removed"),
        (OSError(28, "No space left on device"), "no space left on the device of {d}: free"),
        (UserError("git commit failed"), "git commit failed; the partial checkout in {d} was"),
    ],
)
def test_a_checkout_that_stops_part_way_leaves_dir_as_it_was(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    failure: BaseException,
    message: str,
    directory_existed: bool,
) -> None:
    """Interrupted or failed before its tag, a checkout removes what it made, so that the same
    command can run again; the message says so (and names DIR when the OSError named nothing)."""
    sdist = tiny_sdist(tmp_path / "vllm-9.9.9.tar.gz", "9.9.9")
    monkeypatch.setattr(devtree, "fetch_sdist", lambda version: sdist)
    real_git = devtree.git

    def git_failing_at_commit(directory: Path, *arguments: str, **kwargs: object):
        if arguments[0] == "commit":
            raise failure
        return real_git(directory, *arguments, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(devtree, "git", git_failing_at_commit)
    directory = tmp_path / "checkout"
    if directory_existed:
        directory.mkdir()
    with pytest.raises((UserError, KeyboardInterrupt)) as raised:
        devtree.checkout("9.9.9", directory, with_series=False)
    assert str(raised.value).startswith(message.format(d=directory)), raised.value
    if directory_existed:
        assert directory.is_dir() and not any(directory.iterdir())
    else:
        assert not directory.exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        ["vllm-9.9.9.tar.gz", *(["checkout"] if directory_existed else [])]
    )
    monkeypatch.setattr(devtree, "git", real_git)
    made = devtree.checkout("9.9.9", directory, with_series=False)
    assert made.patch_commits == [] and (directory / "vllm" / "a.py").read_text() == "a = 1\n"


@pytest.mark.parametrize("failure", ["extraction out of room", "DIR filled meanwhile"])
def test_a_checkout_that_fails_before_writing_dir_leaves_it_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """Extraction runs beside DIR: when it fails (a full disk, whose write() names no file) or
    DIR gained a file while the sdist downloaded, DIR is left as it is, and the message names
    DIR and says nothing was written to it."""
    sdist = tiny_sdist(tmp_path / "vllm-9.9.9.tar.gz", "9.9.9")
    directory = tmp_path / "checkout"
    directory.mkdir()

    def fetch(version: str) -> Path:
        if failure == "DIR filled meanwhile":
            (directory / "users-work.txt").write_text("keep me\n")
        return sdist

    def out_of_room(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(devtree, "fetch_sdist", fetch)
    if failure == "extraction out of room":
        monkeypatch.setattr(tarfile.TarFile, "extractall", out_of_room)
    with pytest.raises(UserError) as raised:
        devtree.checkout("9.9.9", directory, with_series=False)
    assert str(raised.value).endswith(f"; nothing was written to {directory}"), raised.value
    if failure == "extraction out of room":
        assert str(raised.value).startswith(f"no space left on the device of {directory}: ")
        assert directory.is_dir() and not any(directory.iterdir())
    else:
        assert (directory / "users-work.txt").read_text() == "keep me\n"
        assert [path.name for path in directory.iterdir()] == ["users-work.txt"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkout", "vllm-9.9.9.tar.gz"]
