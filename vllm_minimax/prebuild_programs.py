"""The FlashInfer programs of a plan's geometries, picked offline and built, checked and recorded.

The warm-ups' own calls run on host tensors through ``flashinfer_offline``: FlashInfer picks
each program as on an SM90 GPU with the target's SM count, and a :class:`Builder` compiles them
into the JIT cache the engine reads (nvcc programs with FlashInfer's own ninja build, side by
side; CuTe-DSL kernels with FlashInfer's own compile and export). Each is then checked the way
FlashInfer checks it at start, and the manifest beside the cache records what they were built
with (patch 0004's ``check_prebuilt_programs`` compares it).
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vllm_minimax import flashinfer_offline as offline
from vllm_minimax.prebuild_geometry import INDEXER_WARMUP_MODULE, SPARSE_ATTENTION_MODULE, Plan
from vllm_minimax.prebuild_inputs import PrebuildError


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


def unready_programs(builder: Builder) -> list[str]:
    """``name: why`` for each program ``builder`` built that FlashInfer's start-up would not
    take as built: an nvcc program ninja would rebuild, a CuTe-DSL kernel not in its cache."""
    stale = []
    for name, spec in builder.nvcc_specs.items():
        reason = ninja_would_rebuild(spec)
        if reason is not None:
            stale.append(f"{name}: {reason}")
    for name, spec in builder.cute_dsl.items():
        if builder.wanted(name) and not spec.is_compiled:
            stale.append(f"{name}: not in FlashInfer's cache as built here")
    return stale


def write_manifest(iw: Any, jit_dir: Path, builder: Builder, plans: list[Plan]) -> Path:
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
