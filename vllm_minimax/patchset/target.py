"""Finding the vLLM tree a command works on, and its version, without importing vLLM."""

from __future__ import annotations

import errno
import importlib.util
import os
import re
import sys
from pathlib import Path

from vllm_minimax.errors import PatchError
from vllm_minimax.patchset.series import is_version_number


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
        raise PatchError(
            f"vLLM is not installed for {sys.executable}, the Python this vllm-minimax runs in:"
            " install vllm-minimax into the environment that has vLLM (in a uv venv, with"
            " `uv pip install`), or pass --target DIR"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    return package_dir.parent.resolve()


_VERSION_ASSIGNMENT = re.compile(
    r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M
)
_METADATA_VERSION = re.compile(r"^Version:\s*(\S+)\s*$", re.M)


def read_vllm_version(root: Path) -> str:
    """Read vLLM's version from text files under ``root`` (vLLM is never imported).

    Only a version number is accepted (see :data:`VERSION_NUMBER`): the version picks the
    series directory, so it must not be able to name another one."""
    version_file = root / "vllm" / "_version.py"
    if version_file.is_file():
        match = _VERSION_ASSIGNMENT.search(
            version_file.read_text(encoding="utf-8", errors="replace")
        )
        if match:
            return _checked_version(match.group(1), version_file)
    metadata_files = [*sorted(root.glob("vllm-*.dist-info/METADATA")), root / "PKG-INFO"]
    for metadata in metadata_files:
        if metadata.is_file():
            text = metadata.read_text(encoding="utf-8", errors="replace")
            head = text.split("\n\n", 1)[0]
            if re.search(r"^Name:\s*vllm\s*$", head, re.M | re.I):
                match = _METADATA_VERSION.search(head)
                if match:
                    return _checked_version(match.group(1), metadata)
    raise PatchError(
        f"cannot tell the vLLM version of {root}: no vllm/_version.py, vllm-*.dist-info/METADATA"
        " or PKG-INFO with a version"
    )


def _checked_version(version: str, source: Path) -> str:
    if not is_version_number(version):
        raise PatchError(
            f"{source} gives the vLLM version {version!r}, which is not a version number (like"
            " 0.34.0); reinstall vLLM. Nothing was changed"
        )
    return version
