"""A CUDA toolkit directory made of the CUDA wheels from PyPI, for FlashInfer's nvcc builds on a
machine without a system toolkit (the CI host).

FlashInfer's JIT looks for ``$CUDA_HOME/bin/nvcc``, includes ``$CUDA_HOME/include`` and links
with ``-L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart -lcuda``
(``flashinfer/jit/cpp_ext.py``). The ``nvidia-cuda-nvcc`` and ``nvidia-cuda-runtime`` wheels put
nvcc, its headers and ``libcudart.so.13`` under ``site-packages/nvidia/cu13`` (``bin``,
``include``, ``nvvm``, ``lib``), without the unversioned ``libcudart.so`` or the driver stub the
link names. :func:`make_cuda_home` links those directories into one and adds both: a
``libcudart.so`` link to the wheel's library, and an empty ``libcuda.so`` whose soname is the
driver's (``libcuda.so.1``), so a program that used the driver API would still load the real
driver at run time. Nothing here is used on a GPU machine.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

_WHEEL_DIRS = ("bin", "include", "nvvm", "lib")


class PypiCudaError(RuntimeError):
    """The PyPI CUDA wheels or a host C compiler are missing; the message says which."""


def wheel_root() -> Path:
    """``site-packages/nvidia/cu13`` of the ``nvidia-cuda-nvcc`` wheel."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        raise PypiCudaError("the nvidia-cuda-* wheels are not installed")
    for location in spec.submodule_search_locations:
        root = Path(location) / "cu13"
        if (root / "bin" / "nvcc").is_file():
            return root
    raise PypiCudaError("no nvcc from the nvidia-cuda-nvcc wheel under site-packages/nvidia/cu13")


def make_cuda_home(directory: Path) -> Path:
    """Make ``directory`` a CUDA_HOME of the PyPI wheels (see the module); returns it."""
    root = wheel_root()
    cudart = root / "lib" / "libcudart.so.13"
    if not cudart.is_file():
        raise PypiCudaError(f"no {cudart.name} from the nvidia-cuda-runtime wheel in {root}")
    compiler = shutil.which("cc")
    if compiler is None:
        raise PypiCudaError("no host C compiler (cc), which nvcc needs as well")
    stubs = directory / "lib64" / "stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    for name in _WHEEL_DIRS:
        link = directory / name
        if not link.exists():
            link.symlink_to(root / name, target_is_directory=True)
    libcudart = directory / "lib64" / "libcudart.so"
    if not libcudart.exists():
        libcudart.symlink_to(cudart)
    stub = stubs / "libcuda.so"
    if not stub.exists():
        source = directory / "libcuda_stub.c"
        source.write_text("/* link-time stand-in for the CUDA driver library */\n")
        subprocess.run(
            [compiler, "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(stub), str(source)],
            check=True,
            capture_output=True,
        )
    return directory
