"""Apply, check and revert the vllm-minimax patch series on an installed vLLM or a source tree.

A series lives in ``patches/vllm-<version>/``: a ``series`` file naming the patches in the
order they apply (``#`` starts a comment) and ``git format-patch`` style ``NNNN-*.patch``
files. Patch paths are relative to vLLM's repository root and all lie under ``vllm/``, so a
series applies both to a source checkout root and to a ``site-packages`` directory.

Applying is all-or-nothing: every file the series touches is copied into a staging directory,
all patches are applied there with ``git apply``, and only when every patch applies are the
results written into the target. The state file ``vllm/.vllm_minimax_state.json`` records
the series, the sha256 of each touched file before and after, and byte copies of the
originals, so that ``revert`` restores the target byte for byte.

Writing is a :class:`Transaction`: the state file first, then new contents in exclusively
created temporary files beside their targets (fsynced), then renames, then the directories
are fsynced; any failure or Ctrl-C undoes the steps done so far. apply and revert hold
``flock`` on the target's ``vllm/`` directory. The state file is untrusted input: its paths
must stay inside ``vllm/`` without passing a symbolic link. Symbolic links at files the
series touches are refused, never followed or replaced. docs/patch-machinery.md has the
user's view.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vllm_minimax import __version__ as TOOL_VERSION

STATE_FILE = Path("vllm") / ".vllm_minimax_state.json"
STATE_FORMAT = 1
SERIES_FILE_NAME = "series"
PATCHES_ENV = "VLLM_MINIMAX_PATCHES"

FileState = Literal["as-applied", "edited", "missing", "pristine"]


class PatchError(Exception):
    """An expected failure with a message meant for the user (no traceback)."""


# --------------------------------------------------------------------------------------------
# Locating the series
# --------------------------------------------------------------------------------------------


def patches_root() -> Path:
    """Return the directory holding ``vllm-<version>/`` series directories.

    Order: ``$VLLM_MINIMAX_PATCHES``; ``vllm_minimax/_patches`` (a wheel built from this
    project carries the series there, see ``pyproject.toml``); the repository's ``patches/``
    next to the package (source tree and editable installs).
    """
    override = os.environ.get(PATCHES_ENV)
    if override:
        return Path(override)
    package_dir = Path(__file__).resolve().parent
    shipped = package_dir / "_patches"
    if shipped.is_dir():
        return shipped
    return package_dir.parent / "patches"


def supported_versions(root: Path | None = None) -> list[str]:
    root = patches_root() if root is None else root
    if not root.is_dir():
        return []
    versions = [
        entry.name.removeprefix("vllm-")
        for entry in root.iterdir()
        if entry.is_dir()
        and entry.name.startswith("vllm-")
        and (entry / SERIES_FILE_NAME).is_file()
    ]
    return sorted(versions, key=_version_sort_key)


def _version_sort_key(version: str) -> tuple[Any, ...]:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"[.+-]", version))


def series_dir_for(version: str, root: Path | None = None) -> Path | None:
    root = patches_root() if root is None else root
    candidate = root / f"vllm-{version}"
    return candidate if (candidate / SERIES_FILE_NAME).is_file() else None


def require_series_dir(version: str, root: Path | None = None) -> Path:
    root = patches_root() if root is None else root
    found = series_dir_for(version, root)
    if found is None:
        supported = ", ".join(supported_versions(root)) or "none"
        raise PatchError(
            f"no patch series for vLLM {version} (no {root / f'vllm-{version}'}/series);"
            f" supported vLLM versions: {supported}"
        )
    return found


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path
    sha256: str
    paths: tuple[str, ...]
    created: frozenset[str]
    deleted: frozenset[str]
    # (path, git blob id before this patch) as abbreviated in the path's ``index`` line; all
    # zeros for a path the patch creates, renames or copies to; paths without one are left out.
    preimages: tuple[tuple[str, str], ...] = ()

    def preimage(self, path: str) -> str | None:
        return dict(self.preimages).get(path)


def read_series(series_dir: Path) -> list[Patch]:
    """Read ``series`` and the patches it names, in order."""
    names = parse_series_file((series_dir / SERIES_FILE_NAME).read_text(encoding="utf-8"))
    if not names:
        raise PatchError(f"{series_dir / SERIES_FILE_NAME} lists no patches")
    patches = []
    for name in names:
        path = series_dir / name
        if not path.is_file():
            raise PatchError(f"{series_dir / SERIES_FILE_NAME} names {name}, which does not exist")
        data = path.read_bytes()
        paths, created, deleted, preimages = parse_patch_paths(data, name)
        patches.append(
            Patch(
                name=name,
                path=path,
                sha256=sha256_hex(data),
                paths=paths,
                created=created,
                deleted=deleted,
                preimages=preimages,
            )
        )
    return patches


def series_fingerprint(patches: list[Patch]) -> list[tuple[str, str]]:
    """What the state file records of a series: each patch's name and sha256."""
    return [(patch.name, patch.sha256) for patch in patches]


def parse_series_file(text: str) -> list[str]:
    names = []
    for raw_line in text.splitlines():
        line = raw_line.split("#", 1)[0].strip()
        if not line:
            continue
        if "/" in line or line in (".", ".."):
            raise PatchError(f"series entry {line!r} must be a file name in the series directory")
        names.append(line)
    return names


_DIFF_GIT = re.compile(r"^diff --git a/(\S+) b/(\S+)$")
_INDEX = re.compile(r"^index ([0-9a-f]{7,40})\.\.[0-9a-f]{7,40}(?: [0-7]{6})?$")


def git_blob_id(content: bytes) -> str:
    """The id git gives ``content`` as a blob (what a patch's ``index`` line abbreviates)."""
    header = b"blob %d\0" % len(content)
    return hashlib.sha1(header + content, usedforsecurity=False).hexdigest()


ABSENT_BLOB = "0000000"


def parse_patch_paths(
    data: bytes, patch_name: str
) -> tuple[tuple[str, ...], frozenset[str], frozenset[str], tuple[tuple[str, str], ...]]:
    """Return (paths touched, paths created, paths deleted, pre-images) of a git-style patch:
    see `Patch.preimages`."""
    paths: list[str] = []
    created: set[str] = set()
    deleted: set[str] = set()
    preimages: dict[str, str] = {}
    current: list[str] = []
    in_header = False
    for raw in data.decode("utf-8", errors="replace").splitlines():
        match = _DIFF_GIT.match(raw)
        if match:
            current = [match.group(1), match.group(2)]
            for path in current:
                if path not in paths:
                    paths.append(path)
            in_header = True
            continue
        if raw.startswith('diff --git "'):
            raise PatchError(f"{patch_name}: quoted paths are not supported: {raw}")
        if not in_header:
            continue
        if raw.startswith("@@") or raw.startswith("GIT binary patch"):
            in_header = False
        elif raw.startswith("new file mode"):
            created.add(current[1])
        elif raw.startswith("deleted file mode"):
            deleted.add(current[0])
        elif raw.startswith(("rename to ", "copy to ")):
            preimages.setdefault(current[1], ABSENT_BLOB)
        elif match := _INDEX.match(raw):
            preimages.setdefault(current[0], match.group(1))
    if not paths:
        raise PatchError(f"{patch_name}: no 'diff --git' sections; is it a git format-patch file?")
    for path in paths:
        parts = Path(path).parts
        if path.startswith("/") or ".." in parts or not parts or parts[0] != "vllm":
            raise PatchError(
                f"{patch_name}: path {path!r} is not under vllm/; a series may only touch the"
                " vllm package so that it applies to site-packages and source trees alike"
            )
    return tuple(paths), frozenset(created), frozenset(deleted), tuple(preimages.items())


# --------------------------------------------------------------------------------------------
# Locating the target
# --------------------------------------------------------------------------------------------


def find_vllm_root(target: Path | None) -> Path:
    """Return the directory that contains the ``vllm/`` package.

    With ``target`` given it must contain ``vllm/`` (a source checkout root or a
    site-packages directory). Otherwise the installed vLLM is located without importing it.
    """
    if target is not None:
        target = Path(target)
        try:
            target.stat()
        except FileNotFoundError:
            if target.is_symlink():
                raise PatchError(
                    f"target {target} is a symbolic link to {os.readlink(target)},"
                    " which does not exist"
                ) from None
            raise PatchError(f"target {target} does not exist") from None
        except OSError as error:
            if error.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            raise PatchError(f"target {target} cannot be reached: {error.strerror}") from None
        if not target.is_dir():
            raise PatchError(f"target {target} is not a directory")
        if (target / "vllm").is_symlink():
            raise PatchError(
                f"{target / 'vllm'} is a symbolic link (to {os.readlink(target / 'vllm')});"
                " vllm-minimax does not follow links: pass the directory that really holds"
                " vllm/ as --target"
            )
        if not (target / "vllm").is_dir():
            raise PatchError(
                f"target {target} has no vllm/ directory; pass a vLLM source checkout root or"
                " the site-packages directory that holds vllm/"
            )
        return target.resolve()
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("vLLM is not installed in this Python environment; pass --target DIR")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    return package_dir.parent.resolve()


_VERSION_ASSIGNMENT = re.compile(
    r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M
)
_METADATA_VERSION = re.compile(r"^Version:\s*(\S+)\s*$", re.M)


def read_vllm_version(root: Path) -> str:
    """Read vLLM's version from text files under ``root`` (vLLM is never imported)."""
    version_file = root / "vllm" / "_version.py"
    if version_file.is_file():
        match = _VERSION_ASSIGNMENT.search(
            version_file.read_text(encoding="utf-8", errors="replace")
        )
        if match:
            return match.group(1)
    metadata_files = [*sorted(root.glob("vllm-*.dist-info/METADATA")), root / "PKG-INFO"]
    for metadata in metadata_files:
        if metadata.is_file():
            text = metadata.read_text(encoding="utf-8", errors="replace")
            head = text.split("\n\n", 1)[0]
            if re.search(r"^Name:\s*vllm\s*$", head, re.M | re.I):
                match = _METADATA_VERSION.search(head)
                if match:
                    return match.group(1)
    raise PatchError(
        f"cannot tell the vLLM version of {root}: no vllm/_version.py, vllm-*.dist-info/METADATA"
        " or PKG-INFO with a version"
    )


# --------------------------------------------------------------------------------------------
# Paths inside the target
# --------------------------------------------------------------------------------------------

# Every temporary file apply and revert create is named ``.<name>.<random>.vllm-minimax-tmp``
# in the directory of the file it replaces; older versions left ``.<name>.vllm-minimax-tmp``
# and ``.vllm-minimax-probe-<random>``. A killed run can leave any of these; apply and revert
# remove them.
TEMP_SUFFIX = ".vllm-minimax-tmp"
LEGACY_PROBE_PREFIX = ".vllm-minimax-probe-"
STAGING_PREFIX = "vllm-minimax-stage-"


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


def check_inside(root: Path, relative: str, kind: Literal["file", "directory"]) -> None:
    """Raise PatchError unless ``root / relative`` reaches no symbolic link.

    Every existing component below ``root`` must be a real directory (and the last one a
    regular file or a directory, as ``kind`` says), so the path cannot leave the target.
    A missing component ends the walk: what does not exist yet is created by this tool."""
    current = root
    parts = relative.split("/")
    for index, part in enumerate(parts):
        current = current / part
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            return
        last = index == len(parts) - 1
        if stat.S_ISLNK(info.st_mode):
            raise PatchError(
                f"{current} is a symbolic link; vllm-minimax writes only regular files inside"
                " the target and never follows links: replace the link with a copy of what it"
                " points to (or reinstall vLLM) and retry. Nothing was changed"
            )
        if not last or kind == "directory":
            if not stat.S_ISDIR(info.st_mode):
                raise PatchError(f"{current} is not a directory. Nothing was changed")
        elif not stat.S_ISREG(info.st_mode):
            raise PatchError(f"{current} is not a regular file. Nothing was changed")


def read_regular(path: Path) -> tuple[bytes, int] | None:
    """The bytes and permission bits of the regular file ``path``, or ``None`` if it does not
    exist. A symbolic link is refused, not followed."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise PatchError(
                f"{path} is a symbolic link; vllm-minimax never follows links inside the"
                " target: replace it with a copy of what it points to. Nothing was changed"
            ) from error
        raise
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise PatchError(f"{path} is not a regular file. Nothing was changed")
        return handle.read(), info.st_mode & 0o777


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
        if _no_free_inodes(error.filename):
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


def _no_free_inodes(filename: object) -> bool:
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


# --------------------------------------------------------------------------------------------
# State file
# --------------------------------------------------------------------------------------------


def sha256_hex(content: bytes | None) -> str | None:
    """The sha256 of ``content``, or ``None`` for a file that does not exist."""
    return None if content is None else hashlib.sha256(content).hexdigest()


def sha256_of(path: Path) -> str | None:
    found = read_regular(path)
    return None if found is None else sha256_hex(found[0])


@dataclass(frozen=True)
class RecordedFile:
    path: str
    before_sha256: str | None
    before_mode: int | None
    before_content: bytes | None
    after_sha256: str | None

    def to_json(self) -> dict[str, Any]:
        before: dict[str, Any] | None = None
        if self.before_content is not None:
            before = {
                "sha256": self.before_sha256,
                "mode": self.before_mode,
                "content_base64": base64.b64encode(self.before_content).decode("ascii"),
            }
        after = None if self.after_sha256 is None else {"sha256": self.after_sha256}
        return {"path": self.path, "before": before, "after": after}

    @classmethod
    def from_json(cls, data: Any) -> RecordedFile:
        """Read one ``files`` entry, refusing anything apply would not have written."""
        if not isinstance(data, dict):
            raise ValueError(f"a files entry is {type(data).__name__}, not an object")
        path = checked_relative_path(data.get("path"), "files entry")
        if "before" not in data or "after" not in data:
            raise ValueError(f"the entry of {path} lacks 'before' or 'after'")
        before, after = data["before"], data["after"]
        if before is None and after is None:
            raise ValueError(
                f"the entry of {path} has neither 'before' nor 'after': the series neither"
                " found nor left that file"
            )
        content = None
        mode = None
        if before is not None:
            if not isinstance(before, dict):
                raise ValueError(f"'before' of {path} is not an object")
            mode = before.get("mode")
            if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o777:
                raise ValueError(f"'before' of {path} has mode {mode!r}, not 0..0o777")
            encoded = before.get("content_base64")
            if not isinstance(encoded, str):
                raise ValueError(f"'before' of {path} has no content_base64")
            content = base64.b64decode(encoded, validate=True)
            if sha256_hex(content) != before.get("sha256"):
                raise ValueError(f"the saved original of {path} does not match its sha256")
        if after is not None and not (isinstance(after, dict) and _is_sha256(after.get("sha256"))):
            raise ValueError(f"'after' of {path} is not an object with a sha256")
        return cls(
            path=path,
            before_sha256=sha256_hex(content),
            before_mode=mode,
            before_content=content,
            after_sha256=None if after is None else after["sha256"],
        )


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


@dataclass(frozen=True)
class AppliedState:
    vllm_version: str
    series: str
    patches: list[tuple[str, str]]
    files: list[RecordedFile]
    created_dirs: list[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "tool": f"vllm-minimax {TOOL_VERSION}",
            "vllm_version": self.vllm_version,
            "series": self.series,
            "patches": [{"name": name, "sha256": sha} for name, sha in self.patches],
            "created_dirs": self.created_dirs,
            "files": [record.to_json() for record in self.files],
        }

    def encode(self) -> bytes:
        return (json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n").encode("utf-8")


def load_state(root: Path) -> AppliedState | None:
    """Read and check the state file; ``None`` when there is none.

    Every path in it must be a plain relative path inside ``vllm/`` that reaches no symbolic
    link, and every ``created_dirs`` entry a directory above a file the series created;
    anything else is refused before a file is touched."""
    state_path = root / STATE_FILE
    check_inside(root, str(STATE_FILE), "file")
    found = read_regular(state_path)
    if found is None:
        return None
    try:
        data = json.loads(found[0].decode("utf-8"))
        if not isinstance(data, dict):
            raise ValueError("it is not a JSON object")
        if data.get("format") != STATE_FORMAT:
            raise PatchError(
                f"state file {state_path} has format {data.get('format')!r}; this vllm-minimax"
                f" understands format {STATE_FORMAT}"
            )
        state = AppliedState(
            vllm_version=str(data["vllm_version"]),
            series=str(data["series"]),
            patches=[(str(entry["name"]), str(entry["sha256"])) for entry in data["patches"]],
            files=[RecordedFile.from_json(entry) for entry in data["files"]],
            created_dirs=list(data.get("created_dirs", [])),
        )
        _check_recorded_paths(state)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, PatchError) as error:
        if isinstance(error, PatchError) and "has format" in str(error):
            raise
        reason = error.args[0] if isinstance(error, KeyError) else error
        if isinstance(error, KeyError):
            reason = f"no {reason!r}"
        raise PatchError(
            f"state file {state_path} is unreadable or was tampered with ({reason}); it was not"
            " written by a complete vllm-minimax apply, so nothing was changed: reinstall vLLM"
            " and delete that file"
        ) from error
    for record in state.files:
        check_inside(root, record.path, "file")
    for directory in state.created_dirs:
        check_inside(root, directory, "directory")
    return state


def _check_recorded_paths(state: AppliedState) -> None:
    paths = [record.path for record in state.files]
    if len(set(paths)) != len(paths):
        raise ValueError("a file is listed twice")
    if str(STATE_FILE) in paths:
        raise ValueError("the state file lists itself")
    created_files = [record.path for record in state.files if record.before_content is None]
    for directory in state.created_dirs:
        checked_relative_path(directory, "created_dirs entry")
        if not any(path.startswith(directory + "/") for path in created_files):
            raise ValueError(f"created_dirs entry {directory!r} holds no file the series created")


def recorded_file_state(root: Path, record: RecordedFile) -> FileState:
    current = sha256_of(root / record.path)
    if current == record.after_sha256:
        return "as-applied"
    if current is None:
        return "missing"
    if current == record.before_sha256:
        return "pristine"
    return "edited"


# --------------------------------------------------------------------------------------------
# Locking and leftovers
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def target_lock(root: Path, exclusive: bool) -> Iterator[None]:
    """Hold ``flock`` on the target's ``vllm/`` directory itself (no lock file to leave behind).

    apply and revert take it exclusively, status shared; a second run gets a PatchError at
    once rather than waiting."""
    descriptor = os.open(root / "vllm", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(descriptor, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError as error:
            raise PatchError(
                f"another vllm-minimax apply or revert is running on {root} (it holds the lock on"
                f" {root / 'vllm'}); wait for it to finish and retry. Nothing was changed"
            ) from error
        yield
    finally:
        os.close(descriptor)


def remove_litter(root: Path, paths: list[str]) -> list[str]:
    """Remove the temporary and probe files a killed run left beside ``paths`` and the state
    file; return the removed paths (relative to ``root``)."""
    found = find_litter(root, paths)
    for relative in found:
        os.unlink(root / relative)
    return found


def find_litter(root: Path, paths: list[str]) -> list[str]:
    """The temporary and probe files a killed run left beside ``paths`` and the state file."""
    directories = {Path(STATE_FILE).parent}
    for path in paths:
        parent = Path(path).parent
        while parent != Path("."):
            directories.add(parent)
            parent = parent.parent
    removed = []
    for directory in sorted(directories):
        full = root / directory
        try:
            check_inside(root, str(directory), "directory")
        except PatchError:
            continue  # not ours to clean; the command itself refuses such a target
        if not full.is_dir():
            continue
        for entry in os.scandir(full):
            name = entry.name
            is_litter = (name.startswith(".") and name.endswith(TEMP_SUFFIX)) or name.startswith(
                LEGACY_PROBE_PREFIX
            )
            if is_litter and not entry.is_dir(follow_symlinks=False):
                removed.append(str(directory / name))
    return removed


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


# --------------------------------------------------------------------------------------------
# Checking a series in a staging directory
# --------------------------------------------------------------------------------------------


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


def stage_series(root: Path, patches: list[Patch]) -> StagedResult:
    """Apply ``patches`` to copies of the files they touch; raise PatchError if any fails."""
    git = git_executable()
    touched = touched_paths(patches)
    before: dict[str, bytes | None] = {}
    modes: dict[str, int] = {}
    for path in touched:
        check_inside(root, path, "file")
        found = read_regular(root / path)
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
                    raise PatchError(describe_apply_failure(patch, completed.stderr, root))
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


def touched_paths(patches: list[Patch]) -> list[str]:
    ordered: list[str] = []
    for patch in patches:
        for path in patch.paths:
            if path not in ordered:
                ordered.append(path)
    return ordered


# --------------------------------------------------------------------------------------------
# Writing: one transaction of steps, each with its undo
# --------------------------------------------------------------------------------------------


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) while apply or revert wrote; the message says what it left."""


def write_temporary(path: Path, content: bytes, mode: int) -> Path:
    """Write ``content`` to a new file beside ``path`` (created exclusively, never through a
    link), with ``mode`` and, for root, the owner of the file it will replace; fsync it."""
    prefix = f".{path.name[:100]}."
    descriptor, name = tempfile.mkstemp(prefix=prefix, suffix=TEMP_SUFFIX, dir=path.parent)
    temporary = Path(name)
    try:
        try:
            view = memoryview(content)
            while view:
                try:
                    written = os.write(descriptor, view)
                except OSError as error:
                    raise OSError(error.errno, error.strerror, str(path)) from error
                view = view[written:]
            os.fchmod(descriptor, mode)
            if os.geteuid() == 0:
                try:
                    owner = os.lstat(path)
                except FileNotFoundError:
                    owner = os.stat(path.parent)
                os.fchown(descriptor, owner.st_uid, owner.st_gid)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return temporary


def fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno != errno.EINVAL:  # file systems that cannot sync a directory
            raise
    finally:
        os.close(descriptor)


def write_atomically(path: Path, content: bytes, mode: int) -> None:
    temporary = write_temporary(path, content, mode)
    try:
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    fsync_directory(path.parent)


class Transaction:
    """Steps that change the target, undone in reverse order when one fails or a signal
    comes. SIGINT and SIGTERM are held off while it runs and act between steps."""

    def __init__(self, root: Path, verb: str) -> None:
        self.root = root
        self.verb = verb
        self.undo: list[tuple[str, Callable[[], None]]] = []
        self.cleanup: list[Path] = []
        self.signals: list[int] = []
        self.synced: set[Path] = set()

    def check_signals(self) -> None:
        if self.signals:
            raise Interrupted(signal.Signals(self.signals[0]).name)

    def step(self, action: Callable[[], None], undo: tuple[str, Callable[[], None]] | None) -> None:
        self.check_signals()
        action()
        if undo is not None:
            self.undo.append(undo)

    def mkdir(self, directory: Path) -> None:
        self.step(
            lambda: os.mkdir(directory, 0o755),
            (str(directory), lambda: os.rmdir(directory)),
        )
        self.synced.add(directory.parent)

    def rmdir(self, directory: Path) -> None:
        self.step(
            lambda: os.rmdir(directory),
            (str(directory), lambda: os.mkdir(directory, 0o755)),
        )
        self.synced.add(directory.parent)

    def prepare(self, path: Path, content: bytes, mode: int) -> Path:
        """Write the new content of ``path`` to a temporary file beside it."""
        self.check_signals()
        temporary = write_temporary(path, content, mode)
        self.cleanup.append(temporary)
        return temporary

    def replace(self, temporary: Path, path: Path, old: tuple[bytes, int] | None) -> None:
        self.step(lambda: os.replace(temporary, path), self._restore(path, old))
        self.cleanup.remove(temporary)
        self.synced.add(path.parent)

    def unlink(self, path: Path, old: tuple[bytes, int]) -> None:
        self.step(lambda: os.unlink(path), self._restore(path, old))
        self.synced.add(path.parent)

    def _restore(self, path: Path, old: tuple[bytes, int] | None) -> tuple[str, Callable[[], None]]:
        if old is None:
            return str(path), lambda: os.unlink(path)
        content, mode = old
        return str(path), lambda: write_atomically(path, content, mode)

    def sync(self) -> None:
        for directory in sorted(self.synced, key=lambda d: len(d.parts), reverse=True):
            self.check_signals()
            if directory.is_dir():
                fsync_directory(directory)

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
                f"interrupted after {self.verb} had finished: {self.root} is left as {self.verb}"
                " completed it"
            )

    def _remove_temporaries(self) -> None:
        """Those not renamed into place (before undoing: they may sit in a new directory)."""
        while self.cleanup:
            with contextlib.suppress(OSError):  # best effort: the next run removes leftovers
                os.unlink(self.cleanup.pop())

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
            except OSError as undo_error:
                failed = (where, undo_error)
                break
        if failed is None:
            message = f"{cause}; {self.verb} was rolled back: nothing was changed"
        else:
            where, undo_error = failed
            state = self.root / STATE_FILE
            if os.path.lexists(state):
                message = (
                    f"{cause}; rolling back failed too ({describe_os_error(undo_error)}):"
                    f" {self.root} is left part-way through {self.verb}; {state} records it: run"
                    f" `vllm-minimax revert --target {self.root}` once that is fixed"
                )
            else:  # the state file goes last in a revert: every file was restored
                message = (
                    f"{cause}; {self.verb} had written everything (rolling back failed:"
                    f" {describe_os_error(undo_error)}): {self.root} is reverted, no state file"
                    " remains"
                )
        if isinstance(error, KeyboardInterrupt):
            return Interrupted(message)
        return PatchError(message)


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


@dataclass
class ApplyResult:
    root: Path
    vllm_version: str
    series_dir: Path
    already_applied: bool
    changed: list[str] = field(default_factory=list)
    litter_removed: list[str] = field(default_factory=list)


def _nothing_changed_on_os_error(function: Callable[..., Any]) -> Callable[..., Any]:
    """An OSError before any write (a transaction reports its own) changed nothing."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except OSError as error:
            raise PatchError(f"{describe_os_error(error)}; nothing was changed") from error

    return wrapper


@_nothing_changed_on_os_error
def apply_series(target: Path | None = None, patches_dir: Path | None = None) -> ApplyResult:
    root = find_vllm_root(target)
    version = read_vllm_version(root)
    series_dir = require_series_dir(version, patches_dir)
    patches = read_series(series_dir)
    paths = touched_paths(patches)
    with target_lock(root, exclusive=True):
        litter = remove_litter(root, paths)
        state = load_state(root)
        if state is not None:
            _check_existing_state(root, state, series_dir, patches)
            return ApplyResult(
                root, version, series_dir, already_applied=True, litter_removed=litter
            )
        for patch in patches:
            for created in sorted(patch.created):
                if os.path.lexists(root / created) and created not in _paths_before(patches, patch):
                    raise PatchError(
                        f"{root / created} already exists, but patch {patch.name} creates it and"
                        f" there is no state file {root / STATE_FILE}: the target looks partly"
                        " patched by someone else; reinstall vLLM (or delete that file) and"
                        " apply again. Nothing was changed"
                    )
        staged = stage_series(root, patches)
        changed = [path for path in paths if staged.after[path] != staged.before[path]]
        created_dirs = _directories_to_create(
            root, [path for path in changed if staged.after[path] is not None]
        )
        records = [
            RecordedFile(
                path=path,
                before_sha256=sha256_hex(staged.before[path]),
                before_mode=staged.modes.get(path),
                before_content=staged.before[path],
                after_sha256=sha256_hex(staged.after[path]),
            )
            for path in paths
        ]
        new_state = AppliedState(
            vllm_version=version,
            series=series_dir.name,
            patches=series_fingerprint(patches),
            files=records,
            created_dirs=[str(directory.relative_to(root)) for directory in created_dirs],
        )
        transaction = Transaction(root, "apply")
        with transaction.running():
            # The state goes first: if the process dies after it, `revert` undoes the rest.
            state_path = root / STATE_FILE
            state_temporary = transaction.prepare(state_path, new_state.encode(), 0o644)
            transaction.replace(state_temporary, state_path, None)
            for directory in created_dirs:
                transaction.mkdir(directory)
            temporaries = {
                path: transaction.prepare(root / path, after, staged.modes.get(path, 0o644))
                for path in changed
                if (after := staged.after[path]) is not None
            }
            for path in changed:
                before = staged.before[path]
                old = None if before is None else (before, staged.modes[path])
                if path in temporaries:
                    transaction.replace(temporaries[path], root / path, old)
                else:
                    assert old is not None
                    transaction.unlink(root / path, old)
            transaction.sync()
    return ApplyResult(
        root, version, series_dir, already_applied=False, changed=changed, litter_removed=litter
    )


def _paths_before(patches: list[Patch], patch: Patch) -> set[str]:
    """Paths an earlier patch of the series deletes (so a later one may create them)."""
    earlier: set[str] = set()
    for other in patches:
        if other is patch:
            break
        earlier |= other.deleted
    return earlier


def _directories_to_create(root: Path, paths: list[str]) -> list[Path]:
    missing: set[Path] = set()
    for path in paths:
        directory = (root / path).parent
        while not os.path.lexists(directory):
            missing.add(directory)
            directory = directory.parent
    return sorted(missing, key=lambda d: len(d.parts))


def _check_existing_state(
    root: Path, state: AppliedState, series_dir: Path, patches: list[Patch]
) -> None:
    """Return quietly when the recorded state is exactly this series fully applied."""
    version = read_vllm_version(root)
    if state.series != series_dir.name and state.vllm_version != version:
        raise PatchError(
            f"{root} carries the {state.series} series (applied to vLLM {state.vllm_version}),"
            f" but its vLLM is now {version}, whose series is {series_dir.name}; a series only"
            f" goes on its own release. Run `vllm-minimax revert` (it restores the files"
            f" {state.series} changed), then apply. Nothing was changed"
        )
    file_states = {record.path: recorded_file_state(root, record) for record in state.files}
    not_applied = {path: s for path, s in file_states.items() if s != "as-applied"}
    if not_applied:
        listing = ", ".join(f"{path} ({s})" for path, s in sorted(not_applied.items()))
        raise PatchError(
            f"state file {root / STATE_FILE} says {state.series} is applied, but these files do"
            f" not match it: {listing}. Run `vllm-minimax revert` if they are only pristine or"
            " as-applied; otherwise reinstall vLLM and delete the state file. Nothing was changed"
        )
    current = series_fingerprint(patches)
    if state.series != series_dir.name or state.patches != current:
        raise PatchError(
            f"{root} carries a different revision of the series ({state.series}, patches"
            f" {', '.join(name for name, _ in state.patches)}) than {series_dir}; run"
            " `vllm-minimax revert` first, then apply. Nothing was changed"
        )


@dataclass
class RevertResult:
    root: Path
    series: str
    restored: list[str]
    removed: list[str]
    litter_removed: list[str] = field(default_factory=list)


@_nothing_changed_on_os_error
def revert_series(target: Path | None = None) -> RevertResult:
    root = find_vllm_root(target)
    with target_lock(root, exclusive=True):
        state = load_state(root)
        series_paths: list[str] = []
        if state is None:
            with contextlib.suppress(PatchError, OSError):
                series_dir = series_dir_for(read_vllm_version(root))
                if series_dir is not None:
                    series_paths = touched_paths(read_series(series_dir))
        litter = remove_litter(
            root, series_paths if state is None else [record.path for record in state.files]
        )
        if state is None:
            cleaned = f" (removed {len(litter)} leftover temporary file(s))" if litter else ""
            raise PatchError(
                f"nothing to revert: no vllm-minimax series is applied to {root}"
                f" (no {STATE_FILE} there){cleaned}"
            )
        return _revert(root, state, litter)


def _revert(root: Path, state: AppliedState, litter: list[str]) -> RevertResult:
    file_states = {record.path: recorded_file_state(root, record) for record in state.files}
    edited = sorted(
        record.path
        for record in state.files
        if file_states[record.path] == "edited"
        or (file_states[record.path] == "missing" and record.before_content is not None)
    )
    if edited:
        listing = ", ".join(f"{path} ({file_states[path]})" for path in edited)
        raise PatchError(
            f"refusing to revert {root}: files were changed since `vllm-minimax apply`: {listing}."
            " Undo those edits (or reinstall vLLM and delete the state file). Nothing was changed"
        )
    to_undo = [
        record
        for record in state.files
        if file_states[record.path] == "as-applied" and record.after_sha256 != record.before_sha256
    ]
    state_path = root / STATE_FILE
    saved_state = read_regular(state_path)
    assert saved_state is not None
    restored, removed = [], []
    transaction = Transaction(root, "revert")
    with transaction.running():
        for record in to_undo:
            if record.before_content is not None:
                for directory in _directories_to_create(root, [record.path]):
                    transaction.mkdir(directory)
        temporaries = {
            record.path: transaction.prepare(
                root / record.path, record.before_content, record.before_mode or 0o644
            )
            for record in to_undo
            if record.before_content is not None
        }
        for record in to_undo:
            file_path = root / record.path
            current = read_regular(file_path)
            if record.path in temporaries:
                transaction.replace(temporaries[record.path], file_path, current)
                restored.append(record.path)
            elif current is not None:
                transaction.unlink(file_path, current)
                removed.append(record.path)
        mismatched = [
            record.path
            for record in state.files
            if sha256_of(root / record.path) != record.before_sha256
        ]
        if mismatched:
            raise PatchError(
                "revert wrote the saved originals but they do not verify: " + ", ".join(mismatched)
            )
        for directory in sorted(state.created_dirs, key=lambda d: len(Path(d).parts), reverse=True):
            directory_path = root / directory
            if directory_path.is_dir() and not any(directory_path.iterdir()):
                transaction.rmdir(directory_path)
        transaction.unlink(state_path, saved_state)
        transaction.sync()
    return RevertResult(root, state.series, restored, removed, litter)


@dataclass
class SeriesState:
    """What the series looks like on a target; see :func:`series_state`."""

    target: Path
    vllm_version: str
    series_dir: Path | None
    applied: bool
    files: list[tuple[str, FileState]]
    recorded_series: str | None = None
    problem: str | None = None
    litter: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """True when this version's current series is applied and every touched file is as the
        series left it."""
        return (
            self.applied
            and self.problem is None
            and all(state == "as-applied" for _, state in self.files)
        )

    @property
    def exit_code(self) -> int:
        """`vllm-minimax status`'s exit code: 0 applied (cleanly), 1 not applied (the series
        would apply), 2 anything else (no series for this version, does not apply,
        half-applied or edited files, a changed series)."""
        if self.clean:
            return 0
        if not self.applied and self.problem is None and self.series_dir is not None:
            return 1
        return 2


@_nothing_changed_on_os_error
def series_state(target: Path | None = None, patches_dir: Path | None = None) -> SeriesState:
    """Describe the target without changing it.

    Applied (state file present): each recorded file is "as-applied", "pristine" (back to its
    original), "edited" or "missing". Not applied: each file the series would touch is
    "pristine", "edited" or "missing" against the blob the series' patches were made on, and
    ``problem`` holds the error when the series would not apply.
    """
    root = find_vllm_root(target)
    with target_lock(root, exclusive=False):
        status = _series_state(root, patches_dir)
        status.litter = find_litter(root, [path for path, _ in status.files])
        return status


def _series_state(root: Path, patches_dir: Path | None) -> SeriesState:
    version = read_vllm_version(root)
    series_dir = series_dir_for(version, patches_dir)
    state = load_state(root)
    if state is not None:
        files = [(record.path, recorded_file_state(root, record)) for record in state.files]
        problem = None
        if series_dir is None or state.series != series_dir.name:
            problem = (
                f"the applied series {state.series} (for vLLM {state.vllm_version}) is not the"
                f" series for vLLM {version}; run `vllm-minimax revert`"
            )
        elif series_fingerprint(read_series(series_dir)) != state.patches:
            problem = (
                f"{series_dir} has changed since it was applied; run `vllm-minimax revert`"
                " and `vllm-minimax apply` to pick up the new revision"
            )
        return SeriesState(
            root, version, series_dir, True, files, recorded_series=state.series, problem=problem
        )
    if series_dir is None:
        supported = ", ".join(supported_versions(patches_dir)) or "none"
        problem = f"no patch series for vLLM {version}; supported: {supported}"
        return SeriesState(root, version, None, False, [], problem=problem)
    patches = read_series(series_dir)
    files = [(path, unapplied_file_state(root, path, patches)) for path in touched_paths(patches)]
    try:
        stage_series(root, patches)
    except PatchError as error:
        return SeriesState(root, version, series_dir, False, files, problem=str(error))
    return SeriesState(root, version, series_dir, False, files)


def unapplied_file_state(root: Path, path: str, patches: list[Patch]) -> FileState:
    """``path`` in a tree without the series, against what the first patch touching it expects:
    "pristine" (vLLM's file, or absent where the series creates it), "edited" or "missing".

    A patch without an ``index`` line for the path leaves only its presence to check."""
    first = next(patch for patch in patches if path in patch.paths)
    preimage = first.preimage(path)
    file = root / path
    if path in first.created or (preimage is not None and not preimage.strip("0")):
        return "edited" if os.path.lexists(file) else "pristine"
    if not os.path.lexists(file):
        return "missing"
    if file.is_symlink() or not file.is_file():  # a link or a directory where a file should be
        return "edited"
    if preimage is None:
        return "pristine"
    return "pristine" if git_blob_id(file.read_bytes()).startswith(preimage) else "edited"


def format_status(status: SeriesState) -> str:
    lines = [
        f"vLLM version: {status.vllm_version}",
        f"target:       {status.target}",
        f"series:       {status.series_dir if status.series_dir else 'none for this version'}",
    ]
    if status.applied:
        if status.clean:
            verdict = "applied"
        elif any(state != "as-applied" for _, state in status.files):
            verdict = "applied, but files changed since"
        else:
            verdict = "applied, but not the current series"
        lines.append(f"state:        {verdict} ({status.recorded_series})")
    else:
        lines.append("state:        not applied")
    for path, state in status.files:
        lines.append(f"  {state:<10}  {path}")
    for path in status.litter:
        lines.append(f"  leftover    {path} (an interrupted run's; apply or revert removes it)")
    if status.problem:
        lines.append(f"problem: {status.problem}")
    return "\n".join(lines)
