"""Which revision of the patch series an end-to-end run was produced by.

`engine_run.py` records `applied_series()` (read from the state file
`vllm-minimax apply` wrote into the vLLM the engine imports) in every run's
JSON; `tests/gpu_e2e/conftest.py` refuses a run whose record is not this
checkout's series (`series_mismatch`), so a run left over from an earlier
revision is never re-checked as if the current one had produced it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_minimax import patchset

RUN_KEY = "series"


def applied_series(target: Path | None = None) -> dict[str, Any] | None:
    """The applied series of the vLLM at `target` (default: the installed one):
    its vLLM version, series directory name and each patch's name and sha256;
    None where no series is applied."""
    state = patchset.applied_state(target)
    if state is None:
        return None
    return {
        "vllm_version": state.vllm_version,
        "series": state.series,
        "patches": [[name, sha256] for name, sha256 in state.patches],
    }


def checkout_series(vllm_version: str) -> dict[str, Any]:
    """The same record for this checkout's series of `vllm_version`."""
    series_dir = patchset.require_series_dir(vllm_version)
    patches = patchset.read_series(series_dir)
    return {
        "vllm_version": vllm_version,
        "series": series_dir.name,
        "patches": [[name, sha256] for name, sha256 in patchset.series_fingerprint(patches)],
    }


def series_mismatch(run: dict[str, Any]) -> str | None:
    """Why `run` (a run's JSON) was not produced by this checkout's series, or None."""
    recorded = run.get(RUN_KEY)
    if RUN_KEY not in run:
        return "unknown series: the run records no series fingerprint (saved before runs had one)"
    if recorded is None:
        return "the run's vLLM had no series applied (no vllm-minimax state file)"
    try:
        expected = checkout_series(recorded["vllm_version"])
    except patchset.PatchError as error:
        return f"the run's series is for vLLM {recorded['vllm_version']}: {error}"
    if recorded != expected:
        ran = ", ".join(f"{name} {sha[:12]}" for name, sha in recorded["patches"])
        here = ", ".join(f"{name} {sha[:12]}" for name, sha in expected["patches"])
        return f"produced by another revision of the series ({ran}); this checkout has {here}"
    return None
