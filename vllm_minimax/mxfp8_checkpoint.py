"""MXFP8 copies of the tiny MiniMax M3's random bf16 weights (``make-tiny-model --weights mxfp8``).

MiniMaxAI/MiniMax-M3-MXFP8 stores each quantized projection as e4m3 values (``weight``,
``float8_e4m3fn``, the bf16 weight's ``[N, K]``) and one e8m0 scale byte per 32 consecutive
input elements (``weight_scale_inv``, ``uint8`` ``[N, K / 32]``, value ``2 ** (byte - 127)``),
which vLLM 0.34.0's MiniMax M3 loader renames to ``weight_scale`` for ModelOpt's MXFP8 layers.
Each group's scale is the smallest power of two that holds the group's largest magnitude
within e4m3's 448 (OCP MX's rule up to its rounding of the exponent), so the groups of a row
spread over as many binades as the weights do.

Quantized: every projection vLLM builds with the quantization config, that is attention's
q/k/v/o and index q/k projections, the dense MLP, the shared expert and the routed experts'
w1/w2/w3. Kept bf16: embeddings, the LM head (``ignored_layers``), norms, the router (vLLM
builds it without the quantization config) and its score bias.
"""

from __future__ import annotations

import re
from typing import Any

MXFP8_GROUP = 32
E4M3_MAX = 448.0
E8M0_BIAS = 127
SCALE_SUFFIX = "weight_scale_inv"
# What vLLM 0.34.0 reads from a MiniMax checkpoint tagged ``quant_method: mxfp8``
# (``ModelOptMxFp8Config.from_config``): the tag, which it maps to ``modelopt_mxfp8``, and
# ``ignored_layers`` (its exclude list). MiniMaxAI/MiniMax-M3-MXFP8's own list is not known
# here; ``lm_head`` is assumed on it (vllm_minimax/memory_budget.py states the same
# assumption), the router is never quantized (vLLM builds it without the quantization config).
MXFP8_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "mxfp8",
    "ignored_layers": ["lm_head"],
}

# Checkpoint names of the projections the MXFP8 checkpoint quantizes.
QUANTIZED = re.compile(
    r"\.(?:self_attn\.(?:q|k|v|o|index_q|index_k)_proj"
    r"|mlp\.(?:gate|up|down)_proj"
    r"|block_sparse_moe\.shared_experts\.(?:gate|up|down)_proj"
    r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight$"
)


def quantize_mxfp8(weight: Any) -> tuple[Any, Any]:
    """``[N, K]`` float weight -> (``[N, K]`` e4m3 values, ``[N, K / 32]`` uint8 e8m0 scales)."""
    import torch

    rows, k = weight.shape
    if k % MXFP8_GROUP:
        raise ValueError(f"input width {k} is not a multiple of {MXFP8_GROUP}")
    groups = weight.to(torch.float32).reshape(rows, k // MXFP8_GROUP, MXFP8_GROUP)
    amax = groups.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny)
    exponent = torch.ceil(torch.log2(amax / E4M3_MAX))
    exponent = torch.where(amax / torch.exp2(exponent) > E4M3_MAX, exponent + 1, exponent)
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    values = (groups / torch.exp2(exponent).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    scales = (exponent + E8M0_BIAS).to(torch.uint8)
    return values.to(torch.float8_e4m3fn).reshape(rows, k), scales


def dequantize_mxfp8(values: Any, scales: Any) -> Any:
    """The float32 weight an MXFP8 pair stands for."""
    import torch

    rows, k = values.shape
    grouped = values.to(torch.float32).reshape(rows, k // MXFP8_GROUP, MXFP8_GROUP)
    factor = torch.exp2(scales.to(torch.float32) - E8M0_BIAS).unsqueeze(-1)
    return (grouped * factor).reshape(rows, k)


def to_mxfp8_checkpoint(weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` (checkpoint names) with every projection of :data:`QUANTIZED` replaced by
    its MXFP8 values and a ``weight_scale_inv`` beside it; the rest unchanged."""
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        if QUANTIZED.search(name) is None:
            out[name] = tensor
            continue
        values, scales = quantize_mxfp8(tensor)
        out[name] = values
        out[name.removesuffix("weight") + SCALE_SUFFIX] = scales
    return out


def rotate_experts(weights: dict[str, Any]) -> dict[str, Any]:
    """A layout fault for controls: each MoE layer's routed expert ``e`` gets expert
    ``(e + 1) % E``'s tensors (the router still scores them as before)."""
    pattern = re.compile(r"^(.*\.block_sparse_moe\.experts\.)(\d+)(\..*)$")
    counts: dict[str, int] = {}
    for name in weights:
        match = pattern.match(name)
        if match:
            prefix = match.group(1)
            counts[prefix] = max(counts.get(prefix, 0), int(match.group(2)) + 1)
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        match = pattern.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, expert, rest = match.group(1), int(match.group(2)), match.group(3)
        source = f"{prefix}{(expert + 1) % counts[prefix]}{rest}"
        out[name] = weights[source]
    return out
