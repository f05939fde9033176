"""``vllm-minimax eval ab``: the same presets against one server per arm, side by side.

An arm is a name and a mapping of ``vllm serve`` arguments, merged into the serve config
(``--config``): a mapping value such as ``attention-config`` is merged key by key, so an arm
that sets ``minimax_m3_indexer_backend`` keeps the config's ``indexer_kv_dtype``; any other
value replaces the config's, and a null removes the config's key (at the top level or inside
a mapping; a mapping left empty goes too), so that an arm can serve a vLLM that does not
know a key of the config. The merged config is written to ``<out>/<arm>/serve.yaml`` and
passed to the server as ``--config``, which is how vLLM itself reads YAML configs. An arm
may also have environment variables of its own (``--arm-env ARM:KEY=VALUE``), set over
``--server-env`` for its servers only: ``PYTHONPATH`` with an unpatched vLLM first serves
stock vLLM beside the patched one. The default arms are MiniMax M3's two indexers,
``triton`` (the stock path, the reference) and ``flashinfer`` (this patch set's).

Arms run one after another, each on a server of its own, started and stopped here, in
``--repeat`` rounds (default 3) whose order rotates (A B C, B C A, C A B, ...; with two arms
A B, B A), so that each arm takes each place in turn and a drift of the machine weighs on
every arm; the reports give each level's median over the rounds and its min..max. With
``--server-rounds N`` each server runs the throughput preset N times over (the rounds of one
server's life: one start per arm where a start costs more than the levels). Each
server's KV cache size (its log's ``KV cache size`` line) is kept with its round, and each
level's record says how many requests ran at once (:mod:`.server_figures`). Accuracy runs
in the first round only (greedy decoding: a second run repeats the first). The first arm
is the reference: each other arm's scores are compared with it by the rule of
:mod:`vllm_minimax.evals.accuracy`. ``ab.json`` and ``report.md``
are rewritten after each arm's round, and a round that fails or is interrupted (Ctrl-C)
keeps its measured levels there; the report names the levels not measured.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vllm_minimax.evals import report
from vllm_minimax.evals.accuracy import (
    DEFAULT_Z,
    Score,
    check_accuracy_preset,
    compare_all,
    run_accuracy,
)
from vllm_minimax.evals.bench import require_bench
from vllm_minimax.evals.common import (
    EvalError,
    progress,
    read_yaml_mapping,
    write_json,
    write_text,
)
from vllm_minimax.evals.presets import AccuracyPreset, ThroughputPreset
from vllm_minimax.evals.server import ServedModel, ServerError, VllmServer
from vllm_minimax.evals.server_figures import logged_kv_cache
from vllm_minimax.evals.throughput import (
    RequestTimeouts,
    Vocabulary,
    check_fits,
    run_throughput,
    scenario_client,
)

INDEXER_BACKEND_KEY = "minimax_m3_indexer_backend"
DEFAULT_ARMS: dict[str, dict[str, Any]] = {
    backend: {"attention-config": {INDEXER_BACKEND_KEY: backend}}
    for backend in ("triton", "flashinfer")
}
DEFAULT_REPEAT = 3
ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Arm:
    name: str
    server_args: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)


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
    """The arm's arguments over the config's: mappings merged key by key, a null (None)
    removing the key, and a mapping that a removal leaves empty removed too."""
    merged = copy.deepcopy(dict(config))
    for key, value in arm_args.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            inner = {**merged[key]}
            for inner_key, inner_value in value.items():
                if inner_value is None:
                    inner.pop(inner_key, None)
                else:
                    inner[inner_key] = copy.deepcopy(inner_value)
            if inner or not merged[key]:
                merged[key] = inner
            else:
                del merged[key]
        elif isinstance(value, Mapping):
            merged[key] = {k: copy.deepcopy(v) for k, v in value.items() if v is not None}
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def parse_arm_env(texts: Sequence[str], arms: Sequence[Arm]) -> list[Arm]:
    """``--arm-env ARM:KEY=VALUE`` (repeatable) set on the arms they name."""
    envs: dict[str, dict[str, str]] = {arm.name: dict(arm.env) for arm in arms}
    for text in texts:
        name, separator, assignment = text.partition(":")
        key, equals, value = assignment.partition("=")
        if not separator or not equals or not key:
            raise EvalError(f"--arm-env {text!r}: expected ARM:KEY=VALUE")
        if name not in envs:
            raise EvalError(f"--arm-env {text!r}: no arm named {name!r} (arms: {', '.join(envs)})")
        envs[name][key] = value
    return [Arm(arm.name, arm.server_args, envs[arm.name]) for arm in arms]


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


def round_order(arms: Sequence[Arm], round_index: int) -> list[Arm]:
    """Round r runs the arms rotated by r places (A B C, B C A, C A B; two arms alternate):
    over as many rounds as arms, each arm runs once in each place, so a drift over time
    (thermal, a neighbour's load) weighs on every arm alike."""
    shift = round_index % len(arms) if arms else 0
    return [*arms[shift:], *arms[:shift]]


def configured_model_len(config: Mapping[str, Any]) -> int | None:
    for key in ("max-model-len", "max_model_len"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def check_presets_fit(
    arms: Sequence[Arm],
    config: Mapping[str, Any],
    accuracy_presets: Sequence[AccuracyPreset],
    throughput_preset: ThroughputPreset | None,
) -> None:
    """Before any server starts: refuse presets longer than an arm's configured max-model-len
    (a server without one is checked once it is up, through /v1/models)."""
    for arm in arms:
        length = configured_model_len(merge_server_args(config, arm.server_args))
        if length is None:
            continue
        served = ServedModel("", length)
        where = f"arm {arm.name}'s serve config"
        if throughput_preset is not None:
            check_fits(throughput_preset, served, where)
        for preset in accuracy_presets:
            check_accuracy_preset(preset, served, where)


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
    repeat: int = DEFAULT_REPEAT,
    timeouts: RequestTimeouts | None = None,
    client: str = "vllm-bench",
    server_rounds: int = 1,
) -> dict[str, Any]:
    if len({arm.name for arm in arms}) != len(arms) or len(arms) < 2:
        raise EvalError("eval ab needs at least two arms with different names")
    if repeat < 1:
        raise EvalError(f"--repeat must be 1 or more, got {repeat}")
    if server_rounds < 1:
        raise EvalError(f"--server-rounds must be 1 or more, got {server_rounds}")
    config = load_serve_config(config_path)
    if throughput_preset is not None and any(
        scenario_client(scenario, client) == "vllm-bench"
        for scenario in throughput_preset.scenarios
    ):
        require_bench()
    check_presets_fit(arms, config, accuracy_presets, throughput_preset)
    ab: dict[str, Any] = {
        "model": launch.model,
        "config": str(config_path) if config_path else None,
        "server_command": launch.command,
        "accuracy_presets": [preset.name for preset in accuracy_presets],
        "throughput_preset": throughput_preset.name if throughput_preset else None,
        "throughput_plan": [
            {
                "name": scenario.name,
                "shapes": [asdict(shape) for shape in scenario.shapes],
                "concurrency": scenario.concurrency,
            }
            for scenario in (throughput_preset.scenarios if throughput_preset else [])
        ],
        "z": z,
        "repeat": repeat,
        "server_rounds": server_rounds,
        "round_order": [[arm.name for arm in round_order(arms, r)] for r in range(repeat)],
        "arms": [
            {
                "name": arm.name,
                "server_args": json.dumps(arm.server_args),
                **({"server_env": arm.env} if arm.env else {}),
                "rounds": [],
            }
            for arm in arms
        ],
        "complete": False,
    }
    records = {record["name"]: record for record in ab["arms"]}
    vocabulary = None
    if throughput_preset is not None:
        progress(f"loading the tokenizer {tokenizer or launch.model} for the random prompts")
        vocabulary = Vocabulary.from_tokenizer(tokenizer or launch.model)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_outputs(ab, out_dir)
    current, current_arm = "", ""
    try:
        for round_index in range(repeat):
            for arm in round_order(arms, round_index):
                current = f"arm {arm.name}, round {round_index + 1} of {repeat}"
                current_arm = arm.name
                run_arm(arm, records[arm.name], round_index, launch, config,
                        accuracy_presets if round_index == 0 else [], throughput_preset,
                        vocabulary, out_dir / arm.name, tokenizer, limit, timeouts,
                        client, server_rounds)  # fmt: skip
                write_outputs(ab, out_dir)
    except EvalError as error:
        if current_arm:
            records[current_arm]["error"] = f"{current}: {str(error).splitlines()[0]}"
        write_outputs(ab, out_dir)
        raise EvalError(f"{current}: {error}\nwhat finished is in {out_dir}") from None
    except KeyboardInterrupt:
        ab["interrupted"] = f"interrupted during {current}" if current else "interrupted"
        write_outputs(ab, out_dir)
        raise
    ab["complete"] = True
    return write_outputs(ab, out_dir)


def run_arm(
    arm: Arm,
    record: dict[str, Any],
    round_index: int,
    launch: ServerLaunch,
    config: Mapping[str, Any],
    accuracy_presets: Sequence[AccuracyPreset],
    throughput_preset: ThroughputPreset | None,
    vocabulary: Vocabulary | None,
    arm_dir: Path,
    tokenizer: str | None,
    limit: int | None,
    timeouts: RequestTimeouts | None,
    client: str = "vllm-bench",
    server_rounds: int = 1,
) -> None:
    """One round of one arm: its own server; accuracy (first round only), then throughput,
    ``server_rounds`` times on that server (its levels numbered from
    ``round_index * server_rounds``).

    The levels measured go into ``record`` also when the round fails or is interrupted."""
    round_dir = arm_dir / f"round-{round_index + 1}"
    round_dir.mkdir(parents=True, exist_ok=True)
    serve_yaml = arm_dir / "serve.yaml"
    serve_yaml.write_text(yaml.safe_dump(merge_server_args(config, arm.server_args)))
    server = VllmServer(
        model=launch.model,
        log_path=round_dir / "server.log",
        command=launch.command,
        config=serve_yaml,
        env={**launch.env, **arm.env},
        port=launch.port,
        startup_timeout=launch.startup_timeout,
    )
    entry: dict[str, Any] = {"round": round_index}
    record["rounds"].append(entry)
    throughput_file = round_dir / "throughput.json"
    progress(f"arm {arm.name} round {round_index + 1}: starting the server")
    try:
        with server:
            entry["startup_seconds"] = server.startup_seconds
            kv_cache = logged_kv_cache(server.log_path)
            if kv_cache is not None:
                entry.update(kv_cache.as_record())
                progress(
                    f"arm {arm.name}: KV cache {kv_cache.tokens:,} tokens"
                    f" ({kv_cache.max_concurrency:.2f} requests of {kv_cache.max_model_len:,})"
                )
            # start_new_session: the pid is the process group id, gone once the server stopped.
            entry["server_pgid"] = server.process.pid if server.process else None
            try:
                scores: list[dict[str, Any]] = []
                for preset in accuracy_presets:
                    progress(f"arm {arm.name}: accuracy preset {preset.name}")
                    summary = run_accuracy(
                        preset, server.base_url, launch.model, arm_dir / "accuracy" / preset.name,
                        tokenizer=tokenizer, limit=limit,
                        request_timeout=timeouts.total_s if timeouts else None,
                    )  # fmt: skip
                    scores += summary["scores"]
                    record["accuracy"] = {"scores": scores}
                if throughput_preset is not None and vocabulary is not None:
                    progress(f"arm {arm.name}: throughput preset {throughput_preset.name}")
                    run_throughput(
                        throughput_preset, server.base_url, launch.model, throughput_file,
                        vocabulary, on_level_done=server.check_alive, timeouts=timeouts,
                        round_index=round_index * server_rounds, repeat=server_rounds,
                        client=client, tokenizer=tokenizer,
                    )  # fmt: skip
            except EvalError as error:
                # A dead server explains a failed request or lm-eval run better than either.
                try:
                    server.check_alive()
                except ServerError as died:
                    raise ServerError(f"{died}\n(while: {str(error).splitlines()[0]})") from None
                raise
    finally:
        merge_round_levels(record, throughput_file)
    entry["finished"] = True


def merge_round_levels(record: dict[str, Any], throughput_file: Path) -> None:
    """Add a round's measured levels (from its throughput.json) to the arm's record."""
    if not throughput_file.exists():
        return
    try:
        round_results = json.loads(throughput_file.read_text())
    except (OSError, ValueError):
        return
    merged = record.setdefault("throughput", {"scenarios": []})
    for index, scenario in enumerate(round_results.get("scenarios", [])):
        if index == len(merged["scenarios"]):
            merged["scenarios"].append({**scenario, "levels": []})
        merged["scenarios"][index]["levels"] += scenario.get("levels", [])


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
    write_text(out_dir / "report.md", report.ab_markdown(ab, plots))
    return ab
