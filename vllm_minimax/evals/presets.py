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
    # lm-eval's --gen_kwargs (e.g. max_gen_toks for a thinking model).
    gen_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reference:
    """A published score the preset is compared against, and how close counts as a match."""

    task: str
    metric: str
    score: float
    tolerance: float
    source: str


@dataclass(frozen=True)
class AccuracyPreset:
    name: str
    path: Path
    model_type: str
    model_args: dict[str, Any]
    tasks: list[AccuracyTask]
    include_path: Path | None
    # The context (prompt + generated tokens) the longest sample needs; checked against the
    # server's max_model_len before lm-eval starts.
    min_model_len: int | None = None
    references: list[Reference] = field(default_factory=list)
    # Local files the tasks read (``data_files`` below the preset): missing ones are named
    # before any request.
    data_files: list[Path] = field(default_factory=list)
    # Hub datasets the tasks load (``openai/gsm8k``): with HF_HUB_OFFLINE or
    # HF_DATASETS_OFFLINE set, one missing from the local cache is named before any request.
    hub_datasets: list[str] = field(default_factory=list)


class _Where:
    """Builds messages that name the file and the key path: ``p.yaml: tasks[1].metrics: ...``."""

    def __init__(self, path: Path, key: str = "") -> None:
        self.path = path
        self.key = key

    def __truediv__(self, key: str | int) -> _Where:
        if isinstance(key, int):
            return _Where(self.path, f"{self.key}[{key}]")
        return _Where(self.path, f"{self.key}.{key}" if self.key else key)

    def error(self, message: str) -> EvalError:
        return EvalError(
            f"{self.path}: `{self.key}`: {message}" if self.key else f"{self.path}: {message}"
        )


def _known_keys(data: dict[str, Any], known: tuple[str, ...], where: _Where) -> None:
    unknown = sorted(str(key) for key in data if key not in known)
    if unknown:
        raise where.error(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")


def _positive_int(value: Any, where: _Where) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise where.error(f"expected a positive integer, got {value!r}")
    return value


def _optional_int(value: Any, where: _Where, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise where.error(f"expected an integer >= {minimum}, got {value!r}")
    return value


def _mapping(value: Any, where: _Where) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise where.error(f"expected a mapping, got {type(value).__name__} {value!r}")
    return dict(value)


def _string(value: Any, where: _Where) -> str:
    if not isinstance(value, str) or not value:
        raise where.error(f"expected a non-empty string, got {value!r}")
    return value


def _number(value: Any, where: _Where) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise where.error(f"expected a number, got {value!r}")
    return float(value)


def _non_empty_list(value: Any, where: _Where) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise where.error(f"expected a non-empty list, got {value!r}")
    return value


TASK_KEYS = (
    "task", "metrics", "num_fewshot", "limit", "metadata", "model_args", "apply_chat_template",
    "gen_kwargs",
)  # fmt: skip
ACCURACY_KEYS = (
    "model_type", "model_args", "include_path", "tasks", "min_model_len", "references",
    "data_files", "hub_datasets",
)  # fmt: skip
REFERENCE_KEYS = ("task", "metric", "score", "tolerance", "source")


def _accuracy_task(entry: Any, where: _Where) -> AccuracyTask:
    if not isinstance(entry, dict):
        raise where.error(f"expected a mapping with `task` and `metrics`, got {entry!r}")
    _known_keys(entry, TASK_KEYS, where)
    metrics = _non_empty_list(entry.get("metrics"), where / "metrics")
    chat = entry.get("apply_chat_template", False)
    if not isinstance(chat, bool):
        raise (where / "apply_chat_template").error(f"expected true or false, got {chat!r}")
    return AccuracyTask(
        task=_string(entry.get("task"), where / "task"),
        metrics=[_string(metric, where / "metrics" / i) for i, metric in enumerate(metrics)],
        num_fewshot=_optional_int(entry.get("num_fewshot"), where / "num_fewshot", 0),
        limit=_optional_int(entry.get("limit"), where / "limit", 1),
        metadata=_mapping(entry.get("metadata"), where / "metadata"),
        model_args=_mapping(entry.get("model_args"), where / "model_args"),
        apply_chat_template=chat,
        gen_kwargs=_mapping(entry.get("gen_kwargs"), where / "gen_kwargs"),
    )


def _reference(entry: Any, where: _Where) -> Reference:
    if not isinstance(entry, dict):
        raise where.error(f"expected a mapping, got {entry!r}")
    _known_keys(entry, REFERENCE_KEYS, where)
    tolerance = _number(entry.get("tolerance"), where / "tolerance")
    if tolerance < 0:
        raise (where / "tolerance").error(f"expected a number >= 0, got {tolerance}")
    return Reference(
        task=_string(entry.get("task"), where / "task"),
        metric=_string(entry.get("metric"), where / "metric"),
        score=_number(entry.get("score"), where / "score"),
        tolerance=tolerance,
        source=_string(entry.get("source"), where / "source"),
    )


def load_accuracy_preset(name_or_path: str) -> AccuracyPreset:
    path = preset_path("accuracy", name_or_path)
    data = read_yaml_mapping(path, "preset file")
    where = _Where(path)
    _known_keys(data, ACCURACY_KEYS, where)
    model_type = data.get("model_type", "local-completions")
    if model_type not in LM_EVAL_MODEL_TYPES:
        raise (where / "model_type").error(f"must be one of {', '.join(LM_EVAL_MODEL_TYPES)}")
    raw_tasks = _non_empty_list(data.get("tasks"), where / "tasks")
    tasks = [_accuracy_task(entry, where / "tasks" / i) for i, entry in enumerate(raw_tasks)]
    include = data.get("include_path")
    include_path = (
        (path.parent / _string(include, where / "include_path")).resolve() if include else None
    )
    if include_path is not None and not include_path.is_dir():
        raise (where / "include_path").error(f"{include_path} is not a directory")
    raw_references = data.get("references") or []
    if not isinstance(raw_references, list):
        raise (where / "references").error(f"expected a list, got {raw_references!r}")
    raw_hub = data.get("hub_datasets") or []
    if not isinstance(raw_hub, list):
        raise (where / "hub_datasets").error(f"expected a list, got {raw_hub!r}")
    raw_files = data.get("data_files") or []
    if not isinstance(raw_files, list):
        raise (where / "data_files").error(f"expected a list, got {raw_files!r}")
    return AccuracyPreset(
        name=path.stem,
        path=path,
        model_type=model_type,
        model_args=_mapping(data.get("model_args"), where / "model_args"),
        tasks=tasks,
        include_path=include_path,
        min_model_len=_optional_int(data.get("min_model_len"), where / "min_model_len", 1),
        references=[
            _reference(entry, where / "references" / i) for i, entry in enumerate(raw_references)
        ],
        data_files=[
            (path.parent / _string(entry, where / "data_files" / i)).resolve()
            for i, entry in enumerate(raw_files)
        ],
        hub_datasets=[
            _string(entry, where / "hub_datasets" / i) for i, entry in enumerate(raw_hub)
        ],
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
    # The same prompts in every round, and the warm-up sends them first: the measured levels
    # then find the prompts in the prefix cache and time decode steps alone (a decode point
    # whose requests would otherwise decode beside the others' prefill chunks).
    prefix_cached: bool = False

    @property
    def fixed_shape(self) -> bool:
        return len(set(self.shapes)) == 1


@dataclass(frozen=True)
class ThroughputPreset:
    name: str
    path: Path
    scenarios: list[ThroughputScenario]
    seed: int = 0

    def longest_request(self) -> tuple[ThroughputScenario, RequestShape]:
        """The scenario and shape with the most tokens (prompt + output) in one request."""
        return max(
            ((scenario, shape) for scenario in self.scenarios for shape in scenario.shapes),
            key=lambda pair: pair[1].input_tokens + pair[1].output_tokens,
        )


SCENARIO_KEYS = ("name", "shapes", "concurrency", "num_requests", "prefix_cached")
SHAPE_KEYS = ("input_tokens", "output_tokens")


def _shape(entry: Any, where: _Where) -> RequestShape:
    if not isinstance(entry, dict):
        raise where.error(f"expected a mapping with input_tokens and output_tokens, got {entry!r}")
    _known_keys(entry, SHAPE_KEYS, where)
    return RequestShape(
        _positive_int(entry.get("input_tokens"), where / "input_tokens"),
        _positive_int(entry.get("output_tokens"), where / "output_tokens"),
    )


def _scenario(entry: Any, where: _Where) -> ThroughputScenario:
    if not isinstance(entry, dict):
        raise where.error(f"expected a mapping with {', '.join(SCENARIO_KEYS)}, got {entry!r}")
    _known_keys(entry, SCENARIO_KEYS, where)
    shapes = _non_empty_list(entry.get("shapes"), where / "shapes")
    concurrency = _non_empty_list(entry.get("concurrency"), where / "concurrency")
    return ThroughputScenario(
        name=_string(entry.get("name"), where / "name"),
        shapes=[_shape(shape, where / "shapes" / i) for i, shape in enumerate(shapes)],
        concurrency=[
            _positive_int(c, where / "concurrency" / i) for i, c in enumerate(concurrency)
        ],
        num_requests=_positive_int(entry.get("num_requests"), where / "num_requests"),
        prefix_cached=_boolean(entry.get("prefix_cached", False), where / "prefix_cached"),
    )


def _boolean(value: Any, where: _Where) -> bool:
    if not isinstance(value, bool):
        raise where.error(f"expected true or false, got {value!r}")
    return value


def load_throughput_preset(name_or_path: str) -> ThroughputPreset:
    path = preset_path("throughput", name_or_path)
    data = read_yaml_mapping(path, "preset file")
    where = _Where(path)
    _known_keys(data, ("seed", "scenarios"), where)
    raw = _non_empty_list(data.get("scenarios"), where / "scenarios")
    scenarios = [_scenario(entry, where / "scenarios" / i) for i, entry in enumerate(raw)]
    names = [scenario.name for scenario in scenarios]
    if len(set(names)) != len(names):
        raise (where / "scenarios").error(f"scenario names must differ, got {names}")
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise (where / "seed").error(f"expected an integer, got {seed!r}")
    return ThroughputPreset(name=path.stem, path=path, scenarios=scenarios, seed=seed)
