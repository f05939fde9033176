"""`vllm serve` of the tiny MiniMax M3 through the OpenAI API (override at auto)."""

from __future__ import annotations

import json
import sys
import urllib.request

import pytest
import torch

from vllm_minimax.evals.server import VllmServer

START_TIMEOUT_S = 420
SERVED_NAME = "tiny-minimax-m3"


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(tiny_model, e2e_dir):
    log_path = e2e_dir / "serve.log"
    with VllmServer(
        model=str(tiny_model),
        log_path=log_path,
        command=[sys.executable, "-m", "vllm.entrypoints.openai.api_server"],
        served_name=SERVED_NAME,
        extra_args=[
            "--max-model-len=32768",
            "--gpu-memory-utilization=0.2",
            "--attention-config",
            json.dumps({"indexer_kv_dtype": "fp8"}),
        ],
        startup_timeout=START_TIMEOUT_S,
    ) as running:
        yield running.base_url, log_path


def test_completion_on_a_long_prompt(server):
    base, log_path = server
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 500, (9000,), generator=g).tolist()
    reply = _post(
        f"{base}/v1/completions",
        {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0},
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
            "model": SERVED_NAME,
            "messages": [{"role": "user", "content": "The capital of France is"}],
            "max_tokens": 12,
            "temperature": 0,
        },
    )
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] >= 1
