"""Helpers shared by the CPU tests (imported by name: a module called
``conftest`` is ambiguous once other test directories have their own)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from probe_host import ProbeHost

REPO_ROOT = Path(__file__).resolve().parents[2]
REAL_PATCHES_ROOT = REPO_ROOT / "patches"
REAL_SERIES_DIR = REAL_PATCHES_ROOT / "vllm-0.34.0"


def run_json_probe(
    probe: Path,
    *arguments: str,
    timeout: float,
    env: dict[str, str] | None = None,
    host: ProbeHost | None = None,
) -> dict:
    """Run a probe script in a fresh interpreter, or in a process forked from ``host``
    (probe_host.py); it must exit 0 and print its report as JSON on its last line of
    standard output."""
    if host is not None:
        completed = host.run(probe, list(arguments), timeout=timeout, env=env)
    else:
        completed = subprocess.run(
            [sys.executable, str(probe), *arguments],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.splitlines()[-1])


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


def real_series_paths() -> list[str]:
    from vllm_minimax.patchset import read_series, touched_paths

    return touched_paths(read_series(REAL_SERIES_DIR))


@dataclass
class SyntheticSeries:
    patches_root: Path
    series_dir: Path
    target: Path
    patch_names: list[str]


@dataclass
class RecordedSeries:
    """A synthetic series that applied and reverted cleanly on its target, with the target's
    manifests when pristine and when applied (the two states a command may leave)."""

    series: SyntheticSeries
    pristine: dict[str, str]
    applied: dict[str, str]

    @property
    def target(self) -> Path:
        return self.series.target

    def manifest(self) -> dict[str, str]:
        return tree_manifest(self.target)


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


def build_and_unpack_wheel(tmp_path: Path) -> Path:
    """Build this project's wheel from a copy of the tree and unpack it; return the unpacked
    directory (what ``pip install`` would put in site-packages)."""
    import sys
    import zipfile

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        if (REPO_ROOT / name).exists():
            shutil.copy2(REPO_ROOT / name, source / name)
        else:
            (source / name).write_text("")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO_ROOT / "vllm_minimax", source / "vllm_minimax", ignore=ignore)
    shutil.copytree(REPO_ROOT / "patches", source / "patches")
    shutil.copytree(REPO_ROOT / "evals", source / "evals")
    shutil.copytree(REPO_ROOT / "configs", source / "configs")
    shutil.copytree(REPO_ROOT / "requirements", source / "requirements")
    build = "import setuptools.build_meta as b, sys; print(b.build_wheel(sys.argv[1]))"
    completed = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path / "dist")],
        cwd=source,
        capture_output=True,
        text=True,
        check=True,
    )
    wheel = tmp_path / "dist" / completed.stdout.strip().splitlines()[-1]
    installed = tmp_path / "installed"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)
    return installed
