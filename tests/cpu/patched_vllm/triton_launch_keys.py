"""Triton's compile key of a kernel launch, computed on a host without a GPU.

vLLM gives a CPU-only host a placeholder ``triton``, so a module's kernels are not real
``JITFunction`` objects there: :func:`kernel_from_module` runs the module's own source again with
Triton's decorators, and :func:`compile_key` binds a launch's arguments as Triton's launcher does
(its specialization and options), so two launches with one key run one compiled kernel.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from types import ModuleType

from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

STOCK_IMPORT = "from vllm.triton_utils import tl, triton\n"


@functools.cache
def _binder(jit_fn: JITFunction):
    return create_function_from_signature(jit_fn.signature, jit_fn.params, BaseBackend)


def compile_key(jit_fn: JITFunction, args: tuple, kwargs: dict) -> str:
    """The launch's specialization and options, as Triton keys its compile cache."""
    _, specialization, options = _binder(jit_fn)(*args, **kwargs)
    return repr((specialization, sorted(options.items())))


def kernel_from_module(
    module: ModuleType, name: str, replacements: tuple[tuple[str, str], ...] = ()
) -> JITFunction:
    """``module``'s kernel ``name`` as a real Triton object: the module's source run again with
    ``triton`` imported for ``vllm.triton_utils``, after ``replacements`` (old, new) of its text."""
    path = inspect.getsourcefile(module)
    assert path is not None
    source = Path(path).read_text()
    assert STOCK_IMPORT in source
    source = source.replace(STOCK_IMPORT, "import triton; import triton.language as tl\n")
    for old, new in replacements:
        source = source.replace(old, new)
    namespace: dict = {"__name__": f"{module.__name__.rsplit('.', 1)[-1]}_with_triton"}
    exec(compile(source, path, "exec"), namespace)
    kernel = namespace[name]
    assert isinstance(kernel, JITFunction)
    return kernel
