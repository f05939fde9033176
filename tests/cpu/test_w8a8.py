"""The tiny model's MXFP8 checkpoint (`make-tiny-model --weights mxfp8`), the W8A8 arm file and
the verdict of `scripts/gpu-e2e w8a8` (vllm_minimax/w8a8.py, vllm_minimax/mxfp8_checkpoint.py).

The MXFP8 reference is a float64 decode written here (e4m3 value times 2 ** (byte - 127) of
its group, group = input index // 32); the verdict is fed planted runs whose differences are
known.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from vllm_minimax import mxfp8_checkpoint as mx
from vllm_minimax import w8a8


def decode(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    group = torch.arange(values.shape[-1]) // 32
    return values.double() * torch.exp2(scales.double()[..., group] - 127)


@pytest.mark.parametrize("spread", [0, 4, 9])
def test_mxfp8_quantizer_groups_along_the_input_dim(spread: int) -> None:
    g = torch.Generator().manual_seed(spread)
    rows, k = 48, 256
    group_exp = -torch.randint(0, spread + 1, (rows, k // 32), generator=g).double() - 6
    weight = torch.randn(rows, k, generator=g, dtype=torch.float64)
    weight = weight * torch.exp2(group_exp.repeat_interleave(32, dim=1))
    values, scales = mx.quantize_mxfp8(weight.to(torch.bfloat16))
    assert values.dtype == torch.float8_e4m3fn and values.shape == (rows, k)
    assert scales.dtype == torch.uint8 and scales.shape == (rows, k // 32)
    decoded = decode(values, scales)
    assert torch.equal(mx.dequantize_mxfp8(values, scales).double(), decoded)
    # Each 32-wide group of a row uses its own scale fully: largest |value| in [224, 448]
    # (in (224, 448] before e4m3 rounds it).
    group_max = values.double().abs().reshape(rows, k // 32, 32).amax(-1)
    assert torch.all(group_max <= 448) and torch.all(group_max >= 224)
    # MXFP8's own error against the bf16 weight: e4m3's 3 mantissa bits.
    reference = weight.to(torch.bfloat16).double()
    error = float((decoded - reference).norm() / reference.norm())
    assert 1e-3 < error < 5e-2


def test_checkpoint_quantizes_the_projections_only() -> None:
    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape).to(torch.bfloat16)

    weights = {
        "model.embed_tokens.weight": w(64, 64),
        "lm_head.weight": w(64, 64),
        "model.norm.weight": w(64),
        "model.layers.0.mlp.gate_proj.weight": w(96, 64),
        "model.layers.0.self_attn.q_proj.weight": w(128, 64),
        "model.layers.0.self_attn.index_k_proj.weight": w(32, 64),
        "model.layers.0.self_attn.q_norm.weight": w(32),
        "model.layers.1.block_sparse_moe.gate.weight": w(4, 64),
        "model.layers.1.block_sparse_moe.e_score_correction_bias": w(4),
        "model.layers.1.block_sparse_moe.experts.3.w2.weight": w(64, 96),
        "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight": w(96, 64),
    }
    stored = mx.to_mxfp8_checkpoint(weights)
    quantized = {
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.index_k_proj.weight",
        "model.layers.1.block_sparse_moe.experts.3.w2.weight",
        "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight",
    }
    for name, tensor in weights.items():
        if name in quantized:
            scale = stored[name.removesuffix("weight") + "weight_scale_inv"]
            assert stored[name].dtype == torch.float8_e4m3fn
            assert scale.shape == (tensor.shape[0], tensor.shape[1] // 32)
            assert torch.equal(decode(stored[name], scale), decode(*mx.quantize_mxfp8(tensor)))
        else:
            assert stored[name] is tensor, name
    assert len(stored) == len(weights) + len(quantized)


def test_rotate_experts_moves_each_expert_by_one() -> None:
    weights = {
        f"model.layers.{layer}.block_sparse_moe.experts.{e}.w{i}.{part}": torch.full(
            (1,), 100 * layer + 10 * e + i
        )
        for layer in (1, 2)
        for e in range(4)
        for i in (1, 2, 3)
        for part in ("weight", "weight_scale_inv")
    }
    weights["model.layers.1.block_sparse_moe.gate.weight"] = torch.zeros(1)
    rotated = mx.rotate_experts(weights)
    assert rotated.keys() == weights.keys()
    for layer in (1, 2):
        for e in range(4):
            name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.w2.weight"
            assert int(rotated[name]) == 100 * layer + 10 * ((e + 1) % 4) + 2
    assert (
        rotated["model.layers.1.block_sparse_moe.gate.weight"]
        is weights["model.layers.1.block_sparse_moe.gate.weight"]
    )


def test_arm_file_is_the_python_override() -> None:
    settings = w8a8.arm_settings()
    assert settings == {"quantization-config": w8a8.W8A8_QUANTIZATION_CONFIG}
    name, _, value = w8a8.arm_argument().partition("=")
    assert name == "w8a8" and json.loads(value) == settings


def run(prompts: list[list[float | None]]) -> dict:
    return {"prompt_logprobs": prompts}


BASE = [[None, -1.0, -2.0, -3.0], [None, -0.5, -4.0]]


def shifted(by: float) -> dict:
    return run([[None if v is None else v + by for v in p] for p in BASE])


def test_verdict_passes_within_the_bound_and_fails_the_control() -> None:
    bound = w8a8.MEAN_ABS_BOUND
    runs = {"w8a16": run(BASE), "w8a8": shifted(bound / 2), "control": shifted(bound * 4)}
    result = w8a8.verdict(runs)
    assert result["passed"], result
    pair = result["pairs"]["w8a8_vs_w8a16"]
    assert pair["tokens"] == 5 and pair["mean_abs"] == pytest.approx(bound / 2)
    assert result["pairs"]["control_vs_w8a16"]["max_abs"] == pytest.approx(bound * 4)


def test_verdict_fails_a_w8a8_beyond_the_bound() -> None:
    bound = w8a8.MEAN_ABS_BOUND
    runs = {"w8a16": run(BASE), "w8a8": shifted(bound * 1.5), "control": shifted(bound * 4)}
    result = w8a8.verdict(runs)
    assert not result["passed"] and "W8A8 differs" in result["reason"]


def test_verdict_fails_when_the_control_passes_too() -> None:
    bound = w8a8.MEAN_ABS_BOUND
    runs = {"w8a16": run(BASE), "w8a8": shifted(0.0), "control": shifted(bound / 2)}
    result = w8a8.verdict(runs)
    assert not result["passed"] and "control stays within" in result["reason"]


def test_verdict_fails_a_refused_run_and_non_finite_logprobs() -> None:
    runs = {"w8a16": run(BASE), "w8a8": {"error": "ValueError: x"}, "control": shifted(1.0)}
    result = w8a8.verdict(runs)
    assert not result["passed"] and "w8a8 run failed" in result["reason"]
    nan = run([[None, math.nan, -2.0, -3.0], [None, -0.5, -4.0]])
    runs = {"w8a16": run(BASE), "w8a8": nan, "control": shifted(1.0)}
    assert not w8a8.verdict(runs)["passed"]


def test_verdict_refuses_runs_of_other_prompts() -> None:
    with pytest.raises(ValueError, match="prompt 1"):
        w8a8.logprob_differences(run(BASE), run([BASE[0], BASE[1][:2]]))
    with pytest.raises(ValueError, match="prompts against"):
        w8a8.logprob_differences(run(BASE), run(BASE[:1]))
