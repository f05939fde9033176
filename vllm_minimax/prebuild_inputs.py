"""What `vllm-minimax warmup --prebuild` reads: the target GPUs, a serving config's engine
settings and the model's geometry.

The serving YAML is read as `vllm serve --config` reads it (``serve_config``), keeping the keys
the warm-ups read; the model's geometry comes from its ``config.json`` (a local directory or the
Hugging Face cache), or, for MiniMax M3's checkpoints, from the published geometry. Nothing here
imports vLLM or FlashInfer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_minimax import warmup
from vllm_minimax.serve_config import (
    ServeConfigError,
    mapping_option,
    read_serve_options,
    serve_config_of,
)

# Checkpoints whose config.json this package knows without reading it: MiniMax M3's published
# text config (m3_geometry.M3_TEXT_CONFIG).
M3_CHECKPOINT_PREFIX = "MiniMaxAI/MiniMax-M3"
# The one checkpoint whose quantization this package knows too (known_config_json). The name
# must match exactly: the BF16 checkpoint shares the prefix above, and no other name's
# quantization is known.
M3_MXFP8_CHECKPOINT = "MiniMaxAI/MiniMax-M3-MXFP8"


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


def config_json_path(model: str) -> Path | None:
    """Where ``model``'s ``config.json`` would be: in a local directory, else the Hugging Face
    cache (no download); None where neither has it."""
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
    return candidate


def read_config_json(model: str) -> tuple[Any, str] | None:
    """``model``'s parsed ``config.json`` (:func:`config_json_path`) and its path; None where
    there is none here."""
    candidate = config_json_path(model)
    if candidate is None or not candidate.is_file():
        return None
    try:
        return json.loads(candidate.read_text(encoding="utf-8")), str(candidate)
    except (OSError, ValueError) as error:
        raise PrebuildError(f"{candidate}: cannot be read ({error})") from None


def known_config_json(model: str) -> tuple[dict[str, Any], str] | None:
    """For :data:`M3_MXFP8_CHECKPOINT` exactly, the ``config.json`` this package knows for it,
    with a label that says so: MiniMax M3's published text config (``m3_geometry``) under
    ``text_config`` and the MXFP8 quantization config (``mxfp8_checkpoint``), the geometry and
    quantization ``make-tiny-model --geometry m3`` writes. None for any other name. Reads and
    downloads nothing; callers try :func:`read_config_json` first, so a real copy wins."""
    if model != M3_MXFP8_CHECKPOINT:
        return None
    from vllm_minimax.m3_geometry import M3_TEXT_CONFIG
    from vllm_minimax.mxfp8_checkpoint import MXFP8_QUANTIZATION_CONFIG

    known = {"quantization_config": MXFP8_QUANTIZATION_CONFIG, "text_config": M3_TEXT_CONFIG}
    label = (
        f"the known geometry of {model} (vllm_minimax/m3_geometry.py, MXFP8): no config.json"
        " of it here, none downloaded"
    )
    return json.loads(json.dumps(known)), label


def no_config_json(model: str) -> PrebuildError:
    """The error for a model with no ``config.json`` here and no published stand-in."""
    return PrebuildError(
        f"no config.json for model {model!r} here (not a directory, not in the Hugging Face"
        " cache): pass --model DIR holding the model's config.json"
    )


def model_config_json(model: str) -> tuple[Any, str]:
    """``model``'s ``config.json`` and where it came from: its own (a local directory, or the
    Hugging Face cache), else, for MiniMax M3's checkpoints, the published text config; else
    :func:`no_config_json`'s error."""
    found = read_config_json(model)
    if found is not None:
        return found
    if model.startswith(M3_CHECKPOINT_PREFIX):
        from vllm_minimax.m3_geometry import M3_TEXT_CONFIG

        return dict(M3_TEXT_CONFIG), f"MiniMax M3's published geometry (for {model})"
    raise no_config_json(model)


def read_model_geometry(model: str) -> ModelGeometry:
    """``model``'s geometry, from :func:`model_config_json`."""
    return geometry_from_config_json(*model_config_json(model))
