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

`run` is the one place that walks the steps, each a plain function of its own module:
``prebuild_inputs`` reads the serving configs, the model's geometry and the target GPUs (no
vLLM); ``prebuild_geometry`` asks the patched vLLM, on a simulated SM90 GPU, which warm-up
geometries each engine registers; ``prebuild_programs`` runs the warm-ups' calls offline, builds
and checks the programs and writes the manifest. This module also checks the environment the
build needs (FlashInfer's cache paths, the CUDA toolkit, ninja) and, for ``docker/prebuild.sh``,
which FlashInfer kernel wheels an environment holds for another release. ``prebuild_modelinfo``
fills vLLM's model-info cache for the model's architectures (in ``$VLLM_CACHE_ROOT``), so a
start need not import the model in a subprocess to inspect its class. ``prebuild_humming``
builds an MXFP8 checkpoint's Humming GEMM kernels into ``$HUMMING_CACHE_DIR``, which the
profile run would otherwise compile; ``prebuild_cutedsl`` the MoE router gate's CuTe-DSL GEMMs
(vLLM's JIT warm-up keys) into ``$VLLM_CACHE_ROOT/cutedsl`` (patch 0010).

Beside the cache (``<version>/<arch>/`` + ``PREBUILD_MANIFEST``) it records what the programs
were built with; the engine's warm-up compares that with its own FlashInfer, CUDA toolkit and
CuTe-DSL stack before using them (patch 0004, ``check_prebuilt_programs``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from vllm_minimax import flashinfer_offline as offline
from vllm_minimax import prebuild_cutedsl, prebuild_humming, prebuild_modelinfo, warmup
from vllm_minimax.prebuild_geometry import (
    INDEXER_WARMUP_MODULE,
    Plan,
    engine_shape,
    indexer_geometry,
    sparse_attention_geometry,
)
from vllm_minimax.prebuild_inputs import (
    DEFAULT_GPUS,
    GPU_TARGETS,
    GpuTarget,
    ModelGeometry,
    PrebuildError,
    read_engine_settings,
    read_model_geometry,
)
from vllm_minimax.prebuild_programs import (
    Builder,
    plan_programs,
    unready_programs,
    write_manifest,
)

ENV_VARIABLES = {
    "FLASHINFER_CUDA_ARCH_LIST": offline.SM90_ARCH_LIST,
    "CUTE_DSL_ARCH": offline.SM90_CUTE_DSL_ARCH,
}


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
    humming = prebuild_humming.plans_for(configs, args.model, gpus)
    humming_ready = None if args.dry_run else prebuild_humming.check_ready(humming, GPU_TARGETS)
    architectures, architectures_source = prebuild_modelinfo.model_architectures(args.model)
    offline.check_flashinfer()
    import importlib
    import importlib.util

    if importlib.util.find_spec(INDEXER_WARMUP_MODULE) is None:
        raise PrebuildError(
            "this vLLM lacks the series' FlashInfer warm-up: run `vllm-minimax apply` first"
        )
    cutedsl = prebuild_cutedsl.plans_for(configs, kv_cache_dtypes, args.model, model, gpus)
    cutedsl_ready = None if args.dry_run else prebuild_cutedsl.check_ready(cutedsl)
    jit_dir = _check_flashinfer_paths(location)
    cuda_home = None if args.dry_run else _check_toolchain()
    iw = importlib.import_module(INDEXER_WARMUP_MODULE)
    _say(f"FlashInfer {offline.VALIDATED_FLASHINFER}, cache {jit_dir}")
    _say(f"model: {model.source}")
    modelinfo = prebuild_modelinfo.fill_modelinfo_cache(architectures, dry_run=args.dry_run)
    _say(prebuild_modelinfo.summary(modelinfo, architectures_source))
    prebuild_humming.prebuild(humming, GPU_TARGETS, args.dry_run, _say, humming_ready)
    prebuild_cutedsl.prebuild(cutedsl, GPU_TARGETS, args.dry_run, _say, cutedsl_ready)
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
    stale = unready_programs(builder)
    if stale:
        for line in stale:
            _say(f"NOT READY {line}")
        return 1
    manifest = write_manifest(iw, jit_dir, builder, plans)
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
