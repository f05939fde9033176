"""A random-weight EAGLE3 draft for a tiny MiniMax M3 target, in the layout vLLM 0.34.0's
``LlamaForCausalLMEagle3`` loads (``vllm/model_executor/models/llama_eagle3.py``).

``python -m vllm_minimax.tiny_eagle3 TARGET_DIR DRAFT_DIR [--kv-heads N] [--seed S]`` writes:

- ``config.json``: ``architectures`` ``["LlamaForCausalLMEagle3"]`` (vLLM's registry maps it to
  ``Eagle3LlamaForCausalLM``), ``model_type`` ``llama``, one decoder layer
  (``num_hidden_layers`` 1) as wide as the target (``hidden_size``: the draft's first layer
  concatenates the target's token embedding with its hidden state, so both must be the target's
  width), ``target_hidden_size``, the target's ``vocab_size`` as ``draft_vocab_size`` (so vLLM
  builds no ``draft_id_to_target_id`` map and needs no ``d2t`` tensor), and
  ``eagle_aux_hidden_state_layer_ids`` (read off the draft's config by vLLM's
  ``get_eagle3_aux_layers_from_config``; the published M3 heads use vLLM's default there,
  ``(2, L // 2, L - 3)`` = (2, 30, 57), which a 4-layer target cannot take).
- ``model.safetensors``: the names EAGLE3 checkpoints carry and ``Eagle3LlamaForCausalLM``
  maps (``midlayer.`` becomes ``model.layers.0.``): ``midlayer.self_attn.{q,k,v,o}_proj``
  (q/k/v take ``2 * hidden`` inputs), ``midlayer.mlp.{gate,up,down}_proj``,
  ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}``, ``fc`` (``hidden`` x
  ``3 * target_hidden``: the three aux hidden states), ``norm`` and ``lm_head``. No
  ``embed_tokens``: vLLM then shares the target's embedding.

``--kv-heads`` below the query heads makes the GQA variant (``Inferact/MiniMax-M3-EAGLE3-GQA``'s
shape); the default, as many KV heads as query heads, is the MHA head
(``Inferact/MiniMax-M3-EAGLE3``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ARCHITECTURE = "LlamaForCausalLMEagle3"
DRAFT_HEADS = 4
DRAFT_HEAD_DIM = 128  # the target's, so the draft's KV pages match the target's per head
DRAFT_INTERMEDIATE = 512
AUX_LAYERS = 3
INITIALIZER_RANGE = 0.02


def target_text_config(target: Path) -> dict[str, Any]:
    """The target's text config (the ``minimax_m3_vl`` wrapper's ``text_config``, or the flat
    config itself)."""
    config = json.loads((Path(target) / "config.json").read_text())
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def aux_layer_ids(num_layers: int) -> list[int]:
    """Three distinct target layers whose hidden states feed the draft: vLLM's default for
    MiniMax M3 ``(2, L // 2, L - 3)`` where those are distinct and in range, else the last
    three layer boundaries."""
    default = [2, num_layers // 2, num_layers - 3]
    if len(set(default)) == AUX_LAYERS and all(0 <= i <= num_layers for i in default):
        return default
    return list(range(max(0, num_layers - AUX_LAYERS + 1), num_layers + 1))[-AUX_LAYERS:]


def draft_config(target: dict[str, Any], kv_heads: int = DRAFT_HEADS) -> dict[str, Any]:
    """The draft's ``config.json`` for a target text config."""
    if DRAFT_HEADS % kv_heads:
        raise ValueError(f"--kv-heads {kv_heads} does not divide {DRAFT_HEADS} query heads")
    hidden = target["hidden_size"]
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "intermediate_size": DRAFT_INTERMEDIATE,
        "num_hidden_layers": 1,
        "num_attention_heads": DRAFT_HEADS,
        "num_key_value_heads": kv_heads,
        "head_dim": DRAFT_HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": target.get("max_position_embeddings", 32768),
        "rope_theta": 10000.0,
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": target["vocab_size"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": INITIALIZER_RANGE,
        "torch_dtype": "bfloat16",
        "eagle_aux_hidden_state_layer_ids": aux_layer_ids(target["num_hidden_layers"]),
        "eagle_config": {"use_aux_hidden_state": True},
        "bos_token_id": target.get("bos_token_id"),
        "eos_token_id": target.get("eos_token_id"),
    }


def draft_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the draft checkpoint and its shape."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    inter = config["intermediate_size"]
    aux = len(config["eagle_aux_hidden_state_layer_ids"])
    layer = "midlayer."
    return {
        f"{layer}self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        f"{layer}self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        f"{layer}self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        f"{layer}self_attn.o_proj.weight": (hidden, heads * head_dim),
        f"{layer}mlp.gate_proj.weight": (inter, hidden),
        f"{layer}mlp.up_proj.weight": (inter, hidden),
        f"{layer}mlp.down_proj.weight": (hidden, inter),
        f"{layer}input_layernorm.weight": (hidden,),
        f"{layer}hidden_norm.weight": (hidden,),
        f"{layer}post_attention_layernorm.weight": (hidden,),
        "fc.weight": (hidden, aux * config["target_hidden_size"]),
        "norm.weight": (hidden,),
        "lm_head.weight": (config["draft_vocab_size"], hidden),
    }


def make_tiny_eagle3_draft(
    target: Path, directory: Path, kv_heads: int = DRAFT_HEADS, seed: int = 0
) -> dict[str, Any]:
    """Write the draft for the tiny model in ``target`` into ``directory``; a short summary."""
    import torch
    from safetensors.torch import save_file

    config = draft_config(target_text_config(target), kv_heads)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in draft_shapes(config).items():
        if len(shape) == 1:  # RMSNorm weights start at one
            tensor = torch.ones(shape)
        else:
            tensor = torch.randn(shape, generator=generator) * INITIALIZER_RANGE
        weights[name] = tensor.to(torch.bfloat16).contiguous()
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return {
        "directory": directory,
        "tensors": len(weights),
        "parameters": sum(t.numel() for t in weights.values()),
        "kv_heads": kv_heads,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_minimax.tiny_eagle3",
        description="Write a random-weight EAGLE3 draft for a tiny MiniMax M3 target.",
    )
    parser.add_argument("target", type=Path, help="the tiny target (make-tiny-model DIR)")
    parser.add_argument("directory", type=Path, help="where to write the draft")
    parser.add_argument(
        "--kv-heads",
        type=int,
        default=DRAFT_HEADS,
        help=f"KV heads of the draft (default {DRAFT_HEADS}: MHA; 1 or 2: GQA)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not (args.target / "config.json").is_file():
        print(f"error: {args.target} has no config.json (make-tiny-model DIR)", file=sys.stderr)
        return 2
    if args.directory.exists() and any(args.directory.iterdir()):
        print(f"error: {args.directory} is not empty", file=sys.stderr)
        return 2
    try:
        made = make_tiny_eagle3_draft(args.target, args.directory, args.kv_heads, args.seed)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"wrote an EAGLE3 draft ({ARCHITECTURE}, {made['parameters']:,} parameters in"
        f" {made['tensors']} tensors, {made['kv_heads']} KV heads) to {made['directory']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
