"""The state file ``vllm/.vllm_minimax_state.json``: what apply changed, so revert can undo it.

It records the series, the sha256 of each touched file before and after, and byte copies of
the originals with their modes. It is untrusted input when read back: every path must be a
plain relative path inside ``vllm/`` that reaches no symbolic link, and every string a value
apply could have written, or it is refused before a file is touched.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from vllm_minimax import __version__ as TOOL_VERSION
from vllm_minimax.errors import PatchError
from vllm_minimax.patchset.series import is_version_number
from vllm_minimax.patchset.tree import TargetTree, checked_relative_path

STATE_FILE = Path("vllm") / ".vllm_minimax_state.json"
STATE_FORMAT = 1
_SERIES_NAME = re.compile(r"vllm-(.+)")
_PATCH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")

# What a file the series touches looks like: "absent" is a file the series creates, not there
# yet, as it should be before apply.
FileState = Literal["as-applied", "edited", "missing", "pristine", "absent"]


def sha256_hex(content: bytes | None) -> str | None:
    """The sha256 of ``content``, or ``None`` for a file that does not exist."""
    return None if content is None else hashlib.sha256(content).hexdigest()


def sha256_in(tree: TargetTree, relative: str) -> str | None:
    found = tree.read(relative)
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
        if not path.isprintable():
            raise ValueError(f"files entry {path!r} holds a character that cannot be shown")
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
                shown = f"{mode:#o}" if isinstance(mode, int) else repr(mode)
                raise ValueError(f"'before' of {path} has mode {shown}, not 0..0o777")
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


def load_state(tree: TargetTree) -> AppliedState | None:
    """Read and check the state file; ``None`` when there is none.

    Every path in it must be a plain relative path inside ``vllm/`` that reaches no symbolic
    link, and every ``created_dirs`` entry a directory above a file the series created;
    anything else is refused before a file is touched."""
    state_path = tree.path(str(STATE_FILE))
    tree.check(str(STATE_FILE), "file")
    found = tree.read(str(STATE_FILE))
    if found is None:
        return None
    try:
        data = json.loads(found[0].decode("utf-8"))
        if not isinstance(data, dict):
            raise ValueError("it is not a JSON object")
        if data.get("format") != STATE_FORMAT:
            shown = data.get("format")
            raise PatchError(
                f"state file {state_path} has format {shown!r}; this vllm-minimax"
                f" understands format {STATE_FORMAT}"
            )
        state = AppliedState(
            vllm_version=_version_field(data["vllm_version"]),
            series=_series_field(data["series"]),
            patches=[
                (_patch_name_field(entry["name"]), _sha256_field(entry["sha256"]))
                for entry in data["patches"]
            ],
            files=[RecordedFile.from_json(entry) for entry in data["files"]],
            created_dirs=list(data.get("created_dirs", [])),
        )
        _check_recorded_paths(state)
    except (
        ValueError,
        KeyError,
        TypeError,
        UnicodeDecodeError,
        RecursionError,
        PatchError,
    ) as error:
        if isinstance(error, PatchError) and "has format" in str(error):
            raise
        reason: object = error.args[0] if isinstance(error, KeyError) else error
        if isinstance(error, KeyError):
            reason = f"no {reason!r}"
        if isinstance(error, RecursionError):
            reason = "nested too deeply"
        raise PatchError(
            f"state file {state_path} is unreadable or was tampered with ({reason}); it was not"
            " written by a complete vllm-minimax apply, so nothing was changed: reinstall vLLM"
            " and delete that file"
        ) from None
    for record in state.files:
        tree.check(record.path, "file")
    for directory in state.created_dirs:
        tree.check(directory, "directory")
    return state


def _version_field(value: object) -> str:
    if not isinstance(value, str) or not is_version_number(value):
        raise ValueError(f"'vllm_version' {value!r} is not a version number")
    return value


def _series_field(value: object) -> str:
    match = _SERIES_NAME.fullmatch(value) if isinstance(value, str) else None
    if match is None or not is_version_number(match.group(1)):
        raise ValueError(f"'series' {value!r} is not vllm-<version>")
    return str(value)


def _patch_name_field(value: object) -> str:
    if not isinstance(value, str) or _PATCH_NAME.fullmatch(value) is None:
        raise ValueError(f"patch name {value!r} is not a file name")
    return value


def _sha256_field(value: object) -> str:
    if not _is_sha256(value):
        raise ValueError(f"patch sha256 {value!r} is not a sha256")
    return str(value)


def _check_recorded_paths(state: AppliedState) -> None:
    paths = [record.path for record in state.files]
    if len(set(paths)) != len(paths):
        raise ValueError("a file is listed twice")
    if str(STATE_FILE) in paths:
        raise ValueError("the state file lists itself")
    created_files = [record.path for record in state.files if record.before_content is None]
    for directory in state.created_dirs:
        checked_relative_path(directory, "created_dirs entry")
        if not directory.isprintable():
            raise ValueError(
                f"created_dirs entry {directory!r} holds a character that cannot be shown"
            )
        if not any(path.startswith(directory + "/") for path in created_files):
            raise ValueError(f"created_dirs entry {directory!r} holds no file the series created")


def recorded_file_state(tree: TargetTree, record: RecordedFile) -> FileState:
    current = sha256_in(tree, record.path)
    if current == record.after_sha256:
        return "as-applied"
    if current is None:
        return "missing"
    if current == record.before_sha256:
        return "pristine"
    return "edited"
