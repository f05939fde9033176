"""Ask the patched vLLM which MiniMax M3 indexer and sparse attention it would select.

`select_indexer` and `select_sparse_attention` call vLLM's own
`select_indexer_impl_cls` and `select_main_backend_and_impl_cls` (never a copy of
their rules) under a given attention config, optionally on a simulated CUDA GPU of
a given compute capability, and return the class picked together with the line
logged, or the error raised. `vllm-minimax doctor` and the CPU tests
both go through here.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

# Modules that bound `current_platform` at import time and take part in the
# indexer selection; a simulated platform has to replace it in each of them.
_PLATFORM_USERS = (
    "vllm.models.minimax_m3.common.indexer",
    "vllm.models.minimax_m3.nvidia.indexer_flashinfer_gate",
)
_SELECTION_MODULE = "vllm.models.minimax_m3.common.indexer"
# The module a series with the FlashInfer sparse attention adds to vLLM.
SPARSE_ATTENTION_FLASHINFER_MODULE = "vllm.models.minimax_m3.nvidia.sparse_attention_flashinfer"
SPARSE_ATTENTION_KEY = "minimax_m3_sparse_attention_backend"


@dataclass(frozen=True)
class Selection:
    """What `select_indexer_impl_cls` did for one configuration."""

    impl: str | None
    log: str | None
    error: str | None

    def describe(self) -> str:
        if self.error is not None:
            return f"error: {self.error}"
        return f"{self.impl}: {self.log}"


def simulated_cuda_platform(capability: tuple[int, int]) -> Any:
    """A vLLM platform object that answers as CUDA on a GPU of `capability`.

    Only what the selection asks (`is_cuda`, the capability queries, fp8
    support as vLLM's CUDA platform reports it) is simulated; vLLM's CUDA
    platform module itself needs the CUDA driver library to import.
    """
    from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

    major, minor = capability

    class SimulatedCudaPlatform(Platform):
        _enum = PlatformEnum.CUDA
        device_name = "cuda"
        device_type = "cuda"

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(major=major, minor=minor)

        @classmethod
        def supports_fp8(cls) -> bool:
            return cls.has_device_capability(89)

    return SimulatedCudaPlatform()


@contextlib.contextmanager
def platform_override(
    platform: Any, module_names: tuple[str, ...] = _PLATFORM_USERS
) -> Iterator[None]:
    """Make the selection code in `module_names` see `platform` as vLLM's current platform."""
    modules = [importlib.import_module(name) for name in module_names]
    saved = [module.current_platform for module in modules]
    try:
        for module in modules:
            module.current_platform = platform
        yield
    finally:
        for module, original in zip(modules, saved, strict=True):
            module.current_platform = original


def parse_capability(text: str) -> tuple[int, int]:
    """`"9.0"` -> `(9, 0)`; raises ValueError on anything else."""
    major, sep, minor = text.partition(".")
    if not (sep and major.isdigit() and minor.isdigit()):
        raise ValueError(f"compute capability must look like 9.0 or 12.1, got {text!r}")
    return int(major), int(minor)


def _run_selection(
    module_name: str,
    attention_options: Mapping[str, object],
    capability: tuple[int, int] | None,
    platform_users: tuple[str, ...],
    select: Callable[[Any, Any], type],
) -> Selection:
    """Call `select(module, attention_config)` under a CPU `VllmConfig` holding
    `attention_options` (validated by vLLM's `AttentionConfig`, as `vllm serve` does), on a
    simulated CUDA GPU of `capability` (None: this machine's platform), and report the class
    it returned with the last line the module logged once, or the error it raised."""
    from vllm.config import AttentionConfig, DeviceConfig, VllmConfig, set_current_vllm_config

    module = importlib.import_module(module_name)
    logged: list[str] = []

    def record(message: str, *args: object, **_: object) -> None:
        logged.append(message % args if args else message)

    try:
        attention_config = AttentionConfig(**attention_options)
    except Exception as exc:  # pydantic names the field and the allowed values
        return Selection(impl=None, log=None, error=f"{type(exc).__name__}: {exc}")
    vllm_config = VllmConfig(
        device_config=DeviceConfig(device="cpu"), attention_config=attention_config
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(set_current_vllm_config(vllm_config))
        if capability is not None:
            platform = simulated_cuda_platform(capability)
            stack.enter_context(platform_override(platform, platform_users))
        logger = module.logger
        stack.callback(setattr, logger, "info_once", logger.info_once)
        logger.info_once = record
        try:
            impl_cls = select(module, attention_config)
        except (ValueError, NotImplementedError, ImportError) as exc:
            return Selection(impl=None, log=None, error=f"{type(exc).__name__}: {exc}")
    return Selection(impl=impl_cls.__name__, log=logged[-1] if logged else None, error=None)


def select_indexer(
    *,
    indexer_kv_dtype: str | None = "bf16",
    topk_blocks: int = 16,
    num_index_heads: int = 1,
    indexer_backend: str = "auto",
    capability: tuple[int, int] | None = None,
    attention_options: Mapping[str, object] | None = None,
) -> Selection:
    """Run vLLM's `select_indexer_impl_cls` once and report what it chose.

    `attention_options` are the rest of a serve config's attention-config, which vLLM's
    `AttentionConfig` validates as `vllm serve` does (an unknown key is an error); with
    `indexer_kv_dtype=None` the dtype is the one vLLM's model resolves from them. With
    `capability`, the selection runs on a simulated CUDA GPU of that capability; without
    it, on this machine's real platform.
    """

    def select(module: Any, attention_config: Any) -> type:
        dtype = indexer_kv_dtype
        if dtype is None:
            dtype = str(attention_config.resolve_indexer_kv_dtype("bf16"))
        return module.select_indexer_impl_cls(
            topk_blocks=topk_blocks, indexer_kv_dtype=dtype, num_index_heads=num_index_heads
        )

    options = {**(attention_options or {}), "minimax_m3_indexer_backend": indexer_backend}
    return _run_selection(_SELECTION_MODULE, options, capability, _PLATFORM_USERS, select)


_SPARSE_ATTENTION_MODULE = "vllm.models.minimax_m3.common.sparse_attention"


def sparse_attention_in_series() -> bool:
    """Whether the vLLM this Python imports carries the FlashInfer sparse attention."""
    return importlib.util.find_spec(SPARSE_ATTENTION_FLASHINFER_MODULE) is not None


def select_sparse_attention(
    *,
    kv_cache_dtype: str = "auto",
    num_heads: int = 8,
    num_kv_heads: int = 1,
    topk_blocks: int = 16,
    head_size: int = 128,
    sparse_attention_backend: str = "auto",
    capability: tuple[int, int] | None = None,
) -> Selection:
    """Run vLLM's `select_main_backend_and_impl_cls` once and report the attend
    it chose for MiniMax M3's sparse layers (per-rank head counts).

    With `capability`, the selection runs on a simulated CUDA GPU of that
    capability; without it, on this machine's real platform.
    """
    import torch

    def select(module: Any, attention_config: Any) -> type:
        return module.select_main_backend_and_impl_cls(
            topk_blocks=topk_blocks,
            kv_cache_dtype=kv_cache_dtype,
            num_kv_heads=num_kv_heads,
            num_heads=num_heads,
            head_size=head_size,
            model_dtype=torch.bfloat16,
        )[1]

    options = {SPARSE_ATTENTION_KEY: sparse_attention_backend}
    return _run_selection(
        _SPARSE_ATTENTION_MODULE, options, capability, (_SPARSE_ATTENTION_MODULE,), select
    )
