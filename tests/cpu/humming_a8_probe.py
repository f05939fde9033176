"""What vLLM 0.34.0 makes of ``VLLM_HUMMING_INPUT_QUANT_CONFIG`` on the MXFP8 rank slice, on
this CPU host, as an SM90 GPU would get it; print JSON.

    VLLM_HUMMING_INPUT_QUANT_CONFIG=... python tests/cpu/humming_a8_probe.py [VALUE ...]

Run by test_humming_a8_arm.py (in a process forked from its probe host, probe_host.py). For
the variable as this process has it, then for each VALUE in its place (``-``: unset), through
vLLM's own code paths with the platform reporting capability 9.0 and Humming's device queries
answered for SM90 (no kernel runs):

- ``parsed``: what ``vllm.envs`` parses it into;
- ``moe``: the input schema ``convert_to_humming_moe_kernel_format`` (utils/humming/moe.py)
  builds for the routed experts from it when ``fused_moe/oracle/fp8.py`` converts MXFP8
  experts for Humming, whether it allows a fallback, what Humming's schema check
  (``check_and_fallback_input_schema``) keeps on SM90 for the checkpoint's MXFP8 weights or
  why it refuses, the quant key vLLM reads that as, and the ``LayerConfig`` Humming's
  ``prepare_layer_config`` makes of it for the slice's w13;
- ``linear``: the same for the MXFP8 linear layers (``HummingMxfp8LinearKernel``);
- ``grouped``: the MoE backend and experts class vLLM picks with it and
  ``VLLM_HUMMING_MOE_GEMM_TYPE=grouped`` (rank_weights_probe.sm90_moe_backends).

Once: what ``--quantization humming`` (``HummingConfig``, quantization/humming.py, the other
reader of the variable) makes of the MiniMax MXFP8 checkpoint's quantization config.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from types import SimpleNamespace
from unittest import mock

from rank_weights_probe import SM90, _sm90_platform, sm90_moe_backends

VARIABLE = "VLLM_HUMMING_INPUT_QUANT_CONFIG"
GEMM_VARIABLE = "VLLM_HUMMING_MOE_GEMM_TYPE"
UNSET = "-"
# A routed-experts layer name as MiniMaxM3MoE builds it (``{prefix}.experts``).
MOE_LAYER = "model.layers.3.block_sparse_moe.experts"
LINEAR_PREFIX = "model.layers.0.self_attn.qkv_proj"


def _humming_sm90():
    """Humming's device object answering SM90 wherever the schema check and LayerConfig ask."""
    device = SimpleNamespace(sm_version=SM90[0] * 10 + SM90[1], is_ppu=False)
    info = SimpleNamespace(sm_version=device.sm_version, sm_major=SM90[0])
    return [
        mock.patch("humming.schema.humming.current_device", device),
        mock.patch("humming.config.config.current_device", device),
        mock.patch("humming.config.mma.current_device", device),
        mock.patch("humming.transform.DeviceInfo", lambda *a, **k: info),
    ]


def _schema(schema) -> dict:
    mode = schema.input_quant_mode
    return {
        "dtype": None if schema.a_dtype is None else str(schema.a_dtype),
        "group": schema.input_scale_group_size,
        "scale_dtype": None if schema.input_scale_dtype is None else str(schema.input_scale_dtype),
        "mode": getattr(mode, "value", mode),
    }


def _settled(weight_schema, asked, allow_fallback: bool, shape_n: int, shape_k: int) -> dict:
    """What Humming keeps of ``asked`` for ``weight_schema`` on SM90, as vLLM's conversion
    calls it, and the LayerConfig it then prepares (or why it refuses)."""
    import torch
    from humming.config.mma import get_default_mma_type
    from humming.transform import prepare_layer_config
    from vllm.model_executor.layers.quantization.utils.humming.schema import (
        check_and_fallback_input_schema,
        input_schema_to_quant_key,
    )

    try:
        got = check_and_fallback_input_schema(
            weight_schema, asked, torch.bfloat16, allow_fallback=allow_fallback
        )
    except ValueError as error:
        return {"refused": str(error)}
    config = prepare_layer_config(
        shape_n=shape_n,
        shape_k=shape_k,
        weight_schema=weight_schema.to_humming_schema(torch.bfloat16),
        input_schema=got,
        num_experts=None,
        pad_n_to_multiple=256,
        pad_k_to_multiple=128,
        torch_dtype=torch.bfloat16,
    )
    key = input_schema_to_quant_key(got, torch.bfloat16)
    return {
        "gets": _schema(got),
        "quant_key": None if key is None else str(key),
        "layer_config": {
            "a_dtype": str(config.a_dtype),
            "as_dtype": None if config.as_dtype is None else str(config.as_dtype),
            "mode": config.input_quant_mode.value,
            "mma": get_default_mma_type(config).name,
            "weight_group": config.weight_scale_group_size,
        },
    }


def moe_inputs(config: dict) -> dict:
    """The routed experts' input schema vLLM 0.34.0 builds from the variable as it stands."""
    import torch
    from vllm.model_executor.layers.quantization.utils.humming import moe
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8DynamicTokenSym
    from vllm.utils.humming import BaseWeightSchema

    calls: list[dict] = []

    def record(**kwargs):
        calls.append(kwargs)
        return kwargs["weight_schema"], kwargs["input_schema"], None

    layer = SimpleNamespace(
        layer_name=MOE_LAYER,
        params_dtype=torch.bfloat16,
        moe_config=SimpleNamespace(
            has_bias=False,
            num_local_experts=config["num_local_experts"],
            activation=SimpleNamespace(is_gated=True),
            intermediate_size_per_partition=config["intermediate_size"],
            hidden_dim=config["hidden_size"],
        ),
    )
    # What fused_moe/oracle/fp8.py passes for MXFP8 experts (_humming_fp8_weight_schema).
    weight_config = {"quant_method": "modelopt", "quant_algo": "mxfp8"}
    with mock.patch.object(moe, "_process_single_sublayer", side_effect=record):
        moe.convert_to_humming_moe_kernel_format(layer, quant_config=weight_config)
    first = calls[0]
    assert [c["sublayer_name"] for c in calls] == ["w13", "w2"]
    assert all(c["input_schema"] is first["input_schema"] for c in calls)
    weights = BaseWeightSchema.from_config(weight_config)
    result = {
        "sublayers": [c["sublayer_name"] for c in calls],
        "asked": _schema(first["input_schema"]),
        "allow_fallback": first["allow_input_schema_fallback"],
        **_settled(
            weights,
            first["input_schema"],
            first["allow_input_schema_fallback"],
            shape_n=2 * config["intermediate_size"],
            shape_k=config["hidden_size"],
        ),
    }
    result["is_fp8_per_token"] = result.get("quant_key") == str(kFp8DynamicTokenSym)
    result["unread_keys"] = _unread_keys(envs_value())
    return result


# Keys of the variable vLLM 0.34.0 reads itself (utils/humming/moe.py and schema.py: the layers
# to skip, per-layer overrides, the fallback) rather than passing them to Humming.
VLLM_KEYS = ("ignored_layers", "ignore", "modules_to_not_convert", "dynamic", "allow_fallback")


def envs_value():
    import vllm.envs as envs

    return envs.VLLM_HUMMING_INPUT_QUANT_CONFIG


def _unread_keys(parsed) -> list[str]:
    """Keys of ``parsed`` that neither vLLM nor ``HummingInputSchema.from_config`` reads (a
    misspelt key is dropped without a word)."""
    import dataclasses

    from vllm.utils.humming import HummingInputSchema

    read = {field.name for field in dataclasses.fields(HummingInputSchema)}
    read |= {alias for aliases in HummingInputSchema.KWARGS_ALIAS.values() for alias in aliases}
    return sorted(key for key in (parsed or {}) if key not in read and key not in VLLM_KEYS)


def linear_inputs(config: dict) -> dict:
    """The input schema the MXFP8 linear kernel vLLM 0.34.0 picks on SM90 asks Humming for,
    with the variable as it stands, and what Humming keeps of it."""
    import torch
    from vllm.model_executor.kernels.linear import init_mxfp8_linear_kernel
    from vllm.model_executor.kernels.linear.mxfp8 import humming as kernel_module
    from vllm.utils.humming import BaseWeightSchema

    shape = (config["hidden_size"], config["num_attention_heads"] * config["head_dim"])
    calls: list[dict] = []
    real = kernel_module.prepare_humming_linear_layer_config

    def record(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append(dict(bound.arguments))
        return None

    layer = SimpleNamespace(
        weight=SimpleNamespace(device=torch.device("cpu")),
        weight_scale=SimpleNamespace(data=torch.zeros(1, dtype=torch.uint8)),
    )
    kernel = init_mxfp8_linear_kernel(weight_shape=shape)
    with (
        mock.patch.object(kernel_module, "convert_linear_layer_to_humming_standard"),
        mock.patch.object(kernel_module, "prepare_humming_linear_layer_config", record),
        mock.patch.object(kernel_module, "create_humming_locks"),
    ):
        kernel.process_weights_after_loading(layer)
    [call] = calls
    weights = BaseWeightSchema.from_config(call["quant_config"])
    return {
        "kernel": type(kernel).__name__,
        "asked": _schema(call["input_schema"]),
        "allow_fallback": call["allow_input_schema_fallback"],
        **_settled(
            weights,
            call["input_schema"],
            call["allow_input_schema_fallback"],
            shape_n=shape[0],
            shape_k=shape[1],
        ),
    }


def humming_quantization_on_the_checkpoint() -> dict:
    """``--quantization humming`` over the MiniMax MXFP8 checkpoint's quantization config: the
    other reader of the variable (HummingConfig.get_quant_config_for_layer)."""
    from vllm.model_executor.layers.quantization.humming import HummingConfig

    from vllm_minimax.tiny_model import MXFP8_QUANTIZATION_CONFIG

    config = HummingConfig.from_config(dict(MXFP8_QUANTIZATION_CONFIG))
    try:
        config.get_quant_config_for_layer(LINEAR_PREFIX, "linear")
    except ValueError as error:
        return {"refused": str(error)}
    return {"refused": None}


def _import_first() -> None:
    """Import what the probes use before the platform reports a CUDA device: some of vLLM's
    modules query the device's kernels at import."""
    import humming.transform  # noqa: F401
    import vllm.model_executor.kernels.linear
    import vllm.model_executor.kernels.linear.mxfp8.humming
    import vllm.model_executor.layers.fused_moe.oracle.mxfp8
    import vllm.model_executor.layers.quantization.humming
    import vllm.model_executor.layers.quantization.utils.humming.moe  # noqa: F401


def probe(value: str | None, config: dict) -> dict:
    env = dict(os.environ)
    env.pop(VARIABLE, None)
    if value is not None:
        env[VARIABLE] = value
    with mock.patch.dict(os.environ, env, clear=True):
        parsed = envs_value()
        patches = [_sm90_platform(), *_humming_sm90()]
        for patch in patches:
            patch.start()
        try:
            result = {
                "value": value,
                "parsed": parsed,
                "moe": moe_inputs(config),
                "linear": linear_inputs(config),
            }
        finally:
            for patch in reversed(patches):
                patch.stop()
    grouped_env = {GEMM_VARIABLE: "grouped"} | ({} if value is None else {VARIABLE: value})
    with mock.patch.dict(os.environ, {}, clear=False):
        os.environ.pop(VARIABLE, None)
        result["grouped"] = sm90_moe_backends(config, env=grouped_env)["picked"]
    return result


def main(argv: list[str] | None = None) -> int:
    from vllm_minimax.m3_geometry import rank_text_config

    values = sys.argv[1:] if argv is None else argv
    config = rank_text_config(8, experts="ep")
    _import_first()
    report = {
        "as_set": probe(os.environ.get(VARIABLE), config),
        "values": [probe(None if v == UNSET else v, config) for v in values],
        "humming_quantization": humming_quantization_on_the_checkpoint(),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
