"""same_code.py: a file the series creates, read back from its patch, is the file the applied
series left in the tree; anything else counts as different (so its tests run)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import same_code

from vllm_minimax import patchset


@pytest.fixture(scope="module")
def series_dir(vllm_version: str) -> Path:
    return patchset.require_series_dir(vllm_version)


def test_each_created_file_read_from_its_patch_is_the_applied_file(patched_vllm_root, series_dir):
    patches = patchset.read_series(series_dir)
    created = [path for patch in patches for path in sorted(patch.created)]
    assert created, "the series creates no file"
    for path in created:
        assert same_code.created_file(series_dir, path) == (patched_vllm_root / path).read_bytes()
        assert same_code.same_as_installed(patched_vllm_root, (path,), series_dir)


def test_a_changed_byte_a_missing_file_or_a_modified_file_is_different(
    patched_vllm_root, series_dir, tmp_path
):
    patches = patchset.read_series(series_dir)
    created = sorted(path for patch in patches for path in patch.created)
    first, second = created[0], created[1]
    tree = tmp_path / "tree"
    for path in (first, second):
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(patched_vllm_root / path, tree / path)
    assert same_code.same_as_installed(tree, (first, second), series_dir)
    data = bytearray((tree / second).read_bytes())
    data[len(data) // 2] ^= 0x01
    (tree / second).write_bytes(bytes(data))
    assert not same_code.same_as_installed(tree, (first, second), series_dir)
    assert same_code.same_as_installed(tree, (first,), series_dir)
    (tree / first).write_bytes((tree / first).read_bytes() + b"\n")
    assert not same_code.same_as_installed(tree, (first,), series_dir)
    (tree / first).unlink()
    assert not same_code.same_as_installed(tree, (first,), series_dir)
    # A file the series patches rather than creates is never the same: its pristine part
    # is the release's own.
    modified = next(p for patch in patches for p in patch.paths if p not in patch.created)
    assert same_code.created_file(series_dir, modified) is None
    assert not same_code.same_as_installed(patched_vllm_root, (modified,), series_dir)
    assert not same_code.same_as_installed(patched_vllm_root, (), series_dir)


def test_the_marked_planning_tests_name_files_the_series_creates(series_dir):
    """The warm-up's planning tests name files that same_code.py can compare, so against
    another release they run where those files differ and nowhere else."""
    import test_indexer_flashinfer_warmup as warmup_tests

    paths = warmup_tests.PLANNING_ONLY.args
    assert paths and all(same_code.created_file(series_dir, path) for path in paths)


def _new_file_section(path: str, lines: list[str], newline_at_end: bool) -> str:
    body = "".join(f"+{line}\n" for line in lines)
    tail = "" if newline_at_end else "\\ No newline at end of file\n"
    return (
        f"diff --git a/{path} b/{path}\nnew file mode 100644\nindex 0000000..1234567\n"
        f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n{body}{tail}"
    )


def test_a_file_without_a_final_newline_and_a_file_two_patches_touch(tmp_path):
    series = tmp_path / "series-dir"
    series.mkdir()
    first = _new_file_section("vllm/a.py", ["x = 1", "y = 2"], newline_at_end=False)
    first += _new_file_section("vllm/b.py", ["z = 3"], newline_at_end=True)
    (series / "0001-a.patch").write_text(f"Subject: a\n\n---\n{first}-- \n2.43.0\n")
    second = (
        "diff --git a/vllm/b.py b/vllm/b.py\nindex 1234567..7654321 100644\n"
        "--- a/vllm/b.py\n+++ b/vllm/b.py\n@@ -1 +1 @@\n-z = 3\n+z = 4\n"
    )
    (series / "0002-b.patch").write_text(f"Subject: b\n\n---\n{second}")
    (series / "series").write_text("0001-a.patch\n0002-b.patch\n")
    assert same_code.created_file(series, "vllm/a.py") == b"x = 1\ny = 2"
    assert same_code.created_file(series, "vllm/b.py") is None
    tree = tmp_path / "tree" / "vllm"
    tree.mkdir(parents=True)
    (tree / "a.py").write_bytes(b"x = 1\ny = 2")
    (tree / "b.py").write_bytes(b"z = 4\n")
    assert same_code.same_as_installed(tree.parent, ("vllm/a.py",), series)
    assert not same_code.same_as_installed(tree.parent, ("vllm/a.py", "vllm/b.py"), series)
