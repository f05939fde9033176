"""What a killed apply or revert leaves: temporary files in the target, staging directories
under ``$TMPDIR``. The next run finds and removes them."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from vllm_minimax.errors import PatchError
from vllm_minimax.patchset.state import STATE_FILE
from vllm_minimax.patchset.tree import TEMP_SUFFIX, TargetTree

STAGING_PREFIX = "vllm-minimax-stage-"


def find_litter(tree: TargetTree, paths: list[str]) -> list[str]:
    """The temporary files a killed run left beside ``paths`` and the state file (relative to
    the target)."""
    directories = {str(STATE_FILE.parent)}
    for path in paths:
        parent = Path(path).parent
        while parent != Path("."):
            directories.add(str(parent))
            parent = parent.parent
    found = []
    for directory in sorted(directories):
        try:
            tree.check(directory, "directory")
            entries = list(tree.entries(directory))
        except PatchError:
            continue  # not ours to clean; the command itself refuses such a target
        for entry in entries:
            name = entry.name
            if (
                name.startswith(".")
                and name.endswith(TEMP_SUFFIX)
                and not entry.is_dir(follow_symlinks=False)
            ):
                found.append(f"{directory}/{name}")
    return found


def remove_litter(tree: TargetTree, paths: list[str]) -> list[str]:
    """Remove what :func:`find_litter` finds; return the removed paths."""
    found = find_litter(tree, paths)
    for relative in found:
        tree.unlink(relative)
    return found


def remove_stale_staging_dirs() -> None:
    """Remove staging directories of vllm-minimax processes that no longer run (SIGKILL)."""
    temporary = Path(tempfile.gettempdir())
    try:
        entries = list(os.scandir(temporary))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(STAGING_PREFIX):
            continue
        pid_text = entry.name.removeprefix(STAGING_PREFIX).split("-", 1)[0]
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not pid_text.isdigit() or not stat.S_ISDIR(info.st_mode):
            continue
        if info.st_uid != os.geteuid() or _process_exists(int(pid_text)):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
