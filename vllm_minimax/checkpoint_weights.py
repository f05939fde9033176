"""doctor's checkpoint row: does the checkpoint carry the weights the config's speculative
method loads?

vLLM 0.34.0 builds the draft of ``speculative-config`` from:

- ``method: mtp`` without ``model``: the target checkpoint itself. ``MiniMaxM3MTP`` (in
  ``vllm/models/minimax_m3/nvidia/mtp.py``) keeps, of the checkpoint's tensors, those whose name
  (less a leading ``language_model.``) contains ``model.mtp.layers``, one
  ``model.mtp.layers.{i}.*`` group per module ``i < num_mtp_modules`` (``enorm``, ``hnorm``,
  ``eh_proj``, ``final_layernorm``, ``transformer_layer.*``), plus the shared embedding and LM
  head. With ``model``, the same names in that checkpoint.
- ``method: eagle3``: a separate draft (``model``), ``LlamaForCausalLMEagle3`` in
  ``vllm/model_executor/models/llama_eagle3.py``: one decoder layer (``midlayer.*`` or
  ``layers.0.*``), ``fc`` (the aux hidden states' projection), ``norm`` and its own ``lm_head``.

What happens when they are absent is vLLM's default loader's business
(``DefaultModelLoader.load_weights`` in ``model_executor/model_loader/default_loader.py``): for a
checkpoint without a quantization config it compares the parameters built with those loaded
and raises ``ValueError: Following weights were not initialized from checkpoint``, so
``vllm serve`` stops; for a quantized checkpoint (the MXFP8 one) that check is off by default,
so the engine starts and drafts from parameters nothing wrote. It never runs for an EAGLE3
draft (``Eagle3LlamaForCausalLM.load_weights`` returns no loaded set), which therefore starts
with whatever it lacks unset. doctor exits 5 for every absent case: the engine stops, or it
serves a draft that cannot draft.

The weight names come from ``model.safetensors.index.json`` (or the header of a single
``model.safetensors``) in a local directory or the local Hugging Face cache; nothing is
downloaded. No index is "cannot check", never a pass.
"""

from __future__ import annotations

import enum
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MTP_METHOD = "mtp"
EAGLE3_METHOD = "eagle3"
# vLLM's SpeculativeConfig reads num_mtp_modules with this default.
DEFAULT_MTP_MODULES = 1
# The names a draft that ``LlamaForCausalLMEagle3`` loads must carry (one decoder layer, under
# either prefix its weight mapper accepts).
EAGLE3_LAYER_PREFIXES = ("midlayer.", "layers.0.")
EAGLE3_LAYER_WEIGHTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
EAGLE3_HEAD_WEIGHTS = ("fc.weight", "norm.weight", "lm_head.weight")
_MTP_MODULE = re.compile(r"model\.mtp\.layers\.(\d+)\.")
# The largest safetensors header read (a single-file checkpoint's tensor names).
MAX_HEADER_BYTES = 100 * 2**20


class Outcome(enum.Enum):
    PRESENT = "present"
    ABSENT = "absent"
    CANNOT_CHECK = "cannot check"
    NOTHING_TO_CHECK = "nothing to check"


@dataclass(frozen=True)
class CheckpointRow:
    """One line of doctor: whether the speculative method's weights are in the checkpoint."""

    outcome: Outcome
    text: str

    @property
    def stops_serve(self) -> bool:
        """vllm serve stops at load, or serves a draft whose weights nothing wrote: exit 5."""
        return self.outcome is Outcome.ABSENT


def hub_cache_dirs() -> list[Path]:
    """Where huggingface_hub keeps downloads: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``~/.cache/huggingface/hub`` (``$XDG_CACHE_HOME`` for ``~/.cache``); the legacy
    ``$HUGGINGFACE_HUB_CACHE`` too."""
    dirs: list[Path] = []
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            dirs.append(Path(os.environ[variable]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    dirs.append(cache / "huggingface" / "hub")
    return list(dict.fromkeys(dirs))


def local_checkpoint(model: str, revision: str | None = None) -> Path | None:
    """The directory holding ``model``'s files on this machine: ``model`` itself when it is a
    directory, else its snapshot in the Hugging Face cache (``refs/<revision or main>``, or
    the only snapshot there); None when neither is here."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if model.count("/") != 1 or model.startswith(("/", ".", "~")):
        return None
    repo = "models--" + model.replace("/", "--")
    for cache in hub_cache_dirs():
        root = cache / repo
        snapshots = root / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = root / "refs" / (revision or "main")
        if ref.is_file():
            snapshot = snapshots / ref.read_text(encoding="utf-8").strip()
            if snapshot.is_dir():
                return snapshot
        if revision is not None and (snapshots / revision).is_dir():
            return snapshots / revision
        found = [entry for entry in snapshots.iterdir() if entry.is_dir()]
        if len(found) == 1:
            return found[0]
    return None


def weight_names(directory: Path) -> tuple[set[str], str] | None:
    """The tensor names of the checkpoint in ``directory`` and the file they were read from:
    the index's ``weight_map``, else the header of a single ``model.safetensors``; None when
    there is neither (or it cannot be read)."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not isinstance(weight_map, dict):
            return None
        return set(weight_map), INDEX_FILE
    single = directory / SINGLE_FILE
    if single.is_file():
        try:
            with single.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                if length > MAX_HEADER_BYTES:
                    return None
                header = json.loads(handle.read(length))
        except (OSError, ValueError, struct.error):
            return None
        if not isinstance(header, dict):
            return None
        return {name for name in header if name != "__metadata__"}, SINGLE_FILE
    return None


def read_config(directory: Path) -> dict[str, Any]:
    """The checkpoint's ``config.json`` ({} when absent or unreadable)."""
    try:
        loaded = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _text_field(config: dict[str, Any], key: str) -> Any:
    text = config.get("text_config")
    if isinstance(text, dict) and key in text:
        return text[key]
    return config.get(key)


def mtp_modules_declared(config: dict[str, Any]) -> int:
    """``num_mtp_modules`` as vLLM reads it (the text config of the VL wrapper), default 1."""
    value = _text_field(config, "num_mtp_modules")
    return value if isinstance(value, int) and value > 0 else DEFAULT_MTP_MODULES


def is_quantized(config: dict[str, Any]) -> bool:
    """Whether vLLM would read a quantization method from the checkpoint's config."""
    return bool(config.get("quantization_config") or _text_field(config, "quantization_config"))


def mtp_tensors_by_module(names: set[str]) -> dict[int, int]:
    """How many tensors each MTP module has, by the names ``MiniMaxM3MTP`` maps."""
    counts: dict[int, int] = {}
    for name in names:
        match = _MTP_MODULE.match(name.removeprefix("language_model."))
        if match:
            module = int(match.group(1))
            counts[module] = counts.get(module, 0) + 1
    return counts


def missing_eagle3_weights(names: set[str]) -> list[str]:
    """The weights an EAGLE3 draft lacks (empty when it has them all)."""
    missing = [weight for weight in EAGLE3_HEAD_WEIGHTS if weight not in names]
    for weight in EAGLE3_LAYER_WEIGHTS:
        if not any(prefix + weight in names for prefix in EAGLE3_LAYER_PREFIXES):
            missing.append(EAGLE3_LAYER_PREFIXES[0] + weight)
    return missing


def speculative_options(options: dict[str, Any]) -> dict[str, Any] | None:
    """The config's ``speculative-config`` mapping (a mapping or JSON text), None when unset."""
    value = options.get("speculative-config")
    if value is None:
        return None
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError(f"speculative-config must be a mapping, got {value!r}")
    return value


def check(speculative: dict[str, Any] | None, model: str) -> CheckpointRow:
    """The checkpoint row for serving ``model`` with ``speculative`` (the config's
    ``speculative-config``)."""
    if speculative is None:
        return CheckpointRow(
            Outcome.NOTHING_TO_CHECK, "the config asks for no speculative decoding"
        )
    method = speculative.get("method")
    draft = speculative.get("model")
    revision = speculative.get("revision")
    if method == MTP_METHOD:
        return _check_mtp(model if draft is None else str(draft), revision if draft else None)
    if method == EAGLE3_METHOD:
        if draft is None:
            return CheckpointRow(Outcome.ABSENT, "method eagle3 without a draft `model`")
        return _check_eagle3(str(draft), revision)
    return CheckpointRow(
        Outcome.CANNOT_CHECK, f"method {method!r}: doctor checks only mtp and eagle3 drafts"
    )


def _not_here(what: str, model: str) -> CheckpointRow:
    return CheckpointRow(
        Outcome.CANNOT_CHECK,
        f"{what} {model} is neither a directory nor in the local Hugging Face cache"
        f" ({', '.join(str(d) for d in hub_cache_dirs())}); nothing is downloaded",
    )


def _names_of(what: str, model: str, revision: str | None):
    directory = local_checkpoint(model, revision)
    if directory is None:
        return _not_here(what, model), None
    found = weight_names(directory)
    if found is None:
        return (
            CheckpointRow(
                Outcome.CANNOT_CHECK,
                f"{directory} has no readable {INDEX_FILE} (nor one {SINGLE_FILE})",
            ),
            None,
        )
    return None, (directory, *found)


def _check_mtp(model: str, revision: str | None) -> CheckpointRow:
    problem, found = _names_of("checkpoint", model, revision)
    if found is None:
        return problem
    directory, names, source = found
    config = read_config(directory)
    declared = mtp_modules_declared(config)
    counts = mtp_tensors_by_module(names)
    missing = [module for module in range(declared) if not counts.get(module)]
    where = f"{directory / source}"
    if not missing:
        total = sum(counts.get(module, 0) for module in range(declared))
        return CheckpointRow(
            Outcome.PRESENT,
            f"method mtp: {total} model.mtp.layers.* tensors for the {declared} MTP"
            f" module(s) config.json declares ({where})",
        )
    consequence = (
        "the checkpoint is quantized, so vLLM 0.34.0 skips its check of weights not loaded"
        " and starts with the MTP modules never written (drafts are noise)"
        if is_quantized(config)
        else "vLLM 0.34.0 stops at load: 'Following weights were not initialized from checkpoint'"
    )
    return CheckpointRow(
        Outcome.ABSENT,
        f"method mtp: no model.mtp.layers.{{{','.join(map(str, missing))}}}.* tensors of the"
        f" {declared} MTP module(s) config.json declares ({len(names)} tensors in {where});"
        f" {consequence}. Use an EAGLE3 draft (docs/deploy.md)",
    )


def _check_eagle3(draft: str, revision: str | None) -> CheckpointRow:
    problem, found = _names_of("EAGLE3 draft", draft, revision)
    if found is None:
        return problem
    directory, names, source = found
    missing = missing_eagle3_weights(names)
    where = f"{directory / source}"
    if not missing:
        return CheckpointRow(
            Outcome.PRESENT,
            f"method eagle3: the draft's decoder layer, fc, norm and lm_head are in {where}",
        )
    return CheckpointRow(
        Outcome.ABSENT,
        f"method eagle3: the draft lacks {', '.join(missing)} ({where}); vLLM 0.34.0 does not"
        " check an EAGLE3 draft's weights (Eagle3LlamaForCausalLM.load_weights returns no"
        " loaded set), so the engine starts with these never written",
    )
