"""apply, revert and status: what the command line runs."""

from __future__ import annotations

import contextlib
import functools
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vllm_minimax.errors import PatchError, describe_os_error
from vllm_minimax.patchset.leftovers import find_litter, remove_litter
from vllm_minimax.patchset.lock import target_lock
from vllm_minimax.patchset.series import (
    Patch,
    git_blob_id,
    read_series,
    require_series_dir,
    series_dir_for,
    series_fingerprint,
    supported_versions,
    touched_paths,
)
from vllm_minimax.patchset.staging import stage_series
from vllm_minimax.patchset.state import (
    STATE_FILE,
    AppliedState,
    FileState,
    RecordedFile,
    load_state,
    recorded_file_state,
    sha256_hex,
    sha256_in,
)
from vllm_minimax.patchset.target import find_vllm_root, read_vllm_version
from vllm_minimax.patchset.transaction import Transaction
from vllm_minimax.patchset.tree import TargetTree
from vllm_minimax.terminal import printable

SeriesMismatch = Literal["release", "revision"]


def series_mismatch(
    state: AppliedState, series_dir: Path | None, patches: list[Patch] | None
) -> SeriesMismatch | None:
    """How the applied series differs from the one this vLLM takes now: "release" (another
    release's series, or none for this release), "revision" (this release's series, changed
    since), or ``None``."""
    if series_dir is None or state.series != series_dir.name:
        return "release"
    if patches is None:
        patches = read_series(series_dir)
    if state.patches != series_fingerprint(patches):
        return "revision"
    return None


def _nothing_changed_on_os_error(function: Callable[..., Any]) -> Callable[..., Any]:
    """An OSError before any write (a transaction reports its own) changed nothing."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except OSError as error:
            raise PatchError(f"{describe_os_error(error)}; nothing was changed") from error

    return wrapper


# --------------------------------------------------------------------------------------------
# apply
# --------------------------------------------------------------------------------------------


@dataclass
class ApplyResult:
    root: Path
    vllm_version: str
    series_dir: Path
    already_applied: bool
    changed: list[str] = field(default_factory=list)
    litter_removed: list[str] = field(default_factory=list)


@_nothing_changed_on_os_error
def apply_series(target: Path | None = None, patches_dir: Path | None = None) -> ApplyResult:
    root = find_vllm_root(target)
    version = read_vllm_version(root)
    series_dir = require_series_dir(version, patches_dir)
    patches = read_series(series_dir)
    paths = touched_paths(patches)
    with TargetTree(root) as tree, target_lock(tree, exclusive=True):
        litter = remove_litter(tree, paths)
        state = load_state(tree)
        if state is not None:
            _check_existing_state(tree, version, state, series_dir, patches)
            return ApplyResult(
                root, version, series_dir, already_applied=True, litter_removed=litter
            )
        for patch in patches:
            for created in sorted(patch.created):
                if tree.exists(created) and created not in _paths_before(patches, patch):
                    raise PatchError(
                        f"{root / created} already exists, but patch {patch.name} creates it and"
                        f" there is no state file {root / STATE_FILE}: the target looks partly"
                        " patched by someone else; reinstall vLLM (or delete that file) and"
                        " apply again. Nothing was changed"
                    )
        staged = stage_series(tree, patches)
        changed = [path for path in paths if staged.after[path] != staged.before[path]]
        created_dirs = _directories_to_create(
            tree, [path for path in changed if staged.after[path] is not None]
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
            created_dirs=created_dirs,
        )
        transaction = Transaction(tree, "apply")
        with transaction.running():
            # The state goes first: if the process dies after it, `revert` undoes the rest.
            state_path = str(STATE_FILE)
            state_temporary = transaction.prepare(state_path, new_state.encode(), 0o644)
            transaction.replace(state_temporary, state_path, None)
            for directory in created_dirs:
                transaction.mkdir(directory)
            temporaries = {
                path: transaction.prepare(path, after, staged.modes.get(path, 0o644))
                for path in changed
                if (after := staged.after[path]) is not None
            }
            for path in changed:
                before = staged.before[path]
                old = None if before is None else (before, staged.modes[path])
                if path in temporaries:
                    transaction.replace(temporaries[path], path, old)
                else:
                    assert old is not None
                    transaction.unlink(path, old)
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


def _directories_to_create(tree: TargetTree, paths: list[str]) -> list[str]:
    missing: set[str] = set()
    for path in paths:
        directory = path.rpartition("/")[0]
        while directory and not tree.exists(directory):
            missing.add(directory)
            directory = directory.rpartition("/")[0]
    return sorted(missing, key=lambda d: d.count("/"))


def _check_existing_state(
    tree: TargetTree,
    version: str,
    state: AppliedState,
    series_dir: Path,
    patches: list[Patch],
) -> None:
    """Return quietly when the recorded state is exactly this series fully applied."""
    root = tree.root
    mismatch = series_mismatch(state, series_dir, patches)
    if mismatch == "release":
        raise PatchError(
            f"{root} carries the {state.series} series (applied to vLLM {state.vllm_version}),"
            f" but its vLLM is now {version}, whose series is {series_dir.name}; a series only"
            f" goes on its own release. Run `vllm-minimax revert` (it restores the files"
            f" {state.series} changed), then apply. Nothing was changed"
        )
    file_states = {record.path: recorded_file_state(tree, record) for record in state.files}
    not_applied = {path: s for path, s in file_states.items() if s != "as-applied"}
    if not_applied:
        listing = ", ".join(f"{path} ({s})" for path, s in sorted(not_applied.items()))
        raise PatchError(
            f"state file {root / STATE_FILE} says {state.series} is applied, but these files do"
            f" not match it: {listing}. Run `vllm-minimax revert` if they are only pristine or"
            " as-applied; otherwise reinstall vLLM and delete the state file. Nothing was changed"
        )
    if mismatch == "revision":
        raise PatchError(
            f"{root} carries a different revision of the series ({state.series}, patches"
            f" {', '.join(name for name, _ in state.patches)}) than {series_dir}; run"
            " `vllm-minimax revert` first, then apply. Nothing was changed"
        )


# --------------------------------------------------------------------------------------------
# revert
# --------------------------------------------------------------------------------------------


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
    with TargetTree(root) as tree, target_lock(tree, exclusive=True):
        state = load_state(tree)
        series_paths: list[str] = []
        if state is None:
            with contextlib.suppress(PatchError, OSError):
                series_dir = series_dir_for(read_vllm_version(root))
                if series_dir is not None:
                    series_paths = touched_paths(read_series(series_dir))
        litter = remove_litter(
            tree, series_paths if state is None else [record.path for record in state.files]
        )
        if state is None:
            cleaned = f" (removed {len(litter)} leftover temporary file(s))" if litter else ""
            raise PatchError(
                f"nothing to revert: no vllm-minimax series is applied to {root}"
                f" (no {STATE_FILE} there){cleaned}"
            )
        return _revert(tree, state, litter)


def _revert(tree: TargetTree, state: AppliedState, litter: list[str]) -> RevertResult:
    root = tree.root
    file_states = {record.path: recorded_file_state(tree, record) for record in state.files}
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
    state_path = str(STATE_FILE)
    saved_state = tree.read(state_path)
    assert saved_state is not None
    restored, removed = [], []
    transaction = Transaction(tree, "revert")
    with transaction.running():
        for record in to_undo:
            if record.before_content is not None:
                for directory in _directories_to_create(tree, [record.path]):
                    transaction.mkdir(directory)
        temporaries = {}
        for record in to_undo:
            if record.before_content is not None:
                assert record.before_mode is not None  # RecordedFile.from_json pairs them
                temporaries[record.path] = transaction.prepare(
                    record.path, record.before_content, record.before_mode
                )
        for record in to_undo:
            current = tree.read(record.path)
            if record.path in temporaries:
                transaction.replace(temporaries[record.path], record.path, current)
                restored.append(record.path)
            elif current is not None:
                transaction.unlink(record.path, current)
                removed.append(record.path)
        mismatched = [
            record.path
            for record in state.files
            if sha256_in(tree, record.path) != record.before_sha256
        ]
        if mismatched:
            raise PatchError(
                "revert wrote the saved originals but they do not verify: " + ", ".join(mismatched)
            )
        for directory in sorted(state.created_dirs, key=lambda d: d.count("/"), reverse=True):
            if tree.is_directory(directory) and not list(tree.entries(directory)):
                transaction.rmdir(directory)
        transaction.unlink(state_path, saved_state)
        transaction.sync()
    return RevertResult(root, state.series, restored, removed, litter)


# --------------------------------------------------------------------------------------------
# status
# --------------------------------------------------------------------------------------------


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
    "pristine", "edited" or "missing" against the blob the series' patches were made on, or
    "absent" when the series creates it, and ``problem`` holds the error when the series would
    not apply.
    """
    root = find_vllm_root(target)
    with TargetTree(root) as tree, target_lock(tree, exclusive=False):
        status = _series_state(tree, patches_dir)
        status.litter = find_litter(tree, [path for path, _ in status.files])
        return status


def _series_state(tree: TargetTree, patches_dir: Path | None) -> SeriesState:
    root = tree.root
    version = read_vllm_version(root)
    series_dir = series_dir_for(version, patches_dir)
    state = load_state(tree)
    if state is not None:
        files = [(record.path, recorded_file_state(tree, record)) for record in state.files]
        problem = None
        mismatch = series_mismatch(state, series_dir, None)
        if mismatch == "release":
            problem = (
                f"the applied series {state.series} (for vLLM {state.vllm_version}) is not the"
                f" series for vLLM {version}; run `vllm-minimax revert`"
            )
        elif mismatch == "revision":
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
    files = [(path, unapplied_file_state(tree, path, patches)) for path in touched_paths(patches)]
    try:
        stage_series(tree, patches)
    except PatchError as error:
        return SeriesState(root, version, series_dir, False, files, problem=str(error))
    return SeriesState(root, version, series_dir, False, files)


def unapplied_file_state(tree: TargetTree, path: str, patches: list[Patch]) -> FileState:
    """``path`` in a tree without the series, against what the first patch touching it expects:
    "pristine" (vLLM's file), "absent" (a file the series creates, not there yet), "edited" or
    "missing".

    A patch without an ``index`` line for the path leaves only its presence to check."""
    first = next(patch for patch in patches if path in patch.paths)
    preimage = first.preimage(path)
    info = tree.lstat(path)
    if path in first.created or (preimage is not None and not preimage.strip("0")):
        return "edited" if info is not None else "absent"
    if info is None:
        return "missing"
    if not stat.S_ISREG(info.st_mode):  # a link or a directory where a file should be
        return "edited"
    found = tree.read(path)
    if found is None:
        return "missing"
    if preimage is None:
        return "pristine"
    return "pristine" if git_blob_id(found[0]).startswith(preimage) else "edited"


def format_status(status: SeriesState) -> str:
    """The report `vllm-minimax status` prints; values read from the target are escaped."""
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
        note = " (created by the series)" if state == "absent" else ""
        lines.append(f"  {state:<10}  {path}{note}")
    for path in status.litter:
        lines.append(f"  leftover    {path} (an interrupted run's; apply or revert removes it)")
    shown = [printable(line, keep_newlines=False) for line in lines]
    if status.problem:  # several lines when it quotes git apply
        shown.append(printable(f"problem: {status.problem}"))
    return "\n".join(shown)


def applied_state(target: Path | None = None) -> AppliedState | None:
    """The checked state file of ``target`` (see :func:`load_state`), ``None`` if not applied."""
    with TargetTree(find_vllm_root(target)) as tree:
        return load_state(tree)
