"""`vllm-minimax eval` without a vLLM server: the baseline rule, presets, arms, bad input,
and the server lifecycle on stand-in processes (tests/cpu/test_eval_e2e.py runs the real
vLLM CPU server)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from patchset_helpers import REPO_ROOT, build_and_unpack_wheel

from vllm_minimax.cli import main
from vllm_minimax.evals import ab, accuracy, presets, report
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
def test_unknown_task_fails_with_lm_evals_message(tmp_path, capsys):
    preset = tmp_path / "unknown-task.yaml"
    source = yaml.safe_load((REPO_ROOT / "evals/accuracy/cpu-tiny.yaml").read_text())
    source["include_path"] = str(REPO_ROOT / "evals/tasks")
    source["tasks"] = [{"task": "no_such_task", "metrics": ["exact_match,none"]}]
    preset.write_text(yaml.safe_dump(source))
    out = tmp_path / "out"
    unreachable = f"http://127.0.0.1:{free_port()}"
    command = ["eval", "accuracy", "--model", "m", "--preset", str(preset)]
    assert main([*command, "--base-url", unreachable, "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert "lm-eval failed for task 'no_such_task'" in error
    assert "no_such_task" in error.split("last lines of", 1)[1]  # lm-eval's own words
    assert json.loads((out / "accuracy.json").read_text())["complete"] is False


def test_malformed_throughput_preset(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"scenarios": [{"name": "x", "shapes": [{}]}]}))
    with pytest.raises(EvalError, match="input_tokens: expected a positive integer"):
        presets.load_throughput_preset(str(path))


def test_presets_ship_inside_the_wheel(tmp_path):
    installed = build_and_unpack_wheel(tmp_path)
    shipped = installed / "vllm_minimax" / "_eval_configs"
    for relative in (
        "accuracy/gsm8k.yaml",
        "throughput/indexer.yaml",
        "tasks/tiny_arithmetic.jsonl",
        "cpu-server.yaml",
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
    assert "| 1 | 10.0 | 1.0 / 2.0 / 3.0 | 4.0 / 5.0 / 6.0 | 7.0 / 8.0 |" in text
    assert "**Stopped early:** stopped" in text


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


def test_server_start_timeout_stops_its_process_group(tmp_path, capsys):
    # The stand-in forks a child into its group, as vLLM forks its engine core.
    script = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    server = VllmServer("m", tmp_path / "server.log", command=[*STAND_IN, script])
    server.startup_timeout = 2.0
    started = time.monotonic()
    with pytest.raises(ServerError, match=r"did not answer .*/health within 2 s"):
        server.start()
    assert time.monotonic() - started < 60
    pgid = int(re.search(r"started pid (\d+)", capsys.readouterr().err).group(1))
    assert not process_group_alive(pgid)


def test_unreachable_server_keeps_partial_results(tmp_path, capsys):
    from vllm_minimax.tiny_model import build_tokenizer

    build_tokenizer(tmp_path / "tok")
    out = tmp_path / "out"
    unreachable = f"http://127.0.0.1:{free_port()}"
    command = ["eval", "throughput", "--model", "m", "--preset", "cpu-tiny"]
    command += ["--base-url", unreachable, "--tokenizer", str(tmp_path / "tok")]
    code = main([*command, "--out", str(out)])
    assert code == 2
    error = capsys.readouterr().err
    assert "is the server up?" in error and "throughput decode warm-up" in error
    written = json.loads((out / "throughput.json").read_text())
    assert written["complete"] is False and "error" in written


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
