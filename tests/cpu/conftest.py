"""Fixtures for the patchset, devtree and cli tests: scratch copies of the installed vLLM and
synthetic patch series, and a TP-8 rank's model directory. Helpers live in
patchset_helpers.py."""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from patchset_helpers import (
    Changes,
    RecordedSeries,
    SyntheticSeries,
    copy_python_sources,
    git_run,
    installed_vllm_site,
    real_series_paths,
    tree_manifest,
)
from probe_host import ProbeHost

from vllm_minimax import doctor_cache
from vllm_minimax.m3_geometry import rank_text_config
from vllm_minimax.patchset import STATE_FILE


@pytest.fixture(autouse=True)
def doctor_answers_of_this_test(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each test's doctor stores its answers apart: an answer stored by another test, or by
    a doctor run outside the tests, in an environment the tests monkeypatch, is not one."""
    directory = tmp_path / "doctor-answers"
    monkeypatch.setattr(doctor_cache, "cache_dir", lambda: directory)


@pytest.fixture(scope="session")
def vllm_probe_host() -> Iterator[ProbeHost]:
    """A Python with torch and vLLM's config imported, which runs each vLLM probe script
    in a process forked from it (probe_host.py): one import for the session's probes."""
    with ProbeHost() as host:
        yield host


@pytest.fixture
def tp8_rank_model(tmp_path: Path) -> Path:
    """A model directory holding only the config.json of one GPU's share of MiniMax M3 at TP 8
    (vLLM 0.34.0's flat layout): what prebuild and doctor read a served model's geometry from."""
    model = tmp_path / "tp8-rank"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(rank_text_config(8)))
    return model


@pytest.fixture(scope="session")
def pristine_vllm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A read-only-by-convention copy of the installed vLLM's Python sources (~1 s)."""
    installed = installed_vllm_site()
    assert not (installed / STATE_FILE).exists(), (
        f"{installed} has the series applied (another conftest put a patched vLLM first on"
        " sys.path?); these tests need the pristine installed vLLM"
    )
    root = tmp_path_factory.mktemp("pristine-vllm")
    copy_python_sources(installed / "vllm", root)
    assert (root / "vllm" / "_version.py").is_file()
    return root


@pytest.fixture
def full_target(pristine_vllm: Path, tmp_path: Path) -> Path:
    """A per-test copy of the whole pristine Python tree."""
    target = tmp_path / "full-site"
    shutil.copytree(pristine_vllm, target)
    return target


@pytest.fixture
def small_target(pristine_vllm: Path, tmp_path: Path) -> Path:
    """A per-test tree with _version.py, the files the real series touches and a bystander."""
    target = tmp_path / "site"
    wanted = ["vllm/_version.py", "vllm/__init__.py", *real_series_paths()]
    for relative in wanted:
        source = pristine_vllm / relative
        if source.is_file():
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / relative)
    return target


@pytest.fixture
def make_series(tmp_path: Path) -> Callable[..., SyntheticSeries]:
    """Build a vLLM-like tree and a format-patch series of ``commits`` over it, with git."""

    def build(
        files: dict[str, str],
        commits: list[tuple[str, Changes]],
        version: str = "9.9.9",
        name: str = "synthetic",
    ) -> SyntheticSeries:
        base = tmp_path / name
        work = base / "work"
        work.mkdir(parents=True)
        all_files = {"vllm/_version.py": f"__version__ = version = '{version}'\n", **files}
        for relative, content in all_files.items():
            (work / relative).parent.mkdir(parents=True, exist_ok=True)
            (work / relative).write_text(content)
        target = base / "target"
        shutil.copytree(work, target)
        git_run(work, "init", "--quiet")
        git_run(work, "add", "-A")
        git_run(work, "commit", "--quiet", "-m", "base")
        for subject, changes in commits:
            for relative, content in changes.items():
                path = work / relative
                if content is None:
                    path.unlink()
                else:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(content)
            git_run(work, "add", "-A")
            git_run(work, "commit", "--quiet", "-m", subject)
        patches_root = base / "patches"
        series_dir = patches_root / f"vllm-{version}"
        series_dir.mkdir(parents=True)
        output = git_run(
            work, "format-patch", "--zero-commit", "-o", str(series_dir), f"HEAD~{len(commits)}"
        )
        names = [Path(line).name for line in output.split()]
        (series_dir / "series").write_text("# synthetic\n" + "".join(f"{n}\n" for n in names))
        return SyntheticSeries(patches_root, series_dir, target, names)

    return build


@pytest.fixture
def use_patches_root(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path], None]:
    def point_at(root: Path) -> None:
        monkeypatch.setenv("VLLM_MINIMAX_PATCHES", str(root))

    return point_at


@pytest.fixture
def make_recorded_series(
    make_series: Callable[..., SyntheticSeries],
    use_patches_root: Callable[[Path], None],
    capsys: pytest.CaptureFixture[str],
) -> Callable[[dict[str, str], list[tuple[str, Changes]]], RecordedSeries]:
    """Build a synthetic series (``make_series``), make it the one the CLI applies, and apply
    and revert it once through the CLI, recording the target's manifest in both states; the
    commands' output is discarded."""
    from vllm_minimax.cli import main

    def build(files: dict[str, str], commits: list[tuple[str, Changes]]) -> RecordedSeries:
        series = make_series(files, commits)
        use_patches_root(series.patches_root)
        pristine = tree_manifest(series.target)
        assert main(["apply", "--target", str(series.target)]) == 0
        applied = tree_manifest(series.target)
        assert main(["revert", "--target", str(series.target)]) == 0
        assert tree_manifest(series.target) == pristine
        capsys.readouterr()
        return RecordedSeries(series, pristine, applied)

    return build


@pytest.fixture(autouse=True)
def _real_patches_by_default(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("VLLM_MINIMAX_PATCHES", raising=False)
    yield


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """Ctrl-C as an interactive terminal delivers it, for the tests that send SIGINT: Python's
    KeyboardInterrupt handler in this process and, since a caught signal is reset on exec, the
    default disposition in every process it starts (whose Python then installs its own
    handler). A shell starts a background job with SIGINT ignored, and an ignored SIGINT is
    inherited; without this, those tests fail when the suite runs as one."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
