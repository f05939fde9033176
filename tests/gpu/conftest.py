"""GPU tests: run only where an SM90 or SM12x GPU and FlashInfer 0.7.4 are
present (`python -m pytest tests/gpu`); CI runs tests/cpu only."""

from __future__ import annotations

import pytest


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 12):
        return f"needs an SM90 or SM12x GPU, found SM{major}{minor}"
    try:
        import flashinfer.msa_ops  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"flashinfer.msa_ops does not import: {exc!r}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _skip_reason()
    if reason is None:
        return
    marker = pytest.mark.skip(reason=reason)
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(marker)
