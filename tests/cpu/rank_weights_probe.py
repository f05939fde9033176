"""What vLLM 0.34.0 makes of a rank slice's weight layout, on this CPU host; print JSON.

    python tests/cpu/rank_weights_probe.py DIR [DIR ...]

Run in a process of its own by test_rank_weight_layouts.py, forked from probe_host.py. Per DIR
(a ``make-tiny-model --geometry m3-tpN-rank`` directory): the quantization method vLLM's own
``ModelConfig`` resolves from its config.json and the config class vLLM builds for it. For each
DIR whose quantization is MXFP8, the MoE backend vLLM 0.34.0's MXFP8 oracle
(``fused_moe/oracle/mxfp8.py``) picks on an SM90 CUDA device, as the platform reports one
(capability 9.0; no kernel runs): with the installed ``humming`` package and without it, and
every backend's verdict in priority order; the same with
``VLLM_HUMMING_MOE_GEMM_TYPE=grouped``; and, for comparison, what one rank of the deployed
TP 8 + EP 8 engine (128 experts, 16 on the rank) gets. For those DIRs also the MXFP8 linear kernel
vLLM picks on that device (with and without ``humming``), and the activation dtype Humming
settles on for the MXFP8 linear layers and MoE there (``check_and_fallback_input_schema``, as
vLLM 0.34.0 calls it; Humming's device query is answered with SM90 too).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

SM90 = (9, 0)
# vLLM 0.34.0's choice of Humming MoE GEMM (fused_humming_moe.get_humming_moe_gemm_type):
# grouped_contiguous under expert parallelism, indexed otherwise, unless this says.
HUMMING_GEMM_ENV = "VLLM_HUMMING_MOE_GEMM_TYPE"


def resolved_quantization(model_dir: Path) -> dict:
    from vllm.config import ModelConfig
    from vllm.model_executor.layers.quantization import get_quantization_config

    model_config = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), dtype="bfloat16")
    method = model_config.quantization
    result: dict = {"quantization": method, "config_class": None}
    if method is not None:
        hf_quant = model_config.hf_config.quantization_config
        config = get_quantization_config(method).from_config(hf_quant)
        result.update(
            config_class=type(config).__name__,
            excluded=list(config.exclude_modules),
            routed_expert_weights=str(config.routed_expert_weight_key()),
            min_capability=config.get_min_capability(),
        )
    return result


def _sm90_platform():
    """Make vLLM's platform object report an SM90 CUDA GPU (an H100) for what the MoE oracle
    asks: ``is_cuda``, the capability queries and the device name."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability, PlatformEnum

    capability = DeviceCapability(*SM90)

    def as_int(value) -> int:
        return value if isinstance(value, int) else value[0] * 10 + value[1]

    return mock.patch.multiple(
        current_platform,
        create=True,
        _enum=PlatformEnum.CUDA,
        device_name="NVIDIA H100 80GB HBM3",
        is_cuda=lambda *a: True,
        is_rocm=lambda *a: False,
        is_xpu=lambda *a: False,
        is_cpu=lambda *a: False,
        get_device_capability=lambda *a, **k: capability,
        has_device_capability=lambda c, *a, **k: capability.to_int() >= as_int(c),
        is_device_capability=lambda c, *a, **k: capability.to_int() == as_int(c),
        is_device_capability_family=lambda c, *a, **k: capability.to_int() // 10 == c // 10,
    )


def _moe_config(config: dict, expert_parallel_size: int):
    """The FusedMoEConfig MiniMaxM3MoE (nvidia/model.py) builds for ``config``: on one GPU
    (``expert_parallel_size`` 1, the slice), or on one rank of an EP group of that size."""
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    experts = config["num_local_experts"]
    if expert_parallel_size == 1:
        parallel = FusedMoEParallelConfig.make_no_parallel()
    else:
        parallel = FusedMoEParallelConfig(
            tp_size=1,
            pcp_size=1,
            dp_size=1,
            ep_size=expert_parallel_size,
            tp_rank=0,
            pcp_rank=0,
            dp_rank=0,
            ep_rank=0,
            sp_size=1,
            use_ep=True,
            all2all_backend="allgather_reducescatter",
            enable_eplb=False,
        )
    return FusedMoEConfig(
        num_experts=experts,
        experts_per_token=config["num_experts_per_tok"],
        hidden_dim=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_local_experts=experts // expert_parallel_size,
        num_logical_experts=experts,
        activation=MoEActivation.SWIGLUOAI_UNINTERLEAVE,
        device="cuda",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=parallel,
        in_dtype=torch.bfloat16,
        router_logits_dtype=torch.float32,
    )


def sm90_moe_backends(config: dict, expert_parallel_size: int = 1, env: dict | None = None) -> dict:
    """The MXFP8 MoE backend and experts class vLLM 0.34.0 picks on an SM90 GPU for
    ``config``'s MoE, with ``env`` set; the same without the ``humming`` package; every
    backend's verdict in priority order."""
    import os

    from vllm.model_executor.layers.fused_moe.oracle import mxfp8 as oracle
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kMxfp8Dynamic,
        kMxfp8Static,
    )

    with _sm90_platform(), mock.patch.dict(os.environ, env or {}):
        moe = _moe_config(config, expert_parallel_size)
        kernel_oracle = oracle.Mxfp8MoEKernelOracle(moe, kMxfp8Static, kMxfp8Dynamic)
        verdicts = []
        for backend in oracle.prioritize_humming(list(oracle._SUPPORTED_BACKENDS)):
            chosen, rejected = kernel_oracle.try_backend(backend)
            verdicts.append(
                {
                    "backend": backend.name,
                    "experts": chosen.__name__ if chosen else None,
                    "rejected": [reason for _, reason in rejected],
                }
            )
        picked = oracle.select_mxfp8_moe_backend(moe)
        with mock.patch(
            "vllm.model_executor.layers.fused_moe.experts.fused_humming_moe.has_humming",
            lambda: False,
        ):
            without_humming = oracle.select_mxfp8_moe_backend(moe)
    return {
        "picked": [picked[0].name, picked[1].__name__],
        "picked_without_humming": [without_humming[0].name, without_humming[1].__name__],
        "verdicts": verdicts,
    }


def sm90_mxfp8_linear(config: dict) -> dict:
    """The MXFP8 linear kernel vLLM 0.34.0 picks on an SM90 GPU for the slice's o_proj
    shape, with the installed ``humming`` package and without it."""
    from vllm.model_executor.kernels.linear import init_mxfp8_linear_kernel

    shape = (config["hidden_size"], config["num_attention_heads"] * config["head_dim"])
    with _sm90_platform():
        picked = init_mxfp8_linear_kernel(weight_shape=shape)
        with mock.patch(
            "vllm.model_executor.kernels.linear.mxfp8.humming.has_humming", lambda: False
        ):
            without_humming = init_mxfp8_linear_kernel(weight_shape=shape)
    return {
        "picked": type(picked).__name__,
        "picked_without_humming": type(without_humming).__name__,
    }


def sm90_humming_activations() -> dict:
    """The activations Humming asks for and gets on SM90 with MXFP8 weights, as vLLM 0.34.0
    prepares its layers: the linear layers ask for MXFP8 activations (``kMxfp8Dynamic``,
    ``HummingMxfp8LinearKernel``) and allow a fallback; the MoE asks for what
    ``VLLM_HUMMING_INPUT_QUANT_CONFIG`` says (unset here) and allows none. ``None`` is the
    16-bit model dtype."""
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.layers.quantization.utils.humming.schema import (
        check_and_fallback_input_schema,
        quant_key_to_input_schema,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp8Dynamic
    from vllm.utils.humming import BaseWeightSchema, HummingInputSchema

    linear_weights = BaseWeightSchema.from_config(
        {
            "quant_method": "humming",
            "dtype": "float8e4m3",
            "scale_dtype": "float8e8m0",
            "group_size": 32,
            "weight_scale_type": "group",
        }
    )
    moe_weights = BaseWeightSchema.from_config({"quant_method": "modelopt", "quant_algo": "mxfp8"})
    asked = {
        "linear": quant_key_to_input_schema(kMxfp8Dynamic),
        "moe": HummingInputSchema.from_config({}),
    }
    device = SimpleNamespace(sm_version=SM90[0] * 10 + SM90[1], is_ppu=False)
    result = {}
    with _sm90_platform(), mock.patch("humming.schema.humming.current_device", device):
        for part, weights, fallback in (
            ("linear", linear_weights, True),
            ("moe", moe_weights, False),
        ):
            got = check_and_fallback_input_schema(weights, asked[part], torch.bfloat16, fallback)
            result[part] = {
                "asked": _dtype_name(asked[part].a_dtype),
                "asked_group": asked[part].input_scale_group_size,
                "gets": _dtype_name(got.a_dtype),
            }
    return result


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path, metavar="DIR")
    args = parser.parse_args(argv)
    from vllm_minimax.m3_geometry import M3_TEXT_CONFIG

    result: dict = {}
    for model_dir in args.models:
        config = json.loads((model_dir / "config.json").read_text())
        result[str(model_dir)] = resolved_quantization(model_dir)
        if result[str(model_dir)]["quantization"] == "mxfp8":
            result[str(model_dir)].update(
                sm90_mxfp8_moe=sm90_moe_backends(config),
                sm90_mxfp8_moe_grouped=sm90_moe_backends(config, env={HUMMING_GEMM_ENV: "grouped"}),
                sm90_mxfp8_linear=sm90_mxfp8_linear(config),
                sm90_humming_activations=sm90_humming_activations(),
            )
    # What a rank of the deployed TP 8 + EP 8 engine gets, for comparison.
    result["deployed-ep8-rank"] = {"sm90_mxfp8_moe": sm90_moe_backends(M3_TEXT_CONFIG, 8)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
