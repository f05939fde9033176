"""doctor's answers that need vLLM and FlashInfer imported (the FlashInfer line, the selection
rows), stored under a fingerprint of what they depend on, so that the next doctor in the
same environment answers without importing either (issue 57: 12 to 81 s a call on 2 cores,
nearly all of it imports).

The fingerprint covers this Python (its executable, version and `sys.path`); every installed
distribution on `sys.path` (each `*.dist-info`, `*.egg-info`, `*.pth` and `*.egg-link` entry
by name, inode and modification time, and each directory's own modification time, which
changes as top-level entries come and go); the vLLM tree's series state and state file, and
whether the CUDA bindings' files are whole (`vllm_minimax.cuda_bindings`); the environment
variables (but the shell's `_`, `PWD`, `OLDPWD`, `SHLVL`); where `nvcc` and
`ninja` are, which decide whether FlashInfer can compile; this machine's GPU capability; and
this package's own modules. A change to any of them is a new fingerprint, so the answer is
asked of vLLM again. An edit inside an installed package that leaves its metadata alone is
not seen: `doctor --no-cache` asks anyway.

Answers live in `${VLLM_MINIMAX_CACHE:-~/.cache/vllm-minimax}/doctor/`, one JSON file each;
one that cannot be read or written is a miss, never an error.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

FORMAT = 1
# Variables a shell changes between two commands without changing what doctor would find.
VOLATILE_ENVIRONMENT = frozenset({"_", "PWD", "OLDPWD", "SHLVL"})
INSTALL_RECORDS = (".dist-info", ".egg-info", ".pth", ".egg-link")


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
        "environment": sorted(
            (key, value) for key, value in os.environ.items() if key not in VOLATILE_ENVIRONMENT
        ),
        "compilers": [
            shutil.which("nvcc"),
            shutil.which("ninja"),
            os.path.exists("/usr/local/cuda/bin/nvcc"),
        ],
        "gpu": capability,
        "package": package_digest(),
    }
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


class AnswerStore:
    """Answers to doctor's questions in one environment (`environment_fingerprint`)."""

    def __init__(self, fingerprint: str, directory: Path | None = None) -> None:
        self.fingerprint = fingerprint
        self.directory = directory if directory is not None else cache_dir()
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
