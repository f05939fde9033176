"""Each supported release gets its own series, and only its own: `apply`, `status` and
`revert` pick the series by the target's vLLM version, and a series made for one
release is refused on the other before anything is written (vLLM 0.33.0's pristine
files come from its sdist, 0.34.0's from the installed vLLM)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from patchset_helpers import tree_manifest

from vllm_minimax import cli, devtree, patchset
from vllm_minimax.patchset import PatchError

OTHER = {"0.33.0": "0.34.0", "0.34.0": "0.33.0"}


def copy_release_files(source: Path, version: str, target: Path) -> Path:
    series = patchset.read_series(patchset.require_series_dir(version))
    for rel in ["vllm/_version.py", "vllm/__init__.py", *patchset.touched_paths(series)]:
        if (source / rel).is_file():
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / rel, target / rel)
    return target


@pytest.fixture(params=["0.33.0", "0.34.0"])
def release_tree(request, pristine_vllm: Path, tmp_path: Path) -> tuple[str, Path]:
    version = request.param
    source = pristine_vllm if version == "0.34.0" else devtree.pristine_tree(version)
    assert patchset.read_vllm_version(source) == version
    return version, copy_release_files(source, version, tmp_path / f"site-{version}")


def set_version(root: Path, version: str) -> None:
    version_file = root / "vllm" / "_version.py"
    old = patchset.read_vllm_version(root)
    version_file.write_text(version_file.read_text().replace(old, version))


def test_apply_picks_the_series_of_the_trees_release(release_tree):
    version, root = release_tree
    result = patchset.apply_series(root)
    assert result.vllm_version == version
    assert result.series_dir.name == f"vllm-{version}"
    status = patchset.series_state(root)
    assert status.clean and status.recorded_series == f"vllm-{version}"


def test_series_of_the_other_release_does_not_apply_and_changes_nothing(
    release_tree, tmp_path: Path
):
    """The other release's patches, put where this release's series would be, do not
    apply to this release's files (the trees differ where the series edits them)."""
    version, root = release_tree
    swapped = tmp_path / "patches"
    shutil.copytree(patchset.require_series_dir(OTHER[version]), swapped / f"vllm-{version}")
    before = tree_manifest(root)
    with pytest.raises(PatchError, match="does not apply"):
        patchset.apply_series(root, patches_dir=swapped)
    assert tree_manifest(root) == before
    status = patchset.series_state(root, patches_dir=swapped)
    assert not status.applied and status.problem is not None


def test_tree_patched_for_one_release_now_reporting_the_other_is_refused(
    release_tree, capsys: pytest.CaptureFixture[str]
):
    """vLLM replaced under an applied series (the state file says one release, the tree
    the other): apply refuses and names both, status says so, revert restores."""
    version, root = release_tree
    pristine = tree_manifest(root)
    patchset.apply_series(root)
    set_version(root, OTHER[version])
    before = tree_manifest(root)
    code = cli.main(["apply", "--target", str(root)])
    err = capsys.readouterr().err
    assert code != 0
    assert f"carries the vllm-{version} series" in err
    assert f"now {OTHER[version]}, whose series is vllm-{OTHER[version]}" in err
    assert "Nothing was changed" in err
    assert tree_manifest(root) == before

    status = patchset.series_state(root)
    assert status.exit_code == 2
    assert status.problem is not None and f"for vLLM {version}" in status.problem

    patchset.revert_series(root)
    set_version(root, version)
    assert tree_manifest(root) == pristine


def test_unsupported_release_lists_both(release_tree, capsys: pytest.CaptureFixture[str]):
    _, root = release_tree
    set_version(root, "0.35.0")
    before = tree_manifest(root)
    for command in ("apply", "status", "doctor"):
        code = cli.main([command, "--target", str(root)])
        captured = capsys.readouterr()
        assert code != 0, command
        assert "0.33.0, 0.34.0" in captured.out + captured.err, command
    assert tree_manifest(root) == before
