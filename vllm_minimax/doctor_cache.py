"""doctor's answers that need vLLM and FlashInfer imported (the FlashInfer line, the selection
rows), stored under a fingerprint of what they depend on, so that the next doctor in the
same environment answers without importing either (issue 57: 12 to 81 s a call on 2 cores,
nearly all of it imports).

The fingerprint covers what vLLM 0.34.0, FlashInfer 0.7.4 and torch read to give those
answers, and nothing else, so that a new login to the same machine finds them:

- this Python (its executable, version and `sys.path`, which `PYTHONPATH` shapes) and every
  installed distribution on `sys.path` (each `*.dist-info`, `*.egg-info`, `*.pth` and
  `*.egg-link` entry by name, inode and modification time, and each directory's own
  modification time, which changes as top-level entries come and go): what
  `importlib.util.find_spec("flashinfer")` and `find_spec("flashinfer_cubin")` in vLLM's
  `has_flashinfer()` / `has_flashinfer_cubin()` (`vllm/utils/flashinfer.py`) find, and what
  `import flashinfer.msa_ops` loads;
- the vLLM tree's series state and state file, and whether the CUDA bindings' files are
  whole (`vllm_minimax.cuda_bindings`), as the caller passes them;
- the nvcc vLLM's `has_flashinfer()` looks for (`_flashinfer_nvcc_path()`: `$CUDA_HOME`,
  else `$CUDA_PATH`, else the directory above `nvcc` on `PATH`, else `/usr/local/cuda`; then
  `bin/nvcc` there, if executable) and `ninja` on `PATH` (`shutil.which`), resolved here as
  vLLM resolves them, so an nvcc that appears under `$CUDA_HOME` is seen; also `nvcc` on
  `PATH` and whether `/usr/local/cuda` exists, FlashInfer's fallbacks for its CUDA home
  (`flashinfer/jit/cpp_ext.py`, `get_cuda_path()`), and whether
  `$CUDA_LIB_PATH/libcudart.so.12` exists, which `import flashinfer.jit` loads when it does
  (`flashinfer/jit/__init__.py`);
- the GPU driver: the kernel module's version (`/proc/driver/nvidia/version`) and the CUDA
  version the user-space driver reports (`cuDriverGetVersion` in `libcuda.so.1`, no CUDA
  context made), which the CUDA bindings `flashinfer.msa_ops` imports must match (series
  patch 0002: mismatched bindings break `msa_ops`); torch is not imported for it;
- the environment variables those packages read (`READ_ENVIRONMENT`, `READ_PREFIXES`):
  vLLM's (`VLLM_*`, `vllm/envs.py`, `VLLM_HAS_FLASHINFER_CUBIN` among them), FlashInfer's
  (`FLASHINFER_*`: `flashinfer/jit/env.py`, `jit/core.py`, `jit/cpp_ext.py`; `CUTE_DSL_*`:
  `jit/cute_dsl_core.py`; `CC`, `CXX`, `MAX_JOBS`, `NCCL_HOME`: its JIT), CUDA's and torch's
  (`CUDA_*`, among them `CUDA_HOME`, `CUDA_PATH`, `CUDA_LIB_PATH`, `CUDA_VISIBLE_DEVICES`;
  `TORCH_*`, `PYTORCH_*`), the dynamic loader's (`LD_LIBRARY_PATH`, `LD_PRELOAD`: which
  libcuda and libcudart load) and `HOME` (FlashInfer's workspace default). `PATH` counts
  through what it resolves (above), and a session's own variables (`SSH_CONNECTION`,
  `XDG_SESSION_ID`, `TERM`, the shell's `PWD` and `_`, ...) not at all;
- this machine's GPU capability, and this package's own modules.

A change to any of them is a new fingerprint, so the answer is asked of vLLM again. An edit
inside an installed package that leaves its metadata alone is not seen: `doctor --no-cache`
asks anyway.

Answers live in `${VLLM_MINIMAX_CACHE:-~/.cache/vllm-minimax}/doctor/`, one JSON file each,
at most `MAX_ANSWERS` of them: a save removes the least recently used beyond that (a reused
answer counts as used). One that cannot be read or written is a miss, never an error.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FORMAT = 2
INSTALL_RECORDS = (".dist-info", ".egg-info", ".pth", ".egg-link")
# The environment variables vLLM, FlashInfer and torch read (the module's docstring says
# where): every one with a prefix of READ_PREFIXES, and the names of READ_ENVIRONMENT.
READ_PREFIXES = ("VLLM_", "FLASHINFER_", "CUTE_DSL_", "CUDA_", "TORCH_", "PYTORCH_")
READ_ENVIRONMENT = frozenset(
    {"CC", "CXX", "MAX_JOBS", "NCCL_HOME", "LD_LIBRARY_PATH", "LD_PRELOAD", "HOME"}
)
# vLLM's and FlashInfer's CUDA home when neither variable names one nor nvcc is on PATH.
DEFAULT_CUDA_HOME = "/usr/local/cuda"
# Where `import flashinfer.jit` looks for libcudart.so.12 unless CUDA_LIB_PATH says.
FLASHINFER_CUDA_LIB_PATH = "/usr/local/cuda/targets/x86_64-linux/lib/"
NVIDIA_DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
CUDA_DRIVER_LIBRARY = "libcuda.so.1"
# Answers kept; a save removes the least recently used beyond it (each is a few KB).
MAX_ANSWERS = 256
# A partial file of a save older than this was left by a killed doctor.
STALE_PARTIAL_S = 3600


def cache_dir() -> Path:
    configured = os.environ.get("VLLM_MINIMAX_CACHE")
    root = Path(configured) if configured else Path.home() / ".cache" / "vllm-minimax"
    return root / "doctor"


def installed_entries(directory: str) -> list[object]:
    """A `sys.path` directory's modification time and its install records, each by name,
    inode and modification time (a reinstall makes a new directory: a new inode)."""
    entries: list[object] = [directory]
    try:
        entries.append(os.stat(directory or ".").st_mtime_ns)
        with os.scandir(directory or ".") as listing:
            records = [entry for entry in listing if entry.name.endswith(INSTALL_RECORDS)]
    except OSError:  # gone, or a zip archive
        return entries
    for entry in sorted(records, key=lambda entry: entry.name):
        with contextlib.suppress(OSError):
            stat = entry.stat()
            entries.append([entry.name, stat.st_ino, stat.st_mtime_ns])
    return entries


def package_digest() -> str:
    """This package's own modules: another revision of doctor may answer otherwise."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for module in sorted(package.glob("*.py")):
        digest.update(module.name.encode() + b"\0" + module.read_bytes())
    return digest.hexdigest()


def file_digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def read_environment() -> list[tuple[str, str]]:
    """The environment variables vLLM, FlashInfer and torch read, as sorted pairs."""
    return sorted(
        (key, value)
        for key, value in os.environ.items()
        if key in READ_ENVIRONMENT or key.startswith(READ_PREFIXES)
    )


def vllm_flashinfer_nvcc() -> str | None:
    """The nvcc vLLM's `has_flashinfer()` requires (without flashinfer-cubin), found as its
    `_flashinfer_nvcc_path()` finds it: `bin/nvcc` under `$CUDA_HOME`, else `$CUDA_PATH`,
    else the directory above `nvcc` on `PATH`, else `/usr/local/cuda`; None when missing."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not cuda_home:
        nvcc = shutil.which("nvcc")
        cuda_home = os.path.dirname(os.path.dirname(nvcc)) if nvcc else DEFAULT_CUDA_HOME
    return shutil.which(os.path.join(cuda_home, "bin", "nvcc"))


def compilers() -> dict[str, object]:
    """What decides whether vLLM lets FlashInfer run (its nvcc and ninja) and where
    FlashInfer finds its CUDA home and libcudart, resolved now."""
    cuda_lib_path = os.environ.get("CUDA_LIB_PATH", FLASHINFER_CUDA_LIB_PATH)
    return {
        "vllm's nvcc": vllm_flashinfer_nvcc(),
        "nvcc on PATH": shutil.which("nvcc"),
        "ninja on PATH": shutil.which("ninja"),
        "default CUDA home": os.path.exists(DEFAULT_CUDA_HOME),
        "libcudart.so.12": os.path.exists(os.path.join(cuda_lib_path, "libcudart.so.12")),
    }


def cuda_driver_version() -> int | None:
    """The CUDA version the user-space driver reports (13000 for 13.0), from libcuda without
    a CUDA context; None where the library does not load."""
    try:
        library = ctypes.CDLL(CUDA_DRIVER_LIBRARY)
        version = ctypes.c_int(0)
        status = library.cuDriverGetVersion(ctypes.byref(version))
    except (OSError, AttributeError):
        return None
    return version.value if status == 0 else None


def driver_version() -> list[object]:
    """The GPU driver: the NVIDIA kernel module's version text (its build, 580.159.04, say)
    and `cuda_driver_version()`; each None where absent. Neither imports torch."""
    try:
        kernel_module: str | None = NVIDIA_DRIVER_VERSION_FILE.read_text(errors="replace")
    except OSError:
        kernel_module = None
    return [kernel_module, cuda_driver_version()]


def environment_fingerprint(
    series: object, state_file: Path, capability: tuple[int, int] | None
) -> str:
    """What doctor's stored answers depend on here; `series` is the target's series state
    and whatever else the caller read (any value with a stable `repr`), `capability` this
    machine's GPU (None: none)."""
    parts = {
        "format": FORMAT,
        "python": [sys.executable, sys.version],
        "sys.path": list(sys.path),
        "installed": [installed_entries(directory) for directory in sys.path],
        "series": repr(series),
        "state file": file_digest(state_file),
        "environment": read_environment(),
        "compilers": compilers(),
        "driver": driver_version(),
        "gpu": capability,
        "package": package_digest(),
    }
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


class AnswerStore:
    """Answers to doctor's questions in one environment (`environment_fingerprint`)."""

    def __init__(
        self, fingerprint: str, directory: Path | None = None, limit: int = MAX_ANSWERS
    ) -> None:
        self.fingerprint = fingerprint
        self.directory = directory if directory is not None else cache_dir()
        self.limit = limit  # answers kept in the directory
        self.used: list[str] = []  # when each answer this run reused was stored

    def path(self, question: object) -> Path:
        key = json.dumps([self.fingerprint, question], sort_keys=True, default=str)
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()}.json"

    def load(self, question: object) -> Any:
        """The stored answer, or None."""
        try:
            stored = json.loads(self.path(question).read_text())
            answer, when = stored["answer"], stored["stored"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        with contextlib.suppress(OSError):
            os.utime(self.path(question))  # used now: the last to be pruned
        self.used.append(str(when))
        return answer

    def save(self, question: object, answer: object) -> None:
        """Store `answer` (JSON), replacing the file whole; a failure stores nothing."""
        stored = {
            "stored": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "answer": answer,
        }
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            descriptor, partial = tempfile.mkstemp(dir=self.directory, suffix=".part")
        except OSError:
            return
        try:
            with os.fdopen(descriptor, "w") as handle:
                json.dump(stored, handle)
            os.replace(partial, self.path(question))
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(partial)
        self.prune()

    def prune(self) -> None:
        """Keep the `limit` most recently used answers; remove the rest, and partial files
        a killed save left."""
        answers = []
        now = time.time()
        try:
            with os.scandir(self.directory) as listing:
                for entry in listing:
                    with contextlib.suppress(OSError):
                        if entry.name.endswith(".json"):
                            answers.append((entry.stat().st_mtime_ns, entry.path))
                        elif (
                            entry.name.endswith(".part")
                            and now - entry.stat().st_mtime > STALE_PARTIAL_S
                        ):
                            os.unlink(entry.path)
        except OSError:
            return
        answers.sort()
        for _, path in answers[: max(0, len(answers) - self.limit)]:
            with contextlib.suppress(OSError):
                os.unlink(path)
