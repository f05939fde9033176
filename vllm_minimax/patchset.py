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
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
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
        paths, created, deleted = parse_patch_paths(data, name)
        patches.append(
            Patch(
                name=name,
                path=path,
                sha256=sha256_hex(data),
                paths=paths,
                created=created,
                deleted=deleted,
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


def parse_patch_paths(
    data: bytes, patch_name: str
) -> tuple[tuple[str, ...], frozenset[str], frozenset[str]]:
    """Return (paths touched, paths created, paths deleted) of a git-style patch."""
    paths: list[str] = []
    created: set[str] = set()
    deleted: set[str] = set()
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
    if not paths:
        raise PatchError(f"{patch_name}: no 'diff --git' sections; is it a git format-patch file?")
    for path in paths:
        parts = Path(path).parts
        if path.startswith("/") or ".." in parts or not parts or parts[0] != "vllm":
            raise PatchError(
                f"{patch_name}: path {path!r} is not under vllm/; a series may only touch the"
                " vllm package so that it applies to site-packages and source trees alike"
            )
    return tuple(paths), frozenset(created), frozenset(deleted)


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
        if not target.exists():
            raise PatchError(f"target {target} does not exist")
        if not target.is_dir():
            raise PatchError(f"target {target} is not a directory")
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
        match = _VERSION_ASSIGNMENT.search(version_file.read_text(encoding="utf-8"))
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
# State file
# --------------------------------------------------------------------------------------------


def sha256_hex(content: bytes | None) -> str | None:
    """The sha256 of ``content``, or ``None`` for a file that does not exist."""
    return None if content is None else hashlib.sha256(content).hexdigest()


def sha256_of(path: Path) -> str | None:
    return sha256_hex(path.read_bytes()) if path.is_file() else None


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
    def from_json(cls, data: dict[str, Any]) -> RecordedFile:
        before = data["before"]
        after = data["after"]
        content = None if before is None else base64.b64decode(before["content_base64"])
        if content is not None and sha256_hex(content) != before["sha256"]:
            raise PatchError(f"state file: the saved original of {data['path']} is corrupt")
        return cls(
            path=data["path"],
            before_sha256=None if before is None else before["sha256"],
            before_mode=None if before is None else before["mode"],
            before_content=content,
            after_sha256=None if after is None else after["sha256"],
        )


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


def load_state(root: Path) -> AppliedState | None:
    state_path = root / STATE_FILE
    if not state_path.exists():
        return None
    try:
        data = json.loads(state_path.read_text(encoding="utf-8"))
        if data.get("format") != STATE_FORMAT:
            raise PatchError(
                f"state file {state_path} has format {data.get('format')!r}; this vllm-minimax"
                f" understands format {STATE_FORMAT}"
            )
        return AppliedState(
            vllm_version=data["vllm_version"],
            series=data["series"],
            patches=[(entry["name"], entry["sha256"]) for entry in data["patches"]],
            files=[RecordedFile.from_json(entry) for entry in data["files"]],
            created_dirs=list(data.get("created_dirs", [])),
        )
    except (ValueError, KeyError, TypeError) as error:
        raise PatchError(
            f"state file {state_path} is unreadable ({error}); it was not written"
            " by a complete vllm-minimax apply"
        ) from error


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
        file_path = root / path
        if file_path.is_file():
            before[path] = file_path.read_bytes()
            modes[path] = file_path.stat().st_mode & 0o7777
        elif file_path.exists():
            raise PatchError(f"{path} in {root} is not a regular file")
        else:
            before[path] = None
    with tempfile.TemporaryDirectory(prefix="vllm-minimax-stage-") as staging_name:
        staging = Path(staging_name) / "tree"
        staging.mkdir()
        for path, content in before.items():
            if content is not None:
                staged = staging / path
                staged.parent.mkdir(parents=True, exist_ok=True)
                staged.write_bytes(content)
        env = isolated_git_env(ceiling=staging.parent)
        for patch in patches:
            completed = subprocess.run(
                [git, "apply", "--whitespace=nowarn", str(patch.path)],
                cwd=staging,
                env=env,
                capture_output=True,
                text=True,
            )
            if completed.returncode != 0:
                raise PatchError(describe_apply_failure(patch, completed.stderr, root))
        after = {
            path: (staging / path).read_bytes() if (staging / path).is_file() else None
            for path in touched
        }
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
# Writing
# --------------------------------------------------------------------------------------------


def check_writable(root: Path, paths: list[str]) -> None:
    """Raise PatchError unless every file in ``paths`` (and the state file) can be written."""
    problems: list[str] = []
    directories: set[Path] = {root / STATE_FILE.parent}
    for path in paths:
        file_path = root / path
        if file_path.exists() and not os.access(file_path, os.W_OK):
            problems.append(str(file_path))
        directory = file_path.parent
        while not directory.exists():
            directory = directory.parent
        directories.add(directory)
    for directory in sorted(directories):
        if not os.access(directory, os.W_OK | os.X_OK) or not _can_create_file_in(directory):
            problems.append(f"{directory}/")
    if problems:
        raise PatchError(
            f"target {root} is not writable by this user: "
            + ", ".join(problems)
            + "\nnothing was changed (run as the owner of the vLLM install, or use a"
            " virtual environment you own)"
        )


def _can_create_file_in(directory: Path) -> bool:
    try:
        descriptor, probe = tempfile.mkstemp(prefix=".vllm-minimax-probe-", dir=directory)
    except OSError:
        return False
    os.close(descriptor)
    os.unlink(probe)
    return True


def write_atomically(path: Path, content: bytes, mode: int) -> None:
    temporary = path.with_name(f".{path.name}.vllm-minimax-tmp")
    temporary.write_bytes(content)
    os.chmod(temporary, mode)
    os.replace(temporary, path)


def write_state(root: Path, state: AppliedState) -> None:
    text = json.dumps(state.to_json(), indent=1, sort_keys=True) + "\n"
    write_atomically(root / STATE_FILE, text.encode("utf-8"), 0o644)


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


def apply_series(target: Path | None = None, patches_dir: Path | None = None) -> ApplyResult:
    root = find_vllm_root(target)
    version = read_vllm_version(root)
    series_dir = require_series_dir(version, patches_dir)
    patches = read_series(series_dir)
    paths = touched_paths(patches)
    state = load_state(root)
    if state is not None:
        _check_existing_state(root, state, series_dir, patches)
        return ApplyResult(root, version, series_dir, already_applied=True)
    for patch in patches:
        for created in sorted(patch.created):
            if (root / created).exists() and created not in _paths_before(patches, patch):
                raise PatchError(
                    f"{root / created} already exists, but patch {patch.name} creates it and"
                    f" there is no state file {root / STATE_FILE}: the target looks partly"
                    " patched by someone else; reinstall vLLM (or delete that file) and apply"
                    " again. Nothing was changed"
                )
    staged = stage_series(root, patches)
    check_writable(root, paths)
    created_dirs = _directories_to_create(root, [p for p in paths if staged.after[p] is not None])
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
    # The state goes first: if writing stops half way, `revert` can still undo it.
    write_state(root, new_state)
    changed = []
    for path in paths:
        after = staged.after[path]
        file_path = root / path
        if after == staged.before[path]:
            continue
        if after is None:
            file_path.unlink()
        else:
            file_path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(file_path, after, staged.modes.get(path, 0o644))
        changed.append(path)
    return ApplyResult(root, version, series_dir, already_applied=False, changed=changed)


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
        while not directory.exists():
            missing.add(directory)
            directory = directory.parent
    return sorted(missing)


def _check_existing_state(
    root: Path, state: AppliedState, series_dir: Path, patches: list[Patch]
) -> None:
    """Return quietly when the recorded state is exactly this series fully applied."""
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


def revert_series(target: Path | None = None) -> RevertResult:
    root = find_vllm_root(target)
    state = load_state(root)
    if state is None:
        raise PatchError(
            f"nothing to revert: no vllm-minimax series is applied to {root}"
            f" (no {STATE_FILE} there)"
        )
    file_states = {record.path: recorded_file_state(root, record) for record in state.files}
    originals = {record.path: record.before_content for record in state.files}
    edited = sorted(
        path
        for path, s in file_states.items()
        if s == "edited" or (s == "missing" and originals[path] is not None)
    )
    if edited:
        listing = ", ".join(f"{path} ({file_states[path]})" for path in edited)
        raise PatchError(
            f"refusing to revert {root}: files were changed since `vllm-minimax apply`: {listing}."
            " Undo those edits (or reinstall vLLM and delete the state file). Nothing was changed"
        )
    check_writable(root, [record.path for record in state.files])
    restored, removed = [], []
    for record in state.files:
        file_path = root / record.path
        if file_states[record.path] == "pristine" or (
            file_states[record.path] == "missing" and record.before_content is None
        ):
            continue
        if record.before_content is None:
            file_path.unlink()
            removed.append(record.path)
        else:
            file_path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(file_path, record.before_content, record.before_mode or 0o644)
            restored.append(record.path)
    mismatched = [
        record.path
        for record in state.files
        if sha256_of(root / record.path) != record.before_sha256
    ]
    if mismatched:
        raise PatchError(
            "revert wrote the saved originals but they do not verify: "
            + ", ".join(mismatched)
            + f"; the state file {root / STATE_FILE} was kept"
        )
    for directory in sorted(state.created_dirs, key=lambda d: len(Path(d).parts), reverse=True):
        directory_path = root / directory
        if directory_path.is_dir() and not any(directory_path.iterdir()):
            directory_path.rmdir()
    (root / STATE_FILE).unlink()
    return RevertResult(root, state.series, restored, removed)


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

    @property
    def clean(self) -> bool:
        """True when this version's current series is applied and every touched file is as the
        series left it."""
        return (
            self.applied
            and self.problem is None
            and all(state == "as-applied" for _, state in self.files)
        )


def series_state(target: Path | None = None, patches_dir: Path | None = None) -> SeriesState:
    """Describe the target without changing it.

    Applied (state file present): each recorded file is "as-applied", "pristine" (back to its
    original), "edited" or "missing". Not applied: each file the series would touch is
    "pristine" when the whole series would apply, otherwise files named by git apply's error are
    "edited" (or "missing"); ``problem`` then holds the error.
    """
    root = find_vllm_root(target)
    version = read_vllm_version(root)
    series_dir = series_dir_for(version, patches_dir)
    state = load_state(root)
    if state is not None:
        files = [(record.path, recorded_file_state(root, record)) for record in state.files]
        problem = None
        if series_dir is None or state.series != series_dir.name:
            problem = f"the applied series {state.series} is not the series for vLLM {version}"
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
    paths = touched_paths(patches)
    try:
        stage_series(root, patches)
    except PatchError as error:
        message = str(error)
        blamed = set(re.findall(r"(vllm/[^\s:,]+)", message.split("git apply said:", 1)[-1]))
        files: list[tuple[str, FileState]] = []
        for path in paths:
            if path in blamed:
                files.append((path, "edited" if (root / path).exists() else "missing"))
            else:
                files.append((path, "pristine"))
        return SeriesState(root, version, series_dir, False, files, problem=message)
    return SeriesState(root, version, series_dir, False, [(path, "pristine") for path in paths])


def format_status(status: SeriesState) -> str:
    lines = [
        f"vLLM version: {status.vllm_version}",
        f"target:       {status.target}",
        f"series:       {status.series_dir if status.series_dir else 'none for this version'}",
    ]
    if status.applied:
        verdict = "applied" if status.clean else "applied, but files changed since"
        lines.append(f"state:        {verdict} ({status.recorded_series})")
    else:
        lines.append("state:        not applied")
    for path, state in status.files:
        lines.append(f"  {state:<10}  {path}")
    if status.problem:
        lines.append(f"problem: {status.problem}")
    return "\n".join(lines)
