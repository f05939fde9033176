"""The checkpoints of the multi-GPU runs (docs/multi-gpu.md): ``--geometry m3-heads`` gives a
rank at TP N what it gets of MiniMax M3, and ``--geometry m3`` writes the whole model's config in
the published layout with its MTP module declared."""

from __future__ import annotations

import json

import pytest

from vllm_minimax import cli
from vllm_minimax.m3_geometry import M3_TEXT_CONFIG, rank_text_config
from vllm_minimax.tiny_model import (
    M3_HEADS_TEXT_CONFIG,
    M3_MTP_MODULES,
    MXFP8_QUANTIZATION_CONFIG,
    PUBLISHED_MODEL_TYPE,
)

RANK_HEADS = ("num_attention_heads", "num_key_value_heads", "index_n_heads", "head_dim")


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_m3_heads_rank_holds_the_real_rank_heads(tp):
    small = rank_text_config(tp, {**M3_HEADS_TEXT_CONFIG, "vocab_size": 576})
    real = rank_text_config(tp)
    assert {k: small[k] for k in RANK_HEADS} == {k: real[k] for k in RANK_HEADS}
    assert small["index_n_heads"] == max(1, 4 // tp)
    assert M3_HEADS_TEXT_CONFIG["num_local_experts"] % tp == 0  # EP N splits the experts
    for key in ("index_head_dim", "index_block_size", "index_topk_blocks", "num_experts_per_tok"):
        assert M3_HEADS_TEXT_CONFIG[key] == M3_TEXT_CONFIG[key]


def test_m3_heads_keeps_m3s_layer_pattern():
    assert M3_HEADS_TEXT_CONFIG["layer_types"][0] == "full_attention"
    assert M3_HEADS_TEXT_CONFIG["mlp_layer_types"][0] == "dense"
    assert set(M3_HEADS_TEXT_CONFIG["layer_types"][1:]) == {"minimax_m3_sparse"}
    assert set(M3_HEADS_TEXT_CONFIG["mlp_layer_types"][1:]) == {"sparse"}


def test_m3_config_is_the_published_layout_with_its_mtp_module(tmp_path):
    target = tmp_path / "m3"
    assert cli.main(["make-tiny-model", str(target), "--geometry", "m3"]) == 0
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == PUBLISHED_MODEL_TYPE
    text = config["text_config"]
    assert text["num_mtp_modules"] == M3_MTP_MODULES
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert text[key] == M3_TEXT_CONFIG[key]
    assert text["sparse_attention_config"]["sparse_num_index_heads"] == 4
    assert config["quantization_config"] == MXFP8_QUANTIZATION_CONFIG
    assert not (target / "model.safetensors").exists()


@pytest.mark.parametrize(
    "extra",
    [["--geometry", "m3", "--mtp-modules", "1"], ["--geometry", "m3-heads", "--kind", "llama"]],
)
def test_options_that_do_nothing_are_refused_and_nothing_is_written(tmp_path, extra):
    target = tmp_path / "x"
    assert cli.main(["make-tiny-model", str(target), *extra]) == 2
    assert not target.exists()
