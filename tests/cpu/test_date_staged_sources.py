"""scripts/date-staged-sources: the staged FlashInfer and tvm-ffi trees are dated before any
carried FlashInfer build, so that ninja does not rebuild the carried programs; a site that
lacks either tree is refused and left as it was."""

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "date-staged-sources"
CARRIED_BUILD = datetime(2026, 12, 4, 20, 1, 43, tzinfo=UTC).timestamp()


def _staged_site(root: Path, packages: tuple[str, ...]) -> list[Path]:
    files = []
    for package in packages:
        for relative in ("__init__.py", "data/csrc/kernel.cu", "include/ffi/header.h"):
            path = root / package / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(relative)
            files.append(path)
    link = root / "flashinfer" / "data" / "link.h"
    link.symlink_to("csrc/kernel.cu")
    files.append(link)
    return files


def test_every_staged_file_and_directory_predates_a_carried_build(tmp_path):
    files = _staged_site(tmp_path, ("flashinfer", "tvm_ffi"))
    other = tmp_path / "torch" / "version.py"
    other.parent.mkdir()
    other.write_text("")
    before_other = other.stat().st_mtime

    subprocess.run([str(SCRIPT), str(tmp_path)], check=True, timeout=30)

    dated = [*files, *(path.parent for path in files)]
    for path in dated:
        assert os.lstat(path).st_mtime < CARRIED_BUILD, path
    # the link itself is dated, not only what it points to
    assert os.lstat(files[-1]).st_mtime == os.lstat(files[0]).st_mtime
    assert other.stat().st_mtime == before_other


def test_a_site_without_tvm_ffi_is_refused_and_left_as_it_was(tmp_path):
    files = _staged_site(tmp_path, ("flashinfer",))
    before = {path: os.lstat(path).st_mtime for path in files}

    run = subprocess.run([str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=30)

    assert run.returncode == 2
    assert run.stderr.strip() == f"date-staged-sources: {tmp_path}/tvm_ffi is not a directory"
    assert {path: os.lstat(path).st_mtime for path in files} == before


def _python3_without_site_packages(tmp_path: Path) -> str:
    """A PATH whose python3 sees only PYTHONPATH (never this venv's own FlashInfer)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python3.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_without_a_site_it_dates_the_flashinfer_python3_imports(tmp_path):
    site = tmp_path / "site"
    files = _staged_site(site, ("flashinfer", "tvm_ffi"))
    env = {**os.environ, "PATH": _python3_without_site_packages(tmp_path), "PYTHONPATH": str(site)}

    subprocess.run([str(SCRIPT)], check=True, timeout=30, env=env)

    assert all(os.lstat(path).st_mtime < CARRIED_BUILD for path in files)


def test_without_a_site_or_a_flashinfer_it_says_so(tmp_path):
    env = {**os.environ, "PATH": _python3_without_site_packages(tmp_path), "PYTHONPATH": ""}

    run = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=30, env=env)

    assert run.returncode == 2
    assert run.stderr.strip() == "date-staged-sources: python3 imports no flashinfer: name the SITE"
