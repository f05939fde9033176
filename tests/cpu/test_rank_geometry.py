"""`vllm-minimax make-tiny-model --geometry m3-tpN-rank`: the config vLLM 0.34.0 builds at
TP=1 holds exactly the parameters rank 0 of MiniMax M3 at TP-N holds, as vLLM itself shards
the full config (the probe builds both on the meta device); its tokenizer covers the config's
vocab and costs vLLM's detokenizer next to nothing per token."""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from pathlib import Path

import pytest
from patchset_helpers import run_json_probe

from vllm_minimax import cli
from vllm_minimax.m3_geometry import M3_TEXT_CONFIG, parameter_counts, weight_bytes
from vllm_minimax.tiny_model import ARCHITECTURE, RANK_GEOMETRIES, write_config_only_model

PROBE = Path(__file__).parent / "rank_geometry_probe.py"
EMBEDDING_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def rank_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("m3-ranks")
    for geometry in RANK_GEOMETRIES:
        assert cli.main(["make-tiny-model", str(root / geometry), "--geometry", geometry]) == 0
    return {geometry: root / geometry for geometry in RANK_GEOMETRIES}


@pytest.fixture(scope="module")
def probed(
    rank_dirs, tmp_path_factory, vllm_probe_host
) -> dict[str, dict[str, dict[str, list[int]]]]:
    """Per geometry: the slice at TP=1 and the full model's rank 0 at TP-N, from one probe."""
    full_dir = write_config_only_model(tmp_path_factory.mktemp("m3-full"), M3_TEXT_CONFIG)
    specs = {}
    for geometry, size in RANK_GEOMETRIES.items():
        specs[geometry] = (f"{rank_dirs[geometry]}:1", f"{full_dir}:{size}")
    shapes = run_json_probe(
        PROBE,
        *(spec for pair in specs.values() for spec in pair),
        timeout=1800,
        host=vllm_probe_host,
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
    from vllm_minimax.m3_geometry import rank_text_config

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
        "mxfp8": 1000 + 1000 // 32 + 2 * 101 + 4 * 10,
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
    [line] = capsys.readouterr().err.strip().splitlines()
    assert (
        line.startswith("vllm-minimax: error: --geometry m3-tp8-rank writes") and extra[0] in line
    )
    assert not target.exists()


def test_unknown_geometry_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["make-tiny-model", str(tmp_path / "x"), "--geometry", "m3-tp16-rank"])
    assert exited.value.code == 2
    assert "m3-tp8-rank" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def _tokenizer(directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("geometry", sorted(RANK_GEOMETRIES))
def test_tokenizer_is_the_configs_vocab(rank_dirs, geometry):
    """Every id the slice can sample (vLLM keeps the config's vocab_size of its padded
    logits) is a token, and the special tokens are the tiny tokenizer's."""
    config = json.loads((rank_dirs[geometry] / "config.json").read_text())
    tokenizer = _tokenizer(rank_dirs[geometry])
    assert len(tokenizer) == tokenizer.vocab_size == config["vocab_size"]
    assert config["vocab_size"] == M3_TEXT_CONFIG["vocab_size"] // RANK_GEOMETRIES[geometry]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (0, 1, 2)
    assert tokenizer.model_max_length == config["max_position_embeddings"]
    assert tokenizer.chat_template.startswith("{% for message in messages %}")
    saved = json.loads((rank_dirs[geometry] / "tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] == "PreTrainedTokenizerFast"
    model = json.loads((rank_dirs[geometry] / "tokenizer.json").read_text())["model"]
    assert "merges" not in model and len(model["vocab"]) == config["vocab_size"]


@pytest.mark.parametrize("geometry", sorted(RANK_GEOMETRIES))
def test_random_ids_round_trip(rank_dirs, geometry):
    """Decoded, then encoded without added special tokens, random ids over the whole vocab
    (specials included) come back unchanged: ``vllm bench serve``'s random prompts hit their
    input length exactly."""
    tokenizer = _tokenizer(rank_dirs[geometry])
    size = len(tokenizer)
    rng = random.Random(geometry)
    ids = [0, size - 1, *(rng.randrange(size) for _ in range(4096)), size - 1, 3, 2, 1]
    assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids
    plain = [token for token in ids if token not in tokenizer.all_special_ids]
    text = tokenizer.decode(plain, skip_special_tokens=True)
    assert tokenizer.encode(text, add_special_tokens=False) == plain
    assert tokenizer.encode(text)[0] == tokenizer.bos_token_id
    # Text that is not made of the tokenizer's pieces still encodes (to its unknown token).
    assert len(tokenizer.encode("The capital of France is", add_special_tokens=False)) == 1


@pytest.mark.parametrize("geometry", sorted(RANK_GEOMETRIES))
def test_detokenizer_step_does_not_grow_with_the_context(rank_dirs, geometry):
    """vLLM's FastIncrementalDetokenizer: a DecodeStream primed with the whole prompt, one
    step per sampled token. With a 32k-token random prompt (the eval's: the tokenizer's
    non-special ids) and ids sampled over the config's vocab (the dummy-weight slice's), a
    step must not re-decode the context: about 1 us here, against 3.5 ms per step with the
    544-token byte-level tokenizer the rank checkpoints had."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    directory = rank_dirs[geometry]
    vocab_size = json.loads((directory / "config.json").read_text())["vocab_size"]
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    special = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    special_ids = {tokenizer.token_to_id(content) for content in special}
    known = [i for i in range(tokenizer.get_vocab_size()) if i not in special_ids]
    rng = random.Random(0)
    stream = DecodeStream(ids=rng.choices(known, k=32768), skip_special_tokens=True)
    seconds = []
    for _ in range(200):
        token = rng.randrange(vocab_size)
        began = time.perf_counter()
        stream.step(tokenizer, token)
        seconds.append(time.perf_counter() - began)
    assert statistics.median(seconds) < 0.5e-3, f"{statistics.median(seconds) * 1e3:.2f} ms"
