"""Patch 0008's first MXFP8 -> per-channel FP8 requantization, kept as the oracle of its successor.

The series at commit ed9a291 requantized an MXFP8 checkpoint's layers like this (patch 0008's
`pow2_requant.py`, `Fp8PtpcOnlineMoEMethod._quantize_power_of_two` and the per-channel linear
method's power-of-two branch, with the stitching of `OnlineMoEMethodBase.quantize_weights`):

- MoE: dequantize the local experts in chunks of ``dequantize_experts_per_chunk`` with vLLM's
  `dequant_mxfp8_to_bf16`, stitch the chunks into whole bf16 ``w13``/``w2``, take their row amax,
  then quantize and record one expert at a time, each record reading three numbers back to the
  host;
- linear: dequantize the whole weight the same way, then the same per-row steps.

The replacement must give the same FP8 bytes, the same scales and the same log line. This module
is that first version as plain functions over tensors (vLLM's own `dequant_mxfp8_to_bf16`,
`weight_amax` and `get_fp8_min_max` imported, not copied), so the CPU tests and
`benchmarks.requant_cost` compare the patched vLLM's conversion against it on any device.
``steps`` (optional) is called as a context manager around each step, by name, for a
breakdown of where the time goes; names are in `STEPS`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

# The chunk of experts `ModelOptMxFp8FusedMoE.dequantize_weight` dequantized at a time.
EXPERTS_PER_CHUNK = 4
STEPS = ("dequantize", "assemble", "amax_scale", "quantize", "statistics")
Steps = Callable[[str], AbstractContextManager[object]]


def _no_steps(name: str) -> AbstractContextManager[object]:
    return contextlib.nullcontext()


def power_of_two_channel_scale(amax: torch.Tensor) -> torch.Tensor:
    """The first version's scale: the smallest power of two ``s`` with ``amax / s <= fp8_max``."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import get_fp8_min_max

    fp8_max = get_fp8_min_max()[1]
    amax = amax.to(torch.float32).clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.ceil(torch.log2(amax / fp8_max)))
    return torch.where(amax / scale > fp8_max, scale * 2, scale)


def quantize_per_channel_power_of_two(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The first version's quantizer: fp32 copy, true division, clamp, FP8."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import get_fp8_min_max
    from vllm.platforms import current_platform

    fp8_min, fp8_max = get_fp8_min_max()
    scaled = weight.to(torch.float32) / scale
    return scaled.clamp_(fp8_min, fp8_max).to(current_platform.fp8_dtype())


@dataclass
class Totals:
    """One layer kind's running totals, kept on the host as the first version kept them."""

    layers: int = 0
    elements: int = 0
    changed: int = 0
    error_sq: float = 0.0
    reference_sq: float = 0.0

    def add(self, reference: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor) -> None:
        reference = reference.to(torch.float32)
        dequantized = quantized.to(torch.float32) * scale
        diff = dequantized - reference
        self.elements += reference.numel()
        self.changed += int(torch.count_nonzero(diff).item())
        self.error_sq += float(diff.square().sum().item())
        self.reference_sq += float(reference.square().sum().item())

    @property
    def changed_fraction(self) -> float:
        return self.changed / max(self.elements, 1)

    @property
    def relative_error(self) -> float:
        return (self.error_sq / max(self.reference_sq, 1e-30)) ** 0.5


@dataclass
class Record:
    """The first version's module-level ``_errors``: totals per layer kind."""

    kinds: dict[str, Totals] = field(default_factory=dict)

    def add(
        self,
        kind: str,
        reference: torch.Tensor,
        quantized: torch.Tensor,
        scale: torch.Tensor,
        *,
        new_layer: bool = True,
    ) -> None:
        totals = self.kinds.setdefault(kind, Totals())
        totals.layers += int(new_layer)
        totals.add(reference, quantized, scale)

    def summaries(self) -> list[str]:
        """The log line's parts, formatted as the first version formatted them."""
        return [
            f"{kind}: {e.layers} layers, {e.changed_fraction:.3g} of weights changed, "
            f"relative error {e.relative_error:.3g}"
            for kind, e in sorted(self.kinds.items())
        ]


def _dequantize_chunks(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    per_chunk: int,
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import (
        dequant_mxfp8_to_bf16,
    )

    for start in range(0, w13.shape[0], per_chunk):
        experts = slice(start, min(start + per_chunk, w13.shape[0]))
        yield (
            experts,
            dequant_mxfp8_to_bf16(w13[experts], w13_scale[experts]),
            dequant_mxfp8_to_bf16(w2[experts], w2_scale[experts]),
        )


def requantize_moe(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    record: Record,
    *,
    per_chunk: int = EXPERTS_PER_CHUNK,
    steps: Steps = _no_steps,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One MoE layer's ``(w13, w2, w13_scale, w2_scale)`` from its MXFP8 experts (e4m3
    ``[E, N, K]``, uint8 e8m0 ``[E, N, K / 32]``), at MoE TP size 1 and without padding or
    fused shared experts, as the first version produced them."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax
    from vllm.platforms import current_platform

    num_experts = w13.shape[0]
    chunks = _dequantize_chunks(w13, w13_scale, w2, w2_scale, per_chunk)
    outputs: list[torch.Tensor] | None = None
    while True:
        with steps("dequantize"):
            chunk = next(chunks, None)
        if chunk is None:
            break
        experts, w13_chunk, w2_chunk = chunk
        with steps("assemble"):
            if outputs is None:
                if w13_chunk.shape[0] == num_experts:
                    outputs = [w13_chunk, w2_chunk]
                    continue
                outputs = [t.new_empty((num_experts, *t.shape[1:])) for t in (w13_chunk, w2_chunk)]
            for output, tensor in zip(outputs, (w13_chunk, w2_chunk), strict=True):
                output[experts] = tensor
    assert outputs is not None
    w13_weight, w2_weight = outputs

    fp8_dtype = current_platform.fp8_dtype()
    q13 = torch.empty_like(w13_weight, dtype=fp8_dtype)
    q2 = torch.empty_like(w2_weight, dtype=fp8_dtype)
    with steps("amax_scale"):
        s13 = power_of_two_channel_scale(weight_amax(w13_weight, dim=-1, keepdim=True))
        s2 = power_of_two_channel_scale(weight_amax(w2_weight, dim=-1, keepdim=True))
    for expert in range(num_experts):
        with steps("quantize"):
            q13[expert] = quantize_per_channel_power_of_two(w13_weight[expert], s13[expert])
            q2[expert] = quantize_per_channel_power_of_two(w2_weight[expert], s2[expert])
        with steps("statistics"):
            for kind, reference, quantized, scale in (
                ("moe w13", w13_weight, q13, s13),
                ("moe w2", w2_weight, q2, s2),
            ):
                record.add(
                    kind,
                    reference[expert],
                    quantized[expert],
                    scale[expert],
                    new_layer=expert == 0,
                )
    return q13, q2, s13, s2


def requantize_linear(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    kind: str,
    record: Record,
    *,
    steps: Steps = _no_steps,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One linear layer's ``(qweight [N, K], scale [N, 1])`` from its MXFP8 weight (e4m3
    ``[N, K]``, uint8 e8m0 ``[N, K / 32]``) at TP size 1, as the first version produced them
    (before the kernel's transpose)."""
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import (
        dequant_mxfp8_to_bf16,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax

    with steps("dequantize"):
        dequantized = dequant_mxfp8_to_bf16(weight.contiguous(), weight_scale.contiguous())
    with steps("amax_scale"):
        scale = power_of_two_channel_scale(weight_amax(dequantized, dim=-1, keepdim=True))
    with steps("quantize"):
        qweight = quantize_per_channel_power_of_two(dequantized, scale)
    with steps("statistics"):
        record.add(kind, dequantized, qweight, scale)
    return qweight, scale
