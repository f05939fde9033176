"""The tiny MTP draft's prefix reaches every process of a served engine.

`tests/gpu_e2e/test_serve_chat.py` serves the tiny MiniMax M3 with MTP; its draft
needs `PrefixedMiniMaxM3MTP` (`vllm_minimax/testing/mtp_draft.py` says why) in the
process that builds it, vLLM's engine core, which vLLM starts with `spawn` once CUDA
is initialised in the API server. `mtp_draft_plugin_probe.py` runs in a fresh
interpreter, as the API server does, and starts its children the way vLLM starts
the engine core (`get_mp_context()` with `VLLM_WORKER_MULTIPROC_METHOD=spawn`).
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest
from patchset_helpers import run_json_probe

from vllm_minimax.testing import mtp_draft

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).parent / "mtp_draft_plugin_probe.py"
VLLM_DRAFT_CLASS = "vllm.models.minimax_m3:MiniMaxM3MTP"


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    plugin_dir = mtp_draft.write_plugin_distribution(tmp_path_factory.mktemp("plugin"))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(plugin_dir), str(REPO)]),
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    }
    env.pop("VLLM_PLUGINS", None)
    report = run_json_probe(PROBE, env=env, timeout=900)
    assert report["start_method"] == "spawn"
    assert report["with_plugins_exitcode"] == report["without_plugins_exitcode"] == 0
    return report


def test_plugin_distribution_declares_install_to_vllm(tmp_path):
    directory = mtp_draft.write_plugin_distribution(tmp_path / "plugin")
    found = [
        entry_point
        for distribution in importlib.metadata.distributions(path=[str(directory)])
        for entry_point in distribution.entry_points
    ]
    assert [(ep.group, ep.name, ep.value) for ep in found] == [
        ("vllm.general_plugins", mtp_draft.PLUGIN_NAME, "vllm_minimax.testing.mtp_draft:install")
    ]
    assert found[0].load() is mtp_draft.install


def test_the_plugin_reaches_a_spawned_engine_process(probe):
    assert probe["parent"]["draft_class"] == mtp_draft.PREFIXED_DRAFT_CLASS
    assert probe["with_plugins"] == mtp_draft.PREFIXED_DRAFT_CLASS


def test_the_api_server_process_imports_no_model_code(probe):
    """What keeps vLLM on fork and the API server free of CUDA: registering the draft
    class imports no MiniMax M3 model module (the old launcher's patch imported it)."""
    assert probe["parent"]["model_modules_imported"] == []
    assert probe["parent"]["cuda_initialized"] is False


def test_what_the_parent_registered_alone_does_not_reach_a_spawned_process(probe):
    """The old launcher's way (set up in the API server process only): a spawned engine
    core without the plugin builds vLLM's own draft, whose layer names collide with the
    tiny target's."""
    assert probe["without_plugins"] == VLLM_DRAFT_CLASS
