"""The presets of ``vllm-minimax eval``: YAML files under ``evals/``.

``evals/accuracy/NAME.yaml`` lists lm-eval tasks and the metrics to compare,
``evals/throughput/NAME.yaml`` lists request shapes and concurrency levels, and
``evals/tasks/`` holds lm-eval task definitions shipped with the project (read by
lm-eval through ``--include_path``). A preset argument is a name from those directories or a
path to a YAML file of the same form.

Where the directory is found mirrors the patch series (:func:`vllm_minimax.patchset.
patches_root`): ``$VLLM_MINIMAX_EVAL_CONFIGS``; ``vllm_minimax/_eval_configs`` (a wheel
carries ``evals`` there, see ``pyproject.toml``); the repository's
``evals`` next to the package (source tree and editable installs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_minimax.evals.common import EvalError, read_yaml_mapping

EVAL_CONFIGS_ENV = "VLLM_MINIMAX_EVAL_CONFIGS"
KINDS = ("accuracy", "throughput")
LM_EVAL_MODEL_TYPES = ("local-completions", "local-chat-completions")


def eval_configs_root() -> Path:
    override = os.environ.get(EVAL_CONFIGS_ENV)
    if override:
        return Path(override)
    package_dir = Path(__file__).resolve().parent.parent
    shipped = package_dir / "_eval_configs"
    if shipped.is_dir():
        return shipped
    return package_dir.parent / "evals"


def available(kind: str) -> list[str]:
    directory = eval_configs_root() / kind
    return sorted(path.stem for path in directory.glob("*.yaml")) if directory.is_dir() else []


def preset_path(kind: str, name_or_path: str) -> Path:
    """Resolve a preset name (``gsm8k``) or a YAML path; unknown names list the known ones."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml"):
        if not candidate.is_file():
            raise EvalError(f"{kind} preset file {candidate} does not exist")
        return candidate
    path = eval_configs_root() / kind / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(available(kind)) or "none"
        raise EvalError(
            f"unknown {kind} preset {name_or_path!r}; known: {known}"
            f" (in {eval_configs_root() / kind}), or give a path to a .yaml file"
        )
    return path


@dataclass(frozen=True)
class AccuracyTask:
    """One lm-eval task and the result keys (``metric,filter``) that are compared."""

    task: str
    metrics: list[str]
    num_fewshot: int | None = None
    limit: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    model_args: dict[str, Any] = field(default_factory=dict)
    apply_chat_template: bool = False


@dataclass(frozen=True)
class AccuracyPreset:
    name: str
    path: Path
    model_type: str
    model_args: dict[str, Any]
    tasks: list[AccuracyTask]
    include_path: Path | None


def load_accuracy_preset(name_or_path: str) -> AccuracyPreset:
    path = preset_path("accuracy", name_or_path)
    data = read_yaml_mapping(path, "preset file")
    model_type = data.get("model_type", "local-completions")
    if model_type not in LM_EVAL_MODEL_TYPES:
        raise EvalError(f"{path}: model_type must be one of {', '.join(LM_EVAL_MODEL_TYPES)}")
    raw_tasks = data.get("tasks")
    if not isinstance(raw_tasks, list) or not raw_tasks:
        raise EvalError(f"{path}: `tasks` must be a non-empty list")
    tasks = []
    for entry in raw_tasks:
        if not isinstance(entry, dict) or "task" not in entry or "metrics" not in entry:
            raise EvalError(f"{path}: each task needs `task` and `metrics`, got {entry!r}")
        tasks.append(
            AccuracyTask(
                task=str(entry["task"]),
                metrics=[str(metric) for metric in entry["metrics"]],
                num_fewshot=entry.get("num_fewshot"),
                limit=entry.get("limit"),
                metadata=dict(entry.get("metadata") or {}),
                model_args=dict(entry.get("model_args") or {}),
                apply_chat_template=bool(entry.get("apply_chat_template", False)),
            )
        )
    include = data.get("include_path")
    include_path = (path.parent / include).resolve() if include else None
    if include_path is not None and not include_path.is_dir():
        raise EvalError(f"{path}: include_path {include_path} is not a directory")
    return AccuracyPreset(
        name=path.stem,
        path=path,
        model_type=model_type,
        model_args=dict(data.get("model_args") or {}),
        tasks=tasks,
        include_path=include_path,
    )


@dataclass(frozen=True)
class RequestShape:
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class ThroughputScenario:
    """Requests cycling through ``shapes``, sent ``num_requests`` at a time per concurrency."""

    name: str
    shapes: list[RequestShape]
    concurrency: list[int]
    num_requests: int


@dataclass(frozen=True)
class ThroughputPreset:
    name: str
    path: Path
    scenarios: list[ThroughputScenario]
    seed: int = 0


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise EvalError(f"{where}: expected a positive integer, got {value!r}")
    return value


def load_throughput_preset(name_or_path: str) -> ThroughputPreset:
    path = preset_path("throughput", name_or_path)
    data = read_yaml_mapping(path, "preset file")
    raw = data.get("scenarios")
    if not isinstance(raw, list) or not raw:
        raise EvalError(f"{path}: `scenarios` must be a non-empty list")
    scenarios = []
    for entry in raw:
        where = f"{path}: scenario {entry.get('name', '?') if isinstance(entry, dict) else '?'}"
        if not isinstance(entry, dict) or not isinstance(entry.get("shapes"), list):
            raise EvalError(f"{where}: needs `name`, `shapes`, `concurrency`, `num_requests`")
        shapes = [
            RequestShape(
                _positive_int(shape.get("input_tokens"), f"{where} input_tokens"),
                _positive_int(shape.get("output_tokens"), f"{where} output_tokens"),
            )
            for shape in entry["shapes"]
        ]
        concurrency = entry.get("concurrency")
        if not isinstance(concurrency, list) or not concurrency:
            raise EvalError(f"{where}: `concurrency` must be a non-empty list")
        scenarios.append(
            ThroughputScenario(
                name=str(entry["name"]),
                shapes=shapes,
                concurrency=[_positive_int(c, f"{where} concurrency") for c in concurrency],
                num_requests=_positive_int(entry.get("num_requests"), f"{where} num_requests"),
            )
        )
    return ThroughputPreset(
        name=path.stem, path=path, scenarios=scenarios, seed=int(data.get("seed", 0))
    )
