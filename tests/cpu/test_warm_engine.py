"""`vllm-minimax warmup --engine` against a stand-in server: it starts `vllm serve` with the
config and vLLM's dummy weights in the caller's environment, waits for ready, sends a long
prompt and a logprobs request, stops it, and reports each compile cache's files; a server
that fails exits 1; bad input exits 2 and starts nothing."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_minimax.cli import main

STAND_IN = textwrap.dedent(
    """
    import http.server, json, os, sys
    record = os.environ["STAND_IN_RECORD"]
    with open(record, "a") as f:
        f.write(json.dumps({"argv": sys.argv[1:]}) + "\\n")
    if os.environ.get("STAND_IN_FAIL"):
        print("RuntimeError: the engine failed to start", flush=True)
        sys.exit(1)
    port = int(sys.argv[sys.argv.index("--port") + 1])
    kernel = os.path.join(os.environ["HOME"], ".humming", "cache", "k1")
    os.makedirs(kernel)
    open(os.path.join(kernel, "kernel.cubin"), "w").write("cubin")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(record, "a") as f:
                f.write(json.dumps({"body": body}) + "\\n")
            self.send_response(200); self.end_headers()
            self.wfile.write(json.dumps({"choices": [{"text": "x"}]}).encode())
        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    server = tmp_path / "stand_in.py"
    server.write_text(STAND_IN)
    record = tmp_path / "record.jsonl"
    home = tmp_path / "home"
    home.mkdir()
    for name in ("HUMMING_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_HOME", "VLLM_CACHE_ROOT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    monkeypatch.setenv("STAND_IN_RECORD", str(record))
    config = tmp_path / "serve.yaml"
    config.write_text("max-model-len: 1024\n")
    argv = [
        "warmup", "--engine", "--config", str(config), "--model", "m",
        "--server-command", f"{sys.executable} {server}", "--timeout", "60",
        "--log", str(tmp_path / "server.log"),
    ]  # fmt: skip
    return argv, record, home, config


def _records(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_engine_warmup_starts_the_configured_server_and_reports_the_caches(stand_in, capsys):
    argv, record, home, config = stand_in
    assert main(argv) == 0
    out = capsys.readouterr().out
    records = _records(record)
    started = records[0]["argv"]
    assert started[started.index("--config") + 1] == str(config)
    assert started[started.index("--load-format") + 1] == "dummy"
    bodies = [entry["body"] for entry in records[1:]]
    assert len(bodies) == 3
    assert max(len(body["prompt"].split()) for body in bodies) >= 6000
    assert any(body.get("logprobs") and body.get("prompt_logprobs") for body in bodies)
    assert f"  humming: {home / '.humming' / 'cache'}: 0 -> 1 files (1 written" in out
    assert f"  triton: {home / '.triton' / 'cache'}: 0 -> 0 files (0 written" in out


def test_engine_warmup_passes_load_format_and_serve_args(stand_in, capsys):
    argv, record, _, _ = stand_in
    rc = main([*argv, "--load-format", "auto", "--serve-arg=--enforce-eager"])
    assert rc == 0
    started = _records(record)[0]["argv"]
    assert started[started.index("--load-format") + 1] == "auto"
    assert "--enforce-eager" in started


def test_engine_that_fails_exits_1_with_its_log(stand_in, capsys, monkeypatch):
    argv, _, _, _ = stand_in
    monkeypatch.setenv("STAND_IN_FAIL", "1")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "the engine failed" in err
    assert "the engine failed to start" in err  # the log's tail


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--prebuild"], "--prebuild and its options build without one"),
        (["--gpu", "h100"], "--prebuild and its options build without one"),
    ],
)
def test_engine_with_prebuild_options_exits_2(stand_in, capsys, extra, words):
    argv, record, _, _ = stand_in
    assert main([*argv, *extra]) == 2
    assert words in capsys.readouterr().err
    assert not record.exists()


def test_engine_with_a_missing_config_exits_2(stand_in, capsys, tmp_path):
    argv, record, _, config = stand_in
    config.unlink()
    assert main(argv) == 2
    assert f"serving config {config} does not exist" in capsys.readouterr().err
    assert not record.exists()
