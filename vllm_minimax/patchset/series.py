"""The patch series: where the packaged series live and what each patch touches.

A series lives in ``patches/vllm-<version>/``: a ``series`` file naming the patches in the
order they apply (``#`` starts a comment) and ``git format-patch`` style ``NNNN-*.patch``
files. Patch paths are relative to vLLM's repository root and all lie under ``vllm/``.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_minimax.errors import PatchError, describe_os_error

SERIES_FILE_NAME = "series"
PATCHES_ENV = "VLLM_MINIMAX_PATCHES"
# A version as PEP 440 normalizes it (0.34.0, 0.34.1rc2, 0.35.0.dev3+g1a2b3c): nothing that
# could name another directory when it is joined to a path.
VERSION_NUMBER = re.compile(
    r"\d+(?:\.\d+)*(?:(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev\d+)?(?:\+[A-Za-z0-9]+(?:\.[A-Za-z0-9]+)*)?"
)


def patches_root() -> Path:
    """Return the directory holding ``vllm-<version>/`` series directories.

    Order: ``$VLLM_MINIMAX_PATCHES``; ``vllm_minimax/_patches`` (a wheel built from this
    project carries the series there, see ``pyproject.toml``); the repository's ``patches/``
    next to the package (source tree and editable installs).
    """
    override = os.environ.get(PATCHES_ENV)
    if override:
        return Path(override)
    package_dir = Path(__file__).resolve().parent.parent
    shipped = package_dir / "_patches"
    if shipped.is_dir():
        return shipped
    return package_dir.parent / "patches"


def is_version_number(text: str) -> bool:
    return VERSION_NUMBER.fullmatch(text) is not None


def supported_versions(root: Path | None = None) -> list[str]:
    """The versions that have a series directory under ``root``; raise PatchError when
    ``root`` cannot be read."""
    root = patches_root() if root is None else root
    try:
        if not root.is_dir():
            return []
        versions = [
            entry.name.removeprefix("vllm-")
            for entry in root.iterdir()
            if entry.is_dir()
            and entry.name.startswith("vllm-")
            and is_version_number(entry.name.removeprefix("vllm-"))
            and (entry / SERIES_FILE_NAME).is_file()
        ]
    except OSError as error:
        raise PatchError(
            f"cannot read the patch series directory {root}:"
            f" {describe_os_error(error, vllm_tree=False)}"
        ) from None
    return sorted(versions, key=_version_sort_key)


def _version_sort_key(version: str) -> tuple[Any, ...]:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"[.+-]", version))


def series_dir_for(version: str, root: Path | None = None) -> Path | None:
    """The series directory of ``version``: only one of those :func:`supported_versions`
    lists, whatever ``version`` holds."""
    root = patches_root() if root is None else root
    if version not in supported_versions(root):
        return None
    return root / f"vllm-{version}"


def require_series_dir(version: str, root: Path | None = None) -> Path:
    root = patches_root() if root is None else root
    found = series_dir_for(version, root)
    if found is None:
        supported = ", ".join(supported_versions(root)) or "none"
        shown = version if is_version_number(version) else repr(version)
        raise PatchError(
            f"no patch series for vLLM {shown} (no {root / f'vllm-{shown}'}/series);"
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
                sha256=hashlib.sha256(data).hexdigest(),
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


def touched_paths(patches: list[Patch]) -> list[str]:
    ordered: list[str] = []
    for patch in patches:
        for path in patch.paths:
            if path not in ordered:
                ordered.append(path)
    return ordered


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
ABSENT_BLOB = "0000000"


def git_blob_id(content: bytes) -> str:
    """The id git gives ``content`` as a blob (what a patch's ``index`` line abbreviates)."""
    header = b"blob %d\0" % len(content)
    return hashlib.sha1(header + content, usedforsecurity=False).hexdigest()


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
