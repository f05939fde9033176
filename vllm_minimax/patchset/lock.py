"""One command at a time on a target: ``flock`` on its ``vllm/`` directory."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator

from vllm_minimax.errors import PatchError
from vllm_minimax.patchset.tree import TargetTree


@contextlib.contextmanager
def target_lock(tree: TargetTree, exclusive: bool) -> Iterator[None]:
    """Hold ``flock`` on the target's ``vllm/`` directory itself (no lock file to leave behind).

    apply and revert take it exclusively, status and doctor shared; a second run gets a
    PatchError at once rather than waiting."""
    descriptor = tree.directory("vllm")
    assert descriptor is not None
    try:
        fcntl.flock(descriptor, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError as error:
        holder = (
            "another vllm-minimax command (apply or revert writing it, or status or doctor"
            " reading it) is using"
            if exclusive
            else "another vllm-minimax apply or revert is running on"
        )
        raise PatchError(
            f"{holder} {tree.root} (it holds the lock on {tree.path('vllm')}); wait for it to"
            " finish and retry. Nothing was changed"
        ) from error
    try:
        yield
    finally:
        fcntl.flock(descriptor, fcntl.LOCK_UN)
