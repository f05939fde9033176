"""The `vllm serve --config` files this package ships, and the settings doctor reads from one.

The serving configs (the repository's ``configs/serve/``) and the eval suite's server
configs (``evals/*.yaml``) travel inside the wheel (``pyproject.toml`` maps them into
``vllm_minimax._serve_configs`` and ``vllm_minimax._eval_configs``), so a config can be named
(``h200-8x``) from any directory: ``vllm-minimax config path h200-8x`` prints its file.

`read_serve_config` reads a YAML file the way ``vllm serve --config`` does (one top-level
mapping of option names, ``-`` and ``_`` alike; ``attention-config`` a nested mapping or its
JSON text) and keeps what decides MiniMax M3's kernel selection.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVE_CONFIGS_ENV = "VLLM_MINIMAX_SERVE_CONFIGS"
CONFIG_SUFFIXES = (".yaml", ".yml")

# MiniMax M3's attention geometry (transformers' MiniMaxM3VLTextConfig defaults, which the
# published checkpoint keeps): what the per-rank shapes below are computed from.
M3_ATTENTION_HEADS = 64
M3_KV_HEADS = 4
M3_INDEX_HEADS = 4
M3_HEAD_DIM = 128
M3_INDEX_HEAD_DIM = 128
M3_TOPK_BLOCKS = 16
M3_SPARSE_BLOCK = 128


class ServeConfigError(ValueError):
    """A config that cannot be found or read; the message names the file and the key."""


def serve_configs_root() -> Path:
    """The directory of the shipped serving configs.

    Order: ``$VLLM_MINIMAX_SERVE_CONFIGS``; ``vllm_minimax/_serve_configs`` (a wheel);
    the repository's ``configs/serve/`` next to the package (source tree, editable install).
    """
    override = os.environ.get(SERVE_CONFIGS_ENV)
    if override:
        return Path(override)
    package_dir = Path(__file__).resolve().parent
    shipped = package_dir / "_serve_configs"
    if shipped.is_dir():
        return shipped
    return package_dir.parent / "configs" / "serve"


def shipped_configs() -> dict[str, Path]:
    """Every shipped `vllm serve` config by name: the serving configs, then the eval suite's
    server configs (``cpu-server``, ...)."""
    serving, eval_suite = shipped_config_groups()
    return {**serving, **eval_suite}


def shipped_config_groups() -> tuple[dict[str, Path], dict[str, Path]]:
    """The serving configs by name, and apart the eval suite's server configs (tiny models,
    one rank with dummy weights) whose names no serving config takes."""
    from vllm_minimax.evals.presets import eval_configs_root

    serving = _configs_in(serve_configs_root())
    eval_suite = {
        name: path for name, path in _configs_in(eval_configs_root()).items() if name not in serving
    }
    return serving, eval_suite


def _configs_in(directory: Path) -> dict[str, Path]:
    if not directory.is_dir():
        return {}
    return {path.stem: path for path in sorted(directory.glob("*.yaml"))}


_STATED_CHECKPOINT = re.compile(r"^#\s+checkpoint:\s*(\S+)", re.M)


def stated_checkpoint(path: Path) -> str | None:
    """The checkpoint a serving config's memory budget names (``#   checkpoint: NAME``), or
    None when it sizes none."""
    match = _STATED_CHECKPOINT.search(path.read_text(encoding="utf-8"))
    return match.group(1) if match else None


def resolve_config(name_or_path: str | os.PathLike[str]) -> Path:
    """A YAML path as given, or a shipped config's name (``h200-8x``) as its file.

    A value with a YAML suffix or a directory part is a path and must exist; anything else
    is a name, and an unknown one lists the known names.
    """
    text = os.fspath(name_or_path)
    candidate = Path(text)
    if candidate.suffix in CONFIG_SUFFIXES or os.sep in text or "/" in text:
        if not candidate.is_file():
            known = ", ".join(shipped_configs()) or "none"
            raise ServeConfigError(
                f"config file {text} does not exist; name a shipped config instead"
                f" (one of: {known})"
            )
        return candidate
    shipped = shipped_configs()
    path = shipped.get(text)
    if path is None:
        known = ", ".join(shipped) or "none"
        raise ServeConfigError(f"no shipped config named {text!r}; one of: {known}")
    return path


@dataclass(frozen=True)
class ServeConfig:
    """What decides MiniMax M3's kernel selection in one `vllm serve` configuration."""

    source: str
    tensor_parallel_size: int = 8
    kv_cache_dtype: str = "auto"
    block_size: int | None = 128
    attention_config: dict[str, Any] = field(
        default_factory=lambda: {"indexer_kv_dtype": "fp8", "minimax_m3_indexer_backend": "auto"}
    )

    @property
    def indexer_kv_dtype(self) -> str:
        """As vLLM's model resolves it: ``auto`` (or unset) is a bf16 index cache."""
        value = str(self.attention_config.get("indexer_kv_dtype", "auto"))
        return "bf16" if value == "auto" else value

    @property
    def indexer_backend(self) -> str:
        return str(self.attention_config.get("minimax_m3_indexer_backend", "auto"))

    @property
    def sparse_attention_backend(self) -> str:
        return str(self.attention_config.get("minimax_m3_sparse_attention_backend", "auto"))

    @property
    def kv_cache_dtype_resolved(self) -> str:
        """``auto`` is the model's dtype, bf16 for MiniMax M3."""
        return "bf16" if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def query_heads_per_rank(self) -> int:
        return M3_ATTENTION_HEADS // self.tensor_parallel_size

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads are replicated once TP exceeds their count."""
        return max(1, M3_KV_HEADS // self.tensor_parallel_size)

    @property
    def index_heads_per_rank(self) -> int:
        return max(1, M3_INDEX_HEADS // self.tensor_parallel_size)

    @property
    def queries_per_kv_head(self) -> int:
        return self.query_heads_per_rank // self.kv_heads_per_rank

    def problems(self) -> list[str]:
        """What vLLM would refuse before any kernel is selected."""
        tp = self.tensor_parallel_size
        if M3_ATTENTION_HEADS % tp:
            return [
                f"tensor-parallel-size {tp} does not divide MiniMax M3's {M3_ATTENTION_HEADS}"
                " attention heads"
            ]
        return []


DEFAULT_SOURCE = (
    "defaults: the shipped configs' (tensor-parallel-size 8, kv-cache-dtype auto, block-size"
    " 128, attention-config indexer_kv_dtype fp8, backends auto)"
)


def default_serve_config() -> ServeConfig:
    return ServeConfig(source=DEFAULT_SOURCE)


def read_serve_config(path: Path) -> ServeConfig:
    """Read ``path`` as `vllm serve --config` reads it; raise ServeConfigError naming the key."""
    return serve_config_of(read_serve_options(path), path)


def read_serve_options(path: Path) -> dict[str, Any]:
    """The options of ``path`` as `vllm serve --config` reads them, each key with ``-`` for
    ``_``; raise ServeConfigError when it is no YAML mapping."""
    if path.suffix not in CONFIG_SUFFIXES:
        raise ServeConfigError(f"{path}: vllm serve reads only .yaml or .yml config files")
    try:
        import yaml
    except ImportError:
        raise ServeConfigError(
            "reading a config needs PyYAML (vLLM installs it; pip install pyyaml)"
        ) from None
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise ServeConfigError(f"{path}: cannot be read as YAML ({error})") from None
    if not isinstance(loaded, dict):
        raise ServeConfigError(f"{path}: a vllm serve config is a mapping of option names")
    return {str(key).replace("_", "-"): value for key, value in loaded.items()}


def mapping_option(options: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    """Option ``key`` (``{}`` when absent), which `vllm serve` takes as a mapping or as a
    JSON object in a string; raise ServeConfigError for anything else."""
    value = options.get(key, {})
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ServeConfigError(f"{path}: {key} is not JSON ({error})") from None
    if not isinstance(value, dict):
        raise ServeConfigError(f"{path}: {key} must be a mapping, got {value!r}")
    return value


def serve_config_of(options: dict[str, Any], path: Path) -> ServeConfig:
    """The `ServeConfig` of the options `read_serve_options` read from ``path``."""

    def integer(key: str, default: int | None) -> int | None:
        value = options.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ServeConfigError(f"{path}: {key} must be a positive integer, got {value!r}")
        return value

    attention = mapping_option(options, "attention-config", path)
    kv_cache_dtype = options.get("kv-cache-dtype", "auto")
    if not isinstance(kv_cache_dtype, str):
        raise ServeConfigError(f"{path}: kv-cache-dtype must be a string, got {kv_cache_dtype!r}")
    return ServeConfig(
        source=str(path),
        tensor_parallel_size=integer("tensor-parallel-size", 1) or 1,
        kv_cache_dtype=kv_cache_dtype,
        block_size=integer("block-size", None),
        attention_config=dict(attention),
    )


def config_option(text: str) -> Path:
    """An argparse type for ``--config``: a YAML path, or a shipped config's name."""
    import argparse

    try:
        return resolve_config(text)
    except ServeConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def config_name_option(text: str) -> Path:
    """An argparse type for a ``--config`` whose command checks the file itself: a path as
    given, or a shipped config's name as its file."""
    import argparse

    if Path(text).suffix in CONFIG_SUFFIXES or os.sep in text or "/" in text:
        return Path(text)
    try:
        return resolve_config(text)
    except ServeConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
