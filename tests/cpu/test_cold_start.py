"""benchmarks/cold_start.py, issue 58's measurement, on the CPU: each arm's home (a carried
cache keeps its modification times, which ninja compares), the engine figures read from a real
H100 engine log, FlashInfer's builds split at ready, and one whole run against a stand-in server
that logs as vLLM does."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks import cold_start

REPO = Path(__file__).resolve().parents[2]
H100_COLD_LOG = REPO / "results/h100/sparse-attention/engine/cold-flashinfer-graphs.log"


def test_carried_home_is_the_empty_arms_with_its_times(tmp_path):
    empty = tmp_path / "home-tiny-empty" / ".cache" / "flashinfer"
    empty.mkdir(parents=True)
    program = empty / "program.so"
    program.write_bytes(b"so")
    os.utime(program, ns=(10**18, 10**18))
    (tmp_path / "home-tiny-empty" / "flashinfer-builds.jsonl").write_text("{}\n")
    env = cold_start.prepare_home(tmp_path, "tiny", "carried", None)
    copied = Path(env["HOME"]) / ".cache" / "flashinfer" / "program.so"
    assert copied.read_bytes() == b"so"
    assert copied.stat().st_mtime_ns == 10**18
    assert not (Path(env["HOME"]) / "flashinfer-builds.jsonl").exists()
    assert "FLASHINFER_WORKSPACE_BASE" not in env


def test_prebuilt_arm_reads_a_copy_of_the_prebuild(tmp_path):
    prebuilt = tmp_path / "prebuild"
    (prebuilt / ".cache").mkdir(parents=True)
    (prebuilt / ".cache" / "x.o").write_bytes(b"o")
    os.utime(prebuilt / ".cache" / "x.o", ns=(10**18, 10**18))
    env = cold_start.prepare_home(tmp_path, "rank", "prebuilt", prebuilt)
    base = Path(env["FLASHINFER_WORKSPACE_BASE"])
    assert base != prebuilt
    assert (base / ".cache" / "x.o").stat().st_mtime_ns == 10**18
    assert list(Path(env["HOME"]).iterdir()) == []  # everything else starts empty


def test_arms_that_need_an_earlier_one_say_so(tmp_path):
    with pytest.raises(SystemExit, match="run the empty arm first"):
        cold_start.prepare_home(tmp_path, "tiny", "carried", None)
    with pytest.raises(SystemExit, match="needs --prebuilt"):
        cold_start.prepare_home(tmp_path, "tiny", "prebuilt", None)


def test_engine_figures_of_the_h100_cold_start_log():
    found = cold_start.parse_log(H100_COLD_LOG.read_text())
    assert found["model_loading_s"] == pytest.approx(3.397923)
    assert found["indexer_warmup_s"] == 56.0
    assert found["indexer_artifacts_built"] == 51
    assert found["sparse_attention_warmup_s"] == 29.6
    assert found["moe_warmup_s"] == 23.5
    assert found["graph_capture_s"] == 1.0
    assert found["init_engine_s"] == 160.88
    assert found["cute_dsl_compile_lines"] == 21
    assert found["triton_after_ready"] == ["_topk_log_softmax_kernel"]
    assert found["prebuilt_check"] is None


def test_builds_split_at_ready(tmp_path):
    log = tmp_path / "builds.jsonl"
    entries = [
        {"toolchain": "nvcc", "name": "a", "seconds": 9.5, "time": 100.0},
        {"toolchain": "cute_dsl", "name": "b", "seconds": 2.0, "time": 101.0},
        {"toolchain": "nvcc", "name": "c", "seconds": 0.01, "time": 102.0},  # ninja no-op
        {"toolchain": "cute_dsl", "name": "d", "seconds": 1.5, "time": 300.0},
    ]
    log.write_text("".join(json.dumps(e) + "\n" for e in entries) + "not json\n")
    builds = cold_start.read_builds(log, ready_at=200.0)
    assert builds["before_ready"]["count"] == 2
    assert builds["before_ready"]["by_toolchain"]["nvcc"] == {"n": 1, "s": 9.5}
    assert builds["after_ready"]["count"] == 1
    assert builds["after_ready_names"] == ["d"]


FAKE_SERVER = textwrap.dedent(
    """
    import http.server, json, os, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    home = os.environ["HOME"]
    log = os.environ["FLASHINFER_JIT_BUILD_LOG"]
    with open(log, "a") as f:
        f.write(json.dumps({"toolchain": "nvcc", "name": "p", "seconds": 3.0,
                            "time": time.time()}) + "\\n")
    print("Model loading took 0.5 GiB memory and 2.000000 seconds")
    print("MiniMax M3: 12 prebuilt FlashInfer programs in /x (10 nvcc, 2 CuTe-DSL)")
    print("init engine (profile, create kv cache, warmup model) took 4.00 s")
    print("home", home, flush=True)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["model"] == "cold-start"
            self.send_response(200); self.end_headers()
            reply = {"choices": [{"text": body["prompt"][-2:]}]}
            self.wfile.write(json.dumps(reply).encode())
        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def test_one_run_against_a_server_that_logs_as_vllm(tmp_path):
    server = tmp_path / "fake_server.py"
    server.write_text(FAKE_SERVER)
    out = tmp_path / "runs" / "tiny-empty.json"
    out.parent.mkdir()
    config = tmp_path / "c.yaml"
    config.write_text("max-model-len: 1024\n")
    began = time.monotonic()
    rc = cold_start.main(
        [
            "run", "--name", "tiny", "--arm", "empty", "--model", "m", "--config", str(config),
            "--work", str(tmp_path / "work"), "--out", str(out), "--requests", "3",
            "--server-command", f"{sys.executable} {server}", "--timeout", "60",
        ]
    )  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    assert 0 < result["ready_s"] < time.monotonic() - began
    assert result["model_loading_s"] == 2.0
    assert result["init_engine_s"] == 4.0
    assert result["other_s"] == pytest.approx(result["ready_s"] - 6.0, abs=0.11)
    assert result["prebuilt_check"].startswith("12 prebuilt FlashInfer programs")
    assert result["flashinfer_builds"]["before_ready"]["count"] == 1
    assert result["flashinfer_builds"]["after_ready"]["count"] == 0
    log = out.with_suffix(".log").read_text()
    assert f"home {tmp_path / 'work' / 'home-tiny-empty'}" in log

    assert result["replies"] == ["lo", "lo", "lo", "0:", "1:", "2:"]

    prebuilt = dict(result, arm="prebuilt")
    differing = dict(result, arm="carried", replies=["other"])
    for row in (prebuilt, differing):
        (tmp_path / f"{row['arm']}.json").write_text(json.dumps(row))
    runs = [out, tmp_path / "prebuilt.json", tmp_path / "carried.json"]
    table = cold_start.report(runs, tmp_path / "report.md")
    assert "| tiny | empty |" in table
    assert "12 prebuilt FlashInfer programs" in table
    assert "tiny prebuilt: greedy replies the same as the empty arm's" in table
    assert "tiny carried: greedy replies DIFFER from the empty arm's" in table
