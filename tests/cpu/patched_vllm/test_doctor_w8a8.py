"""doctor's W8A8 row reads a checkpoint's quantization as the vLLM under test does: for each
way a config.json (or hf_quant_config.json) can declare it, `w8a8_doctor`'s MXFP8 verdict is
whether vLLM's own ModelConfig resolves a ModelOpt MXFP8 method; and over a bf16 checkpoint
the quantization-config override builds no quantization config at all (the row's "the key
is ignored")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from vllm.config import LoadConfig, ModelConfig, VllmConfig
from vllm.config.quantization import resolve_quantization_config
from vllm.model_executor.layers.quantization import get_quantization_config
from vllm.model_executor.layers.quantization.modelopt import ModelOptMxFp8Config
from vllm.platforms import current_platform

from vllm_minimax import w8a8, w8a8_doctor
from vllm_minimax.tiny_model import make_rank_model

MODELOPT_MXFP8 = {"quant_algo": "MXFP8", "kv_cache_quant_algo": None, "exclude_modules": []}
# (config.json's quantization_config or None, hf_quant_config.json's or None)
DECLARATIONS = {
    "minimax-tag": ({"quant_method": "mxfp8", "ignored_layers": ["lm_head"]}, None),
    "modelopt-nested": ({"quant_method": "modelopt", "quantization": MODELOPT_MXFP8}, None),
    "modelopt-flat": ({"quant_method": "modelopt", "quant_algo": "MXFP8"}, None),
    "modelopt-fp8": ({"quant_method": "modelopt", "quant_algo": "FP8"}, None),
    "hf-quant-config": (None, {"quant_method": "modelopt", "quantization": MODELOPT_MXFP8}),
    "bf16": (None, None),
}


@pytest.fixture(scope="module")
def rank_slice(tmp_path_factory) -> Path:
    made = make_rank_model(
        tmp_path_factory.mktemp("w8a8-row") / "slice", "m3-tp8-rank", weights="bf16"
    )
    return Path(made["directory"])


def declared(rank_slice: Path, tmp_path: Path, name: str) -> Path:
    in_config, in_file = DECLARATIONS[name]
    directory = tmp_path / name
    shutil.copytree(rank_slice, directory)
    config = json.loads((directory / "config.json").read_text())
    config.pop("quantization_config", None)
    if in_config is not None:
        config["quantization_config"] = in_config
    (directory / "config.json").write_text(json.dumps(config))
    if in_file is not None:
        (directory / w8a8_doctor.HF_QUANT_CONFIG_FILE).write_text(json.dumps(in_file))
    return directory


def model_config(directory: Path) -> ModelConfig:
    override = resolve_quantization_config(None, dict(w8a8.W8A8_QUANTIZATION_CONFIG))
    return ModelConfig(model=str(directory), max_model_len=4096, quantization_config=override)


@pytest.mark.parametrize("name", sorted(DECLARATIONS))
def test_the_mxfp8_verdict_is_vllms(rank_slice, tmp_path, monkeypatch, name: str) -> None:
    monkeypatch.setattr(current_platform, "device_type", "cpu")
    directory = declared(rank_slice, tmp_path, name)
    method = model_config(directory).quantization
    vllm_mxfp8 = method is not None and get_quantization_config(method) is ModelOptMxFp8Config
    ours = w8a8_doctor.is_mxfp8(w8a8_doctor.declared_quantization(directory))
    assert ours is vllm_mxfp8, (name, method)
    assert vllm_mxfp8 is (name not in ("modelopt-fp8", "bf16")), (name, method)


def test_over_a_bf16_checkpoint_the_override_builds_no_quantization(
    rank_slice, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(current_platform, "device_type", "cpu")
    bf16 = model_config(declared(rank_slice, tmp_path, "bf16"))
    assert bf16.quantization_config is not None  # the key was read into the engine args
    assert VllmConfig._get_quantization_config(bf16, LoadConfig()) is None
    mxfp8 = model_config(declared(rank_slice, tmp_path, "minimax-tag"))
    built = VllmConfig._get_quantization_config(mxfp8, LoadConfig())
    assert isinstance(built, ModelOptMxFp8Config)
    assert built.online_quantization_config is not None
    outcome, text = w8a8_doctor.checkpoint_finding(str(tmp_path / "bf16"))
    assert outcome is w8a8_doctor.Outcome.IGNORED and "the key is ignored" in text
