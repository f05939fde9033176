"""End-to-end runs record the series that produced them; the e2e tests refuse others."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from vllm_minimax import patchset
from vllm_minimax.testing import series_record

E2E_CONFTEST = Path(__file__).resolve().parents[1] / "gpu_e2e" / "conftest.py"
VLLM_VERSION = "0.34.0"


def fake_applied_target(root: Path, patches: list[tuple[str, str]]) -> Path:
    """A directory whose vllm/ holds only a state file recording `patches`."""
    (root / "vllm").mkdir(parents=True)
    state = patchset.AppliedState(
        vllm_version=VLLM_VERSION,
        series=f"vllm-{VLLM_VERSION}",
        patches=patches,
        files=[],
        created_dirs=[],
    )
    (root / patchset.STATE_FILE).write_bytes(state.encode())
    return root


def current_patches() -> list[tuple[str, str]]:
    series_dir = patchset.require_series_dir(VLLM_VERSION)
    return patchset.series_fingerprint(patchset.read_series(series_dir))


def test_a_run_of_this_series_is_accepted(tmp_path):
    target = fake_applied_target(tmp_path, current_patches())
    recorded = series_record.applied_series(target)
    assert recorded == series_record.checkout_series(VLLM_VERSION)
    assert series_record.series_mismatch({"series": recorded}) is None


def test_a_run_of_another_revision_is_refused(tmp_path):
    patches = current_patches()
    name, sha = patches[-1]
    edited = [*patches[:-1], (name, "0" * len(sha))]
    recorded = series_record.applied_series(fake_applied_target(tmp_path, edited))
    mismatch = series_record.series_mismatch({"series": recorded})
    assert mismatch is not None and "another revision of the series" in mismatch, mismatch
    assert f"{name} 000000000000" in mismatch


def test_a_run_without_a_record_or_of_unpatched_vllm_is_refused(tmp_path):
    (tmp_path / "vllm").mkdir()
    assert series_record.applied_series(tmp_path) is None
    assert "no series applied" in series_record.series_mismatch({"series": None})
    assert series_record.series_mismatch({}).startswith("unknown series")


@pytest.fixture
def e2e_conftest(monkeypatch):
    name = "gpu_e2e_conftest"
    spec = importlib.util.spec_from_file_location(name, E2E_CONFTEST)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def test_saved_run_mode_refuses_runs_of_another_or_unknown_series(tmp_path, e2e_conftest):
    good = {"workloads": {}, "series": series_record.checkout_series(VLLM_VERSION)}
    (tmp_path / "triton-eager.json").write_text(json.dumps(good))
    (tmp_path / "flashinfer-eager.json").write_text(json.dumps({"workloads": {}}))
    other = json.loads(json.dumps(good))
    other["series"]["patches"][0][1] = "f" * 64
    (tmp_path / "auto-graphs.json").write_text(json.dumps(other))

    assert e2e_conftest._saved_run("triton-eager", tmp_path).error is None
    unknown = e2e_conftest._saved_run("flashinfer-eager", tmp_path).error
    assert unknown is not None and "refused: unknown series" in unknown, unknown
    refused = e2e_conftest._saved_run("auto-graphs", tmp_path).error
    assert refused is not None and "another revision of the series" in refused, refused
    missing = e2e_conftest._saved_run("triton-graphs", tmp_path).error
    assert missing is not None and "is not among the saved runs" in missing
