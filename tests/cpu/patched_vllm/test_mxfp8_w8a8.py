"""Patch 0008 requantizes MXFP8 weights to per-channel FP8 with power-of-two scales.

The checkpoints are drawn here: bf16-like weights whose 32-wide groups spread over a planted
number of binades within a row, quantized to MXFP8 by this file's own quantizer (e8m0 scale =
the smallest power of two holding the group's largest value, e4m3 values). The reference is a
float64 decode of those bytes (each e4m3 value times 2 ** (its group's byte - 127), group =
input index // 32), written here, not vLLM's `dequant_mxfp8_to_bf16`. The code under test is
the patched vLLM's: `ModelOptMxFp8FusedMoE.dequantize_weight` (the MoE's source side), the
power-of-two quantizer of the per-channel online methods (`Fp8PtpcOnlineMoEMethod` and
`online/pow2_requant.py`), the error log and the refusals.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
from vllm.model_executor.layers.quantization.modelopt import (
    ModelOptLinearMethod,
    ModelOptMxFp8FusedMoE,
)
from vllm.model_executor.layers.quantization.online import pow2_requant
from vllm.model_executor.layers.quantization.online.fp8 import Fp8PtpcOnlineMoEMethod
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    kMxfp8Static,
    kNvfp4Static,
)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
GROUP = 32


def draw_mxfp8(shape: tuple[int, ...], spread: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP8 checkpoint tensor: e4m3 values ``shape`` and uint8 e8m0 scales
    ``shape[:-1] + (shape[-1] // 32,)``; each row's groups span ``spread`` binades."""
    g = torch.Generator().manual_seed(seed)
    *rows, k = shape
    groups = k // GROUP
    row_exp = torch.randint(-12, -4, (*rows, 1), generator=g)
    group_exp = row_exp - torch.randint(0, spread + 1, (*rows, groups), generator=g)
    weight = torch.randn((*rows, groups, GROUP), generator=g, dtype=torch.float64)
    weight = weight * torch.exp2(group_exp.double()).unsqueeze(-1)
    amax = weight.abs().amax(-1).clamp_min(1e-30)
    exponent = torch.ceil(torch.log2(amax / E4M3_MAX))
    exponent = torch.where(amax / torch.exp2(exponent) > E4M3_MAX, exponent + 1, exponent)
    values = (weight / torch.exp2(exponent).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    return values.to(E4M3).reshape(shape), (exponent + 127).to(torch.uint8)


def decode_mxfp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 value of every element: e4m3 times 2 ** (its group's byte - 127)."""
    group_of_k = torch.arange(values.shape[-1]) // GROUP
    exponent = scales.to(torch.float64)[..., group_of_k] - 127.0
    return values.to(torch.float64) * torch.exp2(exponent)


def source_moe(num_experts: int, hidden: int, inter: int, spread: int, seed: int):
    """A layer holding MXFP8 experts as ModelOpt's MXFP8 MoE method loads them."""
    w13, w13_s = draw_mxfp8((num_experts, 2 * inter, hidden), spread, seed)
    w2, w2_s = draw_mxfp8((num_experts, hidden, inter), spread, seed + 1)
    layer = torch.nn.Module()
    for name, tensor in (
        ("w13_weight", w13),
        ("w2_weight", w2),
        ("w13_weight_scale", w13_s),
        ("w2_weight_scale", w2_s),
    ):
        layer.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
    return layer


def dequantize_source(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the patched `ModelOptMxFp8FusedMoE.dequantize_weight` (chunks of 3 experts)
    and assemble its chunks by the expert slices it yields, into poisoned tensors."""
    method = SimpleNamespace(
        dequantize_experts_per_chunk=3,
        _check_weight_dtypes=ModelOptMxFp8FusedMoE._check_weight_dtypes,
    )
    w13 = torch.full(layer.w13_weight.shape, float("nan"), dtype=torch.bfloat16)
    w2 = torch.full(layer.w2_weight.shape, float("nan"), dtype=torch.bfloat16)
    for experts, w13_chunk, w2_chunk in ModelOptMxFp8FusedMoE.dequantize_weight(method, layer):
        w13[experts] = w13_chunk
        w2[experts] = w2_chunk
    return w13, w2


def requantize_moe(w13: torch.Tensor, w2: torch.Tensor):
    """The patched per-channel MoE requantization, on poisoned outputs."""
    method = SimpleNamespace(moe=SimpleNamespace(tp_size=1))
    q13 = torch.full(w13.shape, float("nan")).to(E4M3)
    q2 = torch.full(w2.shape, float("nan")).to(E4M3)
    s13, s2 = Fp8PtpcOnlineMoEMethod._quantize_power_of_two(method, w13, w2, q13, q2)
    return q13, s13, q2, s2


def relative_error(approx: torch.Tensor, reference: torch.Tensor) -> float:
    return float((approx - reference).norm() / reference.norm())


# Group exponents within a row spread over 0 to 6 binades in real MXFP8 checkpoints' range
# (FINDINGS 2026-12-06: 1e-7 to 4e-6 relative error); 10 is a harsh tail.
SPREADS = (0, 3, 6, 10)


@pytest.mark.parametrize("spread", SPREADS)
def test_power_of_two_channel_requant_keeps_the_mxfp8_values(spread: int) -> None:
    values, scales = draw_mxfp8((96, 512), spread, seed=spread)
    reference = decode_mxfp8(values, scales)
    weight = reference.to(torch.bfloat16)  # exact: e4m3 times a power of two
    assert torch.equal(weight.double(), reference)
    amax = weight.float().abs().amax(-1, keepdim=True)
    scale = pow2_requant.power_of_two_channel_scale(amax)
    quantized = pow2_requant.quantize_per_channel_power_of_two(weight, scale)
    assert quantized.dtype == E4M3 and scale.shape == (96, 1)

    # Each scale is a power of two, the smallest holding the row: amax / s in (224, 448].
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)
    ratio = amax.double() / scale.double()
    assert torch.all(ratio <= E4M3_MAX) and torch.all(ratio > E4M3_MAX / 2)
    # ... never larger than the row's largest e8m0 scale.
    largest_e8m0 = torch.exp2(scales.double().amax(-1, keepdim=True) - 127)
    assert torch.all(scale.double() <= largest_e8m0)

    result = quantized.double() * scale.double()
    normal = reference.abs() / scale.double() >= E4M3_MIN_NORMAL
    assert torch.equal(result[normal], reference[normal]), "a normal-range value moved"
    error = relative_error(result, reference)
    changed = float((result != reference).double().mean())
    bound = 1e-5 if spread <= 6 else 1e-4
    assert error <= bound, f"spread {spread}: relative error {error:.3g} > {bound}"
    if spread == 0:
        assert changed == 0.0 and error == 0.0


@pytest.mark.parametrize("spread", (3, 6))
def test_the_bound_rejects_amax_scales_and_rounded_exponents(spread: int) -> None:
    """The controls: the two wrong roundings the bounds above must tell apart."""
    values, scales = draw_mxfp8((96, 512), spread, seed=spread)
    reference = decode_mxfp8(values, scales)
    amax = reference.abs().amax(-1, keepdim=True)

    def requant(scale: torch.Tensor) -> torch.Tensor:
        scaled = (reference / scale).clamp(-E4M3_MAX, E4M3_MAX)
        return scaled.to(torch.float32).to(E4M3).double() * scale

    amax_scale = amax / E4M3_MAX
    nearest_exponent = torch.exp2(torch.round(torch.log2(amax / E4M3_MAX)))
    assert relative_error(requant(amax_scale), reference) > 1e-3
    assert relative_error(requant(nearest_exponent), reference) > 1e-3


def test_moe_experts_requantize_in_layout_and_order() -> None:
    # w13: 2 * 32 rows of 2048, its scales [E, 64, 64]: square, so transposed scales would
    # load without a shape error and only the values tell.
    layer = source_moe(num_experts=7, hidden=2048, inter=32, spread=4, seed=11)
    ref13 = decode_mxfp8(layer.w13_weight.data, layer.w13_weight_scale.data)
    ref2 = decode_mxfp8(layer.w2_weight.data, layer.w2_weight_scale.data)

    w13, w2 = dequantize_source(layer)
    for expert in range(7):
        assert torch.equal(w13[expert].double(), ref13[expert]), f"w13 of expert {expert}"
        assert torch.equal(w2[expert].double(), ref2[expert]), f"w2 of expert {expert}"

    q13, s13, q2, s2 = requantize_moe(w13, w2)
    assert s13.shape == (7, 64, 1) and s2.shape == (7, 2048, 1)
    for expert in range(7):
        for name, q, s, ref in (("w13", q13, s13, ref13), ("w2", q2, s2, ref2)):
            result = q[expert].double() * s[expert].double()
            error = relative_error(result, ref[expert])
            assert error <= 1e-5, f"{name} of expert {expert}: relative error {error:.3g}"


def test_requantization_is_logged_per_layer_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pow2_requant, "_errors", {})
    layer = source_moe(num_experts=4, hidden=256, inter=64, spread=8, seed=3)
    q13, s13, _, _ = requantize_moe(*dequantize_source(layer))
    lines = pow2_requant.requantization_error_summaries()
    assert [line.split(":")[0] for line in lines] == ["moe w13", "moe w2"]
    totals = pow2_requant._errors["moe w13"]
    assert totals.layers == 1 and totals.elements == 4 * 128 * 256
    ref13 = decode_mxfp8(layer.w13_weight.data, layer.w13_weight_scale.data)
    result = q13.double() * s13.double()
    assert totals.changed == int((result != ref13).sum())
    assert totals.relative_error == pytest.approx(relative_error(result, ref13), rel=1e-3)
    assert f"{totals.relative_error:.3g}" in lines[0]


def test_mxfp8_sources_declare_their_power_of_two_grid() -> None:
    def requantizer(source: object) -> SimpleNamespace:
        return SimpleNamespace(requantization_source=source)

    prop = Fp8PtpcOnlineMoEMethod.requantizes_power_of_two_grid.fget
    linear = ModelOptLinearMethod.power_of_two_grid_weights.fget
    assert linear(SimpleNamespace(wkey=SimpleNamespace(key=kMxfp8Static)))
    assert not linear(SimpleNamespace(wkey=SimpleNamespace(key=kNvfp4Static)))
    assert prop(requantizer(object.__new__(ModelOptMxFp8FusedMoE)))
    # Any other source (an NVFP4 MoE, a bf16 checkpoint) keeps vLLM's amax / 448 scales.
    assert not prop(requantizer(object()))
    assert not prop(requantizer(None))


def test_refuses_without_fp8_tensor_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    platform = SimpleNamespace(
        is_cuda=lambda: True,
        has_device_capability=lambda capability: capability <= 80,
        get_device_capability=lambda: (8, 0),
    )
    monkeypatch.setattr(pow2_requant, "current_platform", platform)
    with pytest.raises(ValueError, match=r"quantization_config\.moe=fp8_per_channel .*SM89"):
        pow2_requant.require_fp8_tensor_cores("quantization_config.moe")
    platform.has_device_capability = lambda capability: capability <= 90
    pow2_requant.require_fp8_tensor_cores("quantization_config.moe")


def test_refuses_a_w8a16_moe_backend() -> None:
    method = object.__new__(Fp8PtpcOnlineMoEMethod)
    method.fp8_backend = Fp8MoeBackend.HUMMING
    source = object.__new__(ModelOptMxFp8FusedMoE)
    with pytest.raises(ValueError, match=r"quantization_config\.moe=fp8_per_channel.*HUMMING"):
        method.set_requantization_source(source)
    method.fp8_backend = Fp8MoeBackend.TRITON
    method.set_requantization_source(source)
    assert method.requantization_source is source


def test_refuses_a_layer_whose_checkpoint_cannot_dequantize() -> None:
    from vllm.config.quantization import QuantizationConfigArgs
    from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
    from vllm.model_executor.layers.quantization.base_config import resolve_quant_method
    from vllm.model_executor.layers.quantization.online.base import (
        OnlineQuantizationConfig,
    )

    class OpaqueMethod(LinearMethodBase):
        def create_weights(self, *args, **kwargs) -> None: ...

        def apply(self, *args, **kwargs) -> torch.Tensor: ...

    class Layer(LinearBase):
        def __init__(self) -> None:
            torch.nn.Module.__init__(self)

    online = OnlineQuantizationConfig(QuantizationConfigArgs(linear="fp8_per_channel"))
    checkpoint = SimpleNamespace(
        online_quantization_config=online,
        packed_modules_mapping={},
        get_quant_method=lambda layer, prefix: OpaqueMethod(),
    )
    with pytest.raises(
        ValueError, match=r"quantization_config\.linear requantizes model\.layers\.0\.o_proj"
    ):
        resolve_quant_method(checkpoint, Layer(), "model.layers.0.o_proj")


def test_the_w8a8_arm_parses_as_vllms_quantization_override(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The arm's keys over the MXFP8 rank slice's serve config, as `vllm serve --config`
    reads them: vLLM's online override with per-channel FP8 for linear layers and MoE."""
    import yaml
    from vllm.config.quantization import QuantizationConfigArgs
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8StaticChannelSym,
    )
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_minimax import w8a8

    # The parser fills its defaults from a DeviceConfig, which needs a device type.
    monkeypatch.setattr(current_platform, "device_type", "cpu")
    repo = Path(__file__).resolve().parents[3]
    merged = {
        **yaml.safe_load((repo / "evals/m3-tp8-rank-checkpoint-serve.yaml").read_text()),
        **w8a8.arm_settings(repo / "evals" / w8a8.ARM_FILE),
    }
    path = tmp_path / "w8a8.yaml"
    path.write_text(yaml.safe_dump(merged))
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    args = parser.parse_args(["--model", "MiniMaxAI/MiniMax-M3-MXFP8", "--config", str(path)])
    validate_parsed_serve_args(args)
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.quantization_config
    assert isinstance(config, QuantizationConfigArgs)
    assert config.linear.weight == kFp8StaticChannelSym
    assert config.moe.weight == kFp8StaticChannelSym
    assert engine_args.quantization is None


def test_the_override_resolves_mxfp8_linears_to_power_of_two_requantization(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the MXFP8 rank slice's config.json, vLLM composes the checkpoint's ModelOpt MXFP8
    config with the override, and a quantized linear layer gets the per-channel online
    method with the MXFP8 method as its source, on power-of-two scales."""
    from vllm.config import LoadConfig, ModelConfig, set_current_vllm_config
    from vllm.config.quantization import resolve_quantization_config
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.quantization.base_config import resolve_quant_method
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMxFp8Config
    from vllm.model_executor.layers.quantization.online.fp8 import (
        Fp8PtpcOnlineLinearMethod,
    )
    from vllm.model_executor.model_loader.weight_utils import get_quant_config
    from vllm.platforms import current_platform

    from vllm_minimax import w8a8
    from vllm_minimax.tiny_model import make_rank_model

    monkeypatch.setattr(current_platform, "device_type", "cpu")
    made = make_rank_model(tmp_path / "slice", "m3-tp8-rank", weights="mxfp8", experts="ep")
    model_config = ModelConfig(
        model=str(made["directory"]),
        max_model_len=4096,
        quantization_config=resolve_quantization_config(None, dict(w8a8.W8A8_QUANTIZATION_CONFIG)),
    )
    quant_config = get_quant_config(model_config, LoadConfig())
    assert isinstance(quant_config, ModelOptMxFp8Config)
    prefix = "model.layers.0.self_attn.o_proj"

    class OProj(LinearBase):
        def __init__(self) -> None:
            torch.nn.Module.__init__(self)
            self.input_size = self.input_size_per_partition = 1024
            self.output_size = self.output_size_per_partition = 6144
            self.tp_size, self.prefix, self.params_dtype = 1, prefix, torch.bfloat16

    context = SimpleNamespace(model_config=model_config, quant_config=quant_config)
    with set_current_vllm_config(context):
        method = resolve_quant_method(quant_config, OProj(), prefix)
    assert isinstance(method, Fp8PtpcOnlineLinearMethod)
    assert isinstance(method.requantization_source, ModelOptLinearMethod)
    assert method.requantizes_power_of_two_grid
