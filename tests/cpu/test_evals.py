"""`vllm-minimax eval` without a vLLM server: the baseline rule, presets, arms, bad input,
and the server lifecycle on stand-in processes (tests/cpu/test_eval_e2e.py runs the real
vLLM CPU server)."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from http_stub import StubServer, VllmStubHandler, models_listing
from patchset_helpers import REPO_ROOT, build_and_unpack_wheel

from vllm_minimax.cli import main
from vllm_minimax.evals import ab, accuracy, presets, report, throughput
from vllm_minimax.evals.accuracy import Score, compare
from vllm_minimax.evals.common import EvalError
from vllm_minimax.evals.server import ServerError, VllmServer, free_port, process_group_alive


def score(value: float, stderr: float | None = 0.01, samples: int | None = 1000) -> Score:
    return Score("gsm8k", "exact_match,strict-match", value, stderr, samples)


def test_rule_passes_within_the_bound_and_fails_outside():
    bound = 1.96 * math.sqrt(0.01**2 + 0.02**2)
    inside = compare(score(0.90 + 0.99 * bound, 0.01), score(0.90, 0.02))
    outside = compare(score(0.90 + 1.01 * bound, 0.01), score(0.90, 0.02))
    assert inside.passed and math.isclose(inside.bound, bound)
    assert not outside.passed
    assert compare(score(0.9), score(0.9, 0.0)).passed


def test_rule_with_no_spread_passes_only_equality():
    assert compare(score(0.0, 0.0), score(0.0, 0.0)).passed
    assert not compare(score(0.0, 0.0), score(0.01, 0.0)).passed


def test_rule_uses_the_binomial_stderr_where_lm_eval_reports_none():
    result = compare(score(0.80, None, 400), score(0.70, None, 400))
    expected = 1.96 * math.sqrt(0.8 * 0.2 / 400 + 0.7 * 0.3 / 400)  # 0.060
    assert math.isclose(result.bound, expected)
    assert not result.passed  # a 0.10 drop
    assert compare(score(0.75, None, 400), score(0.70, None, 400)).passed
    assert compare(score(2.5, None, 400), score(2.5, None, 400)).note  # not a fraction


def test_a_score_without_baseline_fails():
    result = accuracy.compare_all([score(0.5)], [])[0]
    assert not result.passed and result.note == "no baseline"


def test_each_score_is_compared_with_the_baseline_of_its_task_and_metric():
    strict = score(0.90)
    flexible = Score("gsm8k", "exact_match,flexible-extract", 0.50, 0.01, 1000)
    baseline = [score(0.10), Score(flexible.task, flexible.metric, 0.50, 0.01, 1000)]
    results = accuracy.compare_all([strict, flexible], baseline)
    assert [(r.metric, r.baseline, r.passed) for r in results] == [
        (strict.metric, 0.10, False),
        (flexible.metric, 0.50, True),
    ]


def test_stderr_key_follows_lm_eval():
    assert accuracy.stderr_key("exact_match,strict-match") == "exact_match_stderr,strict-match"
    assert accuracy.stderr_key("32768,none") == "32768_stderr,none"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not valid JSON"),
        ('{"results": {}}', "expected an accuracy.json"),
        ('{"scores": [{"task": "t", "metric": "m", "value": "high"}]}', "scores[0]"),
        ('{"scores": [{"task": "t", "value": 0.5}]}', "scores[0] needs task, metric"),
    ],
)
def test_malformed_baseline_is_refused_before_any_run(tmp_path, capsys, content, message):
    baseline = tmp_path / "baseline.json"
    baseline.write_text(content)
    unreachable = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "out"
    command = ["eval", "accuracy", "--model", "m", "--preset", "cpu-tiny"]
    code = main(
        [*command, "--base-url", unreachable, "--out", str(out), "--baseline", str(baseline)]
    )
    assert code == 2
    error = capsys.readouterr().err
    assert "malformed baseline" in error or "is not valid JSON" in error
    assert message in error


def test_every_shipped_preset_loads():
    assert {"gsm8k", "ruler-32k", "cpu-tiny"} <= set(presets.available("accuracy"))
    assert {"indexer", "cpu-tiny"} <= set(presets.available("throughput"))
    for name in presets.available("accuracy"):
        preset = presets.load_accuracy_preset(name)
        assert preset.tasks and all(task.metrics for task in preset.tasks)
    for name in presets.available("throughput"):
        assert presets.load_throughput_preset(name).scenarios
    scenarios = {s.name: s for s in presets.load_throughput_preset("indexer").scenarios}
    assert scenarios["long-decode-32k"].shapes[0] == presets.RequestShape(32768, 256)
    ruler = presets.load_accuracy_preset("ruler-32k")
    assert all(task.metadata["max_seq_lengths"] == [32768] for task in ruler.tasks)


@pytest.mark.parametrize("kind", ["accuracy", "throughput"])
def test_unknown_preset_names_the_known_ones(tmp_path, capsys, kind):
    argv = ["eval", kind, "--base-url", "http://127.0.0.1:1", "--model", "m"]
    code = main([*argv, "--preset", "no-such-preset", "--out", str(tmp_path)])
    assert code == 2
    error = capsys.readouterr().err
    assert f"unknown {kind} preset 'no-such-preset'" in error
    assert "cpu-tiny" in error


@pytest.mark.slow
def test_unknown_task_fails_with_lm_evals_message(tmp_path, capsys, stand_in_server):
    preset = tmp_path / "unknown-task.yaml"
    source = yaml.safe_load((REPO_ROOT / "evals/accuracy/cpu-tiny.yaml").read_text())
    source["include_path"] = str(REPO_ROOT / "evals/tasks")
    source["tasks"] = [{"task": "no_such_task", "metrics": ["exact_match,none"]}]
    preset.write_text(yaml.safe_dump(source))
    out = tmp_path / "out"
    command = ["eval", "accuracy", "--model", "m", "--preset", str(preset)]
    assert main([*command, "--base-url", stand_in_server.base_url, "--out", str(out)]) == 2
    error = capsys.readouterr().err
    lines = error.strip().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("vllm-minimax: error:"))
    first, log_line = lines[at : at + 2]
    assert "lm-eval failed for task 'no_such_task'" in first
    # lm-eval's own words: the first exception line of its log, not a traceback.
    assert first.endswith("(exit status 1): ValueError: Tasks not found: no_such_task")
    assert log_line == f"lm-eval's log: {out / 'lm_eval' / 'no_such_task.log'}"
    assert json.loads((out / "accuracy.json").read_text())["complete"] is False


def test_malformed_throughput_preset(tmp_path):
    path = tmp_path / "bad.yaml"
    scenario = {"name": "x", "shapes": [{}], "concurrency": [1], "num_requests": 1}
    path.write_text(yaml.safe_dump({"scenarios": [scenario]}))
    with pytest.raises(
        EvalError, match=r"`scenarios\[0\]\.shapes\[0\]\.input_tokens`: expected a positive"
    ):
        presets.load_throughput_preset(str(path))


GOOD_SCENARIO = {
    "name": "decode",
    "shapes": [{"input_tokens": 8, "output_tokens": 4}],
    "concurrency": [1],
    "num_requests": 2,
}
GOOD_TASK = {"task": "tiny_arithmetic", "metrics": ["exact_match,none"]}


@pytest.mark.parametrize(
    ("kind", "preset", "key"),
    [
        ("throughput", {"scenarios": [{**GOOD_SCENARIO, "shapes": [5]}]}, "scenarios[0].shapes[0]"),
        ("throughput", {"scenarios": [{k: v for k, v in GOOD_SCENARIO.items() if k != "name"}]},
         "scenarios[0].name"),
        ("throughput", {"seed": "abc", "scenarios": [GOOD_SCENARIO]}, "seed"),
        ("throughput", {"scenarios": [{**GOOD_SCENARIO, "shapes": []}]}, "scenarios[0].shapes"),
        ("throughput", {"scenarios": [{**GOOD_SCENARIO, "concurrency": [0]}]},
         "scenarios[0].concurrency[0]"),
        ("throughput", {"scenarios": [GOOD_SCENARIO, GOOD_SCENARIO]}, "scenarios"),
        ("throughput", {"scenarios": [{**GOOD_SCENARIO, "typo": 1}]}, "scenarios[0]"),
        ("accuracy", {"tasks": [{**GOOD_TASK, "metrics": 5}]}, "tasks[0].metrics"),
        ("accuracy", {"tasks": [{**GOOD_TASK, "metadata": [1]}]}, "tasks[0].metadata"),
        ("accuracy", {"tasks": [{**GOOD_TASK, "model_args": ["a"]}]}, "tasks[0].model_args"),
        ("accuracy", {"tasks": [GOOD_TASK], "model_args": [1]}, "model_args"),
        ("accuracy", {"tasks": [{"metrics": ["m"]}]}, "tasks[0].task"),
        ("accuracy", {"tasks": [{**GOOD_TASK, "num_fewshot": "five"}]}, "tasks[0].num_fewshot"),
        ("accuracy", {"tasks": []}, "tasks"),
        ("accuracy", {"tasks": [GOOD_TASK], "min_model_len": 0}, "min_model_len"),
        ("accuracy", {"tasks": [GOOD_TASK], "references": [{"task": "t"}]}, "references[0]"),
    ],
)  # fmt: skip
def test_malformed_preset_names_the_key(tmp_path, capsys, kind, preset, key):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(preset))
    out = tmp_path / "out"
    argv = ["eval", kind, "--base-url", "http://127.0.0.1:1", "--model", "m"]
    assert main([*argv, "--preset", str(path), "--out", str(out)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"{path}: `{key}" in line, line
    assert not out.exists()  # nothing written


@pytest.mark.parametrize(
    ("out", "message"),
    [("file", "exists and is not a directory"), ("file/sub", "is not writable")],
)
def test_unusable_out_is_refused(tmp_path, capsys, out, message):
    (tmp_path / "file").write_text("x")
    argv = ["eval", "throughput", "--base-url", "http://127.0.0.1:1", "--model", "m"]
    code = main([*argv, "--preset", "cpu-tiny", "--out", str(tmp_path / out)])
    assert code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert message in line and str(tmp_path / out) in line
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--startup-timeout", "nan"),
        ("--startup-timeout", "-1"),
        ("--startup-timeout", "inf"),
        ("--z", "nan"),
        ("--z", "0"),
        ("--z", "inf"),
    ],
)
def test_a_bound_that_is_not_a_positive_number_is_refused_before_any_server(
    tmp_path, capsys, option, value
):
    argv = ["eval", "ab", "--model", "m", "--throughput-preset", "none", option, value]
    code = main([*argv, "--server-command", "false", "--out", str(tmp_path / "o")])
    assert code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"{option} must be positive and finite, got {float(value)}" in line
    assert not (tmp_path / "o").exists()


def test_ab_whose_tokenizer_cannot_load_creates_no_out(tmp_path, capsys):
    argv = ["eval", "ab", "--model", str(tmp_path / "no-such-model"), "--no-accuracy"]
    code = main([*argv, "--throughput-preset", "cpu-tiny", "--client", "own",
                 "--out", str(tmp_path / "o")])  # fmt: skip
    assert code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(f"cannot load tokenizer '{tmp_path / 'no-such-model'}': no such directory")
    assert not (tmp_path / "o").exists()


def test_a_failed_json_write_names_its_file_and_leaves_no_scratch(tmp_path, monkeypatch):
    from vllm_minimax.evals import common

    target = tmp_path / "out" / "ab.json"
    target.parent.mkdir()
    target.write_text('{"kept": true}\n')

    def disk_full(self, *args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "replace", disk_full)
    with pytest.raises(OSError) as raised:
        common.write_json(target, {"new": 1})
    assert (raised.value.errno, raised.value.filename) == (28, str(target))
    assert sorted(path.name for path in target.parent.iterdir()) == ["ab.json"]
    assert json.loads(target.read_text()) == {"kept": True}


def test_unbalanced_server_command_is_refused(tmp_path, capsys):
    argv = ["eval", "ab", "--model", "m", "--no-accuracy", "--throughput-preset", "none"]
    code = main([*argv, "--server-command", 'vllm "serve', "--out", str(tmp_path / "o")])
    assert code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--server-command" in line and "No closing quotation" in line
    assert not (tmp_path / "o" / "ab.json").exists()


def test_no_default_preset_for_a_server_of_unknown_size(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["eval", "throughput", "--base-url", "http://x", "--model", "m", "--out", "o"])
    assert exited.value.code == 2
    assert "--preset" in capsys.readouterr().err


def test_tokenizer_with_a_preset_that_loads_none_is_refused(tmp_path, capsys):
    argv = ["eval", "accuracy", "--base-url", "http://127.0.0.1:1", "--model", "m"]
    argv += ["--preset", "cpu-tiny", "--tokenizer", "t", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "--tokenizer has no effect with preset 'cpu-tiny'" in capsys.readouterr().err


def test_shipped_task_reads_its_data_from_any_working_directory(tmp_path):
    """`lm_eval --include_path evals/tasks` from elsewhere: the data is found next to the YAML."""
    probe = (
        "from lm_eval.tasks import TaskManager\n"
        f"manager = TaskManager(include_path={str(REPO_ROOT / 'evals/tasks')!r})\n"
        "[task] = manager.load_task_or_group(['tiny_arithmetic']).values()\n"
        "docs = list(task.test_docs())\n"
        "print(len(docs), docs[0]['question'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    first = json.loads(
        (REPO_ROOT / "evals/tasks/tiny_arithmetic.jsonl").read_text().splitlines()[0]
    )
    assert done.stdout.strip().splitlines()[-1] == f"24 {first['question']}"


def test_presets_ship_inside_the_wheel(tmp_path):
    installed = build_and_unpack_wheel(tmp_path)
    shipped = installed / "vllm_minimax" / "_eval_configs"
    for relative in (
        "accuracy/gsm8k.yaml",
        "throughput/indexer.yaml",
        "tasks/tiny_arithmetic.jsonl",
        "tasks/local_data.py",
        "cpu-server.yaml",
        "README.md",
    ):
        assert (shipped / relative).read_bytes() == (REPO_ROOT / "evals" / relative).read_bytes()
    probe = "from vllm_minimax.evals import presets; print(presets.eval_configs_root())"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(installed)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(result.stdout.strip()) == shipped


def test_default_arms_are_the_indexer_backends_merged_into_the_serve_config():
    config = ab.load_serve_config(REPO_ROOT / "configs/serve/h200-8x.yaml")
    merged = {arm.name: ab.merge_server_args(config, arm.server_args) for arm in ab.default_arms()}
    assert list(merged) == ["triton", "flashinfer"]
    for backend, args in merged.items():
        assert args["attention-config"] == {
            "indexer_kv_dtype": "fp8",
            "minimax_m3_indexer_backend": backend,
        }
        assert args["tensor-parallel-size"] == 8
    assert config["attention-config"]["minimax_m3_indexer_backend"] == "auto"  # not mutated


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "serve config .* does not exist"),
        ("max-model-len: [1024", "serve config .* is not valid YAML"),
        ("- max-model-len", "serve config .*: expected a mapping at the top level"),
    ],
)
def test_bad_serve_config_is_refused_before_any_server_starts(tmp_path, content, message):
    path = tmp_path / "serve.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(EvalError, match=message):
        ab.load_serve_config(path)
    if content is None:
        return
    path.write_text("")
    assert ab.load_serve_config(path) == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("noequals", "expected NAME=JSON"),
        ("a={bad", "not JSON"),
        ("a=[1]", "must be a JSON object"),
        ("bad name={}", "expected NAME=JSON"),
    ],
)
def test_bad_arm(text, message):
    with pytest.raises(EvalError, match=message):
        ab.parse_arm(text)


def test_report_from_results_json():
    results = {
        "preset": "p",
        "base_url": "http://x",
        "model": "m",
        "scenarios": [
            {
                "name": "decode",
                "shapes": [{"input_tokens": 8, "output_tokens": 4}],
                "num_requests": 2,
                "levels": [
                    {
                        "concurrency": 1,
                        "output_tokens_per_s": 10.0,
                        "ttft_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0},
                        "tpot_ms": {"p50": 4.0, "p90": 5.0, "p99": 6.0},
                        "itl_ms": {"p50": 7.0, "p99": 8.0},
                    }
                ],
            }
        ],
        "error": "stopped",
    }
    text = report.throughput_markdown(results)
    assert "| 1 | 1 | 10.0 | 1.0 | 4.0 | 7.0 | 3.0 | 6.0 |" in text
    assert "**Stopped early:** stopped" in text
    # Three rounds of one level: median and min..max, and the rounds counted.
    base = results["scenarios"][0]["levels"][0]
    results["scenarios"][0]["levels"] = [
        {**base, "round": r, "output_tokens_per_s": v} for r, v in enumerate((12.0, 8.0, 10.0))
    ]
    results["repeat"] = 3
    text = report.throughput_markdown(results)
    assert "| 1 | 3 | 10.0 (8.0..12.0) | 1.0 (1.0..1.0) |" in text
    assert "3 rounds per level" in text


STAND_IN = [sys.executable, "-c"]


def test_server_that_exits_reports_its_log(tmp_path):
    server = VllmServer(
        "m",
        tmp_path / "server.log",
        command=[*STAND_IN, "import sys; print('no such model, giving up'); sys.exit(3)"],
    )
    with pytest.raises(ServerError, match="exited with status 3") as raised:
        server.start()
    assert "no such model, giving up" in str(raised.value)


def test_server_start_timeout_stops_its_process_group(tmp_path, capsys, monkeypatch):
    from vllm_minimax.evals import server as server_module

    monkeypatch.setattr(server_module, "HEARTBEAT_S", 1.0)
    # The stand-in forks a child into its group, as vLLM forks its engine core.
    script = (
        "import subprocess, time; print('loading the weights', flush=True);"
        " subprocess.Popen(['sleep', '300']); time.sleep(300)"
    )
    server = VllmServer("m", tmp_path / "server.log", command=[*STAND_IN, script])
    server.startup_timeout = 4.0
    started = time.monotonic()
    with pytest.raises(ServerError, match=r"did not answer .*/health within 4 s"):
        server.start()
    assert time.monotonic() - started < 60
    error = capsys.readouterr().err
    pgid = int(re.search(r"started pid (\d+)", error).group(1))
    assert not process_group_alive(pgid)
    # The heartbeat: seconds waited and the log's last line.
    beats = re.findall(r"server: waiting for /health, (\d+) s so far; log: (.*)", error)
    assert beats and beats[-1][1] == "loading the weights"
    assert int(beats[-1][0]) >= 1


class StandInServer(StubServer):
    """An HTTP server with vLLM's /health and /v1/models; /v1/completions never answers."""

    def __init__(self, model: str, max_model_len: int) -> None:
        self.completions = 0
        outer = self

        class Handler(VllmStubHandler):
            listing = models_listing(model, max_model_len)

            def do_POST(self) -> None:
                outer.completions += 1
                time.sleep(30)  # accepts the request, never answers

        super().__init__(Handler)


@pytest.fixture
def stand_in_server():
    server = StandInServer("m", 1024)
    yield server
    server.close()


def test_stopped_server_fails_at_once_naming_the_url(tmp_path, capsys):
    unreachable = f"http://127.0.0.1:{free_port()}"
    for kind in ("accuracy", "throughput"):
        started = time.monotonic()
        argv = ["eval", kind, "--base-url", unreachable, "--model", "m", "--preset", "cpu-tiny"]
        assert main([*argv, "--out", str(tmp_path / kind)]) == 2
        assert time.monotonic() - started < 10
        [line] = capsys.readouterr().err.strip().splitlines()
        assert f"no server answers {unreachable}/health" in line and "Connection refused" in line


@pytest.mark.parametrize("url", ["http://127.0.0.1:abc", "http://[::1", "", "http://a b"])
def test_a_base_url_urllib_refuses_is_one_line_naming_it(tmp_path, capsys, url):
    for kind in ("accuracy", "throughput"):
        argv = ["eval", kind, "--base-url", url, "--model", "m", "--preset", "cpu-tiny"]
        assert main([*argv, "--out", str(tmp_path / kind)]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert f"--base-url {url!r} is not a URL to reach a server at" in line, line
        assert not (tmp_path / kind).exists()


def test_a_report_that_cannot_be_written_leaves_the_runs_own_error(
    tmp_path, capsys, stand_in_server, monkeypatch
):
    """A run that failed keeps its error and its throughput.json when the disk then has no room
    for throughput.md, and leaves no empty or scratch report behind."""
    from vllm_minimax.evals import throughput
    from vllm_minimax.tiny_tokenizer import build_tokenizer

    build_tokenizer(tmp_path / "tok")
    out = tmp_path / "out"

    def failing_run(preset, base_url, model, results_path, *args, **kwargs):
        results_path.parent.mkdir(parents=True, exist_ok=True)
        partial = {"preset": "cpu-tiny", "base_url": base_url, "model": model, "scenarios": []}
        results_path.write_text(json.dumps({**partial, "complete": False}))
        raise EvalError("the run's own error")

    real_write_text = Path.write_text

    def no_room_for_the_report(self, *args, **kwargs):
        if self.name.startswith(".throughput.md."):
            real_write_text(self, "")  # the scratch file exists when the disk runs out
            raise OSError(28, "No space left on device")
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(throughput, "run_throughput", failing_run)
    monkeypatch.setattr(Path, "write_text", no_room_for_the_report)
    argv = ["eval", "throughput", "--base-url", stand_in_server.base_url, "--model", "m"]
    argv += ["--preset", "cpu-tiny", "--tokenizer", str(tmp_path / "tok"), "--out", str(out)]
    assert main(argv) == 2
    [line] = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.endswith("the run's own error"), line
    assert sorted(path.name for path in out.iterdir()) == ["throughput.json"]


def test_model_the_server_does_not_serve_is_refused(tmp_path, capsys, stand_in_server):
    argv = ["eval", "accuracy", "--base-url", stand_in_server.base_url, "--model", "other"]
    assert main([*argv, "--preset", "cpu-tiny", "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "serves m, not 'other'" in error


def test_preset_longer_than_max_model_len_is_refused_naming_both(tmp_path, capsys, stand_in_server):
    argv = ["eval", "throughput", "--base-url", stand_in_server.base_url, "--model", "m"]
    assert main([*argv, "--preset", "indexer", "--out", str(tmp_path)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    # indexer.yaml's longest request: mixed, 98304 in + 64 out.
    assert "needs max_model_len >= 98368" in line and "has max_model_len 1024" in line
    assert "98304 in + 64 out" in line
    assert stand_in_server.completions == 0 and not (tmp_path / "throughput.json").exists()
    argv[1] = "accuracy"
    assert main([*argv, "--preset", "ruler-32k", "--out", str(tmp_path)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "'ruler-32k' needs max_model_len >= 32768" in line and "max_model_len 1024" in line


def test_server_that_never_answers_fails_at_the_first_byte_timeout(
    tmp_path, capsys, stand_in_server
):
    from vllm_minimax.tiny_tokenizer import build_tokenizer

    build_tokenizer(tmp_path / "tok")
    out = tmp_path / "out"
    argv = ["eval", "throughput", "--base-url", stand_in_server.base_url, "--model", "m"]
    argv += ["--preset", "cpu-tiny", "--tokenizer", str(tmp_path / "tok")]
    # Imports and the tokenizer first, so that the clock below times the requests only.
    import aiohttp  # noqa: F401

    from vllm_minimax.evals.throughput import Vocabulary

    Vocabulary.from_tokenizer(str(tmp_path / "tok"))
    started = time.monotonic()
    assert main([*argv, "--first-byte-timeout", "2", "--out", str(out)]) == 2
    # The stand-in holds each request 30 s: failing sooner is the 2 s timeout's doing.
    assert time.monotonic() - started < 25
    error = capsys.readouterr().err
    assert "sent no response within 2 s (--first-byte-timeout)" in error
    written = json.loads((out / "throughput.json").read_text())
    assert written["complete"] is False and "warm-up" in written["error"]
    assert "**Stopped early:**" in (out / "throughput.md").read_text()


def test_first_error_line_is_the_cause(tmp_path):
    log = tmp_path / "lm_eval.log"
    log.write_text(
        "INFO starting\n"
        "WARNING retrying: aiohttp.client_exceptions.ClientConnectorError: Cannot connect\n"
        "Traceback (most recent call last):\n"
        "RuntimeError: Session is closed\n"
    )
    assert accuracy.first_error_line(log).endswith("ClientConnectorError: Cannot connect")
    log.write_text("no exception here\nlast words\n")
    assert accuracy.first_error_line(log) == "last words"


def test_lm_eval_progress_bars_are_forwarded(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(accuracy, "PROGRESS_EVERY_S", 0.0)
    script = (
        "import sys, time\n"
        "for i in (10, 50, 100):\n"
        "    sys.stdout.write(f'\\rRequesting API: {i}%|#| {i}/100'); sys.stdout.flush()\n"
        "    time.sleep(0.5)\n"
        "print(); print('done')\n"
    )
    log = tmp_path / "log"
    code = accuracy.run_lm_eval([sys.executable, "-c", script], log, tmp_path, "accuracy t")
    assert code == 0
    forwarded = [line for line in capsys.readouterr().err.splitlines() if "accuracy t:" in line]
    assert len(forwarded) >= 2 and forwarded[-1].endswith("Requesting API: 100%|#| 100/100")
    assert "done" in log.read_text()


def test_silent_lm_eval_gets_a_heartbeat(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(accuracy, "LM_EVAL_HEARTBEAT_S", 1.0)
    script = "import time; print('loading tasks', flush=True); time.sleep(3.5)"
    log = tmp_path / "log"
    assert accuracy.run_lm_eval([sys.executable, "-c", script], log, tmp_path, "accuracy t") == 0
    beats = re.findall(
        r"accuracy t: lm-eval running, (\d+) s so far; log: (.*)", capsys.readouterr().err
    )
    assert len(beats) >= 2 and beats[-1][1] == "loading tasks"


@pytest.mark.usefixtures("sigint_raises")
def test_ctrl_c_during_ab_stops_the_server(tmp_path):
    """SIGINT to `eval ab` while its server starts: exit 130, the server's group is gone."""
    stand_in = f"{sys.executable} -c 'import time; time.sleep(300)'"
    stderr_path = tmp_path / "stderr"
    with stderr_path.open("w") as stderr:
        options = ["--no-accuracy", "--throughput-preset", "none", "--arm", "a={}", "--arm", "b={}"]
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm_minimax",
                "eval",
                "ab",
                "--model",
                "m",
                *options,
                "--server-command",
                stand_in,
                "--out",
                str(tmp_path / "out"),
            ],
            stderr=stderr,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        deadline = time.monotonic() + 60
        while "server: started pid" not in stderr_path.read_text():
            assert time.monotonic() < deadline, stderr_path.read_text()
            time.sleep(0.2)
        pgid = int(re.search(r"started pid (\d+)", stderr_path.read_text()).group(1))
        assert process_group_alive(pgid)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 130
    assert not process_group_alive(pgid)
    assert "interrupted" in stderr_path.read_text()
    # The interruption is on record, with where it happened.
    written = json.loads((tmp_path / "out" / "ab.json").read_text())
    assert written["interrupted"] == "interrupted during arm a, round 1 of 3"
    assert not written["complete"]
    assert (
        "**Interrupted:** interrupted during arm a, round 1 of 3."
        in (tmp_path / "out" / "report.md").read_text()
    )


def start_client(tmp_path: Path, script: str) -> tuple[subprocess.Popen, Path, int]:
    """`eval ab` with a stand-in server `script`; returns once the server runs, with its pgid."""
    stderr_path = tmp_path / "stderr"
    stand_in = f"{sys.executable} -c {shlex.quote(script)}"
    options = ["--no-accuracy", "--throughput-preset", "none", "--arm", "a={}", "--arm", "b={}"]
    command = [sys.executable, "-m", "vllm_minimax", "eval", "ab", "--model", "m", *options]
    command += ["--server-command", stand_in, "--out", str(tmp_path / "out")]
    with stderr_path.open("w") as stderr:
        client = subprocess.Popen(
            command,
            stderr=stderr,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
    deadline = time.monotonic() + 60
    while "server: started pid" not in stderr_path.read_text():
        assert time.monotonic() < deadline, stderr_path.read_text()
        time.sleep(0.2)
    pgid = int(re.search(r"started pid (\d+)", stderr_path.read_text()).group(1))
    assert process_group_alive(pgid)
    return client, stderr_path, pgid


def wait_group_gone(pgid: int, seconds: float) -> float:
    started = time.monotonic()
    while process_group_alive(pgid):
        assert time.monotonic() - started < seconds, f"process group {pgid} still alive"
        time.sleep(0.2)
    return time.monotonic() - started


# Forks a child into its group (as vLLM forks its engine core), then waits.
FORKING_SERVER = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"


def test_sigkill_of_the_client_does_not_orphan_the_server(tmp_path):
    client, _, pgid = start_client(tmp_path, FORKING_SERVER)
    client.kill()
    client.wait(timeout=30)
    # The watchdog notices within a second and SIGTERMs the group; sleep obeys SIGTERM.
    assert wait_group_gone(pgid, 30) < 15


@pytest.mark.usefixtures("sigint_raises")
def test_second_ctrl_c_while_stopping_kills_the_server_at_once(tmp_path):
    # A server that ignores SIGTERM: the first Ctrl-C starts a 30 s graceful stop.
    stubborn = (
        "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        " subprocess.Popen(['sleep', '300']); time.sleep(300)"
    )
    client, stderr_path, pgid = start_client(tmp_path, stubborn)
    time.sleep(1.0)
    client.send_signal(signal.SIGINT)
    time.sleep(3.0)
    assert process_group_alive(pgid)  # still within the graceful wait
    client.send_signal(signal.SIGINT)
    assert wait_group_gone(pgid, 10) < 10
    assert client.wait(timeout=30) == 130
    text = stderr_path.read_text()
    assert f"killed process group {pgid}" in text and "interrupted" in text


def level(concurrency: int, round_index: int, tok_s: float, itl: float = 5.0) -> dict:
    return {
        "concurrency": concurrency,
        "round": round_index,
        "output_tokens_per_s": tok_s,
        "ttft_ms": {"p50": 10.0, "p99": 20.0},
        "tpot_ms": {"p50": 4.0, "p99": 6.0},
        "itl_ms": {"p50": itl, "p99": 8.0},
    }


def ab_record(levels_a: list[dict], levels_b: list[dict], repeat: int = 3) -> dict:
    plan = [{"name": "decode", "shapes": [{"input_tokens": 8, "output_tokens": 4}],
             "concurrency": [1, 4]}]  # fmt: skip

    def arm(name: str, levels: list[dict]) -> dict:
        scenario = {**plan[0], "num_requests": 2, "levels": levels}
        return {
            "name": name,
            "server_args": "{}",
            "rounds": [],
            "throughput": {"scenarios": [scenario]},
        }

    return {
        "model": "m", "config": None, "z": 1.96, "repeat": repeat, "throughput_plan": plan,
        "round_order": [["a", "b"], ["b", "a"], ["a", "b"]][:repeat],
        "arms": [arm("a", levels_a), arm("b", levels_b)], "complete": False,
    }  # fmt: skip


def test_ab_report_gives_median_spread_and_paired_ratios():
    a = [level(1, r, v) for r, v in enumerate((100.0, 90.0, 110.0))]
    b = [level(1, r, v) for r, v in enumerate((150.0, 180.0, 165.0))]
    record = ab_record([*a, level(4, 0, 300.0, itl=0.0)], b)
    text = report.ab_markdown(record, [])
    # median 100 (90..110); ratios per round 1.5, 2.0, 1.5 -> median 1.50 (1.50..2.00)
    assert "| 1 | 100.0 (90.0..110.0) | 10.0 (10.0..10.0) | 4.0 (4.0..4.0) |" in text
    assert "| 165.0 (150.0..180.0) |" in text and "| 1.50x (1.50..2.00) |" in text
    assert "`a` concurrency 4: median ITL p50 is about 0 ms" in text
    assert "**Not measured:** `a` decode: c=4 round 2, c=4 round 3;" in text
    assert "`b` decode: c=4 round 1, c=4 round 2, c=4 round 3" in text
    assert "Round order: 1: a then b; 2: b then a; 3: a then b." in text


def test_a_small_figure_keeps_two_significant_digits():
    """Issue 57: a TPOT p50 of 0.013 ms (a CPU server's bunched chunks) was printed 0.0."""
    fast = {**level(1, 0, 100.0), "tpot_ms": {"p50": 0.013, "p99": 0.0049}}
    text = report.ab_markdown(ab_record([fast], [level(1, 0, 100.0)], repeat=1), [])
    assert "| 100.0 | 10.0 | 0.013 |" in text, text
    assert "| 0.013 | 5.0 | 20.0 | 0.0049 |" in report.throughput_markdown(
        {"preset": "p", "base_url": "u", "model": "m", "scenarios": [
            {"name": "s", "shapes": [{"input_tokens": 1, "output_tokens": 2}],
             "num_requests": 1, "levels": [fast]}]}
    )  # fmt: skip
    assert [report.number_text(v, 1) for v in (0.0, 4.0, 0.04, -0.004, 123.46)] == [
        "0.0", "4.0", "0.040", "-0.0040", "123.5"
    ]  # fmt: skip


def test_ab_ratios_pair_levels_by_round_not_by_list_position():
    """Arm `b` misses round 1 and lists its rounds out of order: each ratio still divides
    b's tok/s by a's of the same round."""
    a = [level(1, r, v) for r, v in enumerate((100.0, 200.0, 400.0))]
    b = [level(1, 2, 500.0), level(1, 1, 220.0)]
    ratios = report.paired_ratios(ab_record(a, b)["arms"][1], ab_record(a, b)["arms"][0], 0, 1)
    # round 2: 500 / 400 = 1.25; round 1: 220 / 200 = 1.10 (by position: 5.0 and 1.1)
    assert ratios is not None
    assert (ratios.median, ratios.low, ratios.high) == pytest.approx((1.175, 1.10, 1.25))
    text = report.ab_markdown(ab_record(a, b), [])
    assert "| 1.18x (1.10..1.25) |" in text


def three_arm_record() -> dict:
    """Arms a (the first, so the reference), b and c, one round, with one accuracy score
    each: b's tok/s is twice a's, c's half, and c's score is far from a's and close to b's."""
    record = ab_record([level(1, 0, 100.0)], [level(1, 0, 200.0)], repeat=1)
    third = json.loads(json.dumps(record["arms"][1]))
    third["name"] = "c"
    third["throughput"]["scenarios"][0]["levels"] = [level(1, 0, 50.0)]
    record["arms"].append(third)
    record["round_order"] = [["a", "b", "c"]]
    for arm, value in zip(record["arms"], (0.50, 0.90, 0.91), strict=True):
        arm["accuracy"] = {
            "scores": [{"task": "t", "metric": "m", "value": value, "stderr": 0.01,
                        "samples": 100}]
        }  # fmt: skip
    return record


def test_ab_compares_every_arm_with_the_first(tmp_path):
    """The first arm is the reference: accuracy (values, differences, pass) and the tok/s
    ratios are each other arm's against it, and the report names it so."""
    record = ab.write_outputs(three_arm_record(), tmp_path)
    comparisons = record["accuracy_comparisons"]
    assert sorted(comparisons) == ["b", "c"]
    for name, value in (("b", 0.90), ("c", 0.91)):
        [entry] = comparisons[name]
        assert (entry["baseline"], entry["value"]) == (0.50, value)
        assert entry["difference"] == pytest.approx(value - 0.50)
        assert entry["passed"] is False
    assert record["accuracy_passed"] is False
    text = (tmp_path / "report.md").read_text()
    assert "## Accuracy (each arm against `a`, first round only)" in text
    assert "### `b` vs `a`" in text and "### `c` vs `a`" in text
    assert "| t | `m` | 0.5000 ± 0.0100 | 0.9100 ± 0.0100 | 0.4100 |" in text
    header = next(line for line in text.splitlines() if line.startswith("| concurrency |"))
    assert header.endswith("| b / a tok/s | c / a tok/s |"), header
    row = next(line for line in text.splitlines() if line.startswith("| 1 |"))
    assert row.endswith("| 2.00x | 0.50x |"), row


def test_percentile_interpolates_linearly_between_closest_ranks():
    values = [10.0, 1.0, 4.0, 3.0, 2.0]  # unsorted on purpose
    # Sorted 1, 2, 3, 4, 10: the q-th percentile sits at rank (5 - 1) * q / 100.
    assert throughput.percentile(values, 50) == 3.0
    assert throughput.percentile(values, 90) == pytest.approx(4.0 + 0.6 * 6.0)  # rank 3.6
    assert throughput.percentile(values, 99) == pytest.approx(4.0 + 0.96 * 6.0)  # rank 3.96
    assert throughput.percentile(values, 0) == 1.0 and throughput.percentile(values, 100) == 10.0
    assert throughput.percentile([7.0], 99) == 7.0
    assert math.isnan(throughput.percentile([], 50))
    import numpy

    rng = numpy.random.default_rng(46)
    for size in (2, 3, 10, 101):
        sample = rng.exponential(size=size).tolist()
        for q in (50, 90, 99):
            assert throughput.percentile(sample, q) == pytest.approx(numpy.percentile(sample, q))


def test_level_metrics_tpot_divides_the_decode_time_by_the_tokens_after_the_first():
    timings = [
        throughput.RequestTiming(8, 5, ttft_s=0.1, latency_s=0.5, itl_s=[0.1] * 4),  # 100 ms
        throughput.RequestTiming(8, 3, ttft_s=0.05, latency_s=0.45, itl_s=[0.2] * 2),  # 200 ms
        throughput.RequestTiming(8, 1, ttft_s=0.3, latency_s=0.3),  # one token: no TPOT
    ]
    metrics = throughput.level_metrics(timings, duration_s=2.0)
    tpot = metrics["tpot_ms"]
    assert tpot["mean"] == pytest.approx(150.0)
    assert (tpot["p50"], tpot["p90"], tpot["p99"]) == pytest.approx((150.0, 190.0, 199.0))
    assert metrics["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert metrics["output_tokens"] == 9 and metrics["output_tokens_per_s"] == 4.5
    assert metrics["e2e_latency_ms"]["mean"] == pytest.approx(1250.0 / 3)


def test_ab_plots_start_at_zero_and_skip_an_all_zero_accuracy(tmp_path):
    import matplotlib.pyplot as plt

    record = ab_record([level(1, 0, 100.0), level(4, 0, 120.0)], [level(1, 0, 90.0)], repeat=1)
    zero = [{"task": "t", "metric": "m", "value": 0.0, "stderr": 0.0, "samples": 4}]
    for arm in record["arms"]:
        arm["accuracy"] = {"scores": zero}
    limits = []
    original = plt.Figure.savefig

    def capture(figure, *args, **kwargs):
        limits.extend(axis.get_ylim()[0] for axis in figure.axes)
        return original(figure, *args, **kwargs)

    plt.Figure.savefig = capture
    try:
        written = report.ab_plots(record, tmp_path)
    finally:
        plt.Figure.savefig = original
    assert [path.name for path in written] == ["throughput-decode.png"]
    assert limits == [0.0, 0.0, 0.0]


def test_partial_round_levels_reach_the_arm_record(tmp_path):
    record: dict = {"name": "a", "rounds": []}
    first = {"scenarios": [{"name": "decode", "levels": [level(1, 0, 10.0)]}]}
    (tmp_path / "r1.json").write_text(json.dumps(first))
    second = {"scenarios": [{"name": "decode", "levels": [level(1, 1, 12.0)]}]}
    (tmp_path / "r2.json").write_text(json.dumps(second))
    ab.merge_round_levels(record, tmp_path / "r1.json")
    ab.merge_round_levels(record, tmp_path / "r2.json")
    ab.merge_round_levels(record, tmp_path / "missing.json")
    levels = record["throughput"]["scenarios"][0]["levels"]
    assert [(lv["round"], lv["output_tokens_per_s"]) for lv in levels] == [(0, 10.0), (1, 12.0)]


def test_preset_longer_than_an_arms_max_model_len_is_refused_before_any_server(tmp_path, capsys):
    config = tmp_path / "serve.yaml"
    config.write_text("max-model-len: 1024\n")
    argv = ["eval", "ab", "--model", "m", "--config", str(config), "--no-accuracy"]
    argv += ["--server-command", "/nonexistent/vllm serve", "--out", str(tmp_path / "o")]
    assert main(argv) == 2  # the default throughput preset, indexer
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "needs max_model_len >= 98368" in line and "max_model_len 1024" in line
    assert not (tmp_path / "o" / "triton").exists()


def test_offline_preset_whose_hub_data_is_not_cached_is_refused(
    tmp_path, capsys, monkeypatch, stand_in_server
):
    preset = tmp_path / "hub.yaml"
    preset.write_text(
        yaml.safe_dump({"hub_datasets": ["nobody/no-such-dataset"], "tasks": [GOOD_TASK]})
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    argv = ["eval", "accuracy", "--base-url", stand_in_server.base_url, "--model", "m"]
    assert main([*argv, "--preset", str(preset), "--out", str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "loads the hub dataset(s) nobody/no-such-dataset, not in the local" in line
    assert not (tmp_path / "out" / "lm_eval").exists()
    # Its processed copy in the datasets cache is enough.
    (tmp_path / "hf" / "datasets" / "nobody___no-such-dataset").mkdir(parents=True)
    assert accuracy.hub_dataset_cached("nobody/no-such-dataset")


def test_published_references_and_their_tolerance():
    preset = presets.load_accuracy_preset("gsm8k-chat-thinking")
    [reference] = preset.references
    assert (reference.score, reference.tolerance) == (0.9546, 0.02)
    key = (reference.task, reference.metric)
    inside = Score(*key, 0.9546 - 0.0199, 0.005, 1319)
    outside = Score(*key, 0.9546 - 0.0201, 0.005, 1319)
    assert [c.passed for c in accuracy.check_references([inside], preset)] == [True]
    assert [c.passed for c in accuracy.check_references([outside], preset)] == [False]
    assert [c.passed for c in accuracy.check_references([], preset)] == [False]
    task = preset.tasks[0]
    command = accuracy.lm_eval_command(preset, task, "http://h", "m", Path("o"), None, None, 60)
    assert command[command.index("--gen_kwargs") + 1] == "max_gen_toks=16384"
    assert "timeout=60" in command[command.index("--model_args") + 1]
    assert "--apply_chat_template" in command


def bench_result(output_throughput: float, completed: int = 2, failed: int = 0) -> dict:
    """The keys of a `vllm bench serve --save-result` JSON that the level record reads."""
    data = {
        "completed": completed,
        "failed": failed,
        "num_prompts": completed + failed,
        "duration": 2.0,
        "total_input_tokens": 16,
        "total_output_tokens": 8,
        "request_throughput": 1.0,
        "output_throughput": output_throughput,
        "total_token_throughput": 12.0,
        "errors": ["", "ClientConnectorError: Cannot connect to host"][: completed + failed],
    }
    for offset, name in enumerate(("ttft", "tpot", "itl", "e2el")):
        data |= {f"{kind}_{name}_ms": 10.0 * offset + i for i, kind in
                 enumerate(("mean", "p50", "p90", "p99"))}  # fmt: skip
    return data


def test_scenario_client_bench_for_one_shape_own_for_mixed():
    from vllm_minimax.evals.presets import RequestShape, ThroughputScenario
    from vllm_minimax.evals.throughput import scenario_client

    one = ThroughputScenario("decode", [RequestShape(8, 4)], [1], 2)
    mixed = ThroughputScenario("mixed", [RequestShape(8, 4), RequestShape(16, 2)], [1], 2)
    assert scenario_client(one, "vllm-bench") == "vllm-bench"
    assert scenario_client(mixed, "vllm-bench") == "own"
    assert scenario_client(one, "own") == "own"
    with pytest.raises(EvalError, match="--client 'bench'"):
        scenario_client(one, "bench")


def test_bench_json_becomes_the_level_record():
    from vllm_minimax.evals.bench import level_from_bench

    data = bench_result(4.0)
    record = level_from_bench(data)
    assert record["output_tokens_per_s"] == 4.0 and record["duration_s"] == 2.0
    assert (record["input_tokens"], record["output_tokens"], record["completed"]) == (16, 8, 2)
    for key, name in (("ttft_ms", "ttft"), ("tpot_ms", "tpot"), ("itl_ms", "itl")):
        for stat in ("mean", "p50", "p90", "p99"):
            assert record[key][stat] == data[f"{stat}_{name}_ms"]
    assert record["e2e_latency_ms"]["p99"] == data["p99_e2el_ms"]


def bench_preset(tmp_path: Path) -> Path:
    preset = tmp_path / "one-shape.yaml"
    scenario = {"name": "decode", "shapes": [{"input_tokens": 8, "output_tokens": 4}],
                "concurrency": [1, 2], "num_requests": 2}  # fmt: skip
    preset.write_text(yaml.safe_dump({"scenarios": [scenario]}))
    return preset


@pytest.mark.parametrize("stop", ["failed requests", "ctrl-c"])
def test_a_bench_run_stopped_keeps_its_levels_and_names_the_missing(
    tmp_path, stand_in_server, monkeypatch, stop
):
    """vllm bench serve's second level: its requests fail (a dead server), or Ctrl-C."""
    from vllm_minimax.evals import bench, throughput

    calls: list[list[str]] = []

    def fake_bench(arguments, result_file, log_file, deadline_s):
        calls.append(arguments)
        if len(calls) == 1:
            return bench_result(5.0)
        if stop == "ctrl-c":
            raise KeyboardInterrupt
        return bench.check_bench_result(bench_result(0.0, 1, 1), result_file)

    async def fake_own_level(*args, **kwargs):  # the warm-up: the stand-in never answers
        return [], 0.1

    monkeypatch.setattr(bench, "run_bench_level", fake_bench)
    monkeypatch.setattr(throughput, "run_level", fake_own_level)
    preset = presets.load_throughput_preset(str(bench_preset(tmp_path)))
    out = tmp_path / "throughput.json"
    vocabulary = throughput.Vocabulary(100, frozenset())
    with pytest.raises(KeyboardInterrupt if stop == "ctrl-c" else EvalError) as raised:
        throughput.run_throughput(preset, stand_in_server.base_url, "m", out, vocabulary, repeat=2)
    written = json.loads(out.read_text())
    [scenario] = written["scenarios"]
    assert scenario["client"] == "vllm-bench" and not written["complete"]
    [level] = scenario["levels"]
    assert (level["concurrency"], level["round"], level["output_tokens_per_s"]) == (1, 0, 5.0)
    assert "--max-concurrency 1" in level["bench_command"]
    assert level["bench_command"].startswith("vllm bench serve ")
    missing = ["decode c=2 round 1", "decode c=1 round 2", "decode c=2 round 2"]
    assert written["missing_levels"] == missing
    if stop == "ctrl-c":
        assert written["interrupted"] == "throughput decode concurrency 2 round 1: interrupted"
    else:
        assert "1 of 2 requests failed in vllm bench serve" in written["error"]
        assert "Cannot connect to host" in str(raised.value)
        assert "not measured: decode c=2 round 1, decode c=1 round 2" in str(raised.value)
    report_text = report.throughput_markdown(written)
    assert f"Not measured: {', '.join(missing)}." in report_text


def test_missing_levels_count_a_concurrency_listed_twice():
    from vllm_minimax.evals.throughput import missing_levels

    scenario = {"name": "s", "concurrency": [1, 2, 1], "levels": [{"concurrency": 1, "round": 0}]}
    assert missing_levels({"repeat": 1, "scenarios": [scenario]}) == [
        "s c=2 round 1",
        "s c=1 round 1",
    ]


def test_every_level_sends_prompts_of_its_own(tmp_path, stand_in_server, monkeypatch):
    """Levels that share a server never share a seed, so prefix caching cannot serve one
    level's prompts from an earlier level; a second server of an A/B gets the same seeds."""
    from vllm_minimax.evals import bench, throughput

    seeds: list[int] = []

    def fake_bench(arguments, result_file, log_file, deadline_s):
        seeds.append(int(arguments[arguments.index("--seed") + 1]))
        return bench_result(5.0)

    async def fake_own_level(*args, **kwargs):  # the warm-up requests
        return [], 0.1

    monkeypatch.setattr(bench, "run_bench_level", fake_bench)
    monkeypatch.setattr(throughput, "run_level", fake_own_level)
    shape = {"input_tokens": 8, "output_tokens": 4}
    # decode-b lists concurrency 1 twice: two levels, each with prompts of its own.
    scenarios = [
        {"name": name, "shapes": [shape], "concurrency": levels, "num_requests": 2}
        for name, levels in (("decode-a", [1, 2]), ("decode-b", [1, 1]))
    ]
    (tmp_path / "two.yaml").write_text(yaml.safe_dump({"scenarios": scenarios}))
    preset = presets.load_throughput_preset(str(tmp_path / "two.yaml"))
    vocabulary = throughput.Vocabulary(100, frozenset())
    runs = []
    for server in ("a", "b"):
        out = tmp_path / server / "throughput.json"
        out.parent.mkdir()
        throughput.run_throughput(preset, stand_in_server.base_url, "m", out, vocabulary, repeat=2)
        runs.append(json.loads(out.read_text()))
    first, second = seeds[:8], seeds[8:]
    assert len(set(first)) == 8, "two levels of one server share a seed"
    assert first == second
    recorded = [level["prompt_seed"] for s in runs[0]["scenarios"] for level in s["levels"]]
    assert sorted(recorded) == sorted(first)
    for scenario in runs[0]["scenarios"]:
        for level in scenario["levels"]:
            assert f"--seed {level['prompt_seed']} " in level["bench_command"]


def test_level_seeds_give_vllm_bench_distinct_prompts():
    """vLLM's random dataset (its own sampler is the reference) starts each prompt at a
    drawn id, and the same seed draws the same first starts whatever --num-prompts: with one
    seed for the preset, each decode level re-sent all prompts of the smaller levels before
    it. With level seeds, the levels of evals/throughput/m3-rank.yaml share none beyond
    chance."""
    from types import SimpleNamespace

    import numpy
    from vllm.benchmarks.datasets.utils import get_sampling_params

    from vllm_minimax.evals import throughput

    vocab_size = 200064
    tokenizer = SimpleNamespace(num_special_tokens_to_add=lambda: 0, vocab_size=vocab_size)

    def starts(seed: int, scenario) -> set[int]:
        [shape] = scenario.shapes
        rng = numpy.random.default_rng(seed)
        *_, offsets = get_sampling_params(
            rng, scenario.num_requests, 0.0, shape.input_tokens, shape.output_tokens, tokenizer
        )
        return {(int(offset) + index) % vocab_size for index, offset in enumerate(offsets)}

    preset = presets.load_throughput_preset("m3-rank")
    one_shape = [scenario for scenario in preset.scenarios if len(scenario.shapes) == 1]
    decode_8k = [scenario for scenario in one_shape if scenario.name.startswith("decode-8k-")]
    assert [scenario.num_requests for scenario in decode_8k] == [4, 16, 32, 64]
    old = [starts(preset.seed, scenario) for scenario in decode_8k]
    assert all(smaller <= larger for smaller, larger in itertools.pairwise(old))
    new = [
        starts(throughput.level_seed(preset.seed, scenario.name, index, concurrency, 0), scenario)
        for scenario in one_shape
        for index, concurrency in enumerate(scenario.concurrency)
    ]
    shared = sum(len(a & b) for a, b in itertools.combinations(new, 2))
    assert shared <= 1
