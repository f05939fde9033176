"""scripts/carried_caches.py: the compile caches gpu-rank-slice's cache-out packed are
unpacked under the cache directories they came from and nowhere else; an archive with one
member elsewhere is refused whole, before anything is written. (The script's own use of it,
CARRIED_CACHES, is in test_gpu_env.py.)"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import sys
import tarfile
from pathlib import Path

import pytest
from patchset_helpers import REPO_ROOT

spec = importlib.util.spec_from_file_location(
    "carried_caches", REPO_ROOT / "scripts" / "carried_caches.py"
)
assert spec is not None and spec.loader is not None
carried_caches = importlib.util.module_from_spec(spec)
sys.modules["carried_caches"] = carried_caches
spec.loader.exec_module(carried_caches)

ROOTS = carried_caches.cache_roots("/home/u", "u")
PROGRAM = "home/u/.cache/flashinfer/0.7.4/90/cached_ops/msa/msa.so"


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", data: bytes = b""):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info, (io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def parts(directory: Path, members: list, size: int = 64) -> list[Path]:
    """The members as cache-out writes them: one gzipped tar, split in parts of `size` bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for info, data in members:
            archive.addfile(info, data)
    packed = buffer.getvalue()
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for index in range(0, len(packed), size):
        part = directory / f"part{index // size:02d}"
        part.write_bytes(packed[index : index + size])
        written.append(part)
    return written


def everything(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def good_members() -> list:
    return [
        member("home/u/.cache/flashinfer", tarfile.DIRTYPE),
        member(PROGRAM, data=b"\x7fELF program"),
        member("home/u/.cache/flashinfer/latest", tarfile.SYMTYPE, link="0.7.4"),
        member("home/u/.cache/flashinfer/copy.so", tarfile.LNKTYPE, link=PROGRAM),
        member("tmp/torchinductor_u/fx/graph", data=b"graph"),
    ]


def test_the_caches_unpack_under_their_own_directories(tmp_path: Path) -> None:
    destination = tmp_path / "root"
    destination.mkdir()
    written = parts(tmp_path / "carried", good_members())
    assert len(written) > 1  # joined from several parts
    done = carried_caches.unpack(written, ROOTS, destination)
    assert done == f"5 members under {destination}"
    assert (destination / PROGRAM).read_bytes() == b"\x7fELF program"
    assert (destination / "home/u/.cache/flashinfer/copy.so").read_bytes() == b"\x7fELF program"
    assert os.readlink(destination / "home/u/.cache/flashinfer/latest") == "0.7.4"
    assert (destination / "tmp/torchinductor_u/fx/graph").read_bytes() == b"graph"


OUTSIDE = {
    "absolute": [member("/etc/cron.d/job", data=b"x")],
    "dot-dot": [member("home/u/.cache/flashinfer/../../../../etc/job", data=b"x")],
    "another directory": [member("etc/cron.d/job", data=b"x")],
    "a cache's sibling": [member("home/u/.cache/flashinfer-other/x", data=b"x")],
    "a directory above a cache": [member("tmp", tarfile.DIRTYPE)],
    "absolute link": [member("home/u/.cache/vllm/etc", tarfile.SYMTYPE, link="/etc")],
    "link out of its cache": [
        member("home/u/.cache/vllm/up", tarfile.SYMTYPE, link="../../.ssh"),
    ],
    "link into another cache": [
        member("home/u/.cache/vllm/fi", tarfile.SYMTYPE, link="../flashinfer"),
    ],
    "hard link out": [member("home/u/.triton/key", tarfile.LNKTYPE, link="etc/shadow")],
    "device": [member("home/u/.triton/null", tarfile.CHRTYPE)],
    "fifo": [member("home/u/.triton/pipe", tarfile.FIFOTYPE)],
}


@pytest.mark.parametrize("bad", OUTSIDE, ids=str)
def test_one_member_outside_refuses_the_whole_archive(tmp_path: Path, bad: str) -> None:
    destination = tmp_path / "root"
    destination.mkdir()
    written = parts(tmp_path / "carried", [*good_members()[:2], *OUTSIDE[bad]])
    with pytest.raises(ValueError, match="nothing unpacked"):
        carried_caches.unpack(written, ROOTS, destination)
    assert everything(destination) == []


def test_a_link_already_on_the_machine_is_not_written_through(tmp_path: Path) -> None:
    destination = tmp_path / "root"
    (destination / "home/u/.cache/vllm").mkdir(parents=True)
    (destination / "outside").mkdir()
    (destination / "home/u/.cache/vllm/torch_compile").symlink_to(destination / "outside")
    written = parts(tmp_path / "carried", [member("home/u/.cache/vllm/torch_compile/x", data=b"x")])
    with pytest.raises(ValueError, match=re.escape("through a link out of home/u/.cache/vllm")):
        carried_caches.unpack(written, ROOTS, destination)
    assert list((destination / "outside").iterdir()) == []


def test_the_command_line(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("HOME", "/home/u")
    assert carried_caches.main(["roots"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "home/u/.cache/flashinfer"
    assert carried_caches.main(["unpack", str(tmp_path)]) == carried_caches.EXIT_UNREADABLE
    assert f"no part* in {tmp_path}" in capsys.readouterr().err
    (tmp_path / "part00").write_bytes(b"not gzip")
    assert carried_caches.main(["unpack", str(tmp_path)]) == carried_caches.EXIT_UNREADABLE
    assert "does not unpack" in capsys.readouterr().err
