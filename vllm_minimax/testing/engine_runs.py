"""Saved engine runs of tests/gpu_e2e: loading them, comparing their prompt logprobs, and
listing the FlashInfer programs the engine's JIT cache holds.

The run scripts (`sparse_attention_engine.py`, `tp_engine.py`) write one JSON per run,
committed gzip'ed under results/; the checks read either form.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any


def load_run(directory: Path, name: str) -> dict[str, Any]:
    """`<name>.json` in `directory`, or its gzip'ed copy (committed results)."""
    path = directory / f"{name}.json"
    if path.exists():
        return json.loads(path.read_text())
    packed = path.with_suffix(".json.gz")
    assert packed.exists(), f"no run {path}"
    return json.loads(gzip.decompress(packed.read_bytes()))


def mean_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Mean |difference| of two runs' prompt logprobs, token by token."""
    diffs = []
    for ra, rb in zip(a["requests"], b["requests"], strict=True):
        for x, y in zip(ra["prompt_logprobs"], rb["prompt_logprobs"], strict=True):
            if x is not None and y is not None:
                diffs.append(abs(x - y))
    assert diffs
    return sum(diffs) / len(diffs)


def flashinfer_jit_files() -> set[str]:
    """The built programs in FlashInfer's JIT cache: files that appear between two listings
    were built in between."""
    root = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", Path.home())) / ".cache" / "flashinfer"
    return {str(p) for p in root.rglob("*.so")} if root.exists() else set()
