"""``method: mtp`` against the published layout without MTP tensors, with vLLM 0.34.0's own
config, model and loader code on the CPU (mtp_published_layout_probe.py says what it builds):
the layout `tests/gpu_e2e/mtp_without_tensors.py` serves on the GPU (issue 63)."""

from __future__ import annotations

from pathlib import Path

import pytest
from patchset_helpers import run_json_probe
from probe_host import ProbeHost

from vllm_minimax import cli
from vllm_minimax.testing.speculative_run import NOT_INITIALIZED, not_initialized
from vllm_minimax.tiny_model import MTP_ARCHITECTURE, VL_ARCHITECTURE

PROBE = Path(__file__).parent / "mtp_published_layout_probe.py"


@pytest.fixture(scope="module")
def probe(tmp_path_factory, vllm_probe_host: ProbeHost) -> dict:
    root = tmp_path_factory.mktemp("mtp-published")
    assert cli.main(["make-tiny-model", str(root / "tiny")]) == 0
    return run_json_probe(
        PROBE, str(root / "tiny"), str(root / "work"), timeout=600, host=vllm_probe_host
    )


def test_the_target_is_the_vl_class_and_loads_every_parameter(probe: dict) -> None:
    """The renamed tensors reach every parameter of the text model under `language_model.`
    (the loader's check is on: no quantization) and the tower is skipped."""
    assert probe["target_architectures"] == [VL_ARCHITECTURE]
    assert probe["target_class"] == VL_ARCHITECTURE
    assert probe["target_is_multimodal"] is True
    assert probe["target_load_error"] is None
    assert probe["target_layers"]
    assert all(name.startswith("language_model.model.layers.") for name in probe["target_layers"])


def test_the_draft_is_built_beside_the_target(probe: dict) -> None:
    """No layer name shared with the target (the text-only layout's failure on the GPU)."""
    assert probe["draft_architectures"] == [MTP_ARCHITECTURE]
    assert probe["draft_quantization"] is None
    assert probe["draft_construction_error"] is None
    assert probe["draft_class"] == MTP_ARCHITECTURE
    assert set(probe["draft_layers"]) == {
        "model.layers.0.self_attn.attn",
        "model.layers.0.self_attn.attn.index_cache",
        "model.layers.0.block_sparse_moe.experts",
    }


def test_the_loader_stops_at_the_mtp_modules_parameters(probe: dict) -> None:
    """The message a BF16 checkpoint without MTP tensors stops `vllm serve` with. It names the
    module's norms and routing bias; its linear layers (eh_proj, the projections, the
    experts) are exempt from the check, their method having a post-load step."""
    error = probe["draft_load_error"]
    assert error is not None and error.startswith(NOT_INITIALIZED)
    names = not_initialized(error)
    assert {f"model.layers.0.{norm}.weight" for norm in ("enorm", "hnorm", "final_layernorm")} <= (
        set(names)
    )
    assert all(name.startswith("model.layers.0.") for name in names)
    assert not any(".eh_proj." in name or "_proj." in name for name in names)
