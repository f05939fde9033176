"""``vllm-minimax make-tiny-model DIR``: a random-weight MiniMax M3 for smoke tests.

The checkpoint is text-only MiniMax M3 in the layout vLLM 0.34.0 loads:

- ``config.json``: ``model_type`` ``minimax_m3_vl_text`` (transformers'
  ``MiniMaxM3VLTextConfig``, which vLLM's ``get_config`` reaches through
  ``AutoConfig``; vLLM uses it as the text config as is) and ``architectures``
  ``["MiniMaxM3SparseForCausalLM"]``, the registry entry whose
  ``MiniMaxM3SparseForCausalLM`` reads ``hf_text_config``. The published
  checkpoint is the vision-language ``minimax_m3_vl`` wrapper around the same
  text model; the wrapper would drag in a vision tower and an image processor
  that a smoke test of the indexer does not need.
- ``model.safetensors``: the weight names of the published checkpoint's language
  model (without its ``language_model.`` prefix), which is what vLLM's
  ``MiniMaxM3Model.load_weights`` maps: ``self_attn.{q,k,v,o}_proj``,
  ``self_attn.index_{q,k}_proj`` and ``index_{q,k}_norm`` (sparse layers only),
  ``block_sparse_moe.gate`` / ``.e_score_correction_bias`` /
  ``.experts.{E}.w1|w2|w3`` (gate, down, up) / ``.shared_experts.{gate,up,down}_proj``
  on MoE layers and ``mlp.{gate,up,down}_proj`` on dense ones.
- a byte-level BPE tokenizer trained here with ``tokenizers`` (no hub access, ``tiny_tokenizer``),
  saved as ``tokenizer.json`` + ``tokenizer_config.json``.

transformers names these weights differently inside (``mlp.experts.gate_up_proj``
fused over experts, ``self_attn.indexer.q_proj``, ...) and converts the published
names on load only for ``minimax_m3_vl``; :func:`register_transformers_conversion`
registers the same renames (without the VL prefixes) for the text model type.

``config_layout="0.33.0"`` (``--for-vllm 0.33.0``) writes the same checkpoint (the weights and
tokenizer are the same bytes) with the ``config.json`` files vLLM 0.33.0 parses: that release
reads MiniMax M3 only through its own ``MiniMaxM3TextConfig``, in the published checkpoint's
schema (``sparse_attention_config``, ``moe_layer_freq``, ``hidden_act`` ``swigluoai``,
``rope_theta`` / ``partial_rotary_factor``), and reaches that class only through the
``minimax_m3_vl`` wrapper (its config registry has no text model type; transformers'
``minimax_m3_vl_text`` class drops ``sparse_attention_config`` and reports ``hidden_act``
``silu``, which 0.33.0's MLP refuses). That wrapper also serves on vLLM 0.34.0 with the same
geometry (transformers 5.22 converts the published schema), but transformers'
``AutoModelForCausalLM`` does not load it, so the default stays the flat text config. Both
layouts come from the one flat config (:func:`published_text_config`).

``mtp_modules=N`` (``--mtp-modules N``) also writes an MTP draft for speculative decoding, as
the standalone checkpoint vLLM 0.34.0 loads with ``speculative_config={"method": "mtp",
"model": DIR/mtp}``: ``mtp/config.json`` with ``model_type`` ``minimax_m3_mtp`` (vLLM's
``MiniMaxM3MTPConfig``) and ``architectures`` ``["MiniMaxM3MTP"]``, and ``mtp/model.safetensors``
with the names ``MiniMaxM3MTP.load_weights`` maps: ``model.embed_tokens.weight`` and
``lm_head.weight`` (copies of the target's; vLLM's loader requires them, then the drafter uses
the target's own), and per module ``model.mtp.layers.{i}.`` + ``enorm`` / ``hnorm`` /
``eh_proj`` / ``final_layernorm`` and ``transformer_layer.*``: one sparse-attention MoE
decoder layer under the main model's checkpoint names. The MTP weights cannot ride in the
target's own directory: vLLM rewrites a bundled checkpoint into an MTP draft only for the
``minimax_m3_vl`` wrapper, not for ``minimax_m3_vl_text``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_minimax.m3_geometry import (
    DEFAULT_EXPERT_LAYOUT,
    M3_TEXT_CONFIG,
    parameter_counts,
    rank_text_config,
    weight_bytes,
)
from vllm_minimax.mxfp8_checkpoint import MXFP8_QUANTIZATION_CONFIG
from vllm_minimax.tiny_tokenizer import build_rank_tokenizer, build_tokenizer

# Small everywhere except the indexer, which keeps MiniMax M3's real geometry
# (what FlashInfer's MSA kernels require): head dim 128, 128-token blocks,
# top-16 blocks, one local block; head_dim 128 for the attention itself.
TINY_TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "layer_types": ["full_attention", "minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rotary_dim": 64,
    "intermediate_size": 256,
    "shared_intermediate_size": 256,
    "dense_intermediate_size": 512,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_block_size": 128,
    "index_topk_blocks": 16,
    "index_local_blocks": 1,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}
ARCHITECTURE = "MiniMaxM3SparseForCausalLM"
# The published checkpoints' architecture: the VL wrapper, the text model under `language_model.`.
VL_ARCHITECTURE = "MiniMaxM3SparseForConditionalGeneration"
MTP_ARCHITECTURE = "MiniMaxM3MTP"
MTP_MODEL_TYPE = "minimax_m3_mtp"
# The draft checkpoint's directory inside the tiny model's (vLLM loads only the
# target directory's top-level safetensors, so the two never mix).
MTP_SUBDIRECTORY = "mtp"
# The vLLM releases whose config parsing the config.json files can be written for (--for-vllm).
CONFIG_LAYOUTS = ("0.34.0", "0.33.0")
DEFAULT_CONFIG_LAYOUT = "0.34.0"
# The layout whose config.json is the published minimax_m3_vl wrapper.
PUBLISHED_MODEL_TYPE_LAYOUT = "0.33.0"
# The published checkpoint's model type: vLLM 0.33.0's MiniMaxM3Config, transformers'
# MiniMaxM3VLConfig.
PUBLISHED_MODEL_TYPE = "minimax_m3_vl"
# What transformers' and vLLM 0.34.0's MiniMax M3 hard-code and the published schema spells
# out (vLLM 0.33.0's MiniMaxM3TextConfig reads them; its MLP refuses any other activation).
PUBLISHED_FIXED_FIELDS: dict[str, Any] = {
    "hidden_act": "swigluoai",
    "swiglu_beta": 1.0,
    "use_gemma_norm": True,
    "use_qk_norm": True,
    "qk_norm_type": "per_head",
    "attention_output_gate": False,
    "n_shared_experts": 1,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
}
# Flat fields the published schema spells the same way.
PUBLISHED_SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "dense_intermediate_size",
    "shared_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rotary_dim",
    "swiglu_alpha",
    "swiglu_limit",
    "num_local_experts",
    "num_experts_per_tok",
    "routed_scaling_factor",
    "tie_word_embeddings",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "dtype",
)
# transformers' default weight init std. A larger one makes attention sharper, so
# a changed block selection moves the outputs more (the GPU end-to-end tests use 0.1).
DEFAULT_INITIALIZER_RANGE = 0.02


def tiny_config(
    tokenizer,
    initializer_range: float = DEFAULT_INITIALIZER_RANGE,
    text_config: dict[str, Any] | None = None,
):
    """The transformers config of a random-weight geometry (``text_config``, default
    :data:`TINY_TEXT_CONFIG`) with ``tokenizer``'s vocab and special tokens."""
    from transformers import MiniMaxM3VLTextConfig

    config = MiniMaxM3VLTextConfig(
        **(TINY_TEXT_CONFIG if text_config is None else text_config),
        initializer_range=initializer_range,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = [ARCHITECTURE]
    config.dtype = "bfloat16"
    return config


def to_checkpoint_names(state_dict: dict) -> dict:
    """transformers' MiniMax M3 parameter names -> the published checkpoint's (vLLM's).

    The inverse of the ``minimax_m3_vl`` conversion mapping in transformers, less
    its ``language_model.`` / vision prefixes."""
    out = {}
    for name, tensor in state_dict.items():
        tensor = tensor.contiguous()
        if ".mlp.experts.gate_up_proj" in name:  # [E, 2I, H] = cat(w1, w3) per expert
            prefix = name.replace(".mlp.experts.gate_up_proj", ".block_sparse_moe.experts")
            gate, up = tensor.chunk(2, dim=1)
            for expert in range(tensor.shape[0]):
                out[f"{prefix}.{expert}.w1.weight"] = gate[expert].contiguous()
                out[f"{prefix}.{expert}.w3.weight"] = up[expert].contiguous()
            continue
        if ".mlp.experts.down_proj" in name:  # [E, H, I]
            prefix = name.replace(".mlp.experts.down_proj", ".block_sparse_moe.experts")
            for expert in range(tensor.shape[0]):
                out[f"{prefix}.{expert}.w2.weight"] = tensor[expert].contiguous()
            continue
        name = name.replace(
            ".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias"
        )
        for part in ("gate", "shared_experts"):
            name = name.replace(f".mlp.{part}.", f".block_sparse_moe.{part}.")
        name = name.replace(".self_attn.indexer.", ".self_attn.index_")
        if name.endswith(".gate_up_proj.weight"):  # dense MLP and shared expert
            gate, up = tensor.chunk(2, dim=0)
            stem = name.removesuffix(".gate_up_proj.weight")
            out[f"{stem}.gate_proj.weight"] = gate.contiguous()
            out[f"{stem}.up_proj.weight"] = up.contiguous()
            continue
        out[name] = tensor
    return out


def register_transformers_conversion() -> None:
    """Let transformers load the published weight names for ``minimax_m3_vl_text``.

    transformers ships these renames only for the VL wrapper (``minimax_m3_vl``);
    this registers the same list without the rules anchored at the VL prefixes."""
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    rules = get_checkpoint_conversion_mapping("minimax_m3_vl")
    text_rules = [
        rule
        for rule in rules
        if not any(str(pattern).startswith("^") for pattern in _source_patterns(rule))
    ]
    register_checkpoint_conversion_mapping("minimax_m3_vl_text", text_rules, overwrite=True)


def _source_patterns(rule) -> list:
    patterns = rule.source_patterns
    return list(patterns) if isinstance(patterns, (list, tuple)) else [patterns]


def make_tiny_model(
    directory: Path,
    seed: int = 0,
    initializer_range: float = DEFAULT_INITIALIZER_RANGE,
    mtp_modules: int = 0,
    config_layout: str = DEFAULT_CONFIG_LAYOUT,
    text_config: dict[str, Any] | None = None,
    weights_layout: str = "bf16",
) -> dict[str, Any]:
    """Write the tiny checkpoint into ``directory`` (and, with ``mtp_modules`` > 0, its MTP
    draft into ``directory / MTP_SUBDIRECTORY``), its ``config.json`` files in the layout of
    vLLM ``config_layout`` (one of ``CONFIG_LAYOUTS``); return a short summary.
    ``text_config``: the geometry (default :data:`TINY_TEXT_CONFIG`; one of
    :data:`RANDOM_WEIGHT_GEOMETRIES`' values). ``weights_layout`` ``mxfp8``: the projections
    stored as MXFP8 (:mod:`vllm_minimax.mxfp8_checkpoint`) and config.json carrying
    :data:`MXFP8_QUANTIZATION_CONFIG`; ``bf16`` (default): as drawn."""
    if config_layout not in CONFIG_LAYOUTS:
        raise ValueError(f"config layout {config_layout!r}: one of {', '.join(CONFIG_LAYOUTS)}")
    if weights_layout not in RANDOM_WEIGHT_LAYOUTS:
        raise ValueError(f"weights {weights_layout!r}: one of {', '.join(RANDOM_WEIGHT_LAYOUTS)}")
    import torch
    from safetensors.torch import save_file
    from transformers import MiniMaxM3VLForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory, TINY_TEXT_CONFIG["max_position_embeddings"])
    config = tiny_config(tokenizer, initializer_range, text_config)
    torch.manual_seed(seed)
    model = MiniMaxM3VLForCausalLM(config).to(torch.bfloat16).eval()
    weights = to_checkpoint_names(model.state_dict())
    stored = weights
    if weights_layout == "mxfp8":
        from vllm_minimax.mxfp8_checkpoint import to_mxfp8_checkpoint

        stored = to_mxfp8_checkpoint(weights)
    save_file(stored, str(directory / "model.safetensors"), metadata={"format": "pt"})
    written = flat_config_json(config, directory, text_config)
    target = target_config_json(written, config_layout)
    if weights_layout == "mxfp8":
        target["quantization_config"] = dict(MXFP8_QUANTIZATION_CONFIG)
    _write_json(directory / "config.json", target)
    parameters = sum(t.numel() for t in weights.values())
    summary: dict[str, Any] = {
        "directory": directory,
        "tensors": len(stored),
        "parameters": parameters,
    }
    if mtp_modules > 0:
        summary["mtp"] = write_mtp_draft(
            directory / MTP_SUBDIRECTORY,
            written,
            weights,
            mtp_modules,
            seed=seed + 1,
            config_layout=config_layout,
        )
    return summary


def flat_config_json(
    config, directory: Path, text_config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``config`` as transformers saves it into ``directory``, with the whole geometry
    (``text_config``, default :data:`TINY_TEXT_CONFIG`) spelled out (save_pretrained may drop
    fields equal to the class defaults) and the architecture."""
    config.save_pretrained(directory)
    written = json.loads((Path(directory) / "config.json").read_text())
    written.update(TINY_TEXT_CONFIG if text_config is None else text_config)
    written["architectures"] = [ARCHITECTURE]
    return written


def write_tiny_config_files(
    directory: Path,
    mtp_modules: int = 0,
    config_layout: str = DEFAULT_CONFIG_LAYOUT,
    initializer_range: float = DEFAULT_INITIALIZER_RANGE,
    text_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The tiny checkpoint less its weights: the tokenizer and the ``config.json`` files
    (target and, with ``mtp_modules`` > 0, draft) that :func:`make_tiny_model` writes, which
    is all config parsing reads. Returns the flat config both layouts come from."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = flat_config_json(
        tiny_config(
            build_tokenizer(directory, TINY_TEXT_CONFIG["max_position_embeddings"]),
            initializer_range,
            text_config,
        ),
        directory,
        text_config,
    )
    _write_json(directory / "config.json", target_config_json(written, config_layout))
    if mtp_modules > 0:
        draft = directory / MTP_SUBDIRECTORY
        draft.mkdir(exist_ok=True)
        _write_json(draft / "config.json", mtp_draft_config(written, mtp_modules, config_layout))
    return written


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def published_text_config(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` (a text config as transformers writes it) in the published checkpoint's schema,
    the one vLLM 0.33.0's ``MiniMaxM3TextConfig`` reads: the index geometry in
    ``sparse_attention_config``, the layer kinds as ``sparse_attention_freq`` /
    ``moe_layer_freq``, RoPE as ``rope_theta`` and ``partial_rotary_factor`` (what
    ``rope_parameters`` gives transformers and vLLM 0.34.0: they rotate ``head_dim *
    partial_rotary_factor`` channels, whatever ``rotary_dim`` says).

    vLLM 0.33.0 and 0.34.0 both size the shared expert from ``intermediate_size``, so a
    ``shared_intermediate_size`` that differs would be read differently by transformers."""
    if flat["shared_intermediate_size"] != flat["intermediate_size"]:
        raise ValueError("vLLM sizes the shared expert from intermediate_size; keep both equal")
    sparse_layers = [int(kind == "minimax_m3_sparse") for kind in flat["layer_types"]]
    rope = flat["rope_parameters"]
    text = {key: flat[key] for key in PUBLISHED_SHARED_FIELDS if key in flat}
    text.update(PUBLISHED_FIXED_FIELDS)
    text.update(
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=rope.get("partial_rotary_factor", 1.0),
        moe_layer_freq=[int(kind == "sparse") for kind in flat["mlp_layer_types"]],
        sparse_attention_config={
            "use_sparse_attention": True,
            "sparse_attention_freq": sparse_layers,
            # M3 has no index value/output projections on any sparse layer.
            "sparse_disable_index_value": sparse_layers,
            "sparse_num_index_heads": flat["index_n_heads"],
            "sparse_index_dim": flat["index_head_dim"],
            "sparse_block_size": flat["index_block_size"],
            "sparse_topk_blocks": flat["index_topk_blocks"],
            "sparse_local_block": flat["index_local_blocks"],
            # transformers' and vLLM 0.34.0's indexers keep no leading blocks and score a
            # block by its maximum.
            "sparse_init_block": 0,
            "sparse_score_type": "max",
        },
    )
    return text


def target_config_json(flat: dict[str, Any], config_layout: str) -> dict[str, Any]:
    """The target's ``config.json`` for vLLM ``config_layout``: ``flat`` itself for 0.34.0,
    the published ``minimax_m3_vl`` wrapper around :func:`published_text_config` for 0.33.0."""
    if config_layout == DEFAULT_CONFIG_LAYOUT:
        return flat
    return {
        "model_type": PUBLISHED_MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "dtype": flat["dtype"],
        "tie_word_embeddings": flat["tie_word_embeddings"],
        "text_config": published_text_config(flat),
    }


def mtp_draft_config(
    target_config: dict[str, Any],
    mtp_modules: int,
    config_layout: str = DEFAULT_CONFIG_LAYOUT,
) -> dict[str, Any]:
    """The draft's ``config.json``: the target's flat text config as ``minimax_m3_mtp``, in
    the layout of vLLM ``config_layout`` (0.33.0: the published schema, which both releases'
    ``MiniMaxM3MTPConfig`` read).

    vLLM's ``MiniMaxM3MTPConfig`` keeps only the first ``num_hidden_layers`` layer types;
    the MTP layers are sparse-attention MoE layers whatever those say (vLLM builds them with
    ``force_sparse_attn`` and ``force_moe``), so they are spelled out as such."""
    config = dict(target_config)
    config.update(
        num_hidden_layers=1,
        layer_types=["minimax_m3_sparse"],
        mlp_layer_types=["sparse"],
    )
    config.pop("transformers_version", None)
    if config_layout != DEFAULT_CONFIG_LAYOUT:
        config = published_text_config(config)
    config.update(
        model_type=MTP_MODEL_TYPE,
        architectures=[MTP_ARCHITECTURE],
        num_mtp_modules=mtp_modules,
    )
    return config


def mtp_module_weights(
    target_config: dict[str, Any], mtp_modules: int, seed: int
) -> dict[str, Any]:
    """Random weights of ``mtp_modules`` MTP modules, under the checkpoint names.

    Each module's decoder layer comes from a transformers MiniMax M3 whose every layer is
    sparse attention + MoE, so it gets the main model's initialisation and checkpoint names
    (``model.layers.{i}.*`` -> ``model.mtp.layers.{i}.transformer_layer.*``); ``eh_proj``
    is drawn with the same std, the three norms get the main model's norm initialisation."""
    import torch
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    fields = {
        k: v
        for k, v in target_config.items()
        if k not in ("architectures", "model_type", "transformers_version")
    }
    fields.update(
        num_hidden_layers=mtp_modules,
        layer_types=["minimax_m3_sparse"] * mtp_modules,
        mlp_layer_types=["sparse"] * mtp_modules,
    )
    torch.manual_seed(seed)
    layers_model = MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**fields)).to(torch.bfloat16)
    layer_weights = to_checkpoint_names(layers_model.state_dict())
    norm = layers_model.model.norm.weight.detach()
    hidden = target_config["hidden_size"]
    std = target_config["initializer_range"]
    out: dict[str, Any] = {}
    for index in range(mtp_modules):
        module = f"model.mtp.layers.{index}"
        layer = f"model.layers.{index}."
        for name, tensor in layer_weights.items():
            if name.startswith(layer):
                out[f"{module}.transformer_layer.{name.removeprefix(layer)}"] = tensor
        for norm_name in ("enorm", "hnorm", "final_layernorm"):
            out[f"{module}.{norm_name}.weight"] = norm.clone().contiguous()
        eh_proj = torch.empty(hidden, 2 * hidden).normal_(mean=0.0, std=std)
        out[f"{module}.eh_proj.weight"] = eh_proj.to(torch.bfloat16).contiguous()
    return out


def write_mtp_draft(
    directory: Path,
    target_config: dict[str, Any],
    target_weights: dict[str, Any],
    mtp_modules: int,
    seed: int,
    config_layout: str = DEFAULT_CONFIG_LAYOUT,
) -> dict[str, Any]:
    """Write the standalone MTP draft checkpoint; return a short summary."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = mtp_module_weights(target_config, mtp_modules, seed)
    for shared in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[shared] = target_weights[shared].clone().contiguous()
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _write_json(
        directory / "config.json", mtp_draft_config(target_config, mtp_modules, config_layout)
    )
    parameters = sum(t.numel() for t in weights.values())
    return {"directory": directory, "tensors": len(weights), "parameters": parameters}


# --- The geometries beyond the tiny one, and the config-only models ---------------------
#
# MiniMax M3's own geometry and one rank's share of it: vllm_minimax/m3_geometry.py.
TINY_GEOMETRY = "tiny"
# MiniMax M3's attention and indexer head counts (64 query heads, 4 KV heads, 4 index-q heads,
# all of dim 128, and the index geometry) in four narrow layers with M3's layer pattern (a
# dense full-attention layer, then sparse-attention MoE layers) and 16 routed experts of
# which each token takes M3's 4: small enough to draw random weights for (29M parameters),
# served whole at TP 1 and split at TP 2, 4 and 8, where a rank gets what it gets from the
# real model: 64 / N query heads, max(1, 4 / N) KV and index heads, the 16 experts divisible
# by EP 2, 4 and 8. The vocab is the byte-level tokenizer's.
M3_HEADS_GEOMETRY = "m3-heads"
M3_HEADS_LAYERS = 4
M3_HEADS_TEXT_CONFIG: dict[str, Any] = {
    **{key: value for key, value in M3_TEXT_CONFIG.items() if key != "vocab_size"},
    "hidden_size": 256,
    "num_hidden_layers": M3_HEADS_LAYERS,
    "layer_types": ["full_attention"] + ["minimax_m3_sparse"] * (M3_HEADS_LAYERS - 1),
    "mlp_layer_types": ["dense"] + ["sparse"] * (M3_HEADS_LAYERS - 1),
    "intermediate_size": 256,
    "shared_intermediate_size": 256,
    "dense_intermediate_size": 512,
    "num_local_experts": 16,
    "max_position_embeddings": 32768,
}
# --geometry NAME -> the text config of a geometry make-tiny-model draws random weights for.
RANDOM_WEIGHT_GEOMETRIES: dict[str, dict[str, Any]] = {
    TINY_GEOMETRY: TINY_TEXT_CONFIG,
    M3_HEADS_GEOMETRY: M3_HEADS_TEXT_CONFIG,
}
# --geometry NAME -> the tensor-parallel size whose one rank it is.
RANK_GEOMETRIES: dict[str, int] = {"m3-tp8-rank": 8, "m3-tp4-rank": 4, "m3-tp2-rank": 2}
# --weights: how the slice's (dummy) weights are stored when served. ``fp8-online``: the
# config.json says nothing, the serve config sets ``quantization: fp8`` (vLLM quantizes the
# dummy bf16 weights per tensor at load); ``mxfp8``: config.json carries the quantization
# config of MiniMaxAI/MiniMax-M3-MXFP8 (:data:`MXFP8_QUANTIZATION_CONFIG`); ``bf16``: nothing,
# served as is (MiniMaxAI/MiniMax-M3).
WEIGHT_LAYOUTS = ("fp8-online", "mxfp8", "bf16")
# --weights of the random-weight geometries: ``bf16`` (default) as drawn; ``mxfp8`` the same
# draw with its projections stored as MXFP8 (vllm_minimax/mxfp8_checkpoint.py).
RANDOM_WEIGHT_LAYOUTS = ("bf16", "mxfp8")
DEFAULT_WEIGHT_LAYOUT = "fp8-online"
# The whole of MiniMax M3, config and tokenizer only, in the published checkpoint's
# ``minimax_m3_vl`` layout, for a multi-GPU `vllm serve` of the shipped configs with dummy
# weights: that layout is the one vLLM 0.34.0 turns into an MTP draft when the speculative
# config names no draft model.
M3_GEOMETRY = "m3"
# MTP modules the whole-model config declares: vLLM 0.34.0 runs every draft step on module 0,
# so the dummy loader need draw no others.
M3_MTP_MODULES = 1
GEOMETRIES = (TINY_GEOMETRY, M3_HEADS_GEOMETRY, *RANK_GEOMETRIES, M3_GEOMETRY)


def write_config_only_model(directory: Path, fields: dict[str, Any]) -> Path:
    """Write ``config.json`` (MiniMax M3 text with ``fields``) and a tokenizer of its
    ``vocab_size`` (:func:`build_rank_tokenizer`), no weights."""
    from transformers import MiniMaxM3VLTextConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_rank_tokenizer(
        directory, fields["vocab_size"], model_max_length=fields["max_position_embeddings"]
    )
    config = MiniMaxM3VLTextConfig(
        **fields,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = [ARCHITECTURE]
    config.dtype = "bfloat16"
    config.save_pretrained(directory)
    written = json.loads((directory / "config.json").read_text())
    written.update(fields)
    written["architectures"] = [ARCHITECTURE]
    (directory / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    return directory


def make_rank_model(
    directory: Path,
    geometry: str,
    weights: str = DEFAULT_WEIGHT_LAYOUT,
    experts: str = DEFAULT_EXPERT_LAYOUT,
) -> dict[str, Any]:
    """Write the config and tokenizer of one rank of MiniMax M3 served with TP-N (no
    weights: serve it with ``load_format: dummy``), its experts held as ``experts`` says and
    its weights stored as ``weights`` says (:data:`WEIGHT_LAYOUTS`); return a short
    summary."""
    if weights not in WEIGHT_LAYOUTS:
        raise ValueError(f"weights {weights!r}: one of {', '.join(WEIGHT_LAYOUTS)}")
    fields = rank_text_config(RANK_GEOMETRIES[geometry], experts=experts)
    if weights == "mxfp8":
        fields["quantization_config"] = dict(MXFP8_QUANTIZATION_CONFIG)
    counts = parameter_counts(fields)
    return {
        "directory": write_config_only_model(directory, fields),
        "tensor_parallel_size": RANK_GEOMETRIES[geometry],
        "weights": weights,
        "experts": experts,
        "parameters": sum(counts.values()),
        "bytes": weight_bytes(counts),
    }


def make_m3_model(directory: Path) -> dict[str, Any]:
    """Write the config and tokenizer of the whole of MiniMax M3 (no weights: serve it with
    ``load_format: dummy``) in the published ``minimax_m3_vl`` layout of the MXFP8 checkpoint,
    declaring :data:`M3_MTP_MODULES` MTP modules; return a short summary."""
    directory = Path(directory)
    write_config_only_model(directory, dict(M3_TEXT_CONFIG))
    flat = json.loads((directory / "config.json").read_text())
    wrapper = target_config_json(flat, PUBLISHED_MODEL_TYPE_LAYOUT)
    wrapper["text_config"]["num_mtp_modules"] = M3_MTP_MODULES
    # The checkpoint the shipped SM90 configs name (MiniMaxAI/MiniMax-M3-MXFP8): vLLM reads
    # its quantization from the wrapper, and the dummy loader draws weights in that layout.
    wrapper["quantization_config"] = dict(MXFP8_QUANTIZATION_CONFIG)
    _write_json(directory / "config.json", wrapper)
    counts = parameter_counts(M3_TEXT_CONFIG)
    return {
        "directory": directory,
        "parameters": sum(counts.values()),
        "bytes": weight_bytes(counts),
    }
