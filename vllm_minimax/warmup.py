"""``vllm-minimax warmup``: prebuild FlashInfer's JIT cache for a serving config.

Builds, on the GPU the server will run on, the FlashInfer MSA programs the
engine of a ``vllm serve`` YAML would build in its own JIT warm-up (patch
0004's ``indexer_flashinfer_warmup``), into FlashInfer's JIT cache, so an
image or a volume can carry them and a fresh server starts without compiling.

FlashInfer 0.7.4 keeps its JIT cache, nvcc-built modules and CuTe-DSL objects
alike, in ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/<arch>/
cached_ops`` (``FLASHINFER_WORKSPACE_BASE`` defaults to the home directory),
and a CuTe-DSL module is also keyed on its source files' hash. A cache of
another FlashInfer version or GPU architecture therefore sits in another
directory and is never read; this command names such directories as ignored.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKSPACE_ENV = "FLASHINFER_WORKSPACE_BASE"
# What the build may write: the 89 programs of FlashInfer's full SM90 set took
# 159 MB; one engine's set is a part of it.
MIN_FREE_BYTES = 512 * 1024 * 1024
DEFAULT_MODEL = "MiniMaxAI/MiniMax-M3-MXFP8"


class WarmupError(Exception):
    """Bad input: reported as one message, exit status 2, nothing built."""


@dataclass(frozen=True)
class CacheLocation:
    workspace_base: Path  # what FLASHINFER_WORKSPACE_BASE is set to
    flashinfer_root: Path  # workspace_base/.cache/flashinfer


def cache_location(cache_dir: Path | None) -> CacheLocation:
    """Where FlashInfer will keep its cache: ``cache_dir``, else
    ``$FLASHINFER_WORKSPACE_BASE``, else the home directory (FlashInfer's rule)."""
    if cache_dir is not None:
        base = cache_dir
    else:
        base = Path(os.environ.get(WORKSPACE_ENV) or Path.home())
    base = base.expanduser().absolute()
    return CacheLocation(base, base / ".cache" / "flashinfer")


def deepest_existing(path: Path) -> Path:
    """``path`` itself if it exists, else its deepest existing parent."""
    while not path.exists():
        path = path.parent
    return path


def unwritable_reason(directory: Path) -> str | None:
    """Why ``directory`` cannot be made and written (its deepest existing parent is not a
    directory, or not writable), or None where it can. Creates nothing."""
    existing = deepest_existing(directory)
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"no write permission on {existing}"
    return None


def check_writable(location: CacheLocation, min_free_bytes: int = MIN_FREE_BYTES) -> None:
    """Raise WarmupError unless the cache directory can take the build. Creates
    nothing: the deepest existing directory on its path must be writable."""
    root = location.flashinfer_root
    reason = unwritable_reason(root)
    if reason is not None:
        raise WarmupError(f"FlashInfer cache directory {root} is not writable: {reason}")
    free = shutil.disk_usage(deepest_existing(root)).free
    if free < min_free_bytes:
        raise WarmupError(
            f"FlashInfer cache directory {root} has {free // 2**20} MiB free; the warm-up"
            f" needs at least {min_free_bytes // 2**20} MiB"
        )


def other_caches(location: CacheLocation, version: str, arch_dir: str) -> list[Path]:
    """Cache directories under ``location`` of another FlashInfer version or
    GPU architecture: FlashInfer does not read them."""
    root = location.flashinfer_root
    if not root.is_dir():
        return []
    found = []
    for version_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for arch in sorted(p for p in version_dir.iterdir() if p.is_dir()):
            if (version_dir.name, arch.name) != (version, arch_dir):
                found.append(arch)
    return found


def read_serve_config(config: Path, model: str):
    """The EngineArgs ``vllm serve MODEL --config CONFIG`` would run with."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    try:
        args = parser.parse_args(["--model", model, "--config", str(config)])
    except SystemExit as error:
        raise WarmupError(f"{config}: not a valid vllm serve config") from error
    return EngineArgs.from_cli_args(args)


def indexer_geometry_fields(hf_config: Any) -> dict[str, int]:
    """The indexer's total index heads, top-k width, head dim and block size from a
    MiniMax M3 model config: 0.34.0's flat ``index_*`` fields, else 0.33.0's
    ``sparse_attention_config`` dict."""
    config = getattr(hf_config, "text_config", hf_config)
    if hasattr(config, "index_n_heads"):
        return {
            "index_heads": config.index_n_heads,
            "topk_blocks": config.index_topk_blocks,
            "index_head_dim": config.index_head_dim,
            "sparse_block_size": config.index_block_size,
        }
    sparse = config.sparse_attention_config
    return {
        "index_heads": sparse["sparse_num_index_heads"],
        "topk_blocks": sparse["sparse_topk_blocks"],
        "index_head_dim": sparse["sparse_index_dim"],
        "sparse_block_size": sparse["sparse_block_size"],
    }


def engine_indexer_flashinfer_geometry(
    vllm_config: Any, tensor_parallel_size: int | None = None
) -> tuple[Any | None, str | None]:
    """The geometry of the FlashInfer indexer an engine with ``vllm_config`` would
    run on the current device, as the patched vLLM's warm-up registers it, or
    ``(None, reason)`` where the engine would not run the FlashInfer indexer.
    ``tensor_parallel_size`` overrides the config's, so one GPU can prepare the
    programs of every rank of a larger engine (the ranks share one geometry)."""
    from vllm.models.minimax_m3.nvidia import indexer_flashinfer_warmup as warmup
    from vllm.models.minimax_m3.nvidia.indexer_flashinfer_gate import (
        index_cache_is_fp8,
        minimax_m3_use_flashinfer_msa,
    )

    fields = indexer_geometry_fields(vllm_config.model_config.hf_config)
    tp_size = tensor_parallel_size or vllm_config.parallel_config.tensor_parallel_size
    # Index-query heads per rank, as the indexer builder divides them.
    num_index_heads = max(1, fields["index_heads"] // tp_size)
    attention_config = vllm_config.attention_config
    indexer_kv_dtype = attention_config.resolve_indexer_kv_dtype("bf16")
    use_flashinfer, reason = minimax_m3_use_flashinfer_msa(
        backend=attention_config.minimax_m3_indexer_backend,
        topk_blocks=fields["topk_blocks"],
        index_head_dim=fields["index_head_dim"],
        sparse_block_size=fields["sparse_block_size"],
        num_index_heads=num_index_heads,
        indexer_kv_dtype=indexer_kv_dtype,
    )
    if not use_flashinfer:
        return None, reason
    arch, num_sms = warmup.current_device_facts()
    geometry = warmup.geometry_from_config(
        vllm_config,
        num_index_heads=num_index_heads,
        kv_fp8=index_cache_is_fp8(indexer_kv_dtype),
        arch=arch,
        num_sms=num_sms,
    )
    return geometry, None


def run(args: argparse.Namespace) -> int:
    location = cache_location(args.cache_dir)
    if not args.config.is_file():
        what = "is not a file" if args.config.exists() else "does not exist"
        raise WarmupError(f"serving config {args.config} {what}")
    check_writable(location)
    # FlashInfer reads the variable once, at import.
    os.environ[WORKSPACE_ENV] = str(location.workspace_base)

    import torch

    if not torch.cuda.is_available():
        raise WarmupError(
            "no CUDA GPU: the warm-up builds for the GPU the server runs on; run it there"
        )
    try:
        from vllm.models.minimax_m3.nvidia import indexer_flashinfer_warmup as warmup
    except ImportError as error:
        raise WarmupError(
            f"this vLLM lacks the series' FlashInfer warm-up ({error}); run `vllm-minimax"
            " apply` first"
        ) from error
    from flashinfer.jit import env as jit_env
    from vllm.usage.usage_lib import UsageContext

    engine_args = read_serve_config(args.config, args.model)
    tensor_parallel_size = engine_args.tensor_parallel_size
    # One GPU prepares every rank's programs: the ranks share one geometry.
    engine_args.tensor_parallel_size = 1
    engine_args.pipeline_parallel_size = 1
    engine_args.data_parallel_size = 1
    vllm_config = engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    geometry, reason = engine_indexer_flashinfer_geometry(
        vllm_config, tensor_parallel_size=tensor_parallel_size
    )
    if geometry is None:
        raise WarmupError(
            f"{args.config} would not run the FlashInfer indexer here ({reason}); nothing to build"
        )

    jit_dir = Path(jit_env.FLASHINFER_JIT_DIR)
    jit_dir.mkdir(parents=True, exist_ok=True)
    version_dir = jit_dir.parent.parent.name
    arch_dir = jit_dir.parent.name
    print(f"FlashInfer {version_dir}, cache {jit_dir}")
    for path in other_caches(location, version_dir, arch_dir):
        print(f"ignored (another FlashInfer version or GPU): {path}")
    print(f"geometry: {geometry}")
    programs = warmup.cached_indexer_flashinfer_programs(geometry)
    print(f"{len(programs)} programs:")
    began = time.perf_counter()
    done = 0

    def report(program) -> None:
        nonlocal done
        done += 1
        print(
            f"  [{done}/{len(programs)}] {program.name}  ({time.perf_counter() - began:.1f}s)",
            flush=True,
        )

    built_programs, built, seconds = warmup.build_indexer_flashinfer_programs(
        geometry, on_program=report
    )
    print(
        f"{len(built_programs)} programs ready in {seconds:.1f}s: {built} artifacts built or"
        f" rebuilt in {jit_dir}, the rest already there"
    )
    print(f"serve with {WORKSPACE_ENV}={location.workspace_base} to use them")
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        return run(args)
    except WarmupError as error:
        print(f"vllm-minimax warmup: error: {error}", file=sys.stderr)
        return 2
