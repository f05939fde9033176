"""`vllm-minimax make-tiny-model`: transformers loads and runs the checkpoint, and
stock vLLM 0.34.0's config code and model registry accept it as MiniMax M3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from vllm_minimax import cli
from vllm_minimax.tiny_model import ARCHITECTURE, TINY_TEXT_CONFIG


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-minimax-m3")
    assert cli.main(["make-tiny-model", str(directory)]) == 0
    return directory


def test_layout(tiny_dir):
    names = {path.name for path in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "minimax_m3_vl_text"
    assert config["architectures"] == [ARCHITECTURE]
    assert set(config["layer_types"]) == {"full_attention", "minimax_m3_sparse"}
    for key in ("index_head_dim", "index_block_size", "head_dim"):
        assert config[key] == 128
    assert (config["index_topk_blocks"], config["index_local_blocks"]) == (16, 1)


def test_weight_names_are_the_checkpoint_names_vllm_loads(tiny_dir):
    """The names vLLM's MiniMaxM3Model.load_weights maps (the published checkpoint's)."""
    with safe_open(tiny_dir / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    experts = TINY_TEXT_CONFIG["num_local_experts"]
    for layer, (attention, mlp) in enumerate(
        zip(TINY_TEXT_CONFIG["layer_types"], TINY_TEXT_CONFIG["mlp_layer_types"], strict=True)
    ):
        stem = f"model.layers.{layer}"
        expected = {f"{stem}.input_layernorm.weight", f"{stem}.post_attention_layernorm.weight"}
        expected |= {f"{stem}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")}
        expected |= {f"{stem}.self_attn.{p}.weight" for p in ("o_proj", "q_norm", "k_norm")}
        if attention == "minimax_m3_sparse":
            expected |= {
                f"{stem}.self_attn.index_{p}.weight"
                for p in ("q_proj", "k_proj", "q_norm", "k_norm")
            }
        if mlp == "sparse":
            moe = f"{stem}.block_sparse_moe"
            expected |= {f"{moe}.gate.weight", f"{moe}.e_score_correction_bias"}
            expected |= {f"{moe}.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj")}
            expected.add(f"{moe}.shared_experts.down_proj.weight")
            expected |= {
                f"{moe}.experts.{e}.{w}.weight" for e in range(experts) for w in ("w1", "w2", "w3")
            }
        else:
            expected |= {f"{stem}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        layer_names = {name for name in names if name.startswith(f"{stem}.")}
        assert layer_names == expected, f"layer {layer}"


def test_transformers_loads_and_runs_it(tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_minimax.tiny_model import register_transformers_conversion

    register_transformers_conversion()
    model, info = AutoModelForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert type(model).__name__ == "MiniMaxM3VLForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    assert inputs["input_ids"][0, 0] == tokenizer.bos_token_id
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.float().std() > 0  # random weights, not zeros


def test_vllm_config_and_registry_resolve_minimax_m3(tiny_dir):
    from vllm.config import ModelConfig
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.config import get_config

    hf_config = get_config(str(tiny_dir), trust_remote_code=False)
    assert type(hf_config).__name__ == "MiniMaxM3VLTextConfig"
    assert hf_config.index_topk_blocks == 16

    model_config = ModelConfig(model=str(tiny_dir), tokenizer=str(tiny_dir))
    assert model_config.architecture == ARCHITECTURE
    assert model_config.hf_text_config.layer_types == TINY_TEXT_CONFIG["layer_types"]
    assert model_config.max_model_len == TINY_TEXT_CONFIG["max_position_embeddings"]
    info, arch = ModelRegistry.inspect_model_cls(model_config.architectures, model_config)
    assert arch == ARCHITECTURE and info.is_text_generation_model
    model_cls, arch = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
    assert arch == ARCHITECTURE
    assert model_cls.__module__ == "vllm.models.minimax_m3.nvidia.model"
    assert model_cls.__name__ == ARCHITECTURE
