"""The compile caches `scripts/gpu-rank-slice cache-out` packs, and unpacking them on another
machine under their own directories only.

    python3 scripts/carried_caches.py roots           # one per line, relative to /
    python3 scripts/carried_caches.py unpack DIR      # DIR/part*, joined, into /

The caches are FlashInfer's JIT programs and CuTe-DSL kernels, vLLM's torch.compile
artifacts, Triton's and Inductor's caches, CuTe DSL's own, the CUDA driver's and Humming's,
each under this user's home or /tmp (`cache_roots`). cache-out packs them with their paths
from /, for a machine with the same user and home.

``unpack`` reads the archive twice: first every member is checked, and one outside those
directories (an absolute or `..` path, a path under none of them, a link whose target leaves
the cache it lies in, a device or other special file) rejects the whole archive with one
line naming it, before anything is written (exit 1); then it is extracted, with tarfile's
``data`` filter as well. An archive that does not read is exit 2, nothing written.
"""

from __future__ import annotations

import getpass
import io
import os
import posixpath
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

EXIT_REJECTED = 1
EXIT_UNREADABLE = 2


def cache_roots(home: str, user: str) -> list[str]:
    """The cache directories cache-out packs, relative to /."""
    home = home.strip("/")
    return [
        f"{home}/.cache/flashinfer",
        f"{home}/.cache/vllm",
        f"{home}/.triton",
        f"tmp/torchinductor_{user}",
        f"tmp/{user}/cutlass_python_cache",
        f"{home}/.nv/ComputeCache",
        f"{home}/.humming/cache",
    ]


def this_machines_roots() -> list[str]:
    return cache_roots(os.environ.get("HOME") or str(Path.home()), getpass.getuser())


class Joined(io.RawIOBase):
    """The parts, read one after the other as one stream."""

    def __init__(self, parts: list[Path]) -> None:
        self.parts = iter(parts)
        self.current: io.BufferedReader | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        while True:
            if self.current is None:
                part = next(self.parts, None)
                if part is None:
                    return 0
                self.current = part.open("rb")
            count = self.current.readinto(buffer)
            if count:
                return count
            self.current.close()
            self.current = None


def root_of(path: str, roots: list[str]) -> str | None:
    """The cache root `path` (normalized, relative) lies in, or None."""
    for root in roots:
        if path == root or path.startswith(root + "/"):
            return root
    return None


def problem(member: tarfile.TarInfo, roots: list[str]) -> str | None:
    """Why `member` may not be unpacked into /, or None."""
    name = member.name
    parts = name.split("/")
    if name.startswith("/") or ".." in parts:
        return f"{name!r} is not a plain relative path"
    normalized = posixpath.normpath(name)
    root = root_of(normalized, roots)
    if root is None:
        # A directory above a cache too: its mode and owner would be set on /tmp or a home.
        return f"{name!r} lies in none of the cache directories ({', '.join(roots)})"
    if member.isdir() or member.isreg():
        return None
    if member.issym():
        target = member.linkname
        if target.startswith("/"):
            return f"{name!r} links to the absolute path {target!r}"
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(normalized), target))
        if root_of(resolved, [root]) is None:
            return f"{name!r} links to {target!r}, outside {root}"
        return None
    if member.islnk():
        target = posixpath.normpath(member.linkname)
        if member.linkname.startswith("/") or root_of(target, [root]) is None:
            return f"{name!r} is a hard link to {member.linkname!r}, outside {root}"
        return None
    return f"{name!r} is neither a file, a directory nor a link"


def written_elsewhere(member: tarfile.TarInfo, roots: list[str], destination: Path) -> str | None:
    """Why `member` (which `problem` passed) would land outside its cache through a link
    already on this machine, or None."""
    normalized = posixpath.normpath(member.name)
    root = root_of(normalized, roots)
    if root is None or normalized == root:
        return None
    inside = os.path.realpath(destination / root)
    parent = os.path.realpath(destination / posixpath.dirname(normalized))
    if parent == inside or parent.startswith(inside + os.sep):
        return None
    return f"{member.name!r} would be written in {parent}, through a link out of {root}"


def members(parts: list[Path]) -> Iterator[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BufferedReader(Joined(parts)), mode="r|gz") as archive:
        yield from archive


def unpack(parts: list[Path], roots: list[str], destination: Path) -> str:
    """Check every member, then extract them all under `destination`; raises ValueError
    naming the first member refused (nothing written)."""
    count = 0
    for member in members(parts):
        reason = problem(member, roots) or written_elsewhere(member, roots, destination)
        if reason is not None:
            raise ValueError(f"{reason}: nothing unpacked")
        count += 1

    def checked(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
        reason = problem(member, roots) or written_elsewhere(member, roots, destination)
        if reason is not None:  # the same stream read again: refuse anyway
            raise tarfile.FilterError(reason)
        return tarfile.data_filter(member, path)

    with tarfile.open(fileobj=io.BufferedReader(Joined(parts)), mode="r|gz") as archive:
        archive.extractall(destination, filter=checked)
    return f"{count} members under {destination}"


def main(argv: list[str]) -> int:
    match argv:
        case ["roots"]:
            print("\n".join(this_machines_roots()))
            return 0
        case ["unpack", directory]:
            parts = sorted(Path(directory).glob("part*"))
        case _:
            print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
            return EXIT_UNREADABLE
    if not parts:
        print(f"carried caches: no part* in {directory}", file=sys.stderr)
        return EXIT_UNREADABLE
    try:
        done = unpack(parts, this_machines_roots(), Path("/"))
    except ValueError as error:
        print(f"carried caches: {directory} refused: {error}", file=sys.stderr)
        return EXIT_REJECTED
    except tarfile.FilterError as error:  # only if the machine changed between the reads
        print(f"carried caches: {directory} refused while unpacking: {error}", file=sys.stderr)
        return EXIT_REJECTED
    except (OSError, tarfile.TarError, EOFError) as error:
        print(f"carried caches: {directory} does not unpack: {error}", file=sys.stderr)
        return EXIT_UNREADABLE
    print(f"carried caches: {len(parts)} parts, {done}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
