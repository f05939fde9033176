"""Trying the series on copies: every file it touches is copied into a staging directory
under ``$TMPDIR`` and each patch is applied there with ``git apply``; the target is not
written."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vllm_minimax.errors import PatchError, describe_os_error
from vllm_minimax.patchset.leftovers import STAGING_PREFIX, remove_stale_staging_dirs
from vllm_minimax.patchset.series import Patch, touched_paths
from vllm_minimax.patchset.tree import TargetTree


def git_executable() -> str:
    git = shutil.which("git")
    if git is None:
        raise PatchError("git is not installed (or not on PATH); vllm-minimax uses `git apply`")
    return git


def isolated_git_env(ceiling: Path | None = None) -> dict[str, str]:
    """Environment for git that ignores the user's and the system's configuration."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}
    env["GIT_CONFIG_NOSYSTEM"] = "1"
    env["GIT_CONFIG_GLOBAL"] = os.devnull
    env["LC_ALL"] = "C"
    if ceiling is not None:
        env["GIT_CEILING_DIRECTORIES"] = str(ceiling)
    return env


@dataclass
class StagedResult:
    before: dict[str, bytes | None]
    modes: dict[str, int]
    after: dict[str, bytes | None]


def stage_series(tree: TargetTree, patches: list[Patch]) -> StagedResult:
    """Apply ``patches`` to copies of the files they touch; raise PatchError if any fails."""
    git = git_executable()
    touched = touched_paths(patches)
    before: dict[str, bytes | None] = {}
    modes: dict[str, int] = {}
    for path in touched:
        tree.check(path, "file")
        found = tree.read(path)
        before[path] = None if found is None else found[0]
        if found is not None:
            modes[path] = found[1]
    remove_stale_staging_dirs()
    try:
        with tempfile.TemporaryDirectory(prefix=f"{STAGING_PREFIX}{os.getpid()}-") as staging_name:
            staging = Path(staging_name) / "tree"
            staging.mkdir()
            for path, content in before.items():
                if content is not None:
                    staged = staging / path
                    staged.parent.mkdir(parents=True, exist_ok=True)
                    try:
                        staged.write_bytes(content)
                    except OSError as error:  # a failed write() names no file
                        raise OSError(error.errno, error.strerror, str(staged)) from error
            env = isolated_git_env(ceiling=staging.parent)
            for patch in patches:
                completed = subprocess.run(
                    [git, "apply", "--whitespace=nowarn", str(patch.path)],
                    cwd=staging,
                    env=env,
                    capture_output=True,
                    text=True,
                )
                for code in (errno.ENOSPC, errno.EDQUOT):  # git ran out of room in staging
                    if os.strerror(code) in completed.stderr:
                        raise OSError(code, os.strerror(code), str(staging))
                if completed.returncode != 0:
                    raise PatchError(describe_apply_failure(patch, completed.stderr, tree.root))
            after = {
                path: (staging / path).read_bytes() if (staging / path).is_file() else None
                for path in touched
            }
    except OSError as error:
        if not Path(str(error.filename or "/")).is_relative_to(tempfile.gettempdir()):
            raise  # not the staging copy's (git that does not start, say)
        raise PatchError(
            f"could not stage the series under {tempfile.gettempdir()} (set TMPDIR to stage"
            f" elsewhere): {describe_os_error(error, vllm_tree=False)}; nothing was changed"
        ) from error
    return StagedResult(before=before, modes=modes, after=after)


def describe_apply_failure(patch: Patch, stderr: str, root: Path) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    hunks = re.findall(r"patch failed: (\S+:\d+)", stderr)
    missing = re.findall(r"error: (\S+): No such file or directory", stderr)
    exists = re.findall(r"error: (\S+): already exists in working directory", stderr)
    details = []
    if hunks:
        details.append("hunk does not apply at " + ", ".join(hunks) + " (file edited?)")
    if missing:
        details.append("missing file " + ", ".join(missing))
    if exists:
        details.append("file the series creates already exists: " + ", ".join(exists))
    summary = "; ".join(details) if details else "git apply failed"
    return (
        f"patch {patch.name} does not apply to {root}: {summary}\n  git apply said:\n    "
        + "\n    ".join(lines)
        + "\nnothing was changed"
    )
