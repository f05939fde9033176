"""The tiny MTP draft's prefix reaches every process of a served engine.

`tests/gpu_e2e/test_serve_chat.py` serves the tiny MiniMax M3 with MTP; its draft
needs `PrefixedMiniMaxM3MTP` (`vllm_minimax/testing/mtp_draft.py` says why) in the
process that builds it, vLLM's engine core, which vLLM starts with `spawn` once CUDA
is initialised in the API server. Each probe runs in a fresh interpreter, as the API
server does, and starts its child the way vLLM starts the engine core
(`get_mp_context()` with `VLLM_WORKER_MULTIPROC_METHOD=spawn`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_minimax.testing import mtp_draft

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).parent / "mtp_draft_plugin_probe.py"
VLLM_DRAFT_CLASS = "vllm.models.minimax_m3:MiniMaxM3MTP"


def _run_probe(python_path: list[Path], *extra: str) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(path) for path in python_path),
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    }
    env.pop("VLLM_PLUGINS", None)
    completed = subprocess.run(
        [sys.executable, str(PROBE), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.splitlines()[-1])


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


def test_the_plugin_reaches_a_spawned_engine_process_without_importing_the_model(tmp_path):
    plugin_dir = mtp_draft.write_plugin_distribution(tmp_path / "plugin")
    probe = _run_probe([plugin_dir, REPO])
    assert probe["start_method"] == "spawn"
    assert probe["child_exitcode"] == 0
    assert probe["child_draft_class"] == mtp_draft.PREFIXED_DRAFT_CLASS
    assert probe["parent"]["draft_class"] == mtp_draft.PREFIXED_DRAFT_CLASS
    # What keeps vLLM on fork: the API server's setup imports no model code.
    assert probe["parent"]["model_modules_imported"] == []
    assert probe["parent"]["cuda_initialized"] is False


def test_install_in_the_parent_alone_does_not_reach_a_spawned_process():
    """The old launcher's way (`install()` before vLLM's server, no plugin): the
    registration stays in the parent, and a spawned engine core builds vLLM's own
    draft, whose layer names collide with the tiny target's."""
    probe = _run_probe([REPO], "--install-in-parent")
    assert probe["parent"]["draft_class"] == mtp_draft.PREFIXED_DRAFT_CLASS
    assert probe["parent"]["model_modules_imported"] == []
    assert probe["child_draft_class"] == VLLM_DRAFT_CLASS
