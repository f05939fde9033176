"""`vllm-minimax eval` against servers whose replies are malformed or slow, and eval options
that are out of range: one line and an exit code, the reason recorded (issue 44 items 6, 7)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from http_stub import StubServer, VllmStubHandler, models_listing

from vllm_minimax.cli import main
from vllm_minimax.evals import accuracy

NESTED = "[" * 100_000 + "]" * 100_000


class ReplyingServer(StubServer):
    """vLLM's /health and /v1/models, and a /v1/completions that streams ``stream`` (lines
    after ``data: ``) or, with ``stall``, accepts the request and answers nothing."""

    def __init__(self, stream: list[str], models: str | None = None, stall: bool = False) -> None:
        class Handler(VllmStubHandler):
            listing = models or models_listing()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                if stall:
                    time.sleep(30)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for line in stream:
                    self.wfile.write(f"data: {line}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

        super().__init__(Handler)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_minimax.tiny_tokenizer import build_tokenizer

    directory = tmp_path_factory.mktemp("tok")
    build_tokenizer(directory)
    return directory


def throughput(server: ReplyingServer, tokenizer: Path, out: Path, *extra: str) -> int:
    argv = ["eval", "throughput", "--base-url", server.base_url, "--model", "m"]
    argv += ["--preset", "cpu-tiny", "--tokenizer", str(tokenizer), "--out", str(out), *extra]
    return main(argv)


GOOD = json.dumps({"choices": [{"text": "a"}]})


@pytest.mark.parametrize(
    ("stream", "reason"),
    [
        ([GOOD, "{not json"], "streamed a line that is not JSON"),
        ([GOOD, "[1, 2]"], "streamed list where a JSON object belongs"),
        ([GOOD, json.dumps({"choices": [], "usage": "many"})], "a usage that is str"),
        ([GOOD, json.dumps({"choices": [], "usage": {"completion_tokens": "x"}})], "is 'x'"),
        ([GOOD, NESTED], "streamed a line that is not JSON"),
    ],
    ids=["not-json", "not-an-object", "usage-not-an-object", "usage-not-a-count", "nested"],
)
def test_a_malformed_stream_fails_the_level_with_its_reason(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    tokenizer: Path,
    stream: list[str],
    reason: str,
) -> None:
    server = ReplyingServer(stream)
    try:
        code = throughput(server, tokenizer, tmp_path / "out")
    finally:
        server.close()
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert reason in err, err
    written = json.loads((tmp_path / "out" / "throughput.json").read_text())
    assert written["complete"] is False
    assert reason in written["error"], written


def test_a_request_timeout_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tokenizer: Path
) -> None:
    """--request-timeout 2 under the default 100 s --first-byte-timeout: the message names the
    timeout that ran out."""
    server = ReplyingServer([], stall=True)
    try:
        code = throughput(server, tokenizer, tmp_path / "out", "--request-timeout", "2")
    finally:
        server.close()
    err = capsys.readouterr().err
    assert code == 2
    assert "took over 2 s (--request-timeout)" in err, err
    assert "--first-byte-timeout" not in err, err


def test_a_deeply_nested_model_listing_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tokenizer: Path
) -> None:
    server = ReplyingServer([GOOD], models=NESTED)
    try:
        code = throughput(server, tokenizer, tmp_path / "out")
    finally:
        server.close()
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("kind", ["preset", "baseline"])
def test_a_deeply_nested_input_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    argv = ["eval", "accuracy", "--base-url", "http://127.0.0.1:9", "--model", "m"]
    argv += ["--out", str(tmp_path / "out")]
    if kind == "preset":
        (tmp_path / "p.yaml").write_text(NESTED)
        argv += ["--preset", str(tmp_path / "p.yaml")]
    else:
        (tmp_path / "b.json").write_text(NESTED)
        argv += ["--preset", "cpu-tiny", "--baseline", str(tmp_path / "b.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "nested too deeply" in err, err


@pytest.mark.parametrize("port", ["0", "65536", "-1", "http"])
def test_ab_port_out_of_range_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], port: str
) -> None:
    argv = ["eval", "ab", "--model", "m", "--out", str(tmp_path / "out"), "--port", port]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "is not a port number" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_lm_eval_timeout_is_not_shown_as_a_cancelled_task(tmp_path: Path) -> None:
    log = tmp_path / "lm_eval.log"
    log.write_text(
        "INFO starting\n"
        "Traceback (most recent call last):\n"
        "asyncio.exceptions.CancelledError\n"
        "The above exception was the direct cause of the following exception:\n"
        "TimeoutError\n"
    )
    line = accuracy.first_error_line(log)
    assert "CancelledError" not in line
    assert line.startswith("a request timed out (--request-timeout"), line


def test_stopping_a_server_that_ignores_sigterm_waits_one_grace(tmp_path: Path) -> None:
    """A server deaf to SIGTERM is killed after one grace, not after one for its leader and
    another for the rest of its process group."""
    import subprocess
    import sys

    from vllm_minimax.evals.server import VllmServer, process_group_alive

    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    server = VllmServer("m", tmp_path / "server.log", command=[sys.executable, "-c", deaf])
    server.process = subprocess.Popen([sys.executable, "-c", deaf], start_new_session=True)
    pgid = server.process.pid
    time.sleep(0.5)  # its SIGTERM handler is set
    started = time.monotonic()
    server.stop(grace=2.0)
    waited = time.monotonic() - started
    assert not process_group_alive(pgid)
    assert 2.0 <= waited < 3.5, waited
