"""The target's files, reached only through directory descriptors.

Every open, create, rename and unlink inside the target is relative to a descriptor of the
directory that holds it, and each directory is opened component by component from the
target without following a symbolic link. A directory is opened once and its descriptor kept,
so whatever is renamed or swapped in the tree meanwhile, a write lands only in the directory
that was checked. Paths are ``/``-separated and relative to the target root.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from vllm_minimax.errors import PatchError

# Every temporary file apply and revert create is named ``.<name>.<random>.vllm-minimax-tmp``
# in the directory of the file it replaces; a killed run can leave one, and apply and revert
# remove them.
TEMP_SUFFIX = ".vllm-minimax-tmp"
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMPORARY_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def checked_relative_path(path: object, what: str) -> str:
    """Return ``path`` if it is a plain relative path below ``vllm/``, else raise PatchError.

    Plain: ``/``-separated, not absolute, no empty, ``.`` or ``..`` component, no NUL."""
    if not isinstance(path, str) or not path:
        raise PatchError(f"{what}: {path!r} is not a path")
    parts = path.split("/")
    if (
        path.startswith("/")
        or "\0" in path
        or "\\" in path
        or any(part in ("", ".", "..") for part in parts)
        or parts[0] != "vllm"
        or len(parts) < 2
    ):
        raise PatchError(
            f"{what}: {path!r} is not a relative path inside vllm/ (absolute paths, '..' and"
            " empty components are refused)"
        )
    return path


def symlink_refused(path: Path) -> PatchError:
    return PatchError(
        f"{path} is a symbolic link; vllm-minimax writes only regular files inside the target"
        " and never follows links: replace the link with a copy of what it points to (or"
        " reinstall vLLM) and retry. Nothing was changed"
    )


def _split(relative: str) -> tuple[str, str]:
    parent, _, name = relative.rpartition("/")
    return parent, name


class TargetTree:
    """A vLLM tree (the directory holding ``vllm/``), open for reading and writing by
    descriptor. Use it as a context manager; the descriptors close on exit."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._root = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._directories: dict[str, int] = {}
        try:
            if self.directory("vllm") is None:
                raise PatchError(f"target {root} has no vllm/ directory")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TargetTree:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        for descriptor in self._directories.values():
            os.close(descriptor)
        self._directories.clear()
        if self._root >= 0:
            os.close(self._root)
            self._root = -1

    def path(self, relative: str) -> Path:
        """``relative`` as a path, for messages."""
        return self.root / relative

    def _named(self, error: OSError, relative: str, other: str | None = None) -> OSError:
        """``error`` naming the target's path (a call relative to a descriptor names only the
        last component, or nothing)."""
        second = None if other is None else str(self.path(other))
        return OSError(error.errno, error.strerror, str(self.path(relative)), None, second)

    # ---------------------------------------------------------------------------------------
    # Directories
    # ---------------------------------------------------------------------------------------

    def directory(self, relative: str) -> int | None:
        """The descriptor of the directory ``relative`` (``""`` is the root), or ``None`` when
        a component is missing. A link or a non-directory on the way is a PatchError."""
        if not relative:
            return self._root
        if relative in self._directories:
            return self._directories[relative]
        parent_path, name = _split(relative)
        parent = self.directory(parent_path)
        if parent is None:
            return None
        try:
            descriptor = os.open(name, _DIRECTORY_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            return None
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR):
                if self._is_link(parent, name):
                    raise symlink_refused(self.path(relative)) from None
                raise PatchError(
                    f"{self.path(relative)} is not a directory. Nothing was changed"
                ) from None
            raise self._named(error, relative) from error
        self._directories[relative] = descriptor
        return descriptor

    def _is_link(self, parent: int, name: str) -> bool:
        try:
            return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False

    def _parent(self, relative: str) -> tuple[int | None, str]:
        parent_path, name = _split(relative)
        return self.directory(parent_path), name

    def _existing_parent(self, relative: str) -> tuple[int, str]:
        parent, name = self._parent(relative)
        if parent is None:
            raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), str(self.path(relative)))
        return parent, name

    def check(self, relative: str, kind: Literal["file", "directory"]) -> None:
        """Raise PatchError unless ``relative`` reaches no symbolic link: every existing
        component a real directory, the last one a regular file or a directory as ``kind``
        says. A missing component ends the check: what does not exist yet is created here."""
        info = self.lstat(relative)
        if info is None:
            return
        if stat.S_ISLNK(info.st_mode):
            raise symlink_refused(self.path(relative))
        if kind == "directory":
            if not stat.S_ISDIR(info.st_mode):
                raise PatchError(f"{self.path(relative)} is not a directory. Nothing was changed")
        elif not stat.S_ISREG(info.st_mode):
            raise PatchError(f"{self.path(relative)} is not a regular file. Nothing was changed")

    def lstat(self, relative: str) -> os.stat_result | None:
        """The status of ``relative`` itself (a link is not followed), ``None`` if absent."""
        parent, name = self._parent(relative)
        if parent is None:
            return None
        try:
            return os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise self._named(error, relative) from error

    def exists(self, relative: str) -> bool:
        return self.lstat(relative) is not None

    def is_directory(self, relative: str) -> bool:
        info = self.lstat(relative)
        return info is not None and stat.S_ISDIR(info.st_mode)

    def entries(self, relative: str) -> Iterator[os.DirEntry[str]]:
        """The entries of the directory ``relative`` (none if it does not exist)."""
        descriptor = self.directory(relative)
        if descriptor is None:
            return
        with os.scandir(descriptor) as entries:
            yield from entries

    def mkdir(self, relative: str) -> None:
        parent, name = self._existing_parent(relative)
        try:
            os.mkdir(name, 0o755, dir_fd=parent)
        except OSError as error:
            raise self._named(error, relative) from error

    def rmdir(self, relative: str) -> None:
        for opened in [
            d for d in self._directories if d == relative or d.startswith(relative + "/")
        ]:
            os.close(self._directories.pop(opened))
        parent, name = self._existing_parent(relative)
        try:
            os.rmdir(name, dir_fd=parent)
        except OSError as error:
            raise self._named(error, relative) from error

    def sync_directory(self, relative: str) -> None:
        """fsync the directory ``relative``, if it exists."""
        descriptor = self.directory(relative)
        if descriptor is None:
            return
        try:
            os.fsync(descriptor)
        except OSError as error:
            if error.errno != errno.EINVAL:  # file systems that cannot sync a directory
                raise self._named(error, relative) from error

    # ---------------------------------------------------------------------------------------
    # Files
    # ---------------------------------------------------------------------------------------

    def read(self, relative: str) -> tuple[bytes, int] | None:
        """The bytes and permission bits of the regular file ``relative``, or ``None`` if it
        does not exist. A symbolic link is refused, not followed."""
        parent, name = self._parent(relative)
        if parent is None:
            return None
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            descriptor = os.open(name, flags, dir_fd=parent)
        except FileNotFoundError:
            return None
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise PatchError(
                    f"{self.path(relative)} is a symbolic link; vllm-minimax never follows links"
                    " inside the target: replace it with a copy of what it points to. Nothing"
                    " was changed"
                ) from error
            raise self._named(error, relative) from error
        with os.fdopen(descriptor, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise PatchError(
                    f"{self.path(relative)} is not a regular file. Nothing was changed"
                )
            try:
                return handle.read(), stat.S_IMODE(info.st_mode) & 0o777
            except OSError as error:
                raise self._named(error, relative) from error

    def write_temporary(self, relative: str, content: bytes, mode: int) -> str:
        """Write ``content`` to a new file beside ``relative`` (created exclusively, never
        through a link), with ``mode`` and, for root, the owner of the file it will replace;
        fsync it. Return the new file's path."""
        parent, name = self._existing_parent(relative)
        directory, _ = _split(relative)
        while True:
            temporary_name = f".{name[:100]}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
            try:
                descriptor = os.open(temporary_name, _TEMPORARY_FLAGS, 0o600, dir_fd=parent)
                break
            except FileExistsError:
                continue
            except OSError as error:
                raise self._named(error, f"{directory}/{temporary_name}") from error
        temporary = f"{directory}/{temporary_name}"
        try:
            try:
                view = memoryview(content)
                while view:
                    view = view[os.write(descriptor, view) :]
                os.fchmod(descriptor, mode)
                if os.geteuid() == 0:
                    try:
                        owner = os.stat(name, dir_fd=parent, follow_symlinks=False)
                    except FileNotFoundError:
                        owner = os.fstat(parent)
                    os.fchown(descriptor, owner.st_uid, owner.st_gid)
                os.fsync(descriptor)
            except OSError as error:  # write() and fsync() name no file
                raise self._named(error, relative) from error
            finally:
                os.close(descriptor)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary_name, dir_fd=parent)
            raise
        return temporary

    def replace(self, source: str, relative: str) -> None:
        """Rename ``source`` onto ``relative``; both in the same directory."""
        parent, name = self._existing_parent(relative)
        source_parent, source_name = self._existing_parent(source)
        try:
            os.replace(source_name, name, src_dir_fd=source_parent, dst_dir_fd=parent)
        except OSError as error:
            raise self._named(error, source, relative) from error

    def unlink(self, relative: str) -> None:
        parent, name = self._existing_parent(relative)
        try:
            os.unlink(name, dir_fd=parent)
        except OSError as error:
            raise self._named(error, relative) from error

    def write_atomically(self, relative: str, content: bytes, mode: int) -> None:
        temporary = self.write_temporary(relative, content, mode)
        try:
            self.replace(temporary, relative)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                self.unlink(temporary)
            raise
        self.sync_directory(_split(relative)[0])
