"""Make this test directory import a patched real vLLM.

The vLLM under test is mirrored into a temporary directory as a tree of symlinks;
the files the series touches are real copies, and `vllm-minimax apply` patches
them there, with the series it picks for that tree's version. That tree goes
first on `sys.path` before anything imports vLLM, so these tests run vLLM's own
code with the series applied while the source stays pristine. This directory
runs in its own pytest process (`scripts/test`), because a process can hold only
one `vllm` package.

By default the vLLM under test is the installed one. `VLLM_MINIMAX_TEST_VLLM=X.Y.Z`
takes release X.Y.Z's pristine Python sources from its sdist instead
(`devtree.pristine_tree`), on the installed torch, transformers and FlashInfer;
`scripts/test` runs this directory so against every other supported release.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import same_code

from vllm_minimax import devtree, patchset

TEST_VLLM_ENV = "VLLM_MINIMAX_TEST_VLLM"


def _installed_vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed"
    return Path(next(iter(spec.submodule_search_locations))).parent


def _source_vllm_root() -> Path:
    installed = _installed_vllm_root()
    wanted = os.environ.get(TEST_VLLM_ENV, "").strip()
    if not wanted or wanted == patchset.read_vllm_version(installed):
        return installed
    if patchset.series_dir_for(wanted) is None:
        supported = ", ".join(patchset.supported_versions())
        raise pytest.UsageError(f"{TEST_VLLM_ENV}={wanted}: no series; supported: {supported}")
    return devtree.pristine_tree(wanted)


def _build_patched_tree() -> Path:
    assert "vllm" not in sys.modules, "vLLM was imported before the patched tree was set up"
    source = _source_vllm_root()
    root = Path(tempfile.mkdtemp(prefix="patched-vllm-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    for directory, subdirs, files in os.walk(source / "vllm"):
        subdirs[:] = [d for d in subdirs if d != "__pycache__"]
        mirror = root / Path(directory).relative_to(source)
        mirror.mkdir(parents=True, exist_ok=True)
        for name in files:
            (mirror / name).symlink_to(Path(directory) / name)
    series_dir = patchset.require_series_dir(patchset.read_vllm_version(source))
    for rel in patchset.touched_paths(patchset.read_series(series_dir)):
        copy = root / rel
        if copy.is_symlink():
            copy.unlink()
            shutil.copy2(source / rel, copy)
    result = patchset.apply_series(root)
    assert not result.already_applied
    assert result.series_dir == series_dir
    return root


def _use_a_vllm_cache_of_this_tree(version: str) -> None:
    """Point vLLM's cache (`VLLM_CACHE_ROOT`) of this process and the ones it starts at a
    directory of the patched tree's own release.

    vLLM keeps what it learned of a model class (`<root>/modelinfos/`) in one file per class,
    checked against a hash of the model's package; where it is stale vLLM inspects the class
    again in a subprocess that imports vLLM afresh (about 11 s here). The patched
    `minimax_m3` package hashes unlike the installed one and unlike another release's, so in
    one shared root each tree's processes overwrote the others' entries and missed in turn.
    """
    os.environ["VLLM_CACHE_ROOT"] = str(devtree.cache_dir() / "patched-vllm" / version / "vllm")


INSTALLED_VLLM_VERSION = patchset.read_vllm_version(_installed_vllm_root())
PATCHED_VLLM_ROOT = _build_patched_tree()
sys.path.insert(0, str(PATCHED_VLLM_ROOT))
_use_a_vllm_cache_of_this_tree(patchset.read_vllm_version(PATCHED_VLLM_ROOT))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{same_code.MARK}(*paths): calls only the code of these series files; against a"
        " release other than the installed one it runs only where they differ (same_code.py)",
    )


_same_code_deselected: list[str] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Against a release other than the installed one, leave out the tests whose series files
    are byte for byte the installed release's (`same_code.py`): its run runs them."""
    installed = INSTALLED_VLLM_VERSION
    if patchset.read_vllm_version(PATCHED_VLLM_ROOT) == installed:
        return
    installed_series = patchset.require_series_dir(installed)
    verdicts: dict[tuple[str, ...], bool] = {}
    counts: dict[tuple[str, ...], int] = {}
    kept = []
    for item in items:
        mark = item.get_closest_marker(same_code.MARK)
        paths = tuple(mark.args) if mark is not None else ()
        if mark is not None and paths not in verdicts:
            verdicts[paths] = same_code.same_as_installed(
                PATCHED_VLLM_ROOT, paths, installed_series
            )
        if mark is None or not verdicts[paths]:
            kept.append(item)
        counts[paths] = counts.get(paths, 0) + 1
    kept_ids = {id(item) for item in kept}
    deselected = [item for item in items if id(item) not in kept_ids]
    if deselected:
        items[:] = kept
        config.hook.pytest_deselected(items=deselected)
    for paths, same in verdicts.items():
        files = ", ".join(paths)
        if same:
            _same_code_deselected.append(
                f"{counts[paths]} deselected: {files} are vLLM {installed}'s bytes,"
                " whose run runs them"
            )
        else:
            _same_code_deselected.append(f"{files} differ from vLLM {installed}'s: they run")


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    return [f"{same_code.MARK}: {line}" for line in _same_code_deselected]


@pytest.fixture
def patched_vllm_root() -> Path:
    """The temporary vLLM tree these tests import, with the series applied."""
    return PATCHED_VLLM_ROOT


@pytest.fixture(scope="session")
def vllm_version() -> str:
    """The release under test (its series is the one applied)."""
    return patchset.read_vllm_version(PATCHED_VLLM_ROOT)


@pytest.fixture(autouse=True)
def cpu_workspace():
    """vLLM's workspace manager on the CPU, fresh per test, as the GPU worker
    makes one (the FlashInfer indexer scores into it)."""
    import torch
    from vllm.v1.worker import workspace

    workspace.init_workspace_manager(torch.device("cpu"))
    yield workspace.current_workspace_manager()
    workspace.reset_workspace_manager()


@pytest.fixture
def single_rank(monkeypatch):
    """The MiniMax M3 indexer on a single tensor-parallel rank (modules that need it use
    `pytestmark = pytest.mark.usefixtures("single_rank")`)."""
    from vllm.models.minimax_m3.common import indexer

    monkeypatch.setattr(indexer, "get_tensor_model_parallel_world_size", lambda: 1)


@pytest.fixture
def kernels(monkeypatch):
    """FlashInfer's msa_proxy_score and msa_topk_select, in the patched FlashInfer indexer,
    replaced by the float32 reference (`indexer_helpers.ReferenceKernels`)."""
    from indexer_helpers import ReferenceKernels
    from vllm.models.minimax_m3.nvidia import indexer_flashinfer

    fake = ReferenceKernels()
    monkeypatch.setattr(indexer_flashinfer, "msa_proxy_score", fake.msa_proxy_score)
    monkeypatch.setattr(indexer_flashinfer, "msa_topk_select", fake.msa_topk_select)
    return fake
