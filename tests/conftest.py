"""Skip rules for the device-only directories, in one place.

tests/gpu (FlashInfer's kernels against the reference) needs an SM90 or SM12x GPU and an
importable ``flashinfer.msa_ops``; tests/gpu_e2e (the whole patched engine) needs the same
GPU and a vLLM with the series applied. CI runs tests/cpu only, where none of this applies.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


@cache
def gpu_missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 12):
        return f"needs an SM90 or SM12x GPU, found SM{major}{minor}"
    return None


@cache
def flashinfer_msa_missing() -> str | None:
    try:
        import flashinfer.msa_ops  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"flashinfer.msa_ops does not import: {exc!r}"
    return None


@cache
def patched_vllm_missing() -> str | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return "vLLM is not installed"
    site = Path(spec.origin).parent
    if not (site / "models/minimax_m3/nvidia/indexer_flashinfer.py").is_file():
        return f"the vLLM at {site} lacks the series: vllm-minimax apply"
    return None


REQUIREMENTS: dict[Path, tuple[Callable[[], str | None], ...]] = {
    TESTS / "gpu": (gpu_missing, flashinfer_msa_missing),
    TESTS / "gpu_e2e": (gpu_missing, patched_vllm_missing),
}


# tests/gpu_e2e modules that only read saved GPU runs -> the variable naming their directory.
SAVED_RUN_CHECKS = {
    "test_sparse_attention_engine.py": "VLLM_MINIMAX_SA_RUNS",
    "test_sparse_attention_layout.py": "VLLM_MINIMAX_SA_LAYOUT_RUNS",
    "test_tp_engine.py": "VLLM_MINIMAX_TP_RUNS",
}


def saved_e2e_runs_only() -> str | None:
    """In saved-run mode (tests/gpu_e2e/conftest.py) only the live server test needs a GPU."""
    if os.environ.get("VLLM_MINIMAX_E2E_SAVED"):
        return "VLLM_MINIMAX_E2E_SAVED re-checks saved engine runs; a live server needs the GPU"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("VLLM_MINIMAX_E2E_SAVED"):
        requirements = {TESTS / "gpu_e2e" / "test_serve.py": (saved_e2e_runs_only,)}
    else:
        requirements = REQUIREMENTS
    for directory, checks in requirements.items():
        selected = [
            item
            for item in items
            if (directory == item.path or directory in item.path.parents)
            and not (
                # These engine checks read saved runs only.
                item.path.name in SAVED_RUN_CHECKS
                and os.environ.get(SAVED_RUN_CHECKS[item.path.name])
            )
        ]
        if not selected:
            continue
        reason = next((r for r in (check() for check in checks) if r is not None), None)
        if reason is not None:
            for item in selected:
                item.add_marker(pytest.mark.skip(reason=reason))
