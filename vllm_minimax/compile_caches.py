"""Where each on-disk compile cache a MiniMax M3 start can fill lives, and what is in it.

Each cache is located by the same rule its owner uses (environment variable, else a default
under the home directory or the temporary directory), from an environment mapping, so that
a caller can ask about a server it starts with an environment of its own. ``inventory``
counts the files of each cache, and of those the ones written at or after a given time (what
a start built, when given the time it became ready: what it built after ready).

The caches (docs/warm-start.md says who builds what and what keys each entry):

- ``flashinfer``: ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer`` (default: the home
  directory), FlashInfer's JIT programs and its autotune cache.
- ``humming``: ``$HUMMING_CACHE_DIR`` (default ``~/.humming/cache``), Humming's NVRTC
  cubins, one directory per kernel.
- ``triton``: ``$TRITON_CACHE_DIR`` (default ``$TRITON_HOME/.triton/cache``, ``TRITON_HOME``
  defaulting to the home directory).
- ``vllm_torch_compile``: ``$VLLM_CACHE_ROOT/torch_compile_cache`` (default
  ``$XDG_CACHE_HOME/vllm``, else ``~/.cache/vllm``).
- ``vllm_startup_plan``: ``$VLLM_CACHE_ROOT/startup_plan`` (written only with
  ``VLLM_ENABLE_STARTUP_PLAN=1``).
- ``vllm_cutedsl``: ``$VLLM_CACHE_ROOT/cutedsl``, the executors of vLLM's CuTe-DSL JIT
  kernels (the series' patch 0010).
- ``torchinductor``: ``$TORCHINDUCTOR_CACHE_DIR`` (default ``$TMPDIR/torchinductor_<user>``).
- ``cute_dsl``: ``$CUTE_DSL_CACHE_DIR`` (default ``$TMPDIR/<user>/cutlass_python_cache``),
  the CuTe DSL's file cache, which ``cute.compile`` (every vLLM and FlashInfer CuTe-DSL
  kernel) does not use.
"""

from __future__ import annotations

import getpass
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CACHE_NAMES = (
    "flashinfer",
    "humming",
    "triton",
    "vllm_torch_compile",
    "vllm_startup_plan",
    "vllm_cutedsl",
    "torchinductor",
    "cute_dsl",
)


def _user(env: Mapping[str, str]) -> str:
    for key in ("USER", "LOGNAME"):
        if env.get(key):
            return env[key]
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def cache_dirs(env: Mapping[str, str]) -> dict[str, Path]:
    """Each cache's directory for a process started with environment ``env``."""
    home = Path(env.get("HOME") or Path.home())
    tmp = Path(env.get("TMPDIR") or tempfile.gettempdir())
    user = _user(env)
    vllm_root = Path(
        env.get("VLLM_CACHE_ROOT") or Path(env.get("XDG_CACHE_HOME") or home / ".cache") / "vllm"
    )
    triton_home = Path(env.get("TRITON_HOME") or home)
    return {
        "flashinfer": Path(env.get("FLASHINFER_WORKSPACE_BASE") or home) / ".cache" / "flashinfer",
        "humming": Path(env.get("HUMMING_CACHE_DIR") or home / ".humming" / "cache"),
        "triton": Path(env.get("TRITON_CACHE_DIR") or triton_home / ".triton" / "cache"),
        "vllm_torch_compile": vllm_root / "torch_compile_cache",
        "vllm_startup_plan": vllm_root / "startup_plan",
        "vllm_cutedsl": vllm_root / "cutedsl",
        "torchinductor": Path(env.get("TORCHINDUCTOR_CACHE_DIR") or tmp / f"torchinductor_{user}"),
        "cute_dsl": Path(env.get("CUTE_DSL_CACHE_DIR") or tmp / user / "cutlass_python_cache"),
    }


def inventory(dirs: Mapping[str, Path], since: float | None = None) -> dict[str, dict[str, Any]]:
    """Per cache: ``files`` and ``bytes`` of the regular files under its directory (0 when it
    does not exist), and with ``since`` (a ``time.time()``), ``since_files``: how many of them
    were modified at or after it. Lock files and symbolic links are not counted."""
    found: dict[str, dict[str, Any]] = {}
    for name, root in dirs.items():
        files = size = recent = 0
        if root.is_dir():
            for dirpath, _, filenames in os.walk(root):
                for filename in filenames:
                    path = Path(dirpath) / filename
                    if filename.endswith(".lock") or path.is_symlink():
                        continue
                    try:
                        stat = path.stat()
                    except OSError:
                        continue
                    files += 1
                    size += stat.st_size
                    if since is not None and stat.st_mtime >= since:
                        recent += 1
        entry: dict[str, Any] = {"dir": str(root), "files": files, "bytes": size}
        if since is not None:
            entry["since_files"] = recent
        found[name] = entry
    return found
