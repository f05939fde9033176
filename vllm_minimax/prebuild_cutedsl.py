"""vLLM's CuTe-DSL router GEMMs of a serving config, compiled for SM90 without a GPU.

vLLM 0.34.0's ``GateLinear`` (the MoE router of every MiniMax M3 MoE layer: an fp32 weight of
``num_local_experts x hidden_size``) registers JIT warm-up keys when it is built:
``LLFp32WGemm`` (1 to 32 tokens, bf16 and fp32 activations) for a gate shape without a
precompiled fp32 kernel, and on SM90 ``Sm90BF16x3RouterGemmKernel`` (one key per tile config
its ``_pick_config`` picks for 1 to ``max_num_batched_tokens`` tokens, from the GPU's SM count).
Patch 0010 keeps each compiled executor in ``$VLLM_CACHE_ROOT/cutedsl/<kernel>/<digest>.o``
and ``.json``, named by a hash of the kernel, the key and everything else that changes the
code (``jit_warmup_cutedsl_cache.cache_factors``), and loads it at the next start.

This module builds those entries on the CPU from vLLM's own code: the gate is built as the
model builds it, inside a ``JitWarmupRegistry``, on a simulated SM90 GPU of the target's SM
count and memory; the registry's own ``warmup`` expands the registrations (its
``compile_many`` only records the keys); each key is compiled through the patched kernel's own
``compile``, which writes the entry. Then every key must load from the cache with
``cute.compile`` refused, or the prebuild fails.

Constraints:

- What the GPU would answer is stood in for: the device's SM count (``num_compute_units``,
  ``torch.accelerator.current_device_index``), PDL support (``use_pdl``: vLLM's CUDA platform
  says yes from SM90 on) and ``LLFp32WGemm``'s CUDA stream argument (a fake stream, which gives
  the executor the same ``Stream`` parameter). The CuTe DSL must target ``sm_90a``
  (``CUTE_DSL_ARCH``, set before it is imported): the string it computes on an SM90 device.
- An entry's digest holds the CuTe DSL's settings, among them the path of its runtime library
  (``shared_libs``: the install's ``cu<N>/lib``, the toolkit flavour the CUDA driver picks, the
  newest where there is none), and a hash of the CuTe-DSL stack's and the kernels' files: a
  server finds these entries only where it runs the same Python environment, at the same path,
  with a driver that picks the same flavour (the image that built them). Another one compiles
  as without them.
- ``VLLM_DISABLE_CUTEDSL_CACHE``, ``VLLM_BATCH_INVARIANT``, or an engine whose JIT warm-up is
  off: nothing to build (said so).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm_minimax.prebuild_inputs import (
    EngineSettings,
    GpuTarget,
    ModelGeometry,
    PrebuildError,
    model_config_json,
    read_engine_settings,
)

CACHE_MODULE = "vllm.model_executor.warmup.jit_warmup_cutedsl_cache"
GATE_MODULE = "vllm.model_executor.layers.fused_moe.router.gate_linear"
LL_FP32W_MODULE = "vllm.model_executor.kernels.linear.cute_dsl.ll_fp32w"
BF16X3_MODULE = "vllm.model_executor.layers.fused_moe.router.bf16x3_router_gemm_sm90"
SM90_ARCH = "sm_90a"


@dataclass(frozen=True)
class GateShape:
    """The router gate of the model's MoE layers: ``GateLinear(hidden_size, num_experts)``."""

    hidden_size: int
    num_experts: int


@dataclass
class CuteDslPlan:
    """The keys one GPU's engine registers, per kernel class, or why there are none."""

    gpu: str
    max_num_batched_tokens: int = 0
    keys: dict[type, list[Any]] = field(default_factory=dict)
    skipped: str | None = None
    configs: list[str] = field(default_factory=list)

    def describe(self) -> str:
        counts = ", ".join(f"{len(keys)} {cls.__qualname__}" for cls, keys in self.keys.items())
        return f"{counts} keys (max_num_batched_tokens {self.max_num_batched_tokens})"


# --- what the engine registers ----------------------------------------------------------------


def gate_shape(model: str) -> tuple[GateShape | None, str]:
    """The gate of ``model``'s MoE layers (None: it has none) and where that came from
    (``prebuild_inputs.model_config_json``)."""
    from vllm_minimax.prebuild_humming import layer_kinds

    config, source = model_config_json(model)
    text = config.get("text_config") or config
    try:
        _, mlp, _ = layer_kinds(text)
        shape = GateShape(int(text["hidden_size"]), int(text["num_local_experts"]))
    except (KeyError, TypeError, ValueError) as error:
        raise PrebuildError(f"{source}: not MiniMax M3's text config ({error!r})") from None
    return (shape if "sparse" in mlp else None), source


def sm90_platform(gpu: GpuTarget) -> Any:
    """vLLM's platform answering as ``gpu`` (``prebuild_geometry.simulated_gpu_platform``) and
    as vLLM's CUDA platform does there for the router GEMMs: PDL from SM90 on
    (``CudaPlatform.is_arch_support_pdl``) and the GPU's SM count."""
    from vllm_minimax.prebuild_geometry import simulated_gpu_platform

    base = type(simulated_gpu_platform(gpu))
    sm_count = gpu.sm_count

    class Sm90Gpu(base):  # type: ignore[misc, valid-type]
        @classmethod
        def is_arch_support_pdl(cls) -> bool:
            return bool(cls.get_device_capability().major >= 9)

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return sm_count

    return Sm90Gpu()


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


@contextlib.contextmanager
def sm90_device(gpu: GpuTarget) -> Iterator[Any]:
    """Inside the block the gate and the router GEMMs' warm-up see ``gpu``: vLLM's platform in
    ``gate_linear`` and the SM count, PDL and CUDA stream the kernels ask of the device."""
    import cutlass.cute as cute
    import torch

    from vllm_minimax.probe import platform_override

    platform = sm90_platform(gpu)
    ll_fp32w = importlib.import_module(LL_FP32W_MODULE)
    with contextlib.ExitStack() as stack:
        stack.enter_context(platform_override(platform, (GATE_MODULE,)))
        stack.enter_context(_patched(ll_fp32w, "use_pdl", platform.is_arch_support_pdl))
        fake_stream = lambda: cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=False)  # noqa: E731
        stack.enter_context(_patched(ll_fp32w, "current_cuda_stream", fake_stream))
        if importlib.util.find_spec(BF16X3_MODULE) is not None:
            bf16x3 = importlib.import_module(BF16X3_MODULE)
            stack.enter_context(_patched(bf16x3, "num_compute_units", platform.num_compute_units))
            stack.enter_context(_patched(torch.accelerator, "current_device_index", lambda: 0))
        yield platform


@contextlib.contextmanager
def _one_rank() -> Iterator[None]:
    """vLLM's tensor-parallel group of one rank, for building a replicated layer (the gate)."""
    from vllm.distributed import parallel_state

    with _patched(parallel_state, "_TP", SimpleNamespace(rank_in_group=0, world_size=1)):
        yield


def _vllm_config(max_num_batched_tokens: int, max_num_seqs: int) -> Any:
    from vllm.config import DeviceConfig, SchedulerConfig, VllmConfig

    scheduler = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_num_batched_tokens,
        is_encoder_decoder=False,
    )
    return VllmConfig(scheduler_config=scheduler, device_config=DeviceConfig(device="cpu"))


def registered_keys(
    gate: GateShape, max_num_batched_tokens: int, max_num_seqs: int, gpu: GpuTarget
) -> dict[type, list[Any]]:
    """Per kernel class, the compile keys vLLM's JIT warm-up compiles for an engine with this
    gate and these batch bounds on ``gpu``: the gate is built as MiniMax M3's MoE builds it
    (fp32 weight, fp32 logits, no bias) while a ``JitWarmupRegistry`` collects, and the
    registry's ``warmup`` expands them, each kernel's ``compile_many`` recording instead of
    compiling. The gate reads ``max_num_batched_tokens``; vLLM's scheduler config checks
    ``max_num_seqs`` against it."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    gate_linear = importlib.import_module(GATE_MODULE)
    vllm_config = _vllm_config(max_num_batched_tokens, max_num_seqs)
    registry = JitWarmupRegistry(vllm_config)
    found: dict[type, list[Any]] = {}
    with sm90_device(gpu), _one_rank(), set_current_vllm_config(vllm_config):
        with registry.activate():
            gate_linear.GateLinear(
                gate.hidden_size,
                gate.num_experts,
                bias=False,
                params_dtype=torch.float32,
                out_dtype=torch.float32,
                prefix="model.layers.0.block_sparse_moe.gate",
            )
        kernels = list(registry._registrations)
        for kernel in kernels:
            kernel.compile_many = _recorder(found.setdefault(type(kernel), []))
        try:
            # Its progress bar would count compiles that do not happen here.
            with contextlib.redirect_stderr(io.StringIO()):
                registry.warmup()
        finally:
            for kernel in kernels:
                del kernel.compile_many
    return {cls: keys for cls, keys in found.items() if keys}


def _recorder(into: list[Any]) -> Callable[[Any], None]:
    return lambda keys: into.extend(keys)


def plans_for(
    configs: list[Path],
    kv_cache_dtypes: list[str | None],
    model: str,
    geometry: ModelGeometry,
    gpus: list[GpuTarget],
) -> list[CuteDslPlan]:
    """One plan per GPU and distinct key set of the engines of ``configs`` served with
    ``model`` (a config whose JIT warm-up is off, or a cache turned off: a plan saying why)."""
    from vllm import envs

    from vllm_minimax.prebuild_geometry import engine_shape

    if importlib.util.find_spec(CACHE_MODULE) is None:
        raise PrebuildError(
            "this vLLM lacks the series' CuTe-DSL kernel cache (patch 0010): run"
            " `vllm-minimax apply` first"
        )
    gate, source = gate_shape(model)
    plans: dict[tuple, CuteDslPlan] = {}

    def add(item: CuteDslPlan, label: str) -> None:
        key = (item.gpu, item.skipped, tuple((c, tuple(k)) for c, k in item.keys.items()))
        plans.setdefault(key, item).configs.append(label)

    for config in configs:
        for kv_cache_dtype in kv_cache_dtypes:
            settings = read_engine_settings(config, kv_cache_dtype)
            label = str(config) + (f" --kv-cache-dtype {kv_cache_dtype}" if kv_cache_dtype else "")
            for gpu in gpus:
                why = _nothing_to_build(settings, gate, source, envs.VLLM_DISABLE_CUTEDSL_CACHE)
                if why is not None:
                    add(CuteDslPlan(gpu.name, skipped=why), label)
                    continue
                assert gate is not None
                shape = engine_shape(settings, geometry, gpu)
                tokens = shape.max_num_batched_tokens
                keys = registered_keys(gate, tokens, shape.max_num_seqs, gpu)
                plan = CuteDslPlan(gpu.name, tokens, keys)
                if not keys:
                    plan.skipped = f"vLLM's GateLinear registers no CuTe-DSL key for {gate}"
                add(plan, label)
    return list(plans.values())


def _nothing_to_build(
    settings: EngineSettings, gate: GateShape | None, source: str, disabled: bool
) -> str | None:
    if disabled:
        return "VLLM_DISABLE_CUTEDSL_CACHE is set: the server keeps no CuTe-DSL kernel on disk"
    if settings.warmup_off:
        return f"{settings.warmup_off} (the engine registers no JIT warm-up key)"
    if gate is None:
        return f"{source} has no MoE layer (no router gate)"
    return None


# --- building and checking the entries --------------------------------------------------------


def cache_dir() -> Path:
    """Where the server's vLLM reads the entries: ``$VLLM_CACHE_ROOT/cutedsl``."""
    return Path(importlib.import_module(CACHE_MODULE).cache_dir())


def check_ready(plans: list[CuteDslPlan]) -> str:
    """Before anything is written: the CuTe DSL targets SM90a and the cache is writable, for
    plans with keys; what it found, or an error."""
    if not any(p.keys and not p.skipped for p in plans):
        return "nothing to build"
    settings = importlib.import_module(CACHE_MODULE).cute_dsl_settings()
    if f"arch='{SM90_ARCH}'" not in settings:
        raise PrebuildError(
            f"the CuTe DSL compiles for another arch than {SM90_ARCH} ({settings}): set"
            f" CUTE_DSL_ARCH={SM90_ARCH} before anything imports cutlass"
        )
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise PrebuildError(
            f"vLLM's CuTe-DSL cache {directory} cannot be created ({error.strerror}; set"
            " VLLM_CACHE_ROOT to the directory the server reads)"
        ) from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PrebuildError(f"vLLM's CuTe-DSL cache {directory} is not writable")
    return f"arch {SM90_ARCH}"


class _NotLoaded(Exception):
    """Raised by the stand-in for ``cute.compile`` while the entries are checked."""


def loads(cls: type, key: Any) -> bool:
    """Whether a fresh ``cls`` gets ``key``'s executor from the cache, ``cute.compile``
    refused (as a start whose entry is current runs it)."""
    import cutlass.cute as cute

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise _NotLoaded

    with _patched(cute, "compile", refuse):
        try:
            cls().compile(key)
        except _NotLoaded:
            return False
    return True


def _first_line(error: Exception) -> str:
    """The DSL's error without its colours and source excerpt."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
    return text.splitlines()[0] if text else type(error).__name__


def build(cls: type, keys: list[Any]) -> list[Any]:
    """Compile the keys through ``cls``'s own ``compile`` (patch 0010 writes each entry); the
    keys built now. A compile that fails is a :class:`PrebuildError` naming the key."""
    built = []
    for key in keys:
        if loads(cls, key):
            continue
        try:
            cls().compile(key)
        except Exception as error:  # the DSL raises its own error types
            raise PrebuildError(
                f"the CuTe DSL could not compile {cls.__qualname__} {key!r}: {_first_line(error)}"
                " (the entries finished before it stay in the cache)"
            ) from None
        built.append(key)
    return built


def prebuild(
    plans: list[CuteDslPlan],
    gpus: dict[str, GpuTarget],
    dry_run: bool,
    say: Callable[[str], None],
    ready: str | None = None,
) -> int:
    """Build the plans' entries into :func:`cache_dir` (list them only in a dry run) and
    check that each loads, saying so in a line per plan and one in all; the entries in all."""
    for item in plans:
        why = item.skipped or item.describe()
        say(f"cutedsl ({item.gpu}): {why} [{'; '.join(item.configs)}]")
    todo: dict[type, dict[Any, None]] = {}
    for item in plans:
        if not item.skipped:
            for cls, keys in item.keys.items():
                todo.setdefault(cls, {}).update(dict.fromkeys(keys))
    total = sum(len(keys) for keys in todo.values())
    if not total or dry_run:
        if total:
            say(f"cutedsl: {total} entries (dry run: nothing built)")
        return total
    directory = cache_dir()
    say(f"cutedsl: {ready or check_ready(plans)}, cache {directory}")
    began = time.perf_counter()
    built = 0
    for item in plans:
        if item.skipped:
            continue
        with sm90_device(gpus[item.gpu]):
            for cls, keys in item.keys.items():
                built += len(build(cls, keys))
            unloaded = [
                f"{cls.__qualname__} {key!r}"
                for cls, keys in item.keys.items()
                for key in keys
                if not loads(cls, key)
            ]
        if unloaded:
            raise PrebuildError(
                f"{len(unloaded)} CuTe-DSL entries do not load after their compile (the"
                f" warning above says why), the first: {unloaded[0]}"
            )
    say(
        f"cutedsl: {total} entries, {built} built, {total - built} already there, in"
        f" {time.perf_counter() - began:.1f}s; each loads with no cute.compile"
    )
    return total
