"""Apply, check and revert the vllm-minimax patch series on an installed vLLM or a source tree.

Applying is all-or-nothing: every file the series touches is copied into a staging directory
(:mod:`.staging`), all patches are applied there with ``git apply``, and only when every patch
applies are the results written into the target. The state file (:mod:`.state`) records the
series, the sha256 of each touched file before and after, and byte copies of the originals
with their modes, so that ``revert`` restores the target byte for byte.

Writing is a :class:`~.transaction.Transaction`: the state file first, then new contents in
exclusively created temporary files beside their targets (fsynced), then renames, then the
directories are fsynced; any failure or Ctrl-C undoes the steps done so far. Every access to
the target goes through directory descriptors opened without following links
(:mod:`.tree`), so a write lands only in a directory that was checked. apply and revert hold
``flock`` on the target's ``vllm/`` directory (:mod:`.lock`); a killed run's temporary files
are removed by the next (:mod:`.leftovers`). Symbolic links at files the series touches are
refused, never followed or replaced. docs/patch-machinery.md has the user's view.

Modules: :mod:`.series` (the packaged series and what each patch touches), :mod:`.target`
(finding the vLLM tree and its version), :mod:`.tree`, :mod:`.state`, :mod:`.lock`,
:mod:`.leftovers`, :mod:`.staging`, :mod:`.transaction`, :mod:`.commands` (apply, revert,
status). Errors are in :mod:`vllm_minimax.errors`.
"""

from vllm_minimax.errors import Interrupted, PatchError
from vllm_minimax.patchset.commands import (
    ApplyResult,
    RevertResult,
    SeriesState,
    applied_state,
    apply_series,
    format_status,
    revert_series,
    series_state,
)
from vllm_minimax.patchset.leftovers import STAGING_PREFIX
from vllm_minimax.patchset.series import (
    PATCHES_ENV,
    SERIES_FILE_NAME,
    Patch,
    parse_patch_paths,
    parse_series_file,
    patches_root,
    read_series,
    require_series_dir,
    series_dir_for,
    series_fingerprint,
    supported_versions,
    touched_paths,
)
from vllm_minimax.patchset.staging import describe_apply_failure, git_executable, isolated_git_env
from vllm_minimax.patchset.state import STATE_FILE, AppliedState, RecordedFile
from vllm_minimax.patchset.target import find_vllm_root, read_vllm_version
from vllm_minimax.patchset.tree import TEMP_SUFFIX

__all__ = [
    "PATCHES_ENV",
    "SERIES_FILE_NAME",
    "STAGING_PREFIX",
    "STATE_FILE",
    "TEMP_SUFFIX",
    "AppliedState",
    "ApplyResult",
    "Interrupted",
    "Patch",
    "PatchError",
    "RecordedFile",
    "RevertResult",
    "SeriesState",
    "applied_state",
    "apply_series",
    "describe_apply_failure",
    "find_vllm_root",
    "format_status",
    "git_executable",
    "isolated_git_env",
    "parse_patch_paths",
    "parse_series_file",
    "patches_root",
    "read_series",
    "read_vllm_version",
    "require_series_dir",
    "revert_series",
    "series_dir_for",
    "series_fingerprint",
    "series_state",
    "supported_versions",
    "touched_paths",
]
