"""A server's own figures in `eval ab` and `eval throughput`, without vLLM: the KV cache size
from its log, the requests it ran at once from /metrics, per-arm environments and a null that
removes a config key, on stand-in servers."""

from __future__ import annotations

import json
import shlex
import sys
import time

import pytest
import yaml
from http_stub import StubServer, VllmStubHandler

from vllm_minimax.evals import ab, presets, report, throughput
from vllm_minimax.evals.common import EvalError
from vllm_minimax.evals.server_figures import (
    RunningSampler,
    gauge_total,
    logged_kv_cache,
)

# vLLM 0.34.0's line (kv_cache_utils.update_kv_cache_capacity) as the H200 rank slice logged it.
KV_LINE = (
    "(EngineCore pid=1602) INFO 12-05 03:31:40 [kv_cache_utils.py:1168] GPU KV cache size:"
    " 2,236,416 tokens, Maximum concurrency for 132,096 tokens per request: 16.93x\n"
)


def test_the_kv_cache_line_gives_tokens_and_concurrency(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO starting\n" + KV_LINE + "INFO ready\n")
    found = logged_kv_cache(log)
    assert found is not None
    assert (found.tokens, found.max_model_len, found.max_concurrency, found.pool) == (
        2236416,
        132096,
        16.93,
        "GPU",
    )
    assert found.as_record()["kv_cache_tokens"] == 2236416
    log.write_text("INFO CPU KV cache size: 9,984 tokens, Maximum concurrency for 1,024 tokens"
                   " per request: 9.75x\n")  # fmt: skip
    assert logged_kv_cache(log).tokens == 9984
    # A log holding two starts (a server restarted into the same file): the last one counts.
    log.write_text(KV_LINE + "INFO restarting\n" + KV_LINE.replace("2,236,416", "1,023,744"))
    assert logged_kv_cache(log).tokens == 1023744
    log.write_text("INFO no cache yet\n")
    assert logged_kv_cache(log) is None
    assert logged_kv_cache(tmp_path / "missing.log") is None


METRICS_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_running_other{engine="0"} 100.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
"""


def test_a_gauge_is_summed_over_engines_and_not_confused_with_a_longer_name():
    assert gauge_total(METRICS_TEXT, "vllm:num_requests_running") == 5.0
    assert gauge_total(METRICS_TEXT, "vllm:num_requests_waiting") == 4.0
    assert gauge_total(METRICS_TEXT, "vllm:num_requests_swapped") is None
    assert gauge_total("vllm:num_requests_running 7\n", "vllm:num_requests_running") == 7.0


class MetricsServer(StubServer):
    """/health, /v1/models and a /metrics whose running gauge steps through ``running``
    (one value per request of /metrics, the last repeated), waiting as given."""

    def __init__(self, running: list[float], waiting: float = 0.0) -> None:
        self.running = list(running)
        outer = self

        class Handler(VllmStubHandler):
            def extra_get(self) -> bytes | None:
                if self.path != "/metrics":
                    return None
                value = outer.running.pop(0) if len(outer.running) > 1 else outer.running[0]
                return (
                    f'vllm:num_requests_running{{engine="0"}} {value}\n'
                    f'vllm:num_requests_waiting{{engine="0"}} {waiting}\n'
                ).encode()

        super().__init__(Handler)


def test_the_sampler_gives_max_and_median_over_the_busy_samples():
    server = MetricsServer([0, 0, 2, 4, 4, 6, 0], waiting=1.0)
    try:
        with RunningSampler(server.base_url, interval_s=0.02) as sampler:
            deadline = time.monotonic() + 10
            while len(sampler.samples) < 9 and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        server.close()
    summary = sampler.summary()
    # Waiting is 1 throughout, so every sample counts as busy: 0, 0, 2, 4, 4, 6, 0, 0, 0...
    assert summary["max"] == 6.0 and summary["waiting_max"] == 1.0
    busy_only = RunningSampler("http://127.0.0.1:1")
    busy_only.samples = [(0.0, 0.0), (2.0, 0.0), (4.0, 0.0), (4.0, 0.0), (0.0, 0.0)]
    assert busy_only.summary() == {
        "max": 4.0, "median": 4.0, "waiting_max": 0.0, "samples": 3, "interval_s": 0.5,
    }  # fmt: skip
    # Requests waiting while none runs (the engine busy with a prefill's first chunk, or
    # stalled) is a busy sample too: it counts, and so does what waited.
    waiting = RunningSampler("http://127.0.0.1:1")
    waiting.samples = [(0.0, 0.0), (0.0, 5.0), (2.0, 0.0), (4.0, 1.0), (0.0, 0.0)]
    assert waiting.summary() == {
        "max": 4.0, "median": 2.0, "waiting_max": 5.0, "samples": 3, "interval_s": 0.5,
    }  # fmt: skip
    # No /metrics: no samples, no summary, no failure.
    with RunningSampler("http://127.0.0.1:1", interval_s=0.01) as unreachable:
        time.sleep(0.05)
    assert unreachable.summary() is None


def test_each_level_records_the_requests_its_server_ran_at_once(tmp_path, monkeypatch):
    from vllm_minimax.evals import bench

    server = MetricsServer([7.0])

    def slow_bench(arguments, result_file, log_file, deadline_s):
        time.sleep(0.3)  # the level lasts long enough for the sampler to read /metrics
        return {
            "completed": 2, "failed": 0, "num_prompts": 2, "duration": 0.3,
            "total_input_tokens": 16, "total_output_tokens": 8, "request_throughput": 1.0,
            "output_throughput": 5.0, "total_token_throughput": 12.0, "errors": ["", ""],
            **{f"{kind}_{name}_ms": 1.0 for kind in ("mean", "p50", "p90", "p99")
               for name in ("ttft", "tpot", "itl", "e2el")},
        }  # fmt: skip

    async def no_warm_up(*args, **kwargs):
        return [], 0.1

    monkeypatch.setattr(bench, "run_bench_level", slow_bench)
    monkeypatch.setattr(throughput, "run_level", no_warm_up)
    scenario = {"name": "decode", "shapes": [{"input_tokens": 8, "output_tokens": 4}],
                "concurrency": [8], "num_requests": 2}  # fmt: skip
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"scenarios": [scenario]}))
    preset = presets.load_throughput_preset(str(tmp_path / "p.yaml"))
    out = tmp_path / "throughput.json"
    try:
        throughput.run_throughput(
            preset, server.base_url, "m", out, throughput.Vocabulary(100, frozenset())
        )
    finally:
        server.close()
    [level] = json.loads(out.read_text())["scenarios"][0]["levels"]
    assert level["running_requests"]["max"] == 7.0
    assert level["running_requests"]["median"] == 7.0
    text = report.throughput_markdown(json.loads(out.read_text()))
    assert "| ran at once max / median |" in text and "| 7 / 7 |" in text


def test_the_report_says_when_requests_waited():
    levels = [
        {"running_requests": {"max": 18.0, "median": 17.0, "waiting_max": 46.0}},
        {"running_requests": {"max": 17.0, "median": 16.0, "waiting_max": 47.0}},
    ]
    assert report.running_text(levels) == "18 (17..18) / 16 (16..17), 47 waited"
    assert report.running_text([{}]) == "-"


def test_a_null_removes_the_config_key_and_an_emptied_mapping():
    config = {
        "max-model-len": 1024,
        "kv-cache-dtype": "fp8",
        "attention-config": {"indexer_kv_dtype": "fp8", "other": 1},
    }
    merged = ab.merge_server_args(
        config, {"kv-cache-dtype": None, "attention-config": {"indexer_kv_dtype": None}}
    )
    assert merged == {"max-model-len": 1024, "attention-config": {"other": 1}}
    emptied = ab.merge_server_args(
        merged, {"attention-config": {"other": None}, "absent-key": None}
    )
    assert emptied == {"max-model-len": 1024}
    added = ab.merge_server_args({}, {"attention-config": {"a": 1, "b": None}})
    assert added == {"attention-config": {"a": 1}}
    assert config["attention-config"] == {"indexer_kv_dtype": "fp8", "other": 1}  # not mutated


def test_rounds_rotate_the_arms_so_each_takes_each_place():
    arms = [ab.Arm(name, {}) for name in "abc"]
    orders = [[arm.name for arm in ab.round_order(arms, r)] for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for arm in "abc":
        assert sorted(order.index(arm) for order in orders) == [0, 1, 2]
    two = [ab.Arm(name, {}) for name in "ab"]
    assert [[arm.name for arm in ab.round_order(two, r)] for r in range(3)] == [
        ["a", "b"],
        ["b", "a"],
        ["a", "b"],
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("b=X=1", "expected ARM:KEY=VALUE"),
        ("b:novalue", "expected ARM:KEY=VALUE"),
        ("c:K=V", "no arm named 'c' \\(arms: a, b\\)"),
    ],
)
def test_a_bad_arm_env_is_refused(text, message):
    with pytest.raises(EvalError, match=message):
        ab.parse_arm_env([text], [ab.Arm("a", {}), ab.Arm("b", {})])


# A stand-in `vllm serve`: logs its KV cache line (the tokens from $STAND_IN_KV), the config it
# was given, then answers /health and /v1/models until stopped.
STAND_IN_SERVER = """
import http.server, json, os, sys
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
config = open(argv[argv.index("--config") + 1]).read()
tokens = int(os.environ["STAND_IN_KV"])
print(f"INFO GPU KV cache size: {tokens:,} tokens, Maximum concurrency for 1,024 tokens per"
      f" request: {tokens / 1024:.2f}x", flush=True)
print("CONFIG " + json.dumps(config), flush=True)
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "m", "max_model_len": 1024}]}).encode()
        self.send_response(200); self.end_headers()
        self.wfile.write(body if self.path == "/v1/models" else b"")
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_each_arm_gets_its_environment_and_its_kv_cache_is_recorded(tmp_path):
    """Two arms on stand-in servers: the launch's environment for both, the stock arm's own
    over it; each round's KV cache tokens from its log; the stock arm's null removed the key
    from the config its server got."""
    config = tmp_path / "serve.yaml"
    config.write_text("max-model-len: 1024\nattention-config:\n  indexer_kv_dtype: fp8\n")
    arms = ab.parse_arm_env(
        ["stock:STAND_IN_KV=5000"],
        [
            ab.parse_arm('patched={"attention-config": {"x": 1}}'),
            ab.parse_arm('stock={"attention-config": {"indexer_kv_dtype": null}}'),
        ],
    )
    launch = ab.ServerLaunch(
        model="m",
        command=f"{shlex.quote(sys.executable)} -c {shlex.quote(STAND_IN_SERVER)}",
        env={"STAND_IN_KV": "9000"},
        startup_timeout=60,
    )
    out = tmp_path / "out"
    result = ab.run_ab(arms, launch, config, [], None, out, repeat=2)
    by_name = {record["name"]: record for record in result["arms"]}
    assert [entry["kv_cache_tokens"] for entry in by_name["patched"]["rounds"]] == [9000, 9000]
    assert [entry["kv_cache_tokens"] for entry in by_name["stock"]["rounds"]] == [5000, 5000]
    assert by_name["stock"]["server_env"] == {"STAND_IN_KV": "5000"}
    assert "server_env" not in by_name["patched"]
    assert result["round_order"] == [["patched", "stock"], ["stock", "patched"]]
    for name, attention in (("patched", {"indexer_kv_dtype": "fp8", "x": 1}), ("stock", None)):
        log = (out / name / "round-1" / "server.log").read_text()
        [line] = [line for line in log.splitlines() if line.startswith("CONFIG ")]
        given = yaml.safe_load(json.loads(line.removeprefix("CONFIG ")))
        assert given.get("attention-config") == attention
    text = (out / "report.md").read_text()
    assert '| `stock` | `{"attention-config": {"indexer_kv_dtype": null}}`, environment' in text
    assert "`STAND_IN_KV=5000` |" in text and "| 5,000, 5,000 |" in text


def test_arm_env_reaches_the_cli(tmp_path, capsys, monkeypatch):
    """`eval ab --arm-env` names an arm: a bad one is refused before any server starts."""
    from vllm_minimax.cli import main

    argv = ["eval", "ab", "--model", "m", "--no-accuracy", "--throughput-preset", "none"]
    argv += ["--arm", "a={}", "--arm", "b={}", "--arm-env", "c:K=V"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert "--arm-env 'c:K=V': no arm named 'c'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_ab_report_shows_kv_tokens_and_requests_at_once(tmp_path):
    level = {
        "concurrency": 64, "round": 0, "output_tokens_per_s": 100.0,
        "ttft_ms": {"p50": 1.0}, "tpot_ms": {"p50": 2.0}, "itl_ms": {"p50": 2.0},
        "running_requests": {"max": 18.0, "median": 17.0, "waiting_max": 46.0},
    }  # fmt: skip
    plan = [{"name": "decode-32k-c64", "shapes": [{"input_tokens": 8, "output_tokens": 4}],
             "concurrency": [64]}]  # fmt: skip

    def arm(name: str, tokens: int) -> dict:
        scenario = {**plan[0], "levels": [level]}
        return {"name": name, "server_args": "{}", "throughput": {"scenarios": [scenario]},
                "rounds": [{"round": 0, "kv_cache_tokens": tokens}]}  # fmt: skip

    record = {"model": "m", "config": None, "repeat": 1, "throughput_plan": plan,
              "arms": [arm("bf16", 610112), arm("fp8", 1023744)], "complete": True}  # fmt: skip
    text = report.ab_markdown(record, [])
    assert "| `bf16` | `{}` | - | 610,112 |" in text
    assert "| `fp8` | `{}` | - | 1,023,744 |" in text
    assert "bf16 ran at once max / median |" in text
    assert "| 18 / 17, 46 waited |" in text


def test_the_running_column_lines_up_with_the_header():
    results = {"preset": "p", "base_url": "u", "model": "m", "scenarios": [{
        "name": "s", "shapes": [{"input_tokens": 1, "output_tokens": 1}], "num_requests": 1,
        "levels": [{"concurrency": 1, "output_tokens_per_s": 1.0, "ttft_ms": {"p50": 1.0},
                    "tpot_ms": {"p50": 1.0}, "itl_ms": {"p50": 1.0}}]}]}  # fmt: skip
    lines = report.throughput_markdown(results).splitlines()
    header = next(line for line in lines if line.startswith("| concurrency |"))
    row = next(line for line in lines if line.startswith("| 1 |"))
    assert header.count("|") == row.count("|")
    assert row.endswith("| - |")
