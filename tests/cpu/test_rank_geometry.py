"""`vllm-minimax make-tiny-model --geometry m3-tpN-rank`: the config vLLM 0.34.0 builds at
TP=1 holds exactly the parameters rank 0 of MiniMax M3 at TP-N holds, as vLLM itself shards
the full config (the probe builds both on the meta device)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from patchset_helpers import run_json_probe

from vllm_minimax import cli
from vllm_minimax.tiny_model import (
    ARCHITECTURE,
    M3_TEXT_CONFIG,
    RANK_GEOMETRIES,
    parameter_counts,
    weight_bytes,
    write_config_only_model,
)

PROBE = Path(__file__).parent / "rank_geometry_probe.py"
EMBEDDING_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def rank_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("m3-ranks")
    for geometry in RANK_GEOMETRIES:
        assert cli.main(["make-tiny-model", str(root / geometry), "--geometry", geometry]) == 0
    return {geometry: root / geometry for geometry in RANK_GEOMETRIES}


@pytest.fixture(scope="module")
def probed(rank_dirs, tmp_path_factory) -> dict[str, dict[str, dict[str, list[int]]]]:
    """Per geometry: the slice at TP=1 and the full model's rank 0 at TP-N, from one probe."""
    full_dir = write_config_only_model(tmp_path_factory.mktemp("m3-full"), M3_TEXT_CONFIG)
    specs = {}
    for geometry, size in RANK_GEOMETRIES.items():
        specs[geometry] = (f"{rank_dirs[geometry]}:1", f"{full_dir}:{size}")
    shapes = run_json_probe(
        PROBE, *(spec for pair in specs.values() for spec in pair), timeout=1800
    )
    return {
        geometry: {"slice": shapes[sliced], "rank": shapes[rank]}
        for geometry, (sliced, rank) in specs.items()
    }


def test_full_config_is_transformers_minimax_m3_with_the_published_layer_pattern():
    from transformers import MiniMaxM3VLTextConfig

    defaults = MiniMaxM3VLTextConfig()
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rotary_dim",
        "intermediate_size",
        "shared_intermediate_size",
        "dense_intermediate_size",
        "num_local_experts",
        "num_experts_per_tok",
        "index_n_heads",
        "index_head_dim",
        "index_block_size",
        "index_topk_blocks",
        "index_local_blocks",
        "vocab_size",
    ):
        assert M3_TEXT_CONFIG[key] == getattr(defaults, key), key
    # Published: moe_layer_freq 0, 0, 0 then 1 for the other 57 layers; sparse attention on
    # exactly the MoE layers.
    mlp, attention = M3_TEXT_CONFIG["mlp_layer_types"], M3_TEXT_CONFIG["layer_types"]
    assert len(mlp) == len(attention) == 60
    assert mlp[:3] == ["dense"] * 3 and set(mlp[3:]) == {"sparse"}
    assert [kind == "minimax_m3_sparse" for kind in attention] == [kind == "sparse" for kind in mlp]


@pytest.mark.parametrize("geometry", sorted(RANK_GEOMETRIES))
def test_slice_holds_a_ranks_parameters(probed, geometry):
    sliced, rank = probed[geometry]["slice"], probed[geometry]["rank"]
    assert set(sliced) == set(rank)
    assert len(rank) > 800  # 60 layers, not a truncated build
    differing = {name for name in rank if sliced[name] != rank[name]}
    # The one difference: vLLM pads the vocab to a multiple of 64 again at TP=1.
    assert differing <= set(EMBEDDING_NAMES)
    size = RANK_GEOMETRIES[geometry]
    for name in EMBEDDING_NAMES:
        rows, hidden = rank[name]
        assert rows == M3_TEXT_CONFIG["vocab_size"] // size
        assert sliced[name] == [math.ceil(rows / 64) * 64, hidden]


@pytest.mark.parametrize("geometry", sorted(RANK_GEOMETRIES))
def test_rank_shards_heads_and_widths_as_issue_18_states(probed, geometry):
    """Read back from vLLM's rank-0 build: 64 / N heads, max(1, 4 // N) KV and index heads
    (plus the one shared index-k head), all 128 experts at 3072 / N wide."""
    size = RANK_GEOMETRIES[geometry]
    rank = probed[geometry]["rank"]
    heads, kv_heads = 64 // size, max(1, 4 // size)
    sparse = "model.layers.3."
    assert rank[sparse + "self_attn.qkv_proj.weight"] == [
        (heads + 2 * kv_heads + kv_heads + 1) * 128,
        6144,
    ]
    assert rank["model.layers.0.self_attn.qkv_proj.weight"] == [(heads + 2 * kv_heads) * 128, 6144]
    assert rank[sparse + "self_attn.o_proj.weight"] == [6144, heads * 128]
    experts = sparse + "block_sparse_moe.experts.routed_experts."
    assert rank[experts + "w13_weight"] == [128, 2 * 3072 // size, 6144]
    assert rank[experts + "w2_weight"] == [128, 6144, 3072 // size]
    assert rank["model.layers.0.mlp.down_proj.weight"] == [6144, 12288 // size]


@pytest.mark.parametrize("geometry", sorted(RANK_GEOMETRIES))
def test_parameter_counts_match_vllms_build(probed, rank_dirs, geometry):
    config = json.loads((rank_dirs[geometry] / "config.json").read_text())
    built = sum(math.prod(shape) for shape in probed[geometry]["slice"].values())
    assert sum(parameter_counts(config).values()) == built


def test_tp8_rank_is_the_issues_53b():
    """Issue 18's sizing: 128 x 3 x 6144 x 3072 per MoE layer (7.2B), ~53B on a TP-8 rank,
    ~106 GB in bf16 and ~53 GB in fp8."""
    from vllm_minimax.tiny_model import rank_text_config

    counts = parameter_counts(rank_text_config(8))
    experts_only = 57 * 128 * 3 * 6144 * 3072 // 8
    total = sum(counts.values())
    assert experts_only < total < 1.04 * experts_only
    assert 52e9 < total < 55e9
    size = weight_bytes(counts)
    assert 104e9 < size["bf16"] < 110e9 and 52e9 < size["fp8"] < 56e9


def test_weight_bytes_by_storage():
    counts = {"linear": 1000, "embedding": 100, "router": 10, "norm": 1}
    assert weight_bytes(counts) == {
        "bf16": 2 * 1000 + 2 * 101 + 4 * 10,
        "fp8": 1000 + 2 * 101 + 4 * 10,
    }


def test_written_checkpoint_is_config_and_tokenizer_only(rank_dirs, capsys):
    directory = rank_dirs["m3-tp8-rank"]
    names = {path.name for path in directory.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not [name for name in names if name.endswith((".safetensors", ".bin"))]
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "minimax_m3_vl_text"
    assert config["architectures"] == [ARCHITECTURE]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 1)
    assert config["index_n_heads"] == 1
    assert config["num_hidden_layers"] == 60


@pytest.mark.parametrize(
    "extra",
    [["--kind", "llama"], ["--initializer-range", "0.1"], ["--mtp-modules", "1"]],
    ids=["kind-llama", "initializer-range", "mtp-modules"],
)
def test_options_a_rank_geometry_would_ignore_are_refused(tmp_path, capsys, extra):
    target = tmp_path / "rank"
    assert cli.main(["make-tiny-model", str(target), "--geometry", "m3-tp8-rank", *extra]) == 2
    assert extra[0] in capsys.readouterr().err
    assert not target.exists()


def test_unknown_geometry_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["make-tiny-model", str(tmp_path / "x"), "--geometry", "m3-tp16-rank"])
    assert exited.value.code == 2
    assert "m3-tp8-rank" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
