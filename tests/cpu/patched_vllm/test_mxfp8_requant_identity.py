"""Patch 0008's chunked requantization gives its first version's results, bit for bit.

The first version (`vllm_minimax.testing.pow2_requant_v1`: whole-layer bf16 copies, fp32
temporaries, a clamp, three host reads per expert) is the oracle; the code under test is the
patched vLLM's: `ModelOptMxFp8FusedMoE.dequantize_weight` and its bf16 dequantization,
`Fp8PtpcOnlineMoEMethod._requantize_power_of_two` (chunks of experts), the per-channel
quantizer without a clamp and the statistics kept on the device (`online/pow2_requant.py`).
Inputs are MXFP8 tensors drawn by `benchmarks.requant_cost` with planted scale spreads (values
pushed below e4m3's normal range) and planted extremes (e8m0 bytes 0, 1, 254, 255; e4m3 NaN,
zeros, subnormals), and, for the two building blocks, every e4m3 value times every e8m0 byte
and every bf16 value.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.quantization import modelopt
from vllm.model_executor.layers.quantization.online import pow2_requant
from vllm.model_executor.layers.quantization.utils.mxfp8_utils import dequant_mxfp8_to_bf16

from benchmarks import requant_cost
from vllm_minimax.testing import pow2_requant_v1 as v1

E4M3 = torch.float8_e4m3fn
CPU = torch.device("cpu")


def bits(tensor: torch.Tensor) -> torch.Tensor:
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()]
    return tensor.contiguous().view(view)


def assert_same_bits(
    got: torch.Tensor, want: torch.Tensor, what: str, *, nan_sign: bool = True
) -> None:
    """The same bits everywhere; with ``nan_sign=False`` a NaN matches any NaN (the sign a
    conversion gives a NaN is not part of the result)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    differ = bits(got) != bits(want)
    if not nan_sign:
        differ &= ~(got.float().isnan() & want.float().isnan())
    assert not differ.any(), f"{what}: {int(differ.sum())} of {want.numel()} elements differ"


def test_bf16_dequantization_matches_vllms_for_every_value_and_scale() -> None:
    """Every e4m3 byte times every e8m0 byte: NaN, infinity, zeros of both signs,
    subnormal products in fp32 and in bf16."""
    values = torch.arange(256, dtype=torch.uint8).view(E4M3).repeat(256, 32)  # [256, 8192]
    scales = torch.arange(256, dtype=torch.uint8).unsqueeze(1).expand(256, 256).contiguous()
    want = dequant_mxfp8_to_bf16(values, scales)
    got = modelopt._dequant_mxfp8_in_bf16(values, scales)
    assert_same_bits(got, want, "dequantized bf16")


def every_bf16_row_set() -> tuple[torch.Tensor, torch.Tensor]:
    """Every bf16 value, in rows of 256 consecutive bit patterns (so each row's values share
    sign and exponent range), and an all-zero row, each row with its own amax."""
    weight = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    weight = torch.cat((weight.reshape(256, 256), torch.zeros(1, 256, dtype=torch.bfloat16)))
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax

    return weight, weight_amax(weight, dim=-1, keepdim=True)


def test_quantizer_without_clamp_matches_the_first_version_for_every_bf16_value() -> None:
    weight, amax = every_bf16_row_set()
    scale = pow2_requant.power_of_two_channel_scale(amax)
    assert_same_bits(scale, v1.power_of_two_channel_scale(amax), "scale")
    want = v1.quantize_per_channel_power_of_two(weight, scale)
    out = torch.full(weight.shape, float("nan")).to(E4M3)
    got = pow2_requant.quantize_per_channel_power_of_two(weight, scale, out)
    assert got is out
    # A NaN weight is NaN in both; on a CPU the bf16 -> e4m3 conversion drops its sign.
    assert_same_bits(got, want, "every bf16 value", nan_sign=False)
    finite = weight.float().isfinite().all(-1)
    assert_same_bits(got[finite], want[finite], "every bf16 value in rows without NaN or inf")
    # A larger amax than the rows' own (the TP group's): the same again.
    bigger = pow2_requant.power_of_two_channel_scale(amax * 4)
    assert_same_bits(
        pow2_requant.quantize_per_channel_power_of_two(weight, bigger),
        v1.quantize_per_channel_power_of_two(weight, bigger),
        "every bf16 value, a TP group's amax",
        nan_sign=False,
    )


def current_moe(layer: requant_cost.Layer, per_chunk: int) -> tuple[torch.Tensor, ...]:
    """The patched MoE conversion over ``layer`` with ``per_chunk`` experts a chunk."""
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PtpcOnlineMoEMethod

    source = object.__new__(modelopt.ModelOptMxFp8FusedMoE)
    source.dequantize_experts_per_chunk = per_chunk
    method = object.__new__(Fp8PtpcOnlineMoEMethod)
    method.requantization_source = source
    method.moe = SimpleNamespace(tp_size=1, w13_num_shards=2)
    assert layer.experts is not None
    w13 = layer.experts[0]
    module = requant_cost._moe_module(layer.experts, w13.shape[-1], w13.shape[-2] // 2)
    return method._requantize_power_of_two(module)


@pytest.mark.parametrize("per_chunk", (1, 3, 4, 7))
@pytest.mark.parametrize(("spread", "extremes"), ((0, False), (6, False), (10, True), (24, True)))
def test_moe_requantization_is_bit_identical(
    spread: int, extremes: bool, per_chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pow2_requant, "_errors", {})
    shapes = requant_cost.tiny_shapes(experts=7)
    layer = requant_cost.make_layer(shapes, "sparse", spread, 40 + spread, CPU, extremes)
    layer = requant_cost.Layer(layer.experts, {})
    assert layer.experts is not None
    record = v1.Record()
    want = v1.requantize_moe(*layer.experts, record)
    got = current_moe(layer, per_chunk)
    for name, g, w in zip(("w13", "w2", "w13_scale", "w2_scale"), got, want, strict=True):
        assert_same_bits(
            g, w, f"{name}, spread {spread}, {per_chunk} a chunk", nan_sign=not extremes
        )
    assert pow2_requant.requantization_error_summaries() == record.summaries()
    for kind in ("moe w13", "moe w2"):
        new, old = pow2_requant._errors[kind], record.kinds[kind]
        assert (new.layers, new.elements, new.changed) == (old.layers, old.elements, old.changed)
        assert new.relative_error == pytest.approx(old.relative_error, rel=1e-5, nan_ok=True)
    if spread:  # the planted spread pushed values below e4m3's normal range
        assert record.kinds["moe w13"].changed > 0


@pytest.mark.parametrize(("spread", "extremes"), ((0, False), (6, False), (24, True)))
def test_linear_requantization_is_bit_identical(
    spread: int, extremes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pow2_requant, "_errors", {})
    shapes = requant_cost.tiny_shapes()
    layer = requant_cost.make_layer(shapes, "dense", spread, 70 + spread, CPU, extremes)
    layer = requant_cost.Layer(None, layer.linears)
    want_out, want_log = requant_cost.convert_v1(layer)
    got_out, got_log = requant_cost.convert_current(layer)
    for name in want_out:
        for index, (g, w) in enumerate(zip(got_out[name], want_out[name], strict=True)):
            assert_same_bits(g, w, f"{name}[{index}], spread {spread}", nan_sign=not extremes)
    assert got_log == want_log


def test_the_logged_sums_hold_their_digits_over_a_real_layer() -> None:
    """2.5 * 10^7 weights, about one MoE chunk's w2: the recorded sums of squares agree with
    float64 to 1e-5, where a whole-tensor fp32 norm is off by about 1e-2 here (the log line
    prints three digits)."""
    generator = torch.Generator().manual_seed(9)
    reference = (torch.randn(4096, 6144, generator=generator) * 1e-2).to(torch.bfloat16)
    scale = pow2_requant.power_of_two_channel_scale(reference.float().abs().amax(-1, keepdim=True))
    quantized = pow2_requant.quantize_per_channel_power_of_two(reference, scale)
    totals = pow2_requant.RequantizationError()
    totals.add(reference, quantized, scale)
    changed, error_sq, reference_sq = totals.totals.tolist()
    diff = quantized.double() * scale.double() - reference.double()
    assert changed == int(torch.count_nonzero(diff)) > 0
    assert error_sq == pytest.approx(float(diff.square().sum()), rel=1e-5)
    assert reference_sq == pytest.approx(float(reference.double().square().sum()), rel=1e-5)


def test_the_conversion_reads_nothing_back_until_the_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first version read three numbers back per expert and kind (a stream drain each on a
    GPU); the chunked one reads nothing until the log line is formatted."""
    monkeypatch.setattr(pow2_requant, "_errors", {})
    shapes = requant_cost.tiny_shapes(experts=5)
    layer = requant_cost.make_layer(shapes, "sparse", 6, 3, CPU)
    moe = requant_cost.Layer(layer.experts, {})
    assert moe.experts is not None
    with requant_cost.Traffic() as old:
        v1.requantize_moe(*moe.experts, v1.Record())
    assert old.syncs == 5 * 2 * 3
    with requant_cost.Traffic() as new:
        current_moe(moe, per_chunk=2)
    assert new.syncs == 0
    assert new.bytes < old.bytes / 2


def test_a_padding_moe_backend_is_padded_on_0_34_and_refused_on_0_33(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.34.0's chunk iterator pads each chunk as the backend asks; 0.33.0 has no
    chunked padding, so the power-of-two path refuses there, naming the key."""
    import vllm

    monkeypatch.setattr(pow2_requant, "_errors", {})
    shapes = requant_cost.tiny_shapes(experts=5)
    layer = requant_cost.make_layer(shapes, "sparse", 6, 8, CPU)
    assert layer.experts is not None
    hidden, inter = shapes.hidden, shapes.intermediate
    module = requant_cost._moe_module(layer.experts, hidden, inter)
    module.moe_config.hidden_dim = hidden + 32
    module.moe_config.intermediate_size_per_partition = inter + 64
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PtpcOnlineMoEMethod

    method = object.__new__(Fp8PtpcOnlineMoEMethod)
    method.requantization_source = object.__new__(modelopt.ModelOptMxFp8FusedMoE)
    method.moe = SimpleNamespace(tp_size=1, w13_num_shards=2)
    if vllm.__version__.startswith("0.33."):
        with pytest.raises(ValueError, match=r"quantization_config\.moe=fp8_per_channel.*pads"):
            method._requantize_power_of_two(module)
        return
    w13, w2, s13, s2 = method._requantize_power_of_two(module)
    assert w13.shape == (5, 2 * (inter + 64), hidden + 32) and w2.shape == (
        5,
        hidden + 32,
        inter + 64,
    )
    q13, q2, want13, want2 = v1.requantize_moe(*layer.experts, v1.Record())
    assert_same_bits(w2[:, :hidden, :inter], q2, "w2's unpadded block")
    assert_same_bits(s2[:, :hidden], want2, "w2's unpadded scales")
    for shard in range(2):
        rows = slice(shard * (inter + 64), shard * (inter + 64) + inter)
        source = slice(shard * inter, (shard + 1) * inter)
        assert_same_bits(w13[:, rows, :hidden], q13[:, source], f"w13 shard {shard}")
        assert_same_bits(s13[:, rows], want13[:, source], f"w13 scales, shard {shard}")
    assert not w2[:, hidden:].float().any() and not w13[:, :, hidden:].float().any()
