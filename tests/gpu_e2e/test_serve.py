"""`vllm serve` of the tiny MiniMax M3 through the OpenAI API (override at auto)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

START_TIMEOUT_S = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(tiny_model, e2e_dir):
    port = _free_port()
    log_path = e2e_dir / "serve.log"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        f"--model={tiny_model}",
        "--served-model-name=tiny-minimax-m3",
        f"--port={port}",
        "--host=127.0.0.1",
        "--max-model-len=32768",
        "--gpu-memory-utilization=0.2",
        "--attention-config",
        json.dumps({"indexer_kv_dtype": "fp8"}),
    ]
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"no /health in {START_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}")
            time.sleep(2)
        yield base, log_path
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_completion_on_a_long_prompt(server):
    base, log_path = server
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 500, (9000,), generator=g).tolist()
    reply = _post(
        f"{base}/v1/completions",
        {"model": "tiny-minimax-m3", "prompt": prompt, "max_tokens": 16, "temperature": 0},
    )
    assert reply["usage"]["prompt_tokens"] == 9000
    assert reply["usage"]["completion_tokens"] == 16
    assert reply["choices"][0]["text"]
    lines = [ln for ln in log_path.read_text().splitlines() if "MiniMax M3 indexer: selected" in ln]
    assert lines and "selected FlashInfer" in lines[0], lines


def test_chat_completion(server):
    base, _ = server
    reply = _post(
        f"{base}/v1/chat/completions",
        {
            "model": "tiny-minimax-m3",
            "messages": [{"role": "user", "content": "The capital of France is"}],
            "max_tokens": 12,
            "temperature": 0,
        },
    )
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] >= 1
