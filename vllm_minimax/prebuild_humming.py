"""Humming's NVRTC GEMM kernels of an MXFP8 checkpoint on SM90, built without a GPU.

vLLM 0.34.0 runs an MXFP8 checkpoint's linear layers and routed experts through Humming on
SM90 (W8A16: the activations stay bf16). A layer's first forward builds the kernels of all
its token-count intervals (``HummingKernel.prepare_kernels``), so a fresh machine's profile
run compiles every GEMM kernel the model has. What picks them is the layer's shape and
schema, the compute config vLLM passes, and what Humming's tuner reads of the device: the SM
version and count, its name, the L2 size and the registers per SM (see :data:`HUMMING_DEVICE`).
Given those, nothing else of a GPU is needed: this module installs them as Humming's device
object and calls the same ``prepare_kernels`` the forward calls, so Humming's own tuner picks
and its own compiler builds (and keys) each kernel into ``$HUMMING_CACHE_DIR``; a kernel whose
``kernel.cubin`` is there already is Humming's to skip.

The cache key (``humming/jit/compiler.py``) holds the absolute paths and modification times of
Humming's headers, the NVRTC version and the CUDA include paths: the server finds these
kernels only where it runs the same Humming install and CUDA toolkit as the prebuild did (the
image that built them, or the machine). The SM count is in no key and compiled into no kernel:
it picks the tuning (whose kernels' source is keyed) and the launch grid (the server's own), so
another GPU finds only kernels of the code its own tuning picks. A model with no
``config.json`` here is planned only when it is the published MXFP8 checkpoint
(``prebuild_inputs.known_config_json``). Not built here: Humming's input-processing kernels
(the MoE activation between w13 and w2; their layout depends on the batch's token count) and
the weight-layout kernels of the load; the start still builds those.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_minimax.prebuild_inputs import GpuTarget, PrebuildError

# What Humming's device object (humming/device.py) is asked on this path, per GPU: the SM
# version and is_ppu (which tuner and code: humming/tune/__init__.py, kernel/humming.py), the
# name (tune/__init__.py picks its H20 tuner by it), the SM count (tune/sm90_policies.py's MoE
# grids; the GPU_TARGETS value, 132 as vLLM logs num_sms on the H100 in
# results/h100/cold-start), the L2 size (tune/raster.py, dense layers) and the registers per SM
# (kernel/humming.py check_config). H100 SXM and H200 are the same GH100 configuration: 50 MiB
# of L2 (NVIDIA's H100 architecture whitepaper) and 64 Ki 32-bit registers per SM (CUDA's
# compute capability 9.0 limits). A property Humming asks that is not here fails the prebuild.
HUMMING_DEVICE: dict[str, Any] = {
    "index": 0,
    "is_ppu": False,
    "sm_version": 90,
    "sm_major": 9,
    "sm_minor": 0,
    "l2_cache_size": 50 * 1024 * 1024,
    "max_registers_per_sm": 65536,
}
KNOWN_GPUS = ("h100", "h200")
# HummingMxfp8LinearKernel's weight schema (vllm/model_executor/kernels/linear/mxfp8/humming.py)
# and the MoE's for e8m0-scaled experts (fused_moe/oracle/fp8.py _humming_fp8_weight_schema).
LINEAR_WEIGHT_CONFIG = {
    "quant_method": "humming",
    "dtype": "float8e4m3",
    "scale_dtype": "float8e8m0",
    "group_size": 32,
    "weight_scale_type": "group",
}
MOE_WEIGHT_CONFIG = {"quant_method": "modelopt", "quant_algo": "mxfp8"}
# vLLM pads every Humming layer's N and K to these (linear.py and moe.py of
# vllm/model_executor/layers/quantization/utils/humming).
PAD_N, PAD_K = 256, 128


@dataclass(frozen=True)
class HummingLayer:
    """One distinct Humming GEMM of the model: its name(s), shape and kind."""

    name: str
    shape_n: int
    shape_k: int
    num_experts: int = 0  # 0: a dense (linear) layer
    gemm_type: str = "dense"


@dataclass
class HummingPlan:
    """What the prebuild builds for one GPU: the layers, or why none."""

    gpu: str
    layers: list[HummingLayer]
    skipped: str | None = None
    source: str = ""  # where the layers' geometry came from


def is_mxfp8(config: dict[str, Any]) -> bool:
    """Whether ``config.json`` states an MXFP8 checkpoint (vLLM's ``mxfp8`` tag, or ModelOpt's)."""
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config"
    )
    if not isinstance(quant, dict):
        return False
    method = str(quant.get("quant_method", "")).lower()
    algo = str(quant.get("quant_algo", "")).lower()
    return method in ("mxfp8", "modelopt_mxfp8") or (method == "modelopt" and algo == "mxfp8")


def _per_rank(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise PrebuildError(f"config.json: {what} ({total}) does not divide {parts} ways")
    return total // parts


def layer_kinds(text: dict[str, Any]) -> tuple[list[str], list[str], int | None]:
    """Each layer's attention and MLP kind (``minimax_m3_sparse`` or ``full_attention``;
    ``sparse`` or ``dense``) and the index head dim, from either spelling of MiniMax M3's text
    config: vLLM 0.34.0's flat ``layer_types``, ``mlp_layer_types`` and ``index_head_dim``, or
    the published checkpoint's ``sparse_attention_config`` (``sparse_attention_freq``,
    ``sparse_index_dim``) and ``moe_layer_freq``, where 1 is a sparse-attention or MoE layer
    (transformers' ``MiniMaxM3VLTextConfig`` reads them so). A KeyError where a kind is in
    neither."""
    sparse = text.get("sparse_attention_config") or {}
    if "layer_types" in text:
        attention = list(text["layer_types"])
    else:
        freq = sparse["sparse_attention_freq"]
        attention = ["minimax_m3_sparse" if f else "full_attention" for f in freq]
    if "mlp_layer_types" in text:
        mlp = list(text["mlp_layer_types"])
    else:
        mlp = ["sparse" if f else "dense" for f in text["moe_layer_freq"]]
    index_dim = text.get("index_head_dim", sparse.get("sparse_index_dim"))
    return attention, mlp, None if index_dim is None else int(index_dim)


def humming_layers(
    text: dict[str, Any], tensor_parallel_size: int, expert_parallel_size: int, moe_gemm_type: str
) -> list[HummingLayer]:
    """The distinct Humming GEMMs of one rank of MiniMax M3 (``text``: its text config, in
    either schema: :func:`layer_kinds`), as vLLM 0.34.0's model builds them
    (vllm/models/minimax_m3/nvidia/model.py): attention's fused projection (q, k, v, and on
    sparse layers index_q and index_k) and o_proj, the dense layers' MLP
    (``dense_intermediate_size``), the MoE layers' shared expert and routed experts (both
    ``intermediate_size``). KV and index-q heads shard while there are at least
    N of them, else each rank holds one; index_k is one head on every rank. Under expert
    parallelism (``expert_parallel_size`` > 1: TP x DP ranks) a rank holds that share of the
    experts whole, else every expert at 1/TP of its width. Speculative drafts are not here."""
    tp = tensor_parallel_size
    try:
        hidden = int(text["hidden_size"])
        heads = _per_rank(int(text["num_attention_heads"]), tp, "num_attention_heads")
        head_dim = int(text.get("head_dim") or hidden // int(text["num_attention_heads"]))
        kv = max(1, int(text["num_key_value_heads"]) // tp)
        layer_types, mlp_types, index_dim = layer_kinds(text)
        index_dim = index_dim or head_dim
        intermediate = int(text["intermediate_size"])
        dense_intermediate = int(text.get("dense_intermediate_size", intermediate))
        experts = int(text["num_local_experts"])
    except (KeyError, TypeError, ValueError) as error:
        raise PrebuildError(f"config.json: not MiniMax M3's text config ({error!r})") from None
    q, kv_width = heads * head_dim, kv * head_dim
    found: dict[tuple[int, int, int, str], list[str]] = {}

    def add(name: str, n: int, k: int, e: int = 0, gemm: str = "dense") -> None:
        found.setdefault((n, k, e, gemm), []).append(name)

    if any(t != "minimax_m3_sparse" for t in layer_types):
        add("qkv_proj (full attention)", q + 2 * kv_width, hidden)
    if "minimax_m3_sparse" in layer_types:
        add("qkv_proj with the indexer", q + 2 * kv_width + kv * index_dim + index_dim, hidden)
    add("o_proj", hidden, q)
    if "dense" in mlp_types:
        width = _per_rank(dense_intermediate, tp, "dense_intermediate_size")
        add("dense MLP gate_up_proj", 2 * width, hidden)
        add("dense MLP down_proj", hidden, width)
    if "sparse" in mlp_types:
        shared = _per_rank(intermediate, tp, "intermediate_size")
        add("shared expert gate_up_proj", 2 * shared, hidden)
        add("shared expert down_proj", hidden, shared)
        if expert_parallel_size > 1:
            local = _per_rank(experts, expert_parallel_size, "num_local_experts")
            width = intermediate
        else:
            local, width = experts, _per_rank(intermediate, tp, "intermediate_size")
        add("experts w13", 2 * width, hidden, local, moe_gemm_type)
        add("experts w2", hidden, width, local, moe_gemm_type)
    return [
        HummingLayer(" + ".join(names), n, k, e, gemm) for (n, k, e, gemm), names in found.items()
    ]


def moe_gemm_type(expert_parallel: bool) -> str:
    """vLLM's choice of Humming's MoE GEMM (``get_humming_moe_gemm_type``):
    ``VLLM_HUMMING_MOE_GEMM_TYPE``, else grouped under expert parallelism, else indexed."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.experts.fused_humming_moe import (
        get_humming_moe_gemm_type,
    )

    moe = SimpleNamespace(moe_parallel_config=SimpleNamespace(use_ep=expert_parallel))
    return str(get_humming_moe_gemm_type(moe))  # type: ignore[arg-type]


def plan(
    config_json: dict[str, Any],
    tensor_parallel_size: int,
    expert_parallel_size: int,
    gpu: GpuTarget,
) -> HummingPlan:
    """The layers to build for ``gpu``, or why none (not MXFP8, a GPU not known here, or a
    Humming setting of vLLM's other than its default, which the prebuild does not follow)."""
    if gpu.name not in KNOWN_GPUS:
        return HummingPlan(
            gpu.name, [], f"Humming's device properties are known here for {KNOWN_GPUS} only"
        )
    if not is_mxfp8(config_json):
        return HummingPlan(
            gpu.name, [], "the checkpoint is not MXFP8 (its Humming kernels are not prebuilt)"
        )
    from vllm import envs

    for variable in ("VLLM_HUMMING_INPUT_QUANT_CONFIG", "VLLM_HUMMING_USE_F16_ACCUM"):
        if getattr(envs, variable):
            why = f"{variable} is set (the prebuild builds vLLM's defaults)"
            return HummingPlan(gpu.name, [], why)
    if envs.VLLM_BATCH_INVARIANT:
        return HummingPlan(
            gpu.name, [], "VLLM_BATCH_INVARIANT is set (the prebuild builds vLLM's defaults)"
        )
    text = config_json.get("text_config") or config_json
    gemm = moe_gemm_type(expert_parallel_size > 1)
    layers = humming_layers(text, tensor_parallel_size, expert_parallel_size, gemm)
    return HummingPlan(gpu.name, layers)


def plans_for(configs: list[Path], model: str, gpus: list[GpuTarget]) -> list[HummingPlan]:
    """One plan per GPU and distinct set of layers of ``configs`` served with ``model``: from
    its ``config.json`` here (a directory, or the Hugging Face cache), else from the one this
    package knows for the published MXFP8 checkpoint's name, else none (why)."""
    from vllm_minimax.prebuild_inputs import known_config_json, read_config_json
    from vllm_minimax.serve_config import ServeConfigError, read_serve_options, serve_config_of

    found = read_config_json(model) or known_config_json(model)
    if found is None:
        why = f"no config.json for {model} here to tell its quantization (pass --model DIR)"
        return [HummingPlan(gpu.name, [], why) for gpu in gpus]
    plans: dict[tuple[str, tuple[HummingLayer, ...], str | None], HummingPlan] = {}
    for config in configs:
        try:
            options = read_serve_options(config)
            tp = serve_config_of(options, config).tensor_parallel_size
        except ServeConfigError as error:
            raise PrebuildError(str(error)) from None
        dp = options.get("data-parallel-size", 1)
        dp = dp if isinstance(dp, int) and not isinstance(dp, bool) and dp > 0 else 1
        ep = tp * dp if options.get("enable-expert-parallel") is True else 1
        for gpu in gpus:
            item = plan(found[0], tp, ep, gpu)
            item.source = found[1]
            plans.setdefault((item.gpu, tuple(item.layers), item.skipped), item)
    return list(plans.values())


def device_properties(gpu: GpuTarget) -> dict[str, Any]:
    """Humming's device object's answers for ``gpu`` (:data:`HUMMING_DEVICE`)."""
    return HUMMING_DEVICE | {"name": gpu.device_name, "sm_count": gpu.sm_count}


class _Device:
    """Stands in for Humming's native device value: the given properties, nothing else."""

    def __init__(self, properties: dict[str, Any]) -> None:
        self._properties = properties

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._properties:
            raise PrebuildError(
                f"Humming asked the device's {name!r}, which the prebuild does not know"
            )
        return self._properties[name]


@contextlib.contextmanager
def humming_device(properties: dict[str, Any]) -> Iterator[None]:
    """Humming's device 0 (and current device) answers from ``properties``, and vLLM's
    Humming schema sees SM90, inside the block; torch's CUDA device guard is a no-op where
    torch has no GPU (Humming only scopes its work to device 0 with it)."""
    import torch
    from humming import device as hd
    from humming import tune

    from vllm_minimax.probe import platform_override, simulated_cuda_platform

    value = _Device(properties)
    info = object.__new__(hd.DeviceInfo)
    info._index, info._value = 0, value
    saved = (hd.current_device._value, hd.DeviceInfo._instances.get(0), torch.cuda.device)
    tune._get_heuristics_config.cache_clear()  # keyed by device index, not by device
    hd.current_device._value = value
    hd.DeviceInfo._instances[0] = info
    if not torch.cuda.is_available():
        torch.cuda.device = lambda _index: contextlib.nullcontext()  # type: ignore[assignment]
    schema = "vllm.model_executor.layers.quantization.utils.humming.schema"
    try:
        with platform_override(simulated_cuda_platform((9, 0)), (schema,)):
            yield
    finally:
        tune._get_heuristics_config.cache_clear()
        hd.current_device._value = saved[0]
        if saved[1] is None:
            hd.DeviceInfo._instances.pop(0, None)
        else:
            hd.DeviceInfo._instances[0] = saved[1]
        torch.cuda.device = saved[2]  # type: ignore[assignment]


def kernel_calls(layers: list[HummingLayer]) -> list[tuple[HummingLayer, str, str, str | None]]:
    """For each layer, the (layer config, compute config, tuning config) strings vLLM hands
    ``HummingKernel.prepare_kernels`` at its first forward, on the device installed now
    (:func:`humming_device`). Dense layers pass no tuning (Humming tunes them itself,
    ``get_humming_linear_compute_config``); the experts pass their tuning as JSON
    (``HummingExpertsBase.init_humming_moe``)."""
    import torch
    from humming.schema import BaseWeightSchema, HummingInputSchema
    from humming.transform import prepare_layer_config
    from humming.tune import get_heuristics_config
    from vllm.model_executor.layers.quantization.utils.humming.schema import (
        check_and_fallback_input_schema,
        quant_key_to_input_schema,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp8Dynamic

    dtype = torch.bfloat16
    calls = []
    for layer in layers:
        moe = layer.num_experts > 0
        weight = BaseWeightSchema.from_config(MOE_WEIGHT_CONFIG if moe else LINEAR_WEIGHT_CONFIG)
        given = (
            HummingInputSchema.from_config({}) if moe else quant_key_to_input_schema(kMxfp8Dynamic)
        )
        inputs = check_and_fallback_input_schema(
            weight_schema=weight, input_schema=given, param_dtype=dtype
        )
        config = prepare_layer_config(
            shape_n=layer.shape_n,
            shape_k=layer.shape_k,
            weight_schema=weight.to_humming_schema(dtype),
            input_schema=inputs,
            num_experts=layer.num_experts or None,
            pad_n_to_multiple=PAD_N,
            pad_k_to_multiple=PAD_K,
            has_bias=False,
            torch_dtype=dtype,
            device=0,
        )
        compute = {
            "use_batch_invariant": False,
            "use_f16_accum": False,
            "gemm_type": layer.gemm_type,
        }
        tuning = None
        if moe:
            tuning = json.dumps(
                get_heuristics_config(
                    layer_config=config,
                    use_f16_accum=False,
                    use_batch_invariant=False,
                    gemm_type=layer.gemm_type,
                    device=0,
                )
            )
        calls.append((layer, config.to_str(), json.dumps(compute), tuning))
    return calls


@contextlib.contextmanager
def recorded_kernels() -> Iterator[list[str]]:
    """Humming's kernels compile as they would at the start, and are not registered with its
    launcher (that needs a GPU): the list collects each one's ``kernel.cubin`` path."""
    from humming.kernel.humming import HummingKernel

    paths: list[str] = []
    saved = HummingKernel.register_kernel

    def record(kernel: Any) -> None:
        paths.append(kernel.kernel_filename)
        kernel.kernel_id, kernel.kernel_name = -1, ""

    HummingKernel.register_kernel = record  # type: ignore[method-assign]
    HummingKernel._str2kernel_cache.clear()
    try:
        yield paths
    finally:
        HummingKernel.register_kernel = saved  # type: ignore[method-assign]
        HummingKernel._str2kernel_cache.clear()


def cache_dir() -> Path:
    """The directory the server's Humming reads: ``$HUMMING_CACHE_DIR``, else Humming's
    default (``humming.utils.jit.get_humming_cache_dir``)."""
    from humming.utils import jit

    return Path(jit.get_humming_cache_dir())


def check_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise PrebuildError(
            f"Humming's cache {directory} cannot be created ({error.strerror})"
        ) from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PrebuildError(f"Humming's cache {directory} is not writable")


def check_compiler() -> str:
    """Humming's compiler here, as the start would pick it, with its include directories (in
    the kernels' keys: the server must see the same CUDA_HOME); an error where it cannot run."""
    from humming.jit.runtime import KernelRuntime

    compiler = KernelRuntime._get_compiler()
    try:
        includes = getattr(compiler, "_get_include_dirs", compiler.include_dirs)()
        return f"{compiler.__name__} ({compiler.signature()}, includes {' '.join(includes)})"
    except Exception as error:  # any failure means it cannot build here
        raise PrebuildError(f"Humming's {compiler.__name__} cannot run here: {error}") from None


def check_ready(plans: list[HummingPlan], gpus: dict[str, GpuTarget]) -> str:
    """Before anything is written: the cache is writable and Humming's compiler runs here
    (what :func:`check_compiler` says), for plans with layers to build; an error otherwise."""
    todo = [p for p in plans if not p.skipped]
    if not todo:
        return "nothing to build"
    check_writable(cache_dir())
    with humming_device(device_properties(gpus[todo[0].gpu])):  # the compiler asks is_ppu
        return check_compiler()


def build(calls: list[tuple[HummingLayer, str, str, str | None]]) -> list[str]:
    """Build every call's kernels through ``HummingKernel.prepare_kernels`` (device 0, the
    installed one); the distinct ``kernel.cubin`` paths, built now or found. A kernel that
    does not compile, or a cache that fills, is a :class:`PrebuildError` naming the layer;
    the kernels finished before it stay in the cache."""
    from humming.kernel.humming import HummingKernel

    with recorded_kernels() as paths:
        for layer, layer_config, compute, tuning in calls:
            try:
                HummingKernel.prepare_kernels(layer_config, compute, tuning, 0)
            except (RuntimeError, OSError) as error:
                raise PrebuildError(
                    f"Humming could not build the kernels of {layer.name}"
                    f" ({layer.shape_n}x{layer.shape_k}): {error}"
                    " (the kernels it finished stay in the cache)"
                ) from None
    return sorted(set(paths))


def prebuild(
    plans: list[HummingPlan],
    gpus: dict[str, GpuTarget],
    dry_run: bool,
    say: Any,
    ready: str | None = None,
) -> int:
    """Build the plans' kernels into :func:`cache_dir` (enumerate only in a dry run), saying
    what it did in one line per GPU; the number of kernels built now. ``ready`` is what
    :func:`check_ready` said of these plans, where the caller checked before writing anything
    else (else it is checked here)."""
    directory = cache_dir()
    todo = [p for p in plans if not p.skipped]
    for skipped in (p for p in plans if p.skipped):
        say(f"humming ({skipped.gpu}): skipped: {skipped.skipped}")
    if not todo:
        return 0
    for source in dict.fromkeys(p.source for p in todo if p.source):
        say(f"humming: layer shapes from {source}")
    if not dry_run:
        say(f"humming: {ready or check_ready(todo, gpus)}, cache {directory}")
    built_now = 0
    for item in todo:
        with humming_device(device_properties(gpus[item.gpu])):
            calls = kernel_calls(item.layers)
            if dry_run:
                say(f"humming ({item.gpu}): {len(calls)} layer shapes (dry run: nothing built)")
                continue
            before = {p.parent.name for p in directory.glob("*/kernel.cubin")}
            paths = build(calls)
        new = [p for p in paths if Path(p).parent.name not in before]
        built_now += len(new)
        say(
            f"humming ({item.gpu}): {len(paths)} GEMM kernels of {len(calls)} layer shapes,"
            f" {len(new)} built, {len(paths) - len(new)} already there"
        )
    return built_now
