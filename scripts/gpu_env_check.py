"""Whether the Python environment a GPU script runs in has what the script needs.

    python3 scripts/gpu_env_check.py NAME --vllm VERSION... --capability X.Y...

Run by scripts/gpu-env.sh (after the optional environment hook), from the project's root with
the checkout first on PYTHONPATH. It checks, without importing vLLM:

- vLLM: the ``vllm`` package this Python imports, at one of the versions named;
- the series: this checkout's series for that version applied there, or applying cleanly
  (``vllm-minimax status``'s check: staged on copies, nothing written), and the tree writable
  when it is not applied yet;
- FlashInfer: ``flashinfer-python`` at least :data:`FLASHINFER_MIN`;
- the GPU: torch with a CUDA GPU of one of the compute capabilities named;
- the target: the scripts patch that vLLM (and revert it on exit) for every program that
  imports it, so it must lie inside the virtual environment python3 runs in, or be named in
  :data:`TARGET_ENV` (the lent GPU machine's ``pip --target`` directory on ``PYTHONPATH``,
  say). A user's own install (as root, the system's site-packages) is refused otherwise.

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
# Names the directory holding the vllm package the scripts may patch outside a venv.
TARGET_ENV = "VLLM_MINIMAX_GPU_TARGET"


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


def check_target(root: Path, missing: list[str]) -> str:
    """Why the scripts may patch ``root``: named in TARGET_ENV, or inside this Python's
    virtual environment; what is missing added otherwise."""
    named = os.environ.get(TARGET_ENV)
    if named:
        if Path(named).resolve() != root.resolve():
            missing.append(
                f"the vLLM {TARGET_ENV} names ({TARGET_ENV}={named}, but python3 imports vllm"
                f" from {root})"
            )
        return f"named by {TARGET_ENV}"
    prefix = Path(sys.prefix).resolve()
    if sys.prefix != sys.base_prefix and root.resolve().is_relative_to(prefix):
        return f"in the virtual environment {prefix}"
    where = (
        f"not inside the virtual environment python3 runs in ({prefix})"
        if sys.prefix != sys.base_prefix
        else "not in a virtual environment"
    )
    missing.append(
        f"a vLLM the script may patch ({root} is {where}: the script applies this checkout's"
        f" series there for every program that imports it; run it in a virtual environment"
        f" of its own, or export {TARGET_ENV}={root} to name that directory)"
    )
    return "refused"


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
    target = check_target(found[0], missing) if found else None
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
        f" {gpu} [python: {sys.executable}; target: {target};"
        f" VLLM_MINIMAX_GPU_ENV_HOOK: {hook}]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
