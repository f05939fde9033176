"""Ask the patched vLLM which MiniMax M3 indexer it would select.

`select_indexer` calls vLLM's own `select_indexer_impl_cls` (never a copy of its
rules) under a given attention config, optionally on a simulated CUDA GPU of a
given compute capability, and returns the class it picked together with the
line it logged, or the error it raised. `vllm-minimax doctor` and the CPU tests
both go through here.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Modules that bound `current_platform` at import time and take part in the
# indexer selection; a simulated platform has to replace it in each of them.
_PLATFORM_USERS = (
    "vllm.models.minimax_m3.common.indexer",
    "vllm.models.minimax_m3.nvidia.indexer_flashinfer_gate",
)
_SELECTION_MODULE = "vllm.models.minimax_m3.common.indexer"


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
def platform_override(platform: Any) -> Iterator[None]:
    """Make the selection code see `platform` as vLLM's current platform."""
    modules = [importlib.import_module(name) for name in _PLATFORM_USERS]
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


def select_indexer(
    *,
    indexer_kv_dtype: str = "bf16",
    topk_blocks: int = 16,
    num_index_heads: int = 1,
    indexer_backend: str = "auto",
    capability: tuple[int, int] | None = None,
) -> Selection:
    """Run vLLM's `select_indexer_impl_cls` once and report what it chose.

    With `capability`, the selection runs on a simulated CUDA GPU of that
    capability; without it, on this machine's real platform.
    """
    from vllm.config import AttentionConfig, DeviceConfig, VllmConfig, set_current_vllm_config

    selection_module = importlib.import_module(_SELECTION_MODULE)
    logged: list[str] = []

    def record(message: str, *args: object, **_: object) -> None:
        logged.append(message % args if args else message)

    try:
        attention_config = AttentionConfig(minimax_m3_indexer_backend=indexer_backend)
    except Exception as exc:  # pydantic names the field and the allowed values
        return Selection(impl=None, log=None, error=f"{type(exc).__name__}: {exc}")
    vllm_config = VllmConfig(
        device_config=DeviceConfig(device="cpu"), attention_config=attention_config
    )
    platform = simulated_cuda_platform(capability) if capability is not None else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(set_current_vllm_config(vllm_config))
        if platform is not None:
            stack.enter_context(platform_override(platform))
        logger = selection_module.logger
        stack.callback(setattr, logger, "info_once", logger.info_once)
        logger.info_once = record
        try:
            impl_cls = selection_module.select_indexer_impl_cls(
                topk_blocks=topk_blocks,
                indexer_kv_dtype=indexer_kv_dtype,
                num_index_heads=num_index_heads,
            )
        except (ValueError, NotImplementedError, ImportError) as exc:
            return Selection(impl=None, log=None, error=f"{type(exc).__name__}: {exc}")
    return Selection(impl=impl_cls.__name__, log=logged[-1] if logged else None, error=None)
