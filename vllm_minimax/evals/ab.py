"""``vllm-minimax eval ab``: the same presets against one server per arm, side by side.

An arm is a name and a mapping of ``vllm serve`` arguments, merged into the serve config
(``--config``): a mapping value such as ``attention-config`` is merged key by key, so an arm
that sets ``minimax_m3_indexer_backend`` keeps the config's ``indexer_kv_dtype``; any other
value replaces the config's. The merged config is written to ``<out>/<arm>/serve.yaml`` and
passed to the server as ``--config``, which is how vLLM itself reads YAML configs. The
default arms are MiniMax M3's two indexers, ``triton`` (the stock path, the reference) and
``flashinfer`` (this patch set's).

Arms run one after another, each on a server of its own, started and stopped here. The
first arm is the reference: each other arm's scores are compared with it by the rule of
:mod:`vllm_minimax.evals.accuracy`. ``ab.json`` and ``report.md`` are rewritten after each
arm, so a failure keeps what finished.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from vllm_minimax.evals import report
from vllm_minimax.evals.accuracy import DEFAULT_Z, Score, compare_all, run_accuracy
from vllm_minimax.evals.common import EvalError, progress, read_yaml_mapping, write_json
from vllm_minimax.evals.presets import AccuracyPreset, ThroughputPreset
from vllm_minimax.evals.server import ServerError, VllmServer
from vllm_minimax.evals.throughput import Vocabulary, run_throughput

INDEXER_BACKEND_KEY = "minimax_m3_indexer_backend"
DEFAULT_ARMS: dict[str, dict[str, Any]] = {
    backend: {"attention-config": {INDEXER_BACKEND_KEY: backend}}
    for backend in ("triton", "flashinfer")
}
ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Arm:
    name: str
    server_args: dict[str, Any]


def parse_arm(text: str) -> Arm:
    """``NAME=JSON``: ``fi={"attention-config": {"minimax_m3_indexer_backend": "flashinfer"}}``."""
    name, separator, raw = text.partition("=")
    if not separator or not ARM_NAME.match(name):
        raise EvalError(f"--arm {text!r}: expected NAME=JSON with NAME of letters, digits, -_.")
    try:
        server_args = json.loads(raw)
    except json.JSONDecodeError as error:
        raise EvalError(f"--arm {name}: the server arguments are not JSON: {error}") from None
    if not isinstance(server_args, dict):
        raise EvalError(f"--arm {name}: the server arguments must be a JSON object")
    return Arm(name, server_args)


def default_arms() -> list[Arm]:
    return [Arm(name, copy.deepcopy(args)) for name, args in DEFAULT_ARMS.items()]


def merge_server_args(config: Mapping[str, Any], arm_args: Mapping[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(dict(config))
    for key, value in arm_args.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_serve_config(path: Path | None) -> dict[str, Any]:
    """The ``vllm serve --config`` file the arms are merged into (none: ``{}``)."""
    if path is None:
        return {}
    return read_yaml_mapping(path, "serve config", empty_ok=True)


@dataclass(frozen=True)
class ServerLaunch:
    """How to start a server, apart from the arm's arguments."""

    model: str
    command: str
    env: dict[str, str]
    startup_timeout: float
    port: int | None = None


def run_ab(
    arms: Sequence[Arm],
    launch: ServerLaunch,
    config_path: Path | None,
    accuracy_presets: Sequence[AccuracyPreset],
    throughput_preset: ThroughputPreset | None,
    out_dir: Path,
    tokenizer: str | None = None,
    limit: int | None = None,
    z: float = DEFAULT_Z,
) -> dict[str, Any]:
    if len({arm.name for arm in arms}) != len(arms) or len(arms) < 2:
        raise EvalError("eval ab needs at least two arms with different names")
    config = load_serve_config(config_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    ab: dict[str, Any] = {
        "model": launch.model,
        "config": str(config_path) if config_path else None,
        "server_command": launch.command,
        "accuracy_presets": [preset.name for preset in accuracy_presets],
        "throughput_preset": throughput_preset.name if throughput_preset else None,
        "z": z,
        "arms": [{"name": arm.name, "server_args": json.dumps(arm.server_args)} for arm in arms],
        "complete": False,
    }
    vocabulary = Vocabulary.from_tokenizer(tokenizer or launch.model) if throughput_preset else None
    try:
        for arm, record in zip(arms, ab["arms"], strict=True):
            run_arm(arm, record, launch, config, accuracy_presets, throughput_preset,
                    vocabulary, out_dir / arm.name, tokenizer, limit)  # fmt: skip
            write_outputs(ab, out_dir)
    except EvalError as error:
        failed = next((record for record in ab["arms"] if "finished" not in record), ab["arms"][-1])
        failed["error"] = str(error).splitlines()[0]
        write_outputs(ab, out_dir)
        raise EvalError(f"arm {failed['name']}: {error}\nwhat finished is in {out_dir}") from None
    ab["complete"] = True
    return write_outputs(ab, out_dir)


def run_arm(
    arm: Arm,
    record: dict[str, Any],
    launch: ServerLaunch,
    config: Mapping[str, Any],
    accuracy_presets: Sequence[AccuracyPreset],
    throughput_preset: ThroughputPreset | None,
    vocabulary: Vocabulary | None,
    arm_dir: Path,
    tokenizer: str | None,
    limit: int | None,
) -> None:
    arm_dir.mkdir(parents=True, exist_ok=True)
    serve_yaml = arm_dir / "serve.yaml"
    serve_yaml.write_text(yaml.safe_dump(merge_server_args(config, arm.server_args)))
    server = VllmServer(
        model=launch.model,
        log_path=arm_dir / "server.log",
        command=launch.command,
        config=serve_yaml,
        env=launch.env,
        port=launch.port,
        startup_timeout=launch.startup_timeout,
    )
    progress(f"arm {arm.name}: starting the server ({json.dumps(arm.server_args)})")
    with server:
        record["startup_seconds"] = server.startup_seconds
        # start_new_session: the pid is the process group id, gone once the server stopped.
        record["server_pgid"] = server.process.pid if server.process else None
        try:
            scores: list[dict[str, Any]] = []
            for preset in accuracy_presets:
                progress(f"arm {arm.name}: accuracy preset {preset.name}")
                summary = run_accuracy(
                    preset, server.base_url, launch.model, arm_dir / "accuracy" / preset.name,
                    tokenizer=tokenizer, limit=limit,
                )  # fmt: skip
                scores += summary["scores"]
                record["accuracy"] = {"scores": scores}
            if throughput_preset is not None and vocabulary is not None:
                progress(f"arm {arm.name}: throughput preset {throughput_preset.name}")
                record["throughput"] = run_throughput(
                    throughput_preset, server.base_url, launch.model,
                    arm_dir / "throughput.json", vocabulary, on_level_done=server.check_alive,
                )  # fmt: skip
        except EvalError as error:
            # A dead server explains a failed request or lm-eval run better than either.
            try:
                server.check_alive()
            except ServerError as died:
                raise ServerError(f"{died}\n(while: {str(error).splitlines()[0]})") from None
            raise
    record["finished"] = True


def write_outputs(ab: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Compare each arm's scores with the first arm's; write ab.json, plots and report.md."""
    reference = ab["arms"][0].get("accuracy", {}).get("scores")
    comparisons: dict[str, list[dict[str, Any]]] = {}
    if reference:
        baseline = [Score(**entry) for entry in reference]
        for record in ab["arms"][1:]:
            scores = record.get("accuracy", {}).get("scores")
            if scores:
                compared = compare_all([Score(**entry) for entry in scores], baseline, ab["z"])
                comparisons[record["name"]] = [asdict(c) for c in compared]
    ab["accuracy_comparisons"] = comparisons
    ab["accuracy_passed"] = all(c["passed"] for entries in comparisons.values() for c in entries)
    write_json(out_dir / "ab.json", ab)
    plots = report.ab_plots(ab, out_dir)
    (out_dir / "report.md").write_text(report.ab_markdown(ab, plots))
    return ab
