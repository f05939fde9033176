"""Writing the target as one transaction: steps, each with its undo.

New contents go to exclusively created temporary files beside their targets (fsynced), then
are renamed into place; directories are fsynced last. Any failure or Ctrl-C undoes the steps
done so far, in reverse order. Every step goes through a :class:`TargetTree`, so it lands in
a directory that was checked.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

from vllm_minimax.errors import Interrupted, PatchError, describe_os_error
from vllm_minimax.patchset.state import STATE_FILE
from vllm_minimax.patchset.tree import TargetTree


def _parent(relative: str) -> str:
    return relative.rpartition("/")[0]


class Transaction:
    """Steps that change the target, undone in reverse order when one fails or a signal
    comes. SIGINT and SIGTERM are held off while it runs and act between steps."""

    def __init__(self, tree: TargetTree, verb: str) -> None:
        self.tree = tree
        self.verb = verb
        self.undo: list[tuple[str, Callable[[], None]]] = []
        self.cleanup: list[str] = []
        self.signals: list[int] = []
        self.synced: set[str] = set()

    def check_signals(self) -> None:
        if self.signals:
            raise Interrupted(signal.Signals(self.signals[0]).name)

    def step(self, action: Callable[[], None], undo: tuple[str, Callable[[], None]] | None) -> None:
        self.check_signals()
        action()
        if undo is not None:
            self.undo.append(undo)

    def mkdir(self, directory: str) -> None:
        self.step(
            lambda: self.tree.mkdir(directory), (directory, lambda: self.tree.rmdir(directory))
        )
        self.synced.add(_parent(directory))

    def rmdir(self, directory: str) -> None:
        self.step(
            lambda: self.tree.rmdir(directory), (directory, lambda: self.tree.mkdir(directory))
        )
        self.synced.add(_parent(directory))

    def prepare(self, path: str, content: bytes, mode: int) -> str:
        """Write the new content of ``path`` to a temporary file beside it."""
        self.check_signals()
        temporary = self.tree.write_temporary(path, content, mode)
        self.cleanup.append(temporary)
        return temporary

    def replace(self, temporary: str, path: str, old: tuple[bytes, int] | None) -> None:
        self.step(lambda: self.tree.replace(temporary, path), self._restore(path, old))
        self.cleanup.remove(temporary)
        self.synced.add(_parent(path))

    def unlink(self, path: str, old: tuple[bytes, int]) -> None:
        self.step(lambda: self.tree.unlink(path), self._restore(path, old))
        self.synced.add(_parent(path))

    def _restore(self, path: str, old: tuple[bytes, int] | None) -> tuple[str, Callable[[], None]]:
        if old is None:
            return path, lambda: self.tree.unlink(path)
        content, mode = old
        return path, lambda: self.tree.write_atomically(path, content, mode)

    def sync(self) -> None:
        for directory in sorted(self.synced, key=lambda d: d.count("/"), reverse=True):
            self.check_signals()
            if self.tree.is_directory(directory):
                self.tree.sync_directory(directory)

    @contextlib.contextmanager
    def running(self) -> Iterator[Transaction]:
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                handlers[signum] = signal.signal(signum, lambda s, _f: self.signals.append(s))
        try:
            try:
                yield self
                self.check_signals()
            except BaseException as error:
                self._remove_temporaries()
                raise self._roll_back(error) from error
            finally:
                self._remove_temporaries()
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        if self.signals:
            raise Interrupted(
                f"interrupted after {self.verb} had finished: {self.tree.root} is left as"
                f" {self.verb} completed it"
            )

    def _remove_temporaries(self) -> None:
        """Those not renamed into place (before undoing: they may sit in a new directory)."""
        while self.cleanup:
            with contextlib.suppress(OSError, PatchError):  # the next run removes leftovers
                self.tree.unlink(self.cleanup.pop())

    def _roll_back(self, error: BaseException) -> BaseException:
        if isinstance(error, OSError):
            cause = describe_os_error(error)
        elif isinstance(error, Interrupted):
            cause = f"interrupted ({error}) during {self.verb}"
        elif isinstance(error, KeyboardInterrupt):
            cause = f"interrupted during {self.verb}"
        else:
            cause = str(error)
        failed = None
        while self.undo:
            where, undo = self.undo.pop()
            try:
                undo()
            except (OSError, PatchError) as undo_error:
                failed = (where, undo_error)
                break
        root = self.tree.root
        if failed is None:
            message = f"{cause}; {self.verb} was rolled back: nothing was changed"
        else:
            where, undo_error = failed
            why = (
                describe_os_error(undo_error)
                if isinstance(undo_error, OSError)
                else str(undo_error)
            )
            state = root / STATE_FILE
            if self._state_file_exists():
                message = (
                    f"{cause}; rolling back failed too ({why}): {root} is left part-way through"
                    f" {self.verb}; {state} records it: run `vllm-minimax revert --target {root}`"
                    " once that is fixed"
                )
            else:  # the state file goes last in a revert: every file was restored
                message = (
                    f"{cause}; {self.verb} had written everything (rolling back failed: {why}):"
                    f" {root} is reverted, no state file remains"
                )
        if isinstance(error, KeyboardInterrupt):
            return Interrupted(message)
        return PatchError(message)

    def _state_file_exists(self) -> bool:
        try:
            return self.tree.exists(str(STATE_FILE))
        except (OSError, PatchError):
            return True
