"""``vllm-minimax warmup --prebuild``: a serving config's FlashInfer programs, built without a GPU.

At start-up the patched engine's warm-ups build every FlashInfer MSA program it can reach:
patch 0004 the indexer's (``msa_proxy_score``, ``msa_topk_select``), patch 0007 the sparse
attention's with an fp8 KV cache (``msa_sparse_decode_attention``, ``msa_sparse_attention``).
This command makes the same calls, from the warm-ups' own code, on the CPU: FlashInfer picks
each program as on an SM90 GPU with the target's SM count (``flashinfer_offline``), and the
programs are compiled into the JIT cache the engine reads, nvcc programs with FlashInfer's own
build (ninja, side by side) and CuTe-DSL kernels with FlashInfer's own compile and export.
Then each nvcc program is checked the way FlashInfer will check it at start (ninja finds
nothing to do) and each CuTe-DSL kernel against FlashInfer's own cache key.

What decides the geometry is read without vLLM's engine (which needs a GPU to configure): the
serving YAML's keys the warm-ups read, the model's ``config.json`` (or MiniMax M3's published
geometry for its checkpoints), and, for what the YAML leaves unset, vLLM's own batch defaults
for the target GPU's memory. Which backends run is asked of the patched vLLM's own selection on
a simulated SM90 GPU (``probe``).

Beside the cache (``<version>/<arch>/`` + ``PREBUILD_MANIFEST``) it records what the programs
were built with; the engine's warm-up compares that with its own FlashInfer, CUDA toolkit and
CuTe-DSL stack before using them (patch 0004, ``check_prebuilt_programs``).
"""

from __future__ import annotations

import argparse
import fnmatch
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_minimax import flashinfer_offline as offline
from vllm_minimax import warmup
from vllm_minimax.serve_config import (
    ServeConfigError,
    mapping_option,
    read_serve_options,
    serve_config_of,
)

INDEXER_WARMUP_MODULE = "vllm.models.minimax_m3.nvidia.indexer_flashinfer_warmup"
SPARSE_ATTENTION_MODULE = "vllm.models.minimax_m3.nvidia.sparse_attention_flashinfer"
INDEXER_FLASHINFER_IMPL = "MiniMaxM3IndexerFlashInferImpl"
SPARSE_ATTENTION_FLASHINFER_IMPL = "MiniMaxM3SparseFlashInferImpl"
# Checkpoints whose config.json this package knows without reading it: MiniMax M3's published
# text config (tiny_model.M3_TEXT_CONFIG).
M3_CHECKPOINT_PREFIX = "MiniMaxAI/MiniMax-M3"
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
ENV_VARIABLES = {
    "FLASHINFER_CUDA_ARCH_LIST": offline.SM90_ARCH_LIST,
    "CUTE_DSL_ARCH": offline.SM90_CUTE_DSL_ARCH,
}


class PrebuildError(warmup.WarmupError):
    """Bad input or an environment that cannot build: one message, exit status 2."""


@dataclass(frozen=True)
class GpuTarget:
    """What of an SM90 GPU decides the programs: the SM count (FlashInfer's planners) and
    the memory and name (vLLM's default batch sizes)."""

    name: str
    sm_count: int
    memory_gib: float
    device_name: str


GPU_TARGETS: dict[str, GpuTarget] = {
    target.name: target
    for target in (
        GpuTarget("h100", 132, 79.19, "NVIDIA H100 80GB HBM3"),
        GpuTarget("h200", 132, 139.8, "NVIDIA H200"),
        GpuTarget("h100-pcie", 114, 79.19, "NVIDIA H100 PCIe"),
        GpuTarget("h20", 78, 95.0, "NVIDIA H20"),
    )
}
DEFAULT_GPUS = ("h100", "h200")


@dataclass(frozen=True)
class ModelGeometry:
    """The model's attention and indexer shape, whole (before tensor parallelism)."""

    source: str
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    index_heads: int
    index_head_dim: int
    topk_blocks: int
    sparse_block_size: int
    max_position_embeddings: int | None


@dataclass(frozen=True)
class EngineSettings:
    """The serving config's values that decide the warm-ups' programs (None: unset)."""

    config: Path
    tensor_parallel_size: int
    decode_context_parallel_size: int
    max_model_len: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    num_speculative_tokens: int
    kv_cache_dtype: str
    dtype: str
    attention: dict[str, Any]
    performance_mode: str | None
    enable_chunked_prefill: bool
    warmup_off: str | None  # why the engine's JIT warm-up would not run, or None


@dataclass(frozen=True)
class EngineShape:
    """The numbers the warm-ups read on one GPU, and where each came from."""

    gpu: GpuTarget
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    sources: dict[str, str]


@dataclass
class Plan:
    """The warm-up geometries of an engine on one GPU, the programs they reach, and the
    configs (with the KV-cache dtype given) whose engines have these geometries."""

    gpu: GpuTarget
    indexer: Any | None = None
    indexer_reason: str | None = None
    sparse_attention: Any | None = None
    sparse_attention_reason: str | None = None
    nvcc: list[str] = field(default_factory=list)
    cute_dsl: list[str] = field(default_factory=list)
    configs: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[int, str, str]:
        return (self.gpu.sm_count, repr(self.indexer), repr(self.sparse_attention))


# --- FlashInfer's own prebuilt kernels in an environment -----------------------------------

# FlashInfer's kernel wheels: downloaded cubins, and the AOT JIT cache (a shim and one provider
# per architecture, ``flashinfer-jit-cache-<arch>``).
CUBIN_WHEEL = "flashinfer-cubin"
JIT_CACHE_WHEEL = "flashinfer-jit-cache"


def installed_distributions() -> dict[str, str]:
    """Every installed distribution's normalized name and version."""
    import importlib.metadata
    import re

    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[re.sub(r"[-_.]+", "-", name).lower()] = dist.version
    return found


def mismatched_kernel_wheels(installed: dict[str, str], flashinfer: str) -> list[str]:
    """FlashInfer kernel wheels in ``installed`` that ``flashinfer`` ignores: a
    ``flashinfer-cubin`` of another version (``flashinfer/jit/env.py``,
    ``_check_cubin_version``), a ``flashinfer-jit-cache`` shim or provider whose version is
    neither ``flashinfer``'s nor it plus a local CUDA suffix (``_check_jit_cache_version``).
    The base vLLM image installs both for the FlashInfer it pins (0.7.3 for v0.34.0)."""
    stale = []
    for name, version in sorted(installed.items()):
        if name == CUBIN_WHEEL:
            matches = version == flashinfer
        elif name == JIT_CACHE_WHEEL or name.startswith(f"{JIT_CACHE_WHEEL}-"):
            matches = version == flashinfer or version.startswith(f"{flashinfer}+")
        else:
            continue
        if not matches:
            stale.append(name)
    return stale


# --- what the engine would run ------------------------------------------------------------


def _integer(options: dict[str, Any], key: str, path: Path, default: int | None) -> int | None:
    value = options.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PrebuildError(
            f"{path}: {key} must be a positive integer here, got {value!r} (write it out in"
            " full: the prebuild reads integers only)"
        )
    return value


def read_engine_settings(path: Path, kv_cache_dtype: str | None = None) -> EngineSettings:
    """The keys of a `vllm serve` YAML that the warm-ups read; ``kv_cache_dtype`` overrides
    the file's (as ``--kv-cache-dtype`` on the `vllm serve` line does)."""
    try:
        options = read_serve_options(path)
        serve = serve_config_of(options, path)
        speculative = (
            mapping_option(options, "speculative-config", path)
            if options.get("speculative-config")
            else {}
        )
    except ServeConfigError as error:
        raise PrebuildError(str(error)) from None
    num_spec = speculative.get("num_speculative_tokens", 0) or 0
    if isinstance(num_spec, bool) or not isinstance(num_spec, int) or num_spec < 0:
        raise PrebuildError(f"{path}: num_speculative_tokens must be an integer, got {num_spec!r}")
    warmup_off = None
    if options.get("enforce-eager") is True:
        warmup_off = "enforce-eager: true turns vLLM's JIT warm-up off"
    kernel = options.get("kernel-config") or {}
    if isinstance(kernel, dict) and kernel.get("enable_jit_warmup") is False:
        warmup_off = "kernel-config enable_jit_warmup: false"
    performance_mode = options.get("performance-mode")
    return EngineSettings(
        config=path,
        tensor_parallel_size=serve.tensor_parallel_size,
        decode_context_parallel_size=_integer(options, "decode-context-parallel-size", path, 1)
        or 1,
        max_model_len=_integer(options, "max-model-len", path, None),
        max_num_seqs=_integer(options, "max-num-seqs", path, None),
        max_num_batched_tokens=_integer(options, "max-num-batched-tokens", path, None),
        num_speculative_tokens=num_spec,
        kv_cache_dtype=kv_cache_dtype or serve.kv_cache_dtype,
        dtype=str(options.get("dtype", "auto")),
        attention=dict(serve.attention_config),
        performance_mode=str(performance_mode) if performance_mode is not None else None,
        enable_chunked_prefill=options.get("enable-chunked-prefill", True) is not False,
        warmup_off=warmup_off,
    )


def geometry_from_config_json(config: dict[str, Any], source: str) -> ModelGeometry:
    """A MiniMax M3 ``config.json``: vLLM 0.34.0's flat ``index_*`` fields, or 0.33.0's
    ``sparse_attention_config``, at the top or under ``text_config``."""
    text = config.get("text_config") or config
    try:
        heads = int(text["num_attention_heads"])
        if "index_n_heads" in text:
            index = {
                "index_heads": int(text["index_n_heads"]),
                "index_head_dim": int(text["index_head_dim"]),
                "topk_blocks": int(text["index_topk_blocks"]),
                "sparse_block_size": int(text["index_block_size"]),
            }
        else:
            sparse = text["sparse_attention_config"]
            index = {
                "index_heads": int(sparse["sparse_num_index_heads"]),
                "index_head_dim": int(sparse["sparse_index_dim"]),
                "topk_blocks": int(sparse["sparse_topk_blocks"]),
                "sparse_block_size": int(sparse["sparse_block_size"]),
            }
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        kv_heads = int(text.get("num_key_value_heads", heads))
    except (KeyError, TypeError, ValueError) as error:
        raise PrebuildError(
            f"{source}: not a MiniMax M3 config (no attention or indexer field {error})"
        ) from None
    max_positions = text.get("max_position_embeddings")
    return ModelGeometry(
        source=source,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(max_positions) if max_positions else None,
        **index,
    )


def read_model_geometry(model: str) -> ModelGeometry:
    """``model``'s geometry: its ``config.json`` (a local directory, or the Hugging Face
    cache), else, for MiniMax M3's checkpoints, the published geometry."""
    directory = Path(model).expanduser()
    candidate: Path | None = directory / "config.json" if directory.is_dir() else None
    if candidate is None and "/" in model and not model.startswith(("/", ".")):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")
        except Exception:
            cached = None
        if isinstance(cached, str):
            candidate = Path(cached)
    if candidate is not None and candidate.is_file():
        try:
            config = json.loads(candidate.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise PrebuildError(f"{candidate}: cannot be read ({error})") from None
        return geometry_from_config_json(config, str(candidate))
    if model.startswith(M3_CHECKPOINT_PREFIX):
        from vllm_minimax.tiny_model import M3_TEXT_CONFIG

        return geometry_from_config_json(
            dict(M3_TEXT_CONFIG), f"MiniMax M3's published geometry (for {model})"
        )
    raise PrebuildError(
        f"no config.json for model {model!r} here (not a directory, not in the Hugging Face"
        " cache): pass --model DIR holding the model's config.json"
    )


def simulated_gpu_platform(target: GpuTarget) -> Any:
    """vLLM's platform answering as ``target`` (capability 9.0, its memory and name)."""
    from vllm_minimax.probe import simulated_cuda_platform

    base = type(simulated_cuda_platform((9, 0)))
    memory = int(target.memory_gib * 2**30)

    class SimulatedGpu(base):  # type: ignore[misc, valid-type]
        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return memory

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return target.device_name

    return SimulatedGpu()


def vllm_batch_defaults(target: GpuTarget, world_size: int) -> tuple[int, int]:
    """vLLM's own defaults of ``max_num_batched_tokens`` and ``max_num_seqs`` for `vllm
    serve` on ``target`` (``EngineArgs.get_batch_defaults``, on a simulated GPU)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from vllm_minimax.probe import platform_override

    with platform_override(simulated_gpu_platform(target), ("vllm.engine.arg_utils",)):
        tokens, seqs = EngineArgs.get_batch_defaults(world_size)
    context = UsageContext.OPENAI_API_SERVER
    return tokens[context], seqs[context]


def engine_shape(settings: EngineSettings, model: ModelGeometry, target: GpuTarget) -> EngineShape:
    """The lengths and batch bounds the warm-ups see on ``target``."""
    sources: dict[str, str] = {}
    max_model_len = settings.max_model_len
    sources["max_model_len"] = "config"
    if max_model_len is None:
        if model.max_position_embeddings is None:
            raise PrebuildError(
                f"{settings.config} sets no max-model-len and {model.source} states no"
                " max_position_embeddings"
            )
        max_model_len = model.max_position_embeddings
        sources["max_model_len"] = f"max_position_embeddings of {model.source}"
    tokens, seqs = settings.max_num_batched_tokens, settings.max_num_seqs
    sources["max_num_batched_tokens"] = sources["max_num_seqs"] = "config"
    if tokens is None or seqs is None:
        default_tokens, default_seqs = vllm_batch_defaults(target, settings.tensor_parallel_size)
        throughput = 2 if settings.performance_mode == "throughput" else 1
        how = f"vLLM's default for {target.device_name}"
        if tokens is None:
            tokens = default_tokens * throughput
            if not settings.enable_chunked_prefill:
                tokens = max(tokens, max_model_len)
            sources["max_num_batched_tokens"] = how
        if seqs is None:
            seqs = default_seqs * throughput
            sources["max_num_seqs"] = how
    return EngineShape(target, max_model_len, seqs, tokens, sources)


def _per_rank(total: int, tensor_parallel_size: int) -> int:
    """Heads a rank holds; KV and index heads are replicated once TP exceeds them."""
    return max(1, total // tensor_parallel_size)


def indexer_geometry(
    settings: EngineSettings, model: ModelGeometry, shape: EngineShape
) -> tuple[Any | None, str | None]:
    """Patch 0004's warm-up geometry for this engine, or ``(None, why it registers none)``."""
    import importlib

    from vllm_minimax.probe import select_indexer

    iw = importlib.import_module(INDEXER_WARMUP_MODULE)
    from vllm.models.minimax_m3.nvidia.indexer_flashinfer_gate import index_cache_is_fp8

    heads = _per_rank(model.index_heads, settings.tensor_parallel_size)
    options = {
        key: value
        for key, value in settings.attention.items()
        if key != "minimax_m3_indexer_backend"
    }
    selection = select_indexer(
        indexer_kv_dtype=None,
        topk_blocks=model.topk_blocks,
        num_index_heads=heads,
        indexer_backend=str(settings.attention.get("minimax_m3_indexer_backend", "auto")),
        capability=(9, 0),
        attention_options=options,
    )
    if selection.impl != INDEXER_FLASHINFER_IMPL:
        return None, selection.describe()
    from vllm.config import AttentionConfig

    dtype = AttentionConfig(**options).resolve_indexer_kv_dtype("bf16")
    return (
        iw.IndexerFlashInferGeometry(
            arch="sm90",
            num_index_heads=heads,
            kv_fp8=index_cache_is_fp8(dtype),
            max_query_len=1 + settings.num_speculative_tokens,
            max_num_batched_tokens=shape.max_num_batched_tokens,
            max_model_len=shape.max_model_len,
            num_sms=shape.gpu.sm_count,
        ),
        None,
    )


def sparse_attention_geometry(
    settings: EngineSettings, model: ModelGeometry, shape: EngineShape
) -> tuple[Any | None, str | None]:
    """Patch 0007's warm-up geometry for this engine, or ``(None, why it registers none)``."""
    import importlib
    import importlib.util

    from vllm_minimax.probe import select_sparse_attention

    if importlib.util.find_spec(SPARSE_ATTENTION_MODULE) is None:
        return None, "this vLLM's series has no FlashInfer sparse attention"
    if settings.dtype not in ("auto", "bfloat16", "bf16"):
        return None, f"dtype {settings.dtype}: FlashInfer's SM90 sparse attention takes bf16"
    tp = settings.tensor_parallel_size
    num_heads = model.num_attention_heads // tp
    num_kv_heads = _per_rank(model.num_key_value_heads, tp)
    selection = select_sparse_attention(
        kv_cache_dtype=settings.kv_cache_dtype,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        topk_blocks=model.topk_blocks,
        head_size=model.head_dim,
        sparse_attention_backend=str(
            settings.attention.get("minimax_m3_sparse_attention_backend", "auto")
        ),
        capability=(9, 0),
    )
    if selection.impl != SPARSE_ATTENTION_FLASHINFER_IMPL:
        return None, selection.describe()
    sa = importlib.import_module(SPARSE_ATTENTION_MODULE)
    derive = getattr(sa, "sparse_attention_warmup_geometry", None)
    if derive is None:
        raise PrebuildError(
            "the series' sparse attention has no sparse_attention_warmup_geometry: apply"
            " this checkout's series (`vllm-minimax apply`)"
        )
    geometry = derive(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        scale=model.head_dim**-0.5,
        num_speculative_tokens=settings.num_speculative_tokens,
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        max_model_len=shape.max_model_len,
        decode_context_parallel_size=settings.decode_context_parallel_size,
    )
    return geometry, None


# --- choosing and building the programs ---------------------------------------------------


class Builder:
    """The programs FlashInfer picks, collected in order; with ``build``, nvcc programs are
    built side by side as they come (FlashInfer's own ninja build, one per program) and
    CuTe-DSL kernels compiled in this process as they come."""

    def __init__(
        self, *, build: bool, jobs: int, only: list[str] | None, say: Callable[[str], None]
    ):
        self.nvcc: dict[str, str] = {}  # program name -> its JIT module (FlashInfer's name)
        self.nvcc_specs: dict[str, Any] = {}  # JIT module -> spec, when building
        self.cute_dsl: dict[str, Any] = {}  # module_dir/kernel -> JitSpecCuteDsl
        self.built: list[str] = []
        self.present: list[str] = []
        self.failed: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        self._build = build
        self._only = only
        self._say = say
        self._pool = ThreadPoolExecutor(max_workers=max(1, jobs)) if build else None
        self._pending: dict[str, Future[None]] = {}

    def wanted(self, name: str) -> bool:
        return not self._only or any(fnmatch.fnmatchcase(name, glob) for glob in self._only)

    def nvcc_program(self, name: str) -> None:
        if name in self.nvcc:
            return
        from flashinfer.jit.cake_hopper_msa import gen_hopper_msa_module, get_hopper_msa_uri

        module = self.nvcc[name] = get_hopper_msa_uri(name)
        if self._pool is not None and self.wanted(module):
            spec = self.nvcc_specs[module] = gen_hopper_msa_module(name)
            self._pending[module] = self._pool.submit(self._build_nvcc, spec)

    def _build_nvcc(self, spec: Any) -> None:
        existed = spec.jit_library_path.exists()
        mtime = spec.jit_library_path.stat().st_mtime_ns if existed else None
        began = time.perf_counter()
        spec.build(need_lock=True)
        self.seconds[spec.name] = time.perf_counter() - began
        now = spec.jit_library_path.stat().st_mtime_ns
        (self.present if existed and now == mtime else self.built).append(spec.name)

    def cute_dsl_program(self, spec: Any) -> None:
        if spec.name in self.cute_dsl:
            return
        self.cute_dsl[spec.name] = spec
        if not self._build or not self.wanted(spec.name):
            return
        if spec.is_compiled:
            self.present.append(spec.name)
            return
        began = time.perf_counter()
        try:
            spec.compile_and_persist()
        except Exception as error:
            self.failed[spec.name] = f"{type(error).__name__}: {error}"
            return
        self.seconds[spec.name] = time.perf_counter() - began
        self.built.append(spec.name)
        self._say(f"  built {spec.name} ({self.seconds[spec.name]:.1f}s)")

    def finish(self) -> None:
        """Wait for the nvcc builds; record each failure by program."""
        for name, pending in self._pending.items():
            try:
                pending.result()
            except Exception as error:
                self.failed[name] = f"{type(error).__name__}: {error}"
            else:
                if name in self.built:
                    self._say(f"  built {name} ({self.seconds[name]:.1f}s)")
        if self._pool is not None:
            self._pool.shutdown()


class _Sink:
    """``flashinfer_offline.ProgramSink`` feeding a :class:`Builder`."""

    def __init__(self, builder: Builder) -> None:
        self.builder = builder
        self.names: list[str] = []
        self.cute_names: list[str] = []

    def nvcc(self, name: str) -> None:
        if name not in self.names:
            self.names.append(name)
        self.builder.nvcc_program(name)

    def cute_dsl(self, spec: Any) -> None:
        if spec.name not in self.cute_names:
            self.cute_names.append(spec.name)
        self.builder.cute_dsl_program(spec)


def _takes_device(function: Callable[..., Any]) -> bool:
    return "device" in inspect.signature(function).parameters


def plan_programs(plan: Plan, builder: Builder) -> None:
    """Run the warm-ups' own calls of ``plan``'s geometries through FlashInfer offline; the
    programs FlashInfer picks go to ``builder`` and are listed in ``plan``."""
    import importlib

    import torch

    iw = importlib.import_module(INDEXER_WARMUP_MODULE)
    if not (_takes_device(iw._run_proxy_score) and _takes_device(iw._run_topk_select)):
        raise PrebuildError(
            "this vLLM's series predates the prebuild (its indexer warm-up runs on the GPU"
            " only): apply the current series (vllm-minimax revert, then apply)"
        )
    host = torch.device("cpu")
    sink = _Sink(builder)
    with offline.offline_sm90(plan.gpu.sm_count, sink):
        if plan.indexer is not None:
            geometry = plan.indexer
            for program in iw.indexer_flashinfer_programs(geometry):
                if isinstance(program.call, iw.ProxyScoreCall):
                    iw._run_proxy_score(
                        program.call,
                        geometry.num_index_heads,
                        iw.INDEX_HEAD_DIM,
                        geometry.kv_fp8,
                        device=host,
                    )
                else:
                    iw._run_topk_select(program.call, geometry.num_index_heads, device=host)
        if plan.sparse_attention is not None:
            sa = importlib.import_module(SPARSE_ATTENTION_MODULE)
            launches = sa.warmup_launches(plan.sparse_attention)
            buffers = sa.WarmupBuffers(plan.sparse_attention, launches, host)
            for launch in launches:
                sa.run_warmup_launch(plan.sparse_attention, *launch, buffers)
    plan.nvcc = [builder.nvcc[name] for name in sink.names]
    plan.cute_dsl = list(sink.cute_names)


def ninja_would_rebuild(spec: Any) -> str | None:
    """What FlashInfer's start-up build of ``spec`` would do: None when ninja finds nothing
    to do (the program is loaded as built), else ninja's explanation."""
    spec.write_ninja()
    ninja = shutil.which("ninja")
    if ninja is None:
        return "ninja is not on PATH"
    result = subprocess.run(
        [ninja, "-n", "-d", "explain", "-C", str(spec.build_dir), "-f", str(spec.ninja_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    output = (result.stdout + result.stderr).strip()
    if result.returncode == 0 and "no work to do" in output:
        return None
    return output or f"ninja exited {result.returncode}"


# --- the command --------------------------------------------------------------------------


def _set_environment(location: warmup.CacheLocation) -> None:
    """Point FlashInfer, before it is imported, at the cache and at SM90."""
    for name, wanted in ENV_VARIABLES.items():
        current = os.environ.get(name)
        if current not in (None, "", wanted):
            raise PrebuildError(
                f"{name}={current}: the prebuild builds SM90 programs into FlashInfer's"
                f" {offline.SM90_ARCH_DIR} cache, which needs {name} unset or {wanted}"
            )
        os.environ[name] = wanted
    os.environ[warmup.WORKSPACE_ENV] = str(location.workspace_base)


def _check_flashinfer_paths(location: warmup.CacheLocation) -> Path:
    from flashinfer.jit import env as jit_env

    jit_dir = Path(jit_env.FLASHINFER_JIT_DIR)
    expected = location.flashinfer_root / offline.VALIDATED_FLASHINFER / offline.SM90_ARCH_DIR
    if jit_dir.parent != expected:
        raise PrebuildError(
            f"FlashInfer's JIT cache is {jit_dir}, not under {expected}: FlashInfer was imported"
            " before the prebuild could point it there; run the prebuild in a fresh process"
        )
    return jit_dir


def _check_toolchain() -> str:
    """The CUDA toolkit FlashInfer's nvcc builds will use, as its own lookup finds it."""
    from flashinfer.jit import cpp_ext

    try:
        home = cpp_ext.get_cuda_path()
    except RuntimeError as error:
        raise PrebuildError(
            f"no CUDA compiler: {error} (set CUDA_HOME to a CUDA toolkit, the one the server's"
            " FlashInfer uses)"
        ) from None
    nvcc = os.environ.get("FLASHINFER_NVCC", os.path.join(home, "bin", "nvcc"))
    if not os.access(nvcc, os.X_OK):
        raise PrebuildError(f"no CUDA compiler at {nvcc} (CUDA_HOME={home})")
    if shutil.which("ninja") is None:
        raise PrebuildError("ninja is not on PATH (FlashInfer builds its nvcc programs with it)")
    return home


def _say(text: str) -> None:
    print(text, flush=True)


def _write_manifest(iw: Any, jit_dir: Path, builder: Builder, plans: list[Plan]) -> Path:
    """Record the programs built here and what they were built with (patch 0004's
    ``_prebuild_environment``, what the engine compares), merged with an earlier prebuild
    of the same setup; ``check_prebuilt_programs`` has removed one of another setup."""
    path = jit_dir.parent / iw.PREBUILD_MANIFEST
    here = iw._prebuild_environment()
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = None
    if not isinstance(old, dict) or iw.prebuilt_mismatches(old, here):
        old = {}
    nvcc = set(old.get("nvcc_programs", [])) | set(builder.nvcc_specs)
    cute = set(old.get("cute_dsl_programs", [])) | {
        name for name, spec in builder.cute_dsl.items() if builder.wanted(name) and spec.is_compiled
    }
    configs = {
        (entry.get("config"), entry.get("gpu")): entry
        for entry in old.get("configs", [])
        if isinstance(entry, dict)
    }
    for plan in plans:
        for config in plan.configs:
            configs[(config, plan.gpu.name)] = {
                "config": config,
                "gpu": plan.gpu.name,
                "indexer": repr(plan.indexer) if plan.indexer else plan.indexer_reason,
                "sparse_attention": (
                    repr(plan.sparse_attention)
                    if plan.sparse_attention
                    else plan.sparse_attention_reason
                ),
                "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
    manifest = {
        "format": 1,
        "written_by": "vllm-minimax warmup --prebuild",
        **here,
        "nvcc_programs": sorted(nvcc),
        "cute_dsl_programs": sorted(cute),
        "configs": list(configs.values()),
    }
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(partial, path)
    return path


def _plans(
    configs: list[Path],
    kv_cache_dtypes: list[str | None],
    model: ModelGeometry,
    gpus: list[GpuTarget],
) -> list[Plan]:
    """One plan per distinct warm-up geometry of the engines of ``configs`` (each with each
    KV-cache dtype) on ``gpus``, printed as it is found."""
    plans: dict[tuple[int, str, str], Plan] = {}
    for config in configs:
        for kv_cache_dtype in kv_cache_dtypes:
            settings = read_engine_settings(config, kv_cache_dtype)
            label = str(config) + (f" --kv-cache-dtype {kv_cache_dtype}" if kv_cache_dtype else "")
            _say(label)
            if settings.warmup_off:
                _say(
                    f"  note: {settings.warmup_off}; the engine loads the indexer's programs at"
                    " first use (the sparse attention's when the model is built)"
                )
            for gpu in gpus:
                shape = engine_shape(settings, model, gpu)
                plan = Plan(gpu)
                plan.indexer, plan.indexer_reason = indexer_geometry(settings, model, shape)
                plan.sparse_attention, plan.sparse_attention_reason = sparse_attention_geometry(
                    settings, model, shape
                )
                sources = ", ".join(f"{key} from {how}" for key, how in shape.sources.items())
                _say(f"  {gpu.name} ({gpu.sm_count} SMs): {sources}")
                _say(f"    indexer: {plan.indexer or 'none: ' + str(plan.indexer_reason)}")
                _say(
                    "    sparse attention: "
                    f"{plan.sparse_attention or 'none: ' + str(plan.sparse_attention_reason)}"
                )
                plans.setdefault(plan.key, plan).configs.append(label)
    return list(plans.values())


def run(args: argparse.Namespace) -> int:
    location = warmup.cache_location(args.cache_dir)
    configs: list[Path] = args.config
    for config in configs:
        if not config.is_file():
            what = "is not a file" if config.exists() else "does not exist"
            raise PrebuildError(f"serving config {config} {what}")
    gpus = [GPU_TARGETS[name] for name in dict.fromkeys(args.gpu or DEFAULT_GPUS)]
    kv_cache_dtypes: list[str | None] = list(dict.fromkeys(args.kv_cache_dtype or [None]))
    if not args.dry_run:
        warmup.check_writable(location)
    _set_environment(location)
    model = read_model_geometry(args.model)
    offline.check_flashinfer()
    import importlib
    import importlib.util

    if importlib.util.find_spec(INDEXER_WARMUP_MODULE) is None:
        raise PrebuildError(
            "this vLLM lacks the series' FlashInfer warm-up: run `vllm-minimax apply` first"
        )
    jit_dir = _check_flashinfer_paths(location)
    cuda_home = None if args.dry_run else _check_toolchain()
    iw = importlib.import_module(INDEXER_WARMUP_MODULE)
    _say(f"FlashInfer {offline.VALIDATED_FLASHINFER}, cache {jit_dir}")
    _say(f"model: {model.source}")
    plans = _plans(configs, kv_cache_dtypes, model, gpus)
    if all(plan.indexer is None and plan.sparse_attention is None for plan in plans):
        raise PrebuildError("no engine of these configs runs a FlashInfer program on these GPUs")
    jobs = args.jobs or max(1, (os.cpu_count() or 2) // 2)
    builder = Builder(build=not args.dry_run, jobs=jobs, only=args.only, say=_say)
    if cuda_home is None:
        return _build(args, iw, jit_dir, builder, plans, location)
    # Patch 0004's lock over the whole check, build and write: an engine checking or
    # removing this cache meanwhile waits, and then sees the programs and manifest whole.
    with iw.prebuild_lock():
        iw.check_prebuilt_programs()
        _say(f"building with the CUDA toolkit at {cuda_home}")
        return _build(args, iw, jit_dir, builder, plans, location)


def _build(
    args: argparse.Namespace,
    iw: Any,
    jit_dir: Path,
    builder: Builder,
    plans: list[Plan],
    location: warmup.CacheLocation,
) -> int:
    """Build ``plans``' programs, check them ready and write the manifest (not in a dry run)."""
    began = time.perf_counter()
    try:
        for plan in plans:
            if plan.indexer is not None or plan.sparse_attention is not None:
                plan_programs(plan, builder)
    finally:
        builder.finish()
    for plan in plans:
        _say(
            f"{plan.gpu.name} ({'; '.join(plan.configs)}): {len(plan.nvcc)} nvcc programs,"
            f" {len(plan.cute_dsl)} CuTe-DSL kernels"
        )
        for name in [*plan.nvcc, *plan.cute_dsl]:
            _say(f"  {name}")
    total = len(builder.nvcc) + len(builder.cute_dsl)
    _say(f"{total} programs in all ({len(builder.nvcc)} nvcc, {len(builder.cute_dsl)} CuTe-DSL)")
    if args.dry_run:
        return 0
    if builder.failed:
        for name, error in builder.failed.items():
            _say(f"FAILED {name}: {error}")
        return 1
    stale = []
    for name, spec in builder.nvcc_specs.items():
        reason = ninja_would_rebuild(spec)
        if reason is not None:
            stale.append(f"{name}: {reason}")
    for name, spec in builder.cute_dsl.items():
        if builder.wanted(name) and not spec.is_compiled:
            stale.append(f"{name}: not in FlashInfer's cache as built here")
    if stale:
        for line in stale:
            _say(f"NOT READY {line}")
        return 1
    manifest = _write_manifest(iw, jit_dir, builder, plans)
    selected = "" if not args.only else f" (of {total}: --only)"
    _say(
        f"{len(builder.built)} programs built, {len(builder.present)} already there{selected},"
        f" in {time.perf_counter() - began:.1f}s; FlashInfer's start-up check finds every one"
        " ready (ninja has nothing to do, the CuTe-DSL keys match)"
    )
    _say(f"manifest: {manifest}")
    _say(f"serve with {warmup.WORKSPACE_ENV}={location.workspace_base} to use them")
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        return run(args)
    except (warmup.WarmupError, offline.OfflineError) as error:
        print(f"vllm-minimax warmup --prebuild: error: {error}", file=sys.stderr)
        return 2
