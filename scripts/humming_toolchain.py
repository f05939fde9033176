"""What humming-kernels needs before its first kernel, as this machine provides it; no GPU use.

    python3 scripts/humming_toolchain.py

vLLM 0.34.0 runs an MXFP8 checkpoint's linear layers and MoE through Humming on SM90 when
``humming`` imports. Humming compiles every kernel at first use (weight packing at load
included) with NVRTC, through a helper program that loads ``libnvrtc`` from the CUDA
environment it selects for torch's CUDA major version, with that environment's headers and
CCCL (``cuda/std``) on the include path; its native launcher, device query and NVRTC helper
ship prebuilt and are used when they match the sources beside them. This prints each of
those as this interpreter resolves it, one ``humming: key: value`` line each.

Exit 0: all present; 1: ``humming`` does not import (vLLM then picks Marlin for MXFP8 on
SM90); 2: it imports but a piece its first kernel needs is missing (vLLM picks Humming and
fails while processing the weights).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Importing humming otherwise starts background builds of its native helpers.
os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")

CCCL_PROBE = "cuda/std/cstdint"
PREBUILT = {  # artifact -> its source, relative to the humming package
    "libhumming_launcher.so": "csrc/launcher",
    "_device_info.abi3.so": "csrc/device_info.cpp",
    "nvrtc_compile": "csrc/nvrtc_compile.cpp",
    "libcubinpatch.so": "csrc/patch_cubin.cpp",
}


def say(key: str, value: object) -> None:
    print(f"humming: {key}: {value}", flush=True)


def kernel_compiler() -> str:
    """The compiler humming.jit.runtime.KernelRuntime picks on an NVIDIA GPU: the one
    HUMMING_COMPILER names, else NVRTC when cuda.bindings.nvrtc imports, else nvcc."""
    chosen = os.environ.get("HUMMING_COMPILER", "").lower()
    if chosen in ("nvcc", "nvrtc"):
        return f"{chosen} (HUMMING_COMPILER)"
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except Exception as error:
        return f"nvcc (cuda.bindings.nvrtc does not import: {error})"
    return "nvrtc"


def main() -> int:
    try:
        import humming
    except Exception as error:  # any failure makes vLLM's has_humming() false
        say("import", f"FAILED ({type(error).__name__}: {error})")
        return 1
    import torch
    from humming.utils import jit as jit_utils
    from humming.utils.cuda import filter_cuda_paths
    from humming.utils.nvrtc import get_nvrtc_library_path

    package = Path(humming.__file__).parent
    say("version", f"{humming.__version__} at {package}")
    say("torch CUDA", torch.version.cuda)
    say("compiler", kernel_compiler())
    missing = []
    try:
        environment = filter_cuda_paths(required_headers=["cuda_runtime.h"])
        includes = environment["include_paths"]
        say("kernel headers", f"{environment['source']} {environment['path']}: {includes}")
        if not any((Path(path) / CCCL_PROBE).is_file() for path in includes):
            missing.append(f"{CCCL_PROBE} (CCCL) on the kernel include path")
    except RuntimeError as error:
        say("kernel headers", f"MISSING ({error})")
        missing.append("a CUDA environment with cuda_runtime.h")
    try:
        say("nvrtc", get_nvrtc_library_path())
    except RuntimeError as error:
        say("nvrtc", f"MISSING ({error})")
        missing.append("libnvrtc with nvrtc.h")
    for artifact, source in PREBUILT.items():
        prebuilt = jit_utils.get_precompiled_artifact_path(package / source, artifact)
        say(artifact, "prebuilt" if prebuilt else "built at first use (needs a C++ compiler)")
    say("kernel cache", jit_utils.get_humming_cache_dir())
    if missing:
        say("missing", "; ".join(missing))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
