"""`vllm-minimax make-tiny-model`: transformers loads and runs the checkpoint, and
stock vLLM 0.34.0's config code and model registry accept it as MiniMax M3; with
`--mtp-modules N`, vLLM's own MiniMaxM3MTP loads the draft strictly; `--for-vllm 0.33.0`
changes only the config files, which vLLM 0.34.0 reads as the same geometry (0.33.0's own
parsing: tests/cpu/patched_vllm/test_tiny_model_config.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from patchset_helpers import run_json_probe
from probe_host import ProbeHost
from safetensors import safe_open

from vllm_minimax import cli
from vllm_minimax.tiny_model import (
    ARCHITECTURE,
    MTP_ARCHITECTURE,
    MTP_MODEL_TYPE,
    MTP_SUBDIRECTORY,
    TINY_TEXT_CONFIG,
)

MTP_MODULES = 2
PROBE = Path(__file__).parent / "mtp_draft_probe.py"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-minimax-m3")
    assert cli.main(["make-tiny-model", str(directory)]) == 0
    return directory


@pytest.fixture(scope="module")
def tiny_mtp_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-minimax-m3-mtp")
    assert cli.main(["make-tiny-model", str(directory), f"--mtp-modules={MTP_MODULES}"]) == 0
    return directory


@pytest.fixture(scope="module")
def tiny_mtp_033_dir(tmp_path_factory) -> Path:
    """The same checkpoint with the config.json files vLLM 0.33.0 parses."""
    directory = tmp_path_factory.mktemp("tiny-minimax-m3-mtp-033")
    argv = ["make-tiny-model", str(directory), f"--mtp-modules={MTP_MODULES}", "--for-vllm=0.33.0"]
    assert cli.main(argv) == 0
    return directory


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(path, "pt") as weights:
        names = list(weights.keys())
        return {name: tuple(weights.get_slice(name).get_shape()) for name in names}


def _run_probe(host: ProbeHost, tiny_mtp_dir: Path, *extra: str) -> dict:
    return run_json_probe(PROBE, str(tiny_mtp_dir), *extra, timeout=600, host=host)


@pytest.fixture(scope="module")
def draft_probe(tiny_mtp_dir, vllm_probe_host) -> dict:
    return _run_probe(vllm_probe_host, tiny_mtp_dir)


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


def test_mtp_option_leaves_the_target_checkpoint_byte_identical(tiny_dir, tiny_mtp_dir):
    assert not (tiny_dir / MTP_SUBDIRECTORY).exists()
    target_files = sorted(path.name for path in tiny_dir.iterdir())
    assert sorted(p.name for p in tiny_mtp_dir.iterdir() if p.is_file()) == target_files
    for name in target_files:
        assert (tiny_mtp_dir / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_mtp_draft_config_is_what_vllm_reads_as_a_minimax_m3_mtp_checkpoint(tiny_mtp_dir):
    from vllm.transformers_utils.config import get_config

    draft_dir = tiny_mtp_dir / MTP_SUBDIRECTORY
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["model_type"] == MTP_MODEL_TYPE
    assert config["architectures"] == [MTP_ARCHITECTURE]
    assert config["num_mtp_modules"] == MTP_MODULES
    target = json.loads((tiny_mtp_dir / "config.json").read_text())
    for key in ("hidden_size", "vocab_size", "index_topk_blocks", "num_local_experts"):
        assert config[key] == target[key], key
    hf_config = get_config(str(draft_dir), trust_remote_code=False)
    assert type(hf_config).__name__ == "MiniMaxM3MTPConfig"
    assert hf_config.num_mtp_modules == MTP_MODULES


def test_mtp_weight_names_are_the_main_sparse_moe_layer_names_plus_the_mtp_modules(tiny_mtp_dir):
    """Derived from the target checkpoint: each MTP module's transformer layer carries
    exactly the tensors (names and shapes) of a main sparse-attention MoE layer."""
    target = _tensor_shapes(tiny_mtp_dir / "model.safetensors")
    draft = _tensor_shapes(tiny_mtp_dir / MTP_SUBDIRECTORY / "model.safetensors")
    sparse_moe_layer = next(
        layer
        for layer, (attention, mlp) in enumerate(
            zip(TINY_TEXT_CONFIG["layer_types"], TINY_TEXT_CONFIG["mlp_layer_types"], strict=True)
        )
        if attention == "minimax_m3_sparse" and mlp == "sparse"
    )
    stem = f"model.layers.{sparse_moe_layer}."
    layer_tensors = {n.removeprefix(stem): s for n, s in target.items() if n.startswith(stem)}
    hidden = TINY_TEXT_CONFIG["hidden_size"]
    expected = {name: target[name] for name in ("model.embed_tokens.weight", "lm_head.weight")}
    for module in range(MTP_MODULES):
        prefix = f"model.mtp.layers.{module}."
        expected |= {f"{prefix}transformer_layer.{n}": s for n, s in layer_tensors.items()}
        expected |= {f"{prefix}{norm}.weight": (hidden,) for norm in ("enorm", "hnorm")}
        expected[f"{prefix}final_layernorm.weight"] = (hidden,)
        expected[f"{prefix}eh_proj.weight"] = (hidden, 2 * hidden)
    assert draft == expected


def test_vllm_mtp_draft_loads_every_parameter_from_the_checkpoint(draft_probe):
    """vLLM's own SpeculativeConfig and MiniMaxM3MTP (built on the CPU): the checkpoint is
    read as a minimax_m3_mtp draft, every tensor maps, and the default loader's strict check
    (every parameter and fused-projection shard initialised) passes."""
    assert draft_probe["draft_model_type"] == MTP_MODEL_TYPE
    assert draft_probe["draft_architectures"] == [MTP_ARCHITECTURE]
    assert draft_probe["num_mtp_modules"] == MTP_MODULES
    # vLLM 0.34.0 keeps MiniMax M3 off the multi-module speculator (speculative.py:1827).
    assert draft_probe["multi_module_speculator"] is False
    assert draft_probe["unmapped_checkpoint_names"] == []
    assert draft_probe["loaded"] == draft_probe["parameters"]
    assert draft_probe["strict_check_error"] is None
    assert all(draft_probe["loaded_values_equal"].values()), draft_probe["loaded_values_equal"]
    modules = {name.split(".")[2] for name in draft_probe["parameters"] if ".layers." in name}
    assert modules == {str(m) for m in range(MTP_MODULES)}


def test_strict_check_catches_a_missing_draft_weight(tiny_mtp_dir, vllm_probe_host):
    missing = "model.mtp.layers.1.transformer_layer.self_attn.index_k_proj.weight"
    probe = _run_probe(vllm_probe_host, tiny_mtp_dir, f"--drop={missing}")
    assert probe["strict_check_error"] is not None
    assert (
        "model.layers.1.transformer_layer.self_attn.qkv_proj.weight.index_k"
        in probe["strict_check_error"]
    )


def test_draft_layer_names_collide_with_the_text_target_unless_prefixed(draft_probe):
    """Why the GPU e2e harness installs `vllm_minimax/testing/mtp_draft.py`: with vLLM's
    empty draft prefix, MTP module 0's attention is named like the target's layer 0; after
    `install()`, vLLM's registry builds the prefixed class for the draft's architecture."""
    assert "model.layers.0.self_attn.attn" in draft_probe["target_layers"]
    assert draft_probe["collision_error"] == "Duplicate layer name: model.layers.0.self_attn.attn"
    assert draft_probe["draft_class_after_install"] == "PrefixedMiniMaxM3MTP"
    prefixed = draft_probe["draft_layers_with_harness_prefix"]
    expected = {
        f"mtp.model.layers.{m}.{layer}"
        for m in range(MTP_MODULES)
        for layer in ("self_attn.attn", "self_attn.attn.index_cache", "block_sparse_moe.experts")
    }
    assert set(prefixed) == expected


def _files(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def test_033_layout_changes_only_the_config_files(tiny_mtp_dir, tiny_mtp_033_dir):
    default, layout_033 = _files(tiny_mtp_dir), _files(tiny_mtp_033_dir)
    assert sorted(default) == sorted(layout_033)
    differing = {name for name in default if default[name] != layout_033[name]}
    assert differing == {"config.json", f"{MTP_SUBDIRECTORY}/config.json"}
    target = json.loads(layout_033["config.json"])
    assert (target["model_type"], target["architectures"]) == ("minimax_m3_vl", [ARCHITECTURE])
    sparse = target["text_config"]["sparse_attention_config"]
    assert sparse["sparse_attention_freq"] == [
        int(kind == "minimax_m3_sparse") for kind in TINY_TEXT_CONFIG["layer_types"]
    ]


# What vLLM 0.34.0's MiniMax M3 and its config parsing read off the text config.
GEOMETRY_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "dense_intermediate_size",
    "num_local_experts",
    "num_experts_per_tok",
    "routed_scaling_factor",
    "rms_norm_eps",
    "swiglu_alpha",
    "swiglu_limit",
    "vocab_size",
    "index_n_heads",
    "index_head_dim",
    "index_block_size",
    "index_topk_blocks",
    "index_local_blocks",
    "layer_types",
    "mlp_layer_types",
    "rope_parameters",
)


def _rotary_channels(text_config) -> int:
    """What vLLM's get_rope rotates for MiniMax M3's rope_parameters."""
    factor = text_config.rope_parameters.get("partial_rotary_factor", 1.0)
    return int(text_config.head_dim * factor)


def test_033_layout_serves_on_vllm_0340_with_the_same_geometry(tiny_mtp_dir, tiny_mtp_033_dir):
    """Both layouts, through vLLM 0.34.0's own config parsing: the same architecture, context
    and geometry (rope_parameters may spell the default factor out)."""
    from vllm.config import ModelConfig
    from vllm.transformers_utils.config import get_config

    configs = [
        ModelConfig(model=str(d), tokenizer=str(d)) for d in (tiny_mtp_dir, tiny_mtp_033_dir)
    ]
    assert [c.architecture for c in configs] == [ARCHITECTURE, ARCHITECTURE]
    assert configs[0].max_model_len == configs[1].max_model_len
    drafts = [
        get_config(str(d / MTP_SUBDIRECTORY), trust_remote_code=False)
        for d in (tiny_mtp_dir, tiny_mtp_033_dir)
    ]
    for default, layout_033 in ([c.hf_text_config for c in configs], drafts):
        fields = [key for key in GEOMETRY_FIELDS if key != "rope_parameters"]
        assert {k: getattr(layout_033, k) for k in fields} == {
            k: getattr(default, k) for k in fields
        }
        assert _rotary_channels(layout_033) == _rotary_channels(default)
        assert layout_033.rope_parameters["rope_theta"] == default.rope_parameters["rope_theta"]
    assert drafts[1].num_mtp_modules == drafts[0].num_mtp_modules == MTP_MODULES


def test_every_file_has_the_mode_open_gives(tiny_mtp_dir: Path) -> None:
    """safetensors writes its files 0600; the model's files are all readable alike (a server in
    a container may run as another user than the one who made the model)."""
    umask = os.umask(0)
    os.umask(umask)
    modes = {
        path.relative_to(tiny_mtp_dir).as_posix(): path.stat().st_mode & 0o777
        for path in tiny_mtp_dir.rglob("*")
        if path.is_file()
    }
    assert {"model.safetensors", "mtp/model.safetensors", "config.json"} <= set(modes), modes
    assert set(modes.values()) == {0o666 & ~umask}, modes
