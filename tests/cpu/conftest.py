"""Shared fixtures: scratch copies of the installed vLLM and synthetic patch series."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
REAL_PATCHES_ROOT = REPO_ROOT / "patches"
REAL_SERIES_DIR = REAL_PATCHES_ROOT / "vllm-0.34.0"


def installed_vllm_site() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM must be installed"
    return Path(next(iter(spec.submodule_search_locations))).parent


def tree_manifest(root: Path) -> dict[str, str]:
    """sha256 (and mode) of every file, plus every directory, under ``root``."""
    manifest: dict[str, str] = {}
    for directory, dirnames, filenames in os.walk(root):
        relative_dir = Path(directory).relative_to(root)
        manifest[f"{relative_dir}/"] = "dir"
        for name in filenames:
            path = Path(directory) / name
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            manifest[str(relative_dir / name)] = f"{digest} {path.stat().st_mode & 0o7777:o}"
        dirnames.sort()
    return manifest


def copy_python_sources(source_vllm: Path, destination_root: Path) -> None:
    """Copy vllm/**.py (no binaries, no caches) to ``destination_root/vllm``."""

    def ignore(directory: str, names: list[str]) -> list[str]:
        ignored = []
        for name in names:
            full = os.path.join(directory, name)
            if name == "__pycache__" or (not os.path.isdir(full) and not name.endswith(".py")):
                ignored.append(name)
        return ignored

    shutil.copytree(source_vllm, destination_root / "vllm", ignore=ignore)


@pytest.fixture(scope="session")
def pristine_vllm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A read-only-by-convention copy of the installed vLLM's Python sources (~1 s)."""
    root = tmp_path_factory.mktemp("pristine-vllm")
    copy_python_sources(installed_vllm_site() / "vllm", root)
    assert (root / "vllm" / "_version.py").is_file()
    return root


def real_series_paths() -> list[str]:
    from vllm_minimax.patchset import read_series, touched_paths

    return touched_paths(read_series(REAL_SERIES_DIR))


@pytest.fixture
def full_target(pristine_vllm: Path, tmp_path: Path) -> Path:
    """A per-test copy of the whole pristine Python tree."""
    target = tmp_path / "full-site"
    shutil.copytree(pristine_vllm, target)
    return target


@pytest.fixture
def small_target(pristine_vllm: Path, tmp_path: Path) -> Path:
    """A per-test tree with _version.py, the files the real series touches and a bystander."""
    target = tmp_path / "site"
    wanted = ["vllm/_version.py", "vllm/__init__.py", *real_series_paths()]
    for relative in wanted:
        source = pristine_vllm / relative
        if source.is_file():
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / relative)
    return target


@dataclass
class SyntheticSeries:
    patches_root: Path
    series_dir: Path
    target: Path
    patch_names: list[str]


def git_run(directory: Path, *arguments: str) -> str:
    env = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}
    env.update(
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_AUTHOR_NAME="Test Author",
        GIT_AUTHOR_EMAIL="author@example.invalid",
        GIT_AUTHOR_DATE="2001-02-03T04:05:06+0000",
        GIT_COMMITTER_NAME="Test Committer",
        GIT_COMMITTER_EMAIL="committer@example.invalid",
        GIT_COMMITTER_DATE="2001-02-03T04:05:06+0000",
    )
    completed = subprocess.run(
        ["git", "-c", "commit.gpgSign=false", *arguments],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return completed.stdout


Changes = dict[str, str | None]


@pytest.fixture
def make_series(tmp_path: Path) -> Callable[..., SyntheticSeries]:
    """Build a vLLM-like tree and a format-patch series of ``commits`` over it, with git."""

    def build(
        files: dict[str, str],
        commits: list[tuple[str, Changes]],
        version: str = "9.9.9",
        name: str = "synthetic",
    ) -> SyntheticSeries:
        base = tmp_path / name
        work = base / "work"
        work.mkdir(parents=True)
        all_files = {"vllm/_version.py": f"__version__ = version = '{version}'\n", **files}
        for relative, content in all_files.items():
            (work / relative).parent.mkdir(parents=True, exist_ok=True)
            (work / relative).write_text(content)
        target = base / "target"
        shutil.copytree(work, target)
        git_run(work, "init", "--quiet")
        git_run(work, "add", "-A")
        git_run(work, "commit", "--quiet", "-m", "base")
        for subject, changes in commits:
            for relative, content in changes.items():
                path = work / relative
                if content is None:
                    path.unlink()
                else:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(content)
            git_run(work, "add", "-A")
            git_run(work, "commit", "--quiet", "-m", subject)
        patches_root = base / "patches"
        series_dir = patches_root / f"vllm-{version}"
        series_dir.mkdir(parents=True)
        output = git_run(
            work, "format-patch", "--zero-commit", "-o", str(series_dir), f"HEAD~{len(commits)}"
        )
        names = [Path(line).name for line in output.split()]
        (series_dir / "series").write_text("# synthetic\n" + "".join(f"{n}\n" for n in names))
        return SyntheticSeries(patches_root, series_dir, target, names)

    return build


@pytest.fixture
def use_patches_root(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path], None]:
    def point_at(root: Path) -> None:
        monkeypatch.setenv("VLLM_MINIMAX_PATCHES", str(root))

    return point_at


@pytest.fixture(autouse=True)
def _real_patches_by_default(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("VLLM_MINIMAX_PATCHES", raising=False)
    yield
