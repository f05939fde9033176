"""Whether the Python environment a GPU script runs in has what the script needs.

    python3 scripts/gpu_env_check.py NAME --vllm VERSION... --capability X.Y...

Run by scripts/gpu-env.sh (after the optional environment hook), from the project's root with
the checkout first on PYTHONPATH. It checks, without importing vLLM:

- vLLM: the ``vllm`` package this Python imports, at one of the versions named;
- the series: this checkout's series for that version applied there, or applying cleanly
  (``vllm-minimax status``'s check: staged on copies, nothing written), and the tree writable
  when it is not applied yet;
- FlashInfer: ``flashinfer-python`` at least :data:`FLASHINFER_MIN`;
- the GPU: torch with a CUDA GPU of one of the compute capabilities named.

Ready: three lines on standard output, the directory that holds the ``vllm`` package, vLLM's
version, and a summary. Otherwise one line on standard error naming everything missing, exit 3.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import sys
from pathlib import Path

from vllm_minimax.errors import PatchError
from vllm_minimax.patchset import find_vllm_root, read_vllm_version, series_state

FLASHINFER_MIN = (0, 7, 4)
EXIT_MISSING = 3


def release(version: str) -> tuple[int, ...]:
    """The leading numeric release of ``version`` ("0.7.2.post1" -> (0, 7, 2))."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def check_vllm(wanted: list[str], missing: list[str]) -> tuple[Path, str] | None:
    """The vLLM tree and its version, or ``None`` with what is missing added."""
    label = f"vLLM {' or '.join(wanted)}"
    try:
        root = find_vllm_root(None)
    except PatchError:
        missing.append(f"{label} (this Python imports no vllm)")
        return None
    try:
        version = read_vllm_version(root)
    except PatchError as error:
        missing.append(f"{label} ({error})")
        return None
    if version not in wanted:
        missing.append(f"{label} ({root} holds vLLM {version})")
        return None
    return root, version


def check_series(root: Path, version: str, missing: list[str]) -> str:
    """How the series stands on ``root``: "applied" or "appliable"; what is missing added."""
    label = f"the vllm-{version} series"
    try:
        state = series_state(root)
    except PatchError as error:
        missing.append(f"{label} ({first_line(str(error))})")
        return "unknown"
    if state.applied:
        # scripts/ensure-series-applied reverts an older revision and applies this one.
        return "applied" if state.clean else "applied (an older revision: applied again)"
    if state.problem is not None:
        missing.append(f"{label} (does not apply to {root}: {first_line(state.problem)})")
        return "not appliable"
    if not os.access(root / "vllm", os.W_OK):
        missing.append(f"{label} (not applied, and {root / 'vllm'} is not writable)")
        return "not writable"
    return "appliable"


def check_flashinfer(missing: list[str]) -> str | None:
    label = f"FlashInfer {'.'.join(map(str, FLASHINFER_MIN))} or later"
    try:
        version = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        missing.append(f"{label} (flashinfer-python is not installed)")
        return None
    if release(version) < FLASHINFER_MIN:
        missing.append(f"{label} ({version} is installed)")
        return None
    return version


def check_gpu(capabilities: list[str], missing: list[str]) -> str | None:
    label = f"a GPU of compute capability {' or '.join(capabilities)}"
    if importlib.util.find_spec("torch") is None:
        missing.append(f"{label} (torch is not installed)")
        return None
    import torch

    if not torch.cuda.is_available():
        missing.append(f"{label} (torch sees no CUDA GPU)")
        return None
    major, minor = torch.cuda.get_device_capability(0)
    name = torch.cuda.get_device_name(0)
    if f"{major}.{minor}" not in capabilities:
        missing.append(f"{label} ({name} is {major}.{minor})")
        return None
    return f"{name} (compute capability {major}.{minor})"


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the script, for the messages")
    parser.add_argument("--vllm", action="append", required=True, help="a vLLM version it runs")
    parser.add_argument(
        "--capability", action="append", required=True, help="a compute capability, X.Y"
    )
    args = parser.parse_args(argv)
    missing: list[str] = []
    found = check_vllm(args.vllm, missing)
    series = check_series(*found, missing) if found else None
    flashinfer = check_flashinfer(missing)
    gpu = check_gpu(args.capability, missing)
    hook = os.environ.get("VLLM_MINIMAX_GPU_ENV_HOOK") or "none"
    if missing or found is None:
        print(
            f"{args.name}: missing: {'; '.join(missing)}"
            f" [python: {sys.executable}; VLLM_MINIMAX_GPU_ENV_HOOK: {hook}]",
            file=sys.stderr,
        )
        return EXIT_MISSING
    root, version = found
    print(root)
    print(version)
    print(
        f"{args.name}: vLLM {version} in {root} (series {series}), FlashInfer {flashinfer},"
        f" {gpu} [python: {sys.executable}; VLLM_MINIMAX_GPU_ENV_HOOK: {hook}]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
