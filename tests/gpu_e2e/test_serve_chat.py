"""`vllm serve` of the tiny MiniMax M3 with the single-node config's chat settings.

`vllm_minimax/testing/serve_chat.py` scales `configs/serve/h200-8x.yaml` to one GPU and the tiny
model (same parsers, auto tool choice, MTP K = 2, fp8 index cache, indexer on
`auto`) and gives the server a tokenizer with MiniMax M3's reasoning markers; the
scaled file is passed with `--config`, as a user would.

The server is vLLM's own (`python -m vllm.entrypoints.openai.api_server`, what
`vllm serve` runs). The tiny text-only target would own the MTP draft's layer
names, so the draft needs its prefix (`vllm_minimax/testing/mtp_draft.py`): the
fixture declares `mtp_draft.install` as a `vllm.general_plugins` entry point on
the server's `PYTHONPATH`, which vLLM loads in the API server, the engine core and
the worker. The engine core is started with `spawn` (`VLLM_WORKER_MULTIPROC_METHOD`),
so the draft's prefix can only have come through that plugin, not from anything
the API server process set up.

The random model calls no tool: the test checks that the request with `tools` is
accepted and parsed into a well-formed choice, not what it says.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.request

import pytest

from vllm_minimax.evals.server import VllmServer
from vllm_minimax.testing import mtp_draft
from vllm_minimax.testing.serve_chat import (
    WEATHER_TOOL,
    tokenizer_with_reasoning_markers,
    write_scaled_config,
)
from vllm_minimax.tiny_model import MTP_SUBDIRECTORY

START_TIMEOUT_S = 540
SERVED_NAME = "tiny-minimax-m3-chat"


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read().decode()


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.status, json.loads(response.read())


def counter_total(metrics: str, name: str) -> float:
    """The sum of a Prometheus counter's samples (`NAME_total{...} VALUE` lines)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith((f"{name}_total{{", f"{name}_total "))
    ]
    assert values, f"no {name} samples in /metrics"
    return sum(values)


@pytest.fixture(scope="module")
def server(tiny_model, e2e_dir):
    draft = tiny_model / MTP_SUBDIRECTORY / "config.json"
    assert draft.exists(), f"no MTP draft at {draft.parent} (make-tiny-model --mtp-modules 1)"
    tokenizer_dir = e2e_dir / "tiny-chat-tokenizer"
    shutil.rmtree(tokenizer_dir, ignore_errors=True)
    tokenizer_with_reasoning_markers(tiny_model, tokenizer_dir)
    config_path = write_scaled_config(tiny_model, e2e_dir / "serve-chat.yaml")
    plugin_dir = e2e_dir / "serve-chat-plugin"
    shutil.rmtree(plugin_dir, ignore_errors=True)
    mtp_draft.write_plugin_distribution(plugin_dir)
    python_path = os.pathsep.join([str(plugin_dir), *filter(None, [os.environ.get("PYTHONPATH")])])
    log_path = e2e_dir / "serve-chat.log"
    with VllmServer(
        model=str(tiny_model),
        log_path=log_path,
        command=[sys.executable, "-m", "vllm.entrypoints.openai.api_server"],
        config=config_path,
        served_name=SERVED_NAME,
        extra_args=["--tokenizer", str(tokenizer_dir)],
        env={"PYTHONPATH": python_path, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
        startup_timeout=START_TIMEOUT_S,
    ) as running:
        yield running.base_url, log_path


def test_server_selected_flashinfer_with_mtp_and_the_parsers(server):
    _, log_path = server
    log = log_path.read_text(errors="replace")
    selections = [ln for ln in log.splitlines() if "MiniMax M3 indexer: selected" in ln]
    assert selections, "no indexer selection logged"
    assert all("selected FlashInfer" in ln for ln in selections), selections
    engine = [ln for ln in log.splitlines() if "Initializing a V1 LLM engine" in ln]
    assert engine and "speculative_config=SpeculativeConfig(method='mtp'" in engine[0], engine
    assert "num_spec_tokens=2" in engine[0], engine
    arguments = next(ln for ln in log.splitlines() if "non-default args" in ln)
    for expected in (
        "'reasoning_parser': 'minimax_m3'",
        "'tool_call_parser': 'minimax_m3'",
        "'enable_auto_tool_choice': True",
        "'block_size': 128",
    ):
        assert expected in arguments, f"{expected} not in {arguments}"


def test_chat_request_with_tools_is_accepted_and_parsed(server):
    base, _ = server
    status, reply = _post(
        f"{base}/v1/chat/completions",
        {
            "model": SERVED_NAME,
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER_TOOL],
            "tool_choice": "auto",
            "max_tokens": 24,
            "temperature": 0,
        },
    )
    assert status == 200
    assert reply["object"] == "chat.completion"
    assert len(reply["choices"]) == 1
    choice = reply["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls"), choice
    message = choice["message"]
    assert message["role"] == "assistant"
    # The parsers' fields: tool calls (none expected from a random model, but a
    # list), reasoning (none: the model emits no markers) and the content.
    assert isinstance(message.get("tool_calls", []), list), message
    assert message.get("reasoning") is None or isinstance(message["reasoning"], str), message
    assert message["content"] is None or isinstance(message["content"], str), message
    assert reply["usage"]["completion_tokens"] >= 1
    # This module's only generation: the draft proposed tokens for it.
    drafts = counter_total(_get(f"{base}/metrics"), "vllm:spec_decode_num_drafts")
    assert drafts > 0, "the MTP draft proposed nothing for the request"
