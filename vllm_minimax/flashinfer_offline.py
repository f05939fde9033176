"""FlashInfer's SM90 MSA programs, chosen and compiled on a machine without a GPU.

FlashInfer 0.7.4 builds an MSA program the first time a call needs it, into its JIT cache
(``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/<arch>/cached_ops``): a Cake program
is an nvcc build (``flashinfer/jit/cake_hopper_msa.py``), the others are CuTe-DSL compiles kept
on disk by ``flashinfer/jit/cute_dsl_core.py``. Which program a call needs is FlashInfer's
decision, made by its SM90 dispatch (``msa_ops/_sm90_dispatch.py``) and planners
(``msa_ops/cake_hopper_sm90.py``, ``msa_ops/cute_dsl/*_sm90.py``) from the call's shapes and
the GPU's SM count.

:func:`offline_sm90` runs FlashInfer's public MSA ops on host tensors as if on an SM90 GPU with
a given number of SMs. Every choice is still FlashInfer's; where it would load a program, the
:class:`ProgramSink` is handed the program instead (an nvcc program by name, a CuTe-DSL kernel
as the cache entry FlashInfer would make, with its compile step), and every launch does
nothing. CuTe-DSL compiles a kernel from the call's tensors, and the compiled kernel checks at
call time that it gets tensors of the device it was compiled for: the host tensors are
therefore handed to it as CUDA tensors of the same shape, strides and dtype (their memory is
never read), so the kernel expects the CUDA tensors it will get on the GPU.

What this replaces are FlashInfer 0.7.4 internals (``VALIDATED_FLASHINFER``); another release
is refused before anything runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol

VALIDATED_FLASHINFER = "0.7.4"
# FLASHINFER_CUDA_ARCH_LIST for an SM90 cache: FlashInfer normalizes 9.0 to 90a and names its
# JIT directory after it (flashinfer/compilation_context.py, flashinfer/jit/env.py).
SM90_ARCH_LIST = "9.0"
SM90_ARCH_DIR = "90a"
# CUTE_DSL_ARCH: the target of a CuTe-DSL compile without a GPU to ask, which FlashInfer also
# puts in the kernel's cache directory name and metadata (sm90a).
SM90_CUTE_DSL_ARCH = "sm_90a"

# The CuTe-DSL modules of FlashInfer's SM90 MSA ops whose kernels the series' calls reach and
# FlashInfer keeps on disk: top-k selection, the fp8 decode and the prefill proxy score.
_CUTE_MODULES = (
    "flashinfer.msa_ops.cute_dsl.topk_select_sm90",
    "flashinfer.msa_ops.cute_dsl.proxy_score_decode_sm90",
    "flashinfer.msa_ops.cute_dsl.proxy_score_prefill_sm90",
)
# Module-level caches of compiled kernels in those modules: they are swapped for empty ones
# while offline, so the launch stubs never outlive it.
_CUTE_CACHES = ("_cache", "_CACHE")
# Launch templates of the Cake backend, cached per geometry with the program bound in.
_CAKE_TEMPLATE_CACHES = (
    "_program",
    "_decode_template",
    "_proxy_decode_template",
    "_proxy_prefill_template",
    "_topk_template",
    "_prefill_template",
)
# DLPack's device type of CUDA memory (dlpack.h: kDLCUDA).
_DLPACK_CUDA = 2


class OfflineError(RuntimeError):
    """FlashInfer cannot choose or compile its programs on this machine; the message says why."""


class ProgramSink(Protocol):
    """Receives the programs FlashInfer would load."""

    def nvcc(self, name: str) -> None:
        """A Cake program (a key of ``flashinfer.jit.cake_hopper_msa.MODULES``)."""

    def cute_dsl(self, spec: Any) -> None:
        """A CuTe-DSL kernel: the ``JitSpecCuteDsl`` FlashInfer would build and load."""


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLTensorHead(ctypes.Structure):
    """The start of DLPack's ``DLTensor``: the data pointer, then the device."""

    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class CudaClaim:
    """A host tensor exported through DLPack as a tensor on CUDA device 0.

    The shape, strides, dtype and data pointer are the host tensor's; only the device differs.
    A CuTe-DSL compile reads the metadata and never the memory."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_DLPACK_CUDA, 0)

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.dlpack import to_dlpack

        capsule = to_dlpack(self.tensor)
        head = _DLTensorHead.from_address(_capsule_pointer(capsule, b"dltensor"))
        head.device.device_type = _DLPACK_CUDA
        head.device.device_id = 0
        return capsule


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class _StubModule:
    """A loaded Cake program whose every entry point launches nothing."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return _noop


def installed_flashinfer() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flashinfer-python")
    except PackageNotFoundError:
        return "not installed"


def check_flashinfer() -> None:
    """Raise OfflineError unless FlashInfer is the release this module was validated on."""
    found = installed_flashinfer()
    if found != VALIDATED_FLASHINFER:
        raise OfflineError(
            f"flashinfer-python is {found}; the prebuild chooses programs through FlashInfer"
            f" {VALIDATED_FLASHINFER}'s internals and was validated on that release only"
        )


def _cute_spec(
    module_name: str,
    kernel_name: str,
    compile_fn: Callable[[], Any],
    extra_key_files: tuple[str, ...] = (),
    *,
    enable_tvm_ffi: bool = True,
) -> Any:
    """The cache entry ``build_and_load_cute_dsl_kernel`` makes for these arguments."""
    from flashinfer.jit import cute_dsl_core

    if cute_dsl_core.cute_dsl_cache_disabled():
        raise OfflineError(
            "FLASHINFER_CUTE_DSL_DISABLE_CACHE=1: FlashInfer keeps no CuTe-DSL kernel on disk,"
            " so none can be prebuilt; unset it"
        )
    try:
        source_sha256 = cute_dsl_core._hash_source_files(tuple(extra_key_files))
    except (OSError, TypeError, SyntaxError, ValueError) as error:
        # FlashInfer then compiles the kernel without its disk cache: nothing to prebuild.
        raise OfflineError(
            f"FlashInfer cannot key CuTe-DSL kernel {module_name}/{kernel_name} on its"
            f" sources ({error}), so it keeps no copy on disk"
        ) from error
    return cute_dsl_core.JitSpecCuteDsl(
        module_name,
        kernel_name,
        compile_fn,
        source_sha256,
        enable_tvm_ffi=enable_tvm_ffi,
    )


class _Patches:
    """Attribute replacements, undone in reverse order."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        if not hasattr(owner, name):
            raise OfflineError(
                f"{getattr(owner, '__name__', owner)} has no {name}: this FlashInfer is not the"
                f" {VALIDATED_FLASHINFER} the prebuild was validated on"
            )
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)


@contextlib.contextmanager
def offline_sm90(sm_count: int, sink: ProgramSink) -> Iterator[None]:
    """FlashInfer's SM90 MSA ops on host tensors, as on an SM90 GPU of ``sm_count`` SMs.

    Inside, the public ops (``msa_proxy_score``, ``msa_topk_select``,
    ``msa_sparse_decode_attention``, ``msa_sparse_attention``) accept CPU tensors: FlashInfer
    plans each call as on that GPU and hands ``sink`` the program it would load; nothing is
    launched. FlashInfer's in-process caches of loaded programs and launch templates are left
    as they were before, so this process can use FlashInfer normally afterwards."""
    import importlib

    import cuda.bindings.driver as cuda_driver
    import torch
    from cutlass.cute import runtime as cute_runtime
    from flashinfer.msa_ops import (
        _sm90_dispatch,
        cake_hopper_sm90,
        proxy_score,
        sparse_prefill,
        sparse_topk_select,
    )

    check_flashinfer()
    if os.environ.get("CUTE_DSL_ARCH") != SM90_CUTE_DSL_ARCH:
        raise OfflineError(
            f"CUTE_DSL_ARCH must be {SM90_CUTE_DSL_ARCH} (it is"
            f" {os.environ.get('CUTE_DSL_ARCH')!r}): without a GPU it is the target of every"
            " CuTe-DSL compile and part of the kernel's cache key"
        )

    def loaded_module(route: str) -> _StubModule:
        sink.nvcc(cake_hopper_sm90.route_program(route))
        return _StubModule()

    def scratch(
        device: Any, *, items: int, splits: int, nc: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        del device, items, splits, nc
        empty = torch.empty((0,), dtype=torch.uint32)
        return empty, torch.empty((0,), dtype=torch.float32), empty

    def cute_build(
        module_name: str,
        kernel_name: str,
        compile_fn: Callable[[], Any],
        extra_key_files: tuple[str, ...] = (),
        *,
        enable_tvm_ffi: bool = True,
    ) -> Callable[..., None]:
        sink.cute_dsl(
            _cute_spec(
                module_name,
                kernel_name,
                compile_fn,
                tuple(extra_key_files),
                enable_tvm_ffi=enable_tvm_ffi,
            )
        )
        return _noop

    def claimed_from_dlpack(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tensor, torch.Tensor):
            tensor = CudaClaim(tensor)
        return cute_runtime.from_dlpack(tensor, *args, **kwargs)

    null_stream = cuda_driver.CUstream(0)
    patches = _Patches()
    try:
        patches.set(torch.cuda, "is_current_stream_capturing", lambda: False)
        patches.set(_sm90_dispatch, "is_sm90a_device", lambda device: True)
        patches.set(_sm90_dispatch, "_sm_count", lambda device: sm_count)
        for module in (proxy_score, sparse_prefill, sparse_topk_select):
            patches.set(module, "is_sm90a_supported", lambda device: True)
        patches.set(cake_hopper_sm90, "_num_sms", lambda device_index: sm_count)
        patches.set(cake_hopper_sm90, "_device_index", lambda device: 0)
        patches.set(cake_hopper_sm90, "_loaded_module", loaded_module)
        patches.set(cake_hopper_sm90, "_ffi_stream_context", contextlib.nullcontext)
        patches.set(cake_hopper_sm90, "_scratch", scratch)
        patches.set(
            cake_hopper_sm90, "_int32_dummy", lambda device: torch.zeros((4,), dtype=torch.int32)
        )
        for name in _CAKE_TEMPLATE_CACHES:
            cached = getattr(cake_hopper_sm90, name)
            # Wrapped afresh: what is cached inside is forgotten with the wrapper.
            patches.set(cake_hopper_sm90, name, functools.cache(cached.__wrapped__))
        for module_name in _CUTE_MODULES:
            module = importlib.import_module(module_name)
            patches.set(module, "from_dlpack", claimed_from_dlpack)
            patches.set(module, "_kf_stream", lambda: null_stream)
            patches.set(module, "build_and_load_cute_dsl_kernel", cute_build)
            for cache in _CUTE_CACHES:
                if hasattr(module, cache):
                    patches.set(module, cache, {})
        # The decode proxy's CTA split is a launch argument (not part of the kernel's key);
        # FlashInfer reads it from the device's properties.
        decode = importlib.import_module("flashinfer.msa_ops.cute_dsl.proxy_score_decode_sm90")
        patches.set(decode, "_nsplit", lambda batch, ncols, device: 1)
        yield
    finally:
        patches.undo()
