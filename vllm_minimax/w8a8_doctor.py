"""doctor's W8A8 row: does the config's ``quantization-config`` requantization of an MXFP8
checkpoint (patch 0008 of the series, :mod:`vllm_minimax.w8a8`) run as the config asks?

A serve config opts in with ``quantization-config`` setting ``linear`` and/or ``moe`` to
``fp8_per_channel`` (vLLM's override of a checkpoint's quantization). The row checks, without
importing vLLM or torch:

- the GPU (or ``--capability``): patch 0008 refuses below SM89, where there are no FP8 tensor
  cores (``require_fp8_tensor_cores``);
- the series state doctor already read: the series is cleanly applied and carries the patch
  that creates :data:`REQUANTIZATION_FILE` (the power-of-two requantization);
- ``moe-backend: humming``, which patch 0008 refuses for the requantized MoE (W8A16 again);
- with ``--model``, the checkpoint's quantization as vLLM 0.34.0 reads it (``config.json``'s
  ``quantization_config``, else ``hf_quant_config.json``, else the text config's): MXFP8 is
  ``quant_method: mxfp8`` (MiniMax's tag, what ``make-tiny-model --weights mxfp8`` writes;
  vLLM maps it to ``ModelOptMxFp8Config``) or a ``modelopt*`` method whose ``quant_algo``
  (flat, or under ``quantization``) contains ``MXFP8``
  (``ModelOptMxFp8Config.override_quantization_method``). Over an unquantized checkpoint
  vLLM builds no quantization method, so the key is never read and the engine serves bf16;
  over another format, every linear method but ModelOpt MXFP8's (and Quark's) has no
  ``dequantize_weight``, so patch 0008 stops the load naming the key. No ``config.json`` is
  "cannot check", never a pass.

A refusal is doctor's exit 5 (the engine stops); a key the engine ignores (a bf16 checkpoint: it
starts and serves bf16) is exit 3, a fall-back; "cannot check" turns a ready exit 0 into 4, as
the checkpoint row does.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_minimax import checkpoint_weights, patchset
from vllm_minimax.serve_config import mapping_option

CONFIG_KEY = "quantization-config"
REQUANTIZATION = "fp8_per_channel"
KINDS = ("linear", "moe")
# The module patch 0008 creates: the power-of-two requantization and its refusals.
REQUANTIZATION_FILE = "vllm/model_executor/layers/quantization/online/pow2_requant.py"
# FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer.
MIN_CAPABILITY = (8, 9)
MXFP8_METHOD = "mxfp8"
MODELOPT_PREFIX = "modelopt"
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
# The MoE backend patch 0008 refuses for the requantized experts (16-bit activations).
W8A16_MOE_BACKEND = "humming"


class Outcome(enum.Enum):
    RUNS = "runs"
    REFUSED = "will not run"
    IGNORED = "has no effect"
    CANNOT_CHECK = "cannot check"
    NOT_CHECKED = "not the W8A8 requantization"


# Worst first: the row's outcome is its worst finding's.
SEVERITY = (Outcome.REFUSED, Outcome.IGNORED, Outcome.CANNOT_CHECK, Outcome.RUNS)


@dataclass(frozen=True)
class Request:
    """What the config asks of ``quantization-config``: the kinds set to fp8_per_channel."""

    kinds: tuple[str, ...]
    setting: dict[str, Any]
    moe_backend: str = "auto"


@dataclass(frozen=True)
class W8A8Row:
    """doctor's one line on the W8A8 requantization."""

    outcome: Outcome
    text: str

    @property
    def stops_serve(self) -> bool:
        """The engine stops at load: exit 5."""
        return self.outcome is Outcome.REFUSED

    @property
    def falls_back(self) -> bool:
        """The engine starts and serves without the W8A8 asked for: exit 3."""
        return self.outcome is Outcome.IGNORED


def request_of(options: dict[str, Any], path: Path) -> Request | None:
    """The config's request (None when it sets no ``quantization-config``); raise
    ServeConfigError for a value vllm serve would not parse as a mapping."""
    if options.get(CONFIG_KEY) is None:
        return None
    setting = mapping_option(options, CONFIG_KEY, path)
    kinds = tuple(kind for kind in KINDS if setting.get(kind) == REQUANTIZATION)
    backend = str(options.get("moe-backend", "auto")).lower().replace("-", "_")
    return Request(kinds, dict(setting), backend)


def capability_finding(capability: tuple[int, int] | None, simulated: bool) -> tuple[Outcome, str]:
    if capability is None:
        return Outcome.CANNOT_CHECK, "no GPU here and no --capability"
    where = "the simulated GPU" if simulated else "this GPU"
    shown = f"{capability[0]}.{capability[1]}"
    if tuple(capability) < MIN_CAPABILITY:
        return (
            Outcome.REFUSED,
            f"{where} is SM {shown}, without FP8 tensor cores (SM 8.9 or newer): patch 0008"
            f" stops the load naming quantization_config.{{linear,moe}}",
        )
    return Outcome.RUNS, f"{where} (SM {shown}) has FP8 tensor cores"


def requantization_patch(state: patchset.SeriesState) -> str | None:
    """The name of the patch of the state's series that creates :data:`REQUANTIZATION_FILE`."""
    if state.series_dir is None:
        return None
    try:
        patches = patchset.read_series(state.series_dir)
    except (OSError, patchset.PatchError):
        return None
    return next((p.name for p in patches if REQUANTIZATION_FILE in p.created), None)


def series_finding(state: patchset.SeriesState) -> tuple[Outcome, str]:
    """Clean is this version's current series applied with every file it touched as it left
    them, so a patch of that series creating the file means the file is there, as-applied."""
    if not state.clean:
        return Outcome.CANNOT_CHECK, "the series is not cleanly applied"
    patch = requantization_patch(state)
    if patch is not None:
        return Outcome.RUNS, f"the applied series carries patch {patch.split('-', 1)[0]}"
    return (
        Outcome.REFUSED,
        f"the series applied to {state.target} ({state.recorded_series}) has no patch"
        f" creating {REQUANTIZATION_FILE} (0008): without it vLLM cannot dequantize the"
        " MXFP8 experts and requantizes linear layers with amax/448 scales",
    )


def moe_backend_finding(request: Request) -> tuple[Outcome, str] | None:
    if "moe" not in request.kinds or request.moe_backend != W8A16_MOE_BACKEND:
        return None
    return (
        Outcome.REFUSED,
        "moe-backend humming takes 16-bit activations: patch 0008 stops the load naming"
        " quantization_config.moe (pick triton or cutlass)",
    )


def declared_quantization(directory: Path) -> dict[str, Any] | None:
    """The checkpoint's quantization config as vLLM 0.34.0 finds it (``config.json``'s
    top-level ``quantization_config``, else ``hf_quant_config.json``, else the top-level
    ``compression_config`` or the text config's ``quantization_config``); None: none."""
    config = checkpoint_weights.read_config(directory)
    found = config.get("quantization_config")
    if not found and (directory / HF_QUANT_CONFIG_FILE).is_file():
        try:
            found = json.loads((directory / HF_QUANT_CONFIG_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            found = None
    if not found:
        text = config.get("text_config")
        found = config.get("compression_config") or (
            text.get("quantization_config") if isinstance(text, dict) else None
        )
    return found if isinstance(found, dict) and found else None


def is_mxfp8(quantization: dict[str, Any] | None) -> bool:
    """Whether vLLM 0.34.0 loads this quantization config with ModelOpt's MXFP8 methods."""
    if quantization is None:
        return False
    method = str(quantization.get("quant_method", "")).lower()
    if method == MXFP8_METHOD:
        return True
    if not method.startswith(MODELOPT_PREFIX):
        return False
    nested = quantization.get("quantization")
    algo = nested.get("quant_algo") if isinstance(nested, dict) else None
    if "quantization" not in quantization:
        algo = quantization.get("quant_algo")
    return MXFP8_METHOD.upper() in str(algo or "").upper()


def checkpoint_finding(model: str) -> tuple[Outcome, str]:
    directory = checkpoint_weights.local_checkpoint(model)
    if directory is None:
        return (
            Outcome.CANNOT_CHECK,
            f"checkpoint {model} is neither a directory nor in the local Hugging Face cache"
            " (nothing is downloaded)",
        )
    config_file = directory / checkpoint_weights.CONFIG_FILE
    if not checkpoint_weights.read_config(directory):
        what = "is no readable model config" if config_file.is_file() else "does not exist"
        return Outcome.CANNOT_CHECK, f"{config_file} {what}: its quantization is unknown"
    quantization = declared_quantization(directory)
    if is_mxfp8(quantization):
        assert quantization is not None
        experts = str(quantization.get("moe_quant_algo") or "").upper()
        note = f" (routed experts {experts}: amax/448 scales, not exact)" if experts else ""
        return Outcome.RUNS, f"{directory} declares MXFP8{note}"
    if quantization is None:
        return (
            Outcome.IGNORED,
            f"{config_file} declares no quantization (bf16): vLLM reads quantization-config"
            " only over a checkpoint's quantization method, so the key is ignored and the"
            " engine serves bf16, not W8A8; serve the MXFP8 checkpoint or drop the key",
        )
    method = quantization.get("quant_method")
    return (
        Outcome.REFUSED,
        f"{directory} declares quant_method {method!r}, not MXFP8: patch 0008 stops the load"
        " at the first layer whose method cannot dequantize (every linear one but ModelOpt"
        " MXFP8's and Quark's), and what vLLM can requantize gets amax/448 scales; drop the"
        " key or serve the MXFP8 checkpoint",
    )


def row(
    request: Request,
    capability: tuple[int, int] | None,
    simulated: bool,
    state: patchset.SeriesState,
    model: str | None,
) -> W8A8Row:
    """The W8A8 row for ``request`` on ``capability`` (None: unknown), with the series state
    doctor read, and the checkpoint ``model`` (None: not given, not checked)."""
    asked = ", ".join(f"{kind}={value}" for kind, value in request.setting.items())
    if not request.kinds:
        return W8A8Row(
            Outcome.NOT_CHECKED,
            f"quantization-config {asked or '{}'} sets neither linear nor moe to"
            f" {REQUANTIZATION}; doctor checks only that",
        )
    findings = [capability_finding(capability, simulated), series_finding(state)]
    backend = moe_backend_finding(request)
    if backend is not None:
        findings.append(backend)
    if model is not None:
        findings.append(checkpoint_finding(model))
    outcome = next(level for level in SEVERITY if any(found == level for found, _ in findings))
    ordered = sorted(findings, key=lambda finding: SEVERITY.index(finding[0]))
    text = "; ".join(text for _, text in ordered)
    if model is None:
        text += "; pass --model CHECKPOINT to check that it is MXFP8"
    return W8A8Row(outcome, f"quantization-config {asked}: {text}")
