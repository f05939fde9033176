"""``vllm-minimax eval accuracy``: lm-eval against a running server, and the baseline rule.

lm-eval runs as a subprocess, once per task of the preset, with its ``local-completions`` or
``local-chat-completions`` model pointed at the server. One process per task keeps each
task's own lm-eval JSON (``lm_eval/<task>/``) on disk as soon as that task ends, so a run
that fails later keeps what it finished, and a failing task's lm-eval log is quoted as is.
The server is checked first (``/health``, ``/v1/models`` lists the model, the preset's
``min_model_len`` fits its ``max_model_len``, the preset's local data files exist). lm-eval's
progress bars are forwarded to stderr every few seconds; a failed task is reported by the
first exception line of its log (the cause) and the log's path.

The summary, ``accuracy.json``, is one score per (task, metric): value, standard error and
sample count. A summary from an earlier run is a baseline for the next one. A preset may list
published ``references``: a score within the preset's stated ``tolerance`` of one matches it.

**The rule.** A score passes when ``|score - baseline| <= z * sqrt(se^2 + se_baseline^2)``
(``z`` = 1.96 by default): the two runs are independent estimates, so the standard error of
their difference is the root sum of squares, and 1.96 of it is a two-sided 95% bound. Where
lm-eval reports no standard error (RULER's custom aggregation says ``N/A``), a score in
[0, 1] over ``n`` samples uses the binomial one, ``sqrt(p * (1 - p) / n)``. Two scores of 0
(or 1) have no spread, so only equality passes. A score the baseline does not have fails.
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_minimax.evals.common import EvalError, progress, read_json, require, write_json
from vllm_minimax.evals.presets import AccuracyPreset, AccuracyTask
from vllm_minimax.evals.server import ServedModel, check_server, require_model_len

DEFAULT_Z = 1.96
# A Python exception named at the start of a line or after a log prefix:
# ``aiohttp.client_exceptions.ClientConnectorError: Cannot connect ...``.
EXCEPTION_LINE = re.compile(r"(^|\s)([A-Za-z_][\w.]*(Error|Exception)|KeyboardInterrupt)(:|$)")
PROGRESS_BAR = re.compile(rb"\d+%\|")
PROGRESS_EVERY_S = 10.0
LM_EVAL_HEARTBEAT_S = 30.0


@dataclass(frozen=True)
class Score:
    task: str
    metric: str
    value: float
    stderr: float | None
    samples: int | None


@dataclass(frozen=True)
class Comparison:
    task: str
    metric: str
    value: float
    baseline: float | None
    difference: float | None
    bound: float | None
    passed: bool
    note: str = ""


def stderr_key(metric: str) -> str:
    """lm-eval's standard-error key: ``exact_match,flex`` -> ``exact_match_stderr,flex``."""
    name, _, filter_name = metric.partition(",")
    return f"{name}_stderr,{filter_name}" if filter_name else f"{name}_stderr"


def effective_stderr(score: Score) -> float | None:
    if score.stderr is not None:
        return score.stderr
    if score.samples and 0.0 <= score.value <= 1.0:
        return math.sqrt(score.value * (1.0 - score.value) / score.samples)
    return None


def compare(score: Score, baseline: Score | None, z: float = DEFAULT_Z) -> Comparison:
    if baseline is None:
        return Comparison(
            score.task, score.metric, score.value, None, None, None, False, "no baseline"
        )
    difference = score.value - baseline.value
    errors = [effective_stderr(score), effective_stderr(baseline)]
    if any(error is None for error in errors):
        return Comparison(
            score.task, score.metric, score.value, baseline.value, difference, None,
            difference == 0.0, "no standard error: only equality passes",
        )  # fmt: skip
    bound = z * math.sqrt(sum(error * error for error in errors if error is not None))
    passed = abs(difference) <= bound + 1e-12
    return Comparison(
        score.task, score.metric, score.value, baseline.value, difference, bound, passed
    )


def compare_all(
    scores: list[Score], baseline: list[Score], z: float = DEFAULT_Z
) -> list[Comparison]:
    by_key = {(score.task, score.metric): score for score in baseline}
    return [compare(score, by_key.get((score.task, score.metric)), z) for score in scores]


def load_baseline(path: Path) -> list[Score]:
    """Read an ``accuracy.json`` (this module's summary) as a baseline; refuse anything else."""
    data = read_json(path, "baseline")
    entries = data.get("scores") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise EvalError(
            f"malformed baseline {path}: expected an accuracy.json written by"
            " `vllm-minimax eval accuracy`, an object with a `scores` list"
        )
    scores = []
    for index, entry in enumerate(entries):
        try:
            value = entry["value"]
            stderr = entry.get("stderr")
            samples = entry.get("samples")
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError("value is not a number")
            if stderr is not None and not isinstance(stderr, (int, float)):
                raise TypeError("stderr is not a number or null")
            scores.append(
                Score(
                    str(entry["task"]),
                    str(entry["metric"]),
                    float(value),
                    None if stderr is None else float(stderr),
                    None if samples is None else int(samples),
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise EvalError(
                f"malformed baseline {path}: scores[{index}] needs task, metric and a numeric"
                f" value ({type(error).__name__}: {error})"
            ) from None
    return scores


def lm_eval_command(
    preset: AccuracyPreset,
    task: AccuracyTask,
    base_url: str,
    model: str,
    output_dir: Path,
    tokenizer: str | None,
    limit: int | None,
    request_timeout: float | None = None,
) -> list[str]:
    endpoint = (
        "chat/completions" if preset.model_type == "local-chat-completions" else "completions"
    )
    model_args: dict[str, Any] = {
        "model": model,
        "base_url": f"{base_url}/v1/{endpoint}",
        **preset.model_args,
        **task.model_args,
    }
    if request_timeout is not None:
        model_args["timeout"] = int(request_timeout)
    if tokenizer and model_args.get("tokenizer_backend") not in (None, "None", "none"):
        model_args["tokenizer"] = tokenizer
    command = [sys.executable, "-m", "lm_eval", "run", "--model", preset.model_type]
    command += ["--model_args", ",".join(f"{key}={value}" for key, value in model_args.items())]
    command += ["--tasks", task.task, "--output_path", str(output_dir), "--log_samples"]
    if preset.include_path is not None:
        command += ["--include_path", str(preset.include_path)]
    if task.num_fewshot is not None:
        command += ["--num_fewshot", str(task.num_fewshot)]
    effective_limit = limit if limit is not None else task.limit
    if effective_limit is not None:
        command += ["--limit", str(effective_limit)]
    if task.metadata:
        command += ["--metadata", json.dumps(task.metadata)]
    if task.gen_kwargs:
        command += ["--gen_kwargs", ",".join(f"{k}={v}" for k, v in task.gen_kwargs.items())]
    if task.apply_chat_template:
        command.append("--apply_chat_template")
    return command


def newest_results_file(output_dir: Path) -> Path | None:
    files = sorted(output_dir.rglob("results_*.json"), key=lambda path: path.stat().st_mtime)
    return files[-1] if files else None


def scores_from_results(results_file: Path, task: AccuracyTask) -> list[Score]:
    data = read_json(results_file, "lm-eval results")
    task_results = data.get("results", {}).get(task.task)
    if not isinstance(task_results, dict):
        raise EvalError(f"{results_file} has no results for task {task.task!r}")
    samples = data.get("n-samples", {}).get(task.task, {}).get("effective")
    scores = []
    for metric in task.metrics:
        if metric not in task_results:
            known = ", ".join(key for key in task_results if "_stderr" not in key and "," in key)
            raise EvalError(
                f"task {task.task!r} has no metric {metric!r} in {results_file}; it has: {known}"
            )
        stderr = task_results.get(stderr_key(metric))
        scores.append(
            Score(
                task.task,
                metric,
                float(task_results[metric]),
                float(stderr) if isinstance(stderr, (int, float)) else None,
                int(samples) if samples is not None else None,
            )
        )
    return scores


def first_error_line(log_path: Path) -> str:
    """The first line of an lm-eval log that names an exception (the cause; the traceback's
    last line is often a consequence, such as ``Session is closed``), else its last line."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    raised = [line.strip() for line in lines if EXCEPTION_LINE.search(line)]
    # A cancelled task is what a timeout or another failure leaves behind, not its cause.
    causes = [line for line in raised if "CancelledError" not in line] or raised
    timeouts = [line for line in causes if "TimeoutError" in line]
    if timeouts:
        return f"a request timed out (--request-timeout is lm-eval's timeout): {timeouts[0]}"
    if causes:
        return causes[0]
    return next((line.strip() for line in reversed(lines) if line.strip()), "(empty log)")


def run_lm_eval(command: list[str], log_path: Path, cwd: Path, label: str) -> int:
    """Run lm-eval with its output in ``log_path``; forward its progress bars (throttled),
    and while it prints none, a heartbeat with the seconds waited and the log's last line."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
        )
        assert process.stdout is not None
        started = reported = time.monotonic()
        pending = b""
        last_line = ""
        try:
            while True:
                ready, _, _ = select.select([process.stdout], [], [], 1.0)
                bars: list[bytes] = []
                if ready:
                    chunk = process.stdout.read1(65536)
                    if not chunk:
                        break
                    log.write(chunk)
                    log.flush()
                    # tqdm redraws with \r; each redraw is a line here.
                    *lines, pending = (pending + chunk).replace(b"\r", b"\n").split(b"\n")
                    bars = [line for line in lines if PROGRESS_BAR.search(line)]
                    text_lines = [line.strip() for line in lines if line.strip()]
                    if text_lines:
                        last_line = text_lines[-1].decode(errors="replace")
                now = time.monotonic()
                if bars and (now - reported >= PROGRESS_EVERY_S or b"100%" in bars[-1]):
                    reported = now
                    progress(f"{label}: {bars[-1].decode(errors='replace').strip()[:150]}")
                elif now - reported >= LM_EVAL_HEARTBEAT_S:
                    reported = now
                    progress(
                        f"{label}: lm-eval running, {now - started:.0f} s so far; log:"
                        f" {last_line[:150] or '(nothing yet)'}"
                    )
        except BaseException:
            process.kill()
            raise
        finally:
            process.wait()
    return process.returncode


OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_offline() -> bool:
    return any(
        os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
        for name in OFFLINE_VARIABLES
    )


def hub_dataset_cached(repo_id: str) -> bool:
    """Whether ``datasets`` can load ``repo_id`` offline: its hub snapshot or its processed
    copy (``HF_DATASETS_CACHE``) is on disk."""
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id, repo_type="dataset", local_files_only=True)
        return True
    except Exception:  # any failure means: not usable offline
        pass
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    processed = Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets"))
    return (processed / repo_id.replace("/", "___")).is_dir()


def check_accuracy_preset(preset: AccuracyPreset, served: ServedModel, base_url: str) -> None:
    """Refuse a preset that cannot run here: missing local data, a context too long."""
    missing = [path for path in preset.data_files if not path.exists()]
    if missing:
        raise EvalError(
            f"accuracy preset {preset.name!r} reads local data that is not there:"
            f" {', '.join(map(str, missing))} (see the preset's comment for how to get it)"
        )
    if hub_offline():
        absent = [name for name in preset.hub_datasets if not hub_dataset_cached(name)]
        if absent:
            raise EvalError(
                f"accuracy preset {preset.name!r} loads the hub dataset(s) {', '.join(absent)},"
                " not in the local Hugging Face cache, and the hub is off (HF_HUB_OFFLINE or"
                " HF_DATASETS_OFFLINE): fetch them once where the hub is reachable, e.g. `hf"
                f" download {absent[0]} --repo-type dataset`, and copy the cache here"
            )
    if preset.min_model_len is not None:
        require_model_len(
            served, preset.min_model_len, f"accuracy preset {preset.name!r}", base_url
        )


def run_accuracy(
    preset: AccuracyPreset,
    base_url: str,
    model: str,
    out_dir: Path,
    tokenizer: str | None = None,
    limit: int | None = None,
    baseline_path: Path | None = None,
    z: float = DEFAULT_Z,
    request_timeout: float | None = None,
) -> dict[str, Any]:
    """Check the server, run each task, rewrite ``out_dir/accuracy.json`` after each task;
    compare with the baseline and the preset's references at the end."""
    require("lm_eval", "tenacity")
    baseline = load_baseline(baseline_path) if baseline_path is not None else None
    base_url = base_url.rstrip("/")
    check_accuracy_preset(preset, check_server(base_url, model), base_url)
    summary_path = out_dir / "accuracy.json"
    summary: dict[str, Any] = {
        "preset": preset.name,
        "preset_file": str(preset.path),
        "base_url": base_url,
        "model": model,
        "complete": False,
        "scores": [],
        "lm_eval_results": {},
    }
    write_json(summary_path, summary)
    for task in preset.tasks:
        task_dir = out_dir / "lm_eval" / task.task
        task_dir.mkdir(parents=True, exist_ok=True)
        log_path = out_dir / "lm_eval" / f"{task.task}.log"
        command = lm_eval_command(
            preset, task, base_url, model, task_dir, tokenizer, limit, request_timeout
        )
        label = f"accuracy {task.task}"
        progress(f"{label}: lm-eval running, log {log_path}")
        try:
            code = run_lm_eval(command, log_path, out_dir, label)
        except KeyboardInterrupt:
            summary["interrupted"] = f"{label}: interrupted"
            write_json(summary_path, summary)
            raise
        results_file = newest_results_file(task_dir)
        if code != 0 or results_file is None:
            summary["error"] = f"lm-eval failed for task {task.task!r} (exit status {code})"
            write_json(summary_path, summary)
            raise EvalError(
                f"lm-eval failed for task {task.task!r} (exit status {code}):"
                f" {first_error_line(log_path)}\nlm-eval's log: {log_path}\n"
                f"scores of the finished tasks are in {summary_path}"
            )
        scores = scores_from_results(results_file, task)
        summary["scores"] += [asdict(score) for score in scores]
        summary["lm_eval_results"][task.task] = str(results_file)
        write_json(summary_path, summary)
        for score in scores:
            progress(f"{label} {score.metric}: {score.value:.4f}")
    summary["complete"] = True
    scores = [Score(**entry) for entry in summary["scores"]]
    if baseline is not None:
        comparisons = compare_all(scores, baseline, z)
        summary["baseline"] = {
            "file": str(baseline_path),
            "z": z,
            "passed": all(comparison.passed for comparison in comparisons),
            "comparisons": [asdict(comparison) for comparison in comparisons],
            "scores": [asdict(score) for score in baseline],
        }
    if preset.references:
        summary["references"] = [asdict(check) for check in check_references(scores, preset)]
    write_json(summary_path, summary)
    return summary


@dataclass(frozen=True)
class ReferenceCheck:
    task: str
    metric: str
    reference: float
    tolerance: float
    source: str
    value: float | None
    passed: bool


def check_references(scores: list[Score], preset: AccuracyPreset) -> list[ReferenceCheck]:
    """Each published reference against this run: ``|value - reference| <= tolerance``."""
    by_key = {(score.task, score.metric): score.value for score in scores}
    checks = []
    for ref in preset.references:
        value = by_key.get((ref.task, ref.metric))
        passed = value is not None and abs(value - ref.score) <= ref.tolerance + 1e-12
        checks.append(
            ReferenceCheck(
                ref.task, ref.metric, ref.score, ref.tolerance, ref.source, value, passed
            )
        )
    return checks
