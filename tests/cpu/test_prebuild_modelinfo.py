"""`vllm-minimax warmup --prebuild`'s model-info step: vLLM's registry, asked for the served
model's architectures on the CPU, writes the file a fresh server then reads instead of
inspecting the model class in a subprocess (27-32 s of an H100 cold start).

vLLM's inspection runs here in this process (its `_run_in_subprocess` given the function to
call), which imports the model module once (~10 s on the CI host); the hash, the file's
place and its reading back are vLLM's own code, against the installed vLLM."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from vllm.model_executor.models import registry

from vllm_minimax import prebuild_modelinfo
from vllm_minimax.cli import main
from vllm_minimax.prebuild_inputs import PrebuildError

TEXT = "MiniMaxM3SparseForCausalLM"
VL = "MiniMaxM3SparseForConditionalGeneration"


CACHE_ROOT = "VLLM_CACHE_ROOT"


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "vllm-cache"
    monkeypatch.setenv(CACHE_ROOT, str(root))
    return root


@pytest.fixture
def inspections(monkeypatch) -> list[object]:
    """vLLM's subprocess inspection, run in this process; each call is recorded."""
    calls: list[object] = []

    def in_process(fn):
        calls.append(fn)
        return fn()

    monkeypatch.setattr(registry, "_run_in_subprocess", in_process)
    return calls


def _as_a_fresh_server_reads(architecture: str, root: Path):
    """What a new server with ``VLLM_CACHE_ROOT=root`` finds for ``architecture``: a fresh lazy
    entry of the same module and class, its cache looked up with the hash vLLM computes now."""
    os.environ[CACHE_ROOT] = str(root)  # as the test set it, whatever the prebuild did
    entry = registry.ModelRegistry.models[architecture]
    fresh = registry._LazyRegisteredModel(entry.module_name, entry.class_name)
    return fresh._load_modelinfo_from_cache(fresh._get_module_hash())


def _rank_slice(tmp_path: Path) -> Path:
    """The MXFP8 slice: `make-tiny-model --geometry m3-tp8-rank --weights mxfp8 --experts ep`."""
    model = tmp_path / "m3-tp8-rank"
    argv = ["make-tiny-model", str(model), "--geometry", "m3-tp8-rank"]
    assert main([*argv, "--weights", "mxfp8", "--experts", "ep"]) == 0
    return model


def test_the_mxfp8_slice_fills_what_a_fresh_server_reads(tmp_path, cache_root, inspections):
    model = _rank_slice(tmp_path)
    architectures, source = prebuild_modelinfo.model_architectures(str(model))
    assert architectures == [TEXT] and source == str(model / "config.json")
    assert _as_a_fresh_server_reads(TEXT, cache_root) is None

    entries = prebuild_modelinfo.fill_modelinfo_cache(architectures)

    path = cache_root / "modelinfos" / "vllm-models-minimax_m3-MiniMaxM3SparseForCausalLM.json"
    assert [(e.architecture, e.path, e.state) for e in entries] == [(TEXT, path, "written")]
    assert len(inspections) == 1 and path.is_file()
    found = _as_a_fresh_server_reads(TEXT, cache_root)
    assert found is not None and found.architecture == TEXT and found.supports_pp
    # The server's own lookup answers from the file, with no inspection.
    entry = registry.ModelRegistry.models[TEXT]
    fresh = registry._LazyRegisteredModel(entry.module_name, entry.class_name)
    assert fresh.inspect_model_cls() == found
    assert len(inspections) == 1
    line = prebuild_modelinfo.summary(entries, source)
    assert line == f"vLLM model info: {TEXT}: {path} (written)"

    again = prebuild_modelinfo.fill_modelinfo_cache(architectures)
    assert [e.state for e in again] == ["already current"] and len(inspections) == 1


def test_a_stale_entry_is_inspected_again(cache_root, inspections):
    entry = registry.ModelRegistry.models[TEXT]
    path = cache_root / "modelinfos" / entry._get_cache_filename()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"hash": "0" * 32, "modelinfo": {}}))

    [written] = prebuild_modelinfo.fill_modelinfo_cache([TEXT])

    assert written.state == "written" and len(inspections) == 1
    assert json.loads(path.read_text())["hash"] == entry._get_module_hash()


def test_the_published_architecture_and_a_dry_run(cache_root, inspections):
    architectures, _ = prebuild_modelinfo.model_architectures("MiniMaxAI/MiniMax-M3-MXFP8")
    assert architectures == [VL]
    [planned] = prebuild_modelinfo.fill_modelinfo_cache(architectures, dry_run=True)
    assert planned.state == "would be written" and not cache_root.exists()

    [written] = prebuild_modelinfo.fill_modelinfo_cache(architectures)

    assert written.state == "written" and written.path.parent == cache_root / "modelinfos"
    found = _as_a_fresh_server_reads(VL, cache_root)
    assert found is not None and found.architecture == VL and found.supports_multimodal


def test_an_unwritable_cache_is_named_and_nothing_is_inspected(tmp_path, monkeypatch, inspections):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(blocker / "vllm"))
    with pytest.raises(PrebuildError) as raised:
        prebuild_modelinfo.fill_modelinfo_cache([TEXT])
    assert str(raised.value) == (
        f"vLLM's model-info cache {blocker / 'vllm' / 'modelinfos'} is not writable:"
        f" {blocker} is not a directory (set VLLM_CACHE_ROOT to the directory the server"
        " reads)"
    )
    assert inspections == []


def test_a_file_vllm_fails_to_save_is_an_error(cache_root, inspections, monkeypatch):
    """vLLM logs and goes on when it cannot save the file; the prebuild does not."""
    monkeypatch.setattr(registry._LazyRegisteredModel, "_save_modelinfo_to_cache", lambda *a: None)
    with pytest.raises(PrebuildError, match="did not write its model-info file"):
        prebuild_modelinfo.fill_modelinfo_cache([TEXT])


def test_a_config_of_no_registered_architecture_is_refused(tmp_path, cache_root):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    architectures, _ = prebuild_modelinfo.model_architectures(str(tmp_path))
    with pytest.raises(PrebuildError, match="has none of the architectures NoSuchForCausalLM"):
        prebuild_modelinfo.fill_modelinfo_cache(architectures)


@pytest.mark.parametrize("architecture", [TEXT, "LlamaForCausalLM"])
def test_the_hash_without_0_34s_helper_is_the_one_vllm_keys_on(architecture, monkeypatch):
    """vLLM 0.33.0 has no ``_get_module_hash``: the prebuild finds the module's file as that
    release's ``inspect_model_cls`` does, for a package and for a one-file model alike."""
    entry = registry.ModelRegistry.models[architecture]
    expected = entry._get_module_hash()
    monkeypatch.delattr(registry._LazyRegisteredModel, "_get_module_hash")
    assert not hasattr(entry, "_get_module_hash")
    assert expected is not None
    assert prebuild_modelinfo._module_hash(entry) == expected
