"""vLLM's model-info cache for the served model's architectures, filled without a GPU.

Before it builds a model, vLLM 0.34.0 asks its registry what the model class supports
(``_LazyRegisteredModel.inspect_model_cls``). It answers from
``$VLLM_CACHE_ROOT/modelinfos/<module>-<class>.json`` when that file's ``hash`` is the hash of
the model package's ``.py`` files (every file under ``vllm/models/minimax_m3/``, the series'
patched ones included); otherwise it imports the model module in a subprocess to inspect the
class and writes the file. This module makes that same
registry call for the architectures of the model's ``config.json``, so vLLM writes the file
where the server will read it; the import needs no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_minimax import warmup
from vllm_minimax.prebuild_inputs import (
    M3_CHECKPOINT_PREFIX,
    PrebuildError,
    no_config_json,
    read_config_json,
)
from vllm_minimax.tiny_model import VL_ARCHITECTURE


@dataclass(frozen=True)
class ModelInfoEntry:
    architecture: str
    path: Path  # the file vLLM reads
    state: str  # "written", "already current" or "would be written" (dry run)


def model_architectures(model: str) -> tuple[list[str], str]:
    """The ``architectures`` of ``model``'s ``config.json`` (none where it names none) and
    where they came from; for MiniMax M3's checkpoints without one here, the published
    checkpoints' (the vision-language wrapper around the text model)."""
    found = read_config_json(model)
    if found is not None:
        config, source = found
        architectures = config.get("architectures") if isinstance(config, dict) else None
        if architectures is None:
            return [], source
        if not isinstance(architectures, list) or not all(
            isinstance(name, str) for name in architectures
        ):
            raise PrebuildError(f"{source}: architectures is not a list of names")
        return list(architectures), source
    if model.startswith(M3_CHECKPOINT_PREFIX):
        return [VL_ARCHITECTURE], f"MiniMax M3's published architecture (for {model})"
    raise no_config_json(model)


def _check_writable(directory: Path) -> None:
    """Raise PrebuildError unless ``directory`` can be made and written. Creates nothing."""
    reason = warmup.unwritable_reason(directory)
    if reason is not None:
        raise PrebuildError(
            f"vLLM's model-info cache {directory} is not writable: {reason} (set VLLM_CACHE_ROOT"
            " to the directory the server reads)"
        )


def _registered(architecture: str) -> Any:
    from vllm.model_executor.models.registry import ModelRegistry, _LazyRegisteredModel

    registered = ModelRegistry.models.get(architecture)
    if not isinstance(registered, _LazyRegisteredModel):
        return None
    return registered


def _module_hash(registered: Any) -> str | None:
    """The hash vLLM keys ``registered``'s model-info file on: 0.34.0's ``_get_module_hash``;
    0.33.0 finds the module's file inline in ``inspect_model_cls`` (the registry's directory
    for a ``vllm.model_executor.models.`` module, else the module spec's origin)."""
    if hasattr(registered, "_get_module_hash"):
        return registered._get_module_hash()
    import importlib.util

    from vllm.model_executor.models import registry

    path: Path | None = None
    if registered.module_name.startswith("vllm.model_executor.models."):
        path = Path(registry.__file__).parent / f"{registered.module_name.split('.')[-1]}.py"
    if path is None or not path.exists():
        try:
            spec = importlib.util.find_spec(registered.module_name)
        except (ImportError, ValueError):
            spec = None
        path = Path(spec.origin) if spec is not None and spec.origin else None
    if path is None or not path.exists():
        return None
    return registered._get_modelinfo_module_hash(path)


def fill_modelinfo_cache(
    architectures: list[str], *, dry_run: bool = False
) -> list[ModelInfoEntry]:
    """Have vLLM's registry inspect each of ``architectures`` it registers lazily, writing its
    model-info file (under ``vllm.envs.VLLM_CACHE_ROOT``, as vLLM resolves it) unless one with
    the current hash is there (``dry_run``: only say which)."""
    if not architectures:
        return []
    found = [(name, _registered(name)) for name in dict.fromkeys(architectures)]
    found = [(name, registered) for name, registered in found if registered is not None]
    if not found:
        raise PrebuildError(
            f"vLLM's registry has none of the architectures {', '.join(architectures)}"
        )
    entries = []
    for architecture, registered in found:
        directory = registered._get_cache_dir()
        path = directory / registered._get_cache_filename()
        module_hash = _module_hash(registered)
        if module_hash is None:
            raise PrebuildError(
                f"vLLM finds no source of {registered.module_name} to hash: it keeps no model"
                f" info for {architecture}"
            )
        if registered._load_modelinfo_from_cache(module_hash) is not None:
            entries.append(ModelInfoEntry(architecture, path, "already current"))
            continue
        if dry_run:
            entries.append(ModelInfoEntry(architecture, path, "would be written"))
            continue
        _check_writable(directory)
        try:
            # vLLM's own call: a miss inspects the class in a subprocess and writes the file.
            registered.inspect_model_cls()
        except Exception as error:
            last = str(error).strip().splitlines()[-1:] or [type(error).__name__]
            raise PrebuildError(f"vLLM could not inspect {architecture}: {last[0]}") from None
        # vLLM logs, and does not raise, when it cannot save the file.
        if registered._load_modelinfo_from_cache(module_hash) is None:
            raise PrebuildError(
                f"vLLM inspected {architecture} but did not write its model-info file {path}"
            )
        entries.append(ModelInfoEntry(architecture, path, "written"))
    return entries


def summary(entries: list[ModelInfoEntry], source: str) -> str:
    """The one line the prebuild prints."""
    if not entries:
        return f"vLLM model info: none ({source} names no architectures)"
    parts = [f"{entry.architecture}: {entry.path} ({entry.state})" for entry in entries]
    return "vLLM model info: " + "; ".join(parts)
