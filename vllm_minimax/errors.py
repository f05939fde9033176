"""Failures the command line reports in one line, and what an OSError means to the user.

A :class:`UserError` carries a message meant for the user (no traceback); its subclasses
name the area it comes from. :func:`describe_os_error` turns a failed system call into one
line that names the path and says what to do.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


class UserError(Exception):
    """An expected failure with a message meant for the user (no traceback)."""


class PatchError(UserError):
    """Applying, checking or reverting the patch series failed, or the series is malformed."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) while a command wrote; the message says what it left."""


def describe_os_error(error: OSError, *, vllm_tree: bool = True) -> str:
    """One line naming the path of a failed system call and what to do about it.

    ``vllm_tree``: the call was on the vLLM tree the series applies to (apply, revert, status,
    doctor), so the advice is about that tree; otherwise it is about the path alone."""
    path = error.filename if error.filename is not None else "(unknown path)"
    if error.filename2 is not None:
        path = f"{path} -> {error.filename2}"
    other_path = "use a target" if vllm_tree else "choose a path"
    code = error.errno
    if code == errno.ENOSPC:
        if no_free_inodes(error.filename):
            return (
                f"no free inodes on the file system of {path}: delete files there (or {other_path}"
                " on a file system with free inodes) and retry"
            )
        return f"no space left on the device of {path}: free some space there and retry"
    if code == errno.EDQUOT:
        return f"disk quota exceeded writing {path}: free some of your quota and retry"
    if code == errno.ENAMETOOLONG:
        shorter = "use a target with a shorter path" if vllm_tree else "use a shorter one"
        return f"file name too long: {path}: {shorter}"
    if code in (errno.EACCES, errno.EPERM):
        if not vllm_tree:
            return (
                f"permission denied: {path}: run as a user who may use it, or {other_path} you own"
            )
        return (
            f"permission denied: {path}: the target is not writable by this user (run as the"
            " owner of the vLLM install, or use a virtual environment you own)"
        )
    if code == errno.EROFS:
        return (
            f"{path} is on a read-only file system: remount it writable or {other_path} elsewhere"
        )
    if code == errno.ELOOP and vllm_tree:
        return f"{path} is (or passes through) a symbolic link, which vllm-minimax does not follow"
    return f"{path}: {error.strerror or error}"


def no_free_inodes(filename: object) -> bool:
    """Whether the file system holding ``filename`` (or its nearest existing parent) has no
    inode left for this user."""
    if not isinstance(filename, (str, os.PathLike)):
        return False
    directory = Path(filename)
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    try:
        info = os.statvfs(directory)
    except OSError:
        return False
    return info.f_files > 0 and info.f_favail == 0
