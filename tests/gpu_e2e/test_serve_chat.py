"""`vllm serve` of the tiny MiniMax M3 with the single-node config's chat and
speculative settings.

`vllm_minimax/testing/serve_chat.py` scales the file `vllm-minimax config path h200-8x`
names to one GPU and the tiny model (same parsers, auto tool choice, fp8 index cache,
indexer on `auto`, and the speculative block as written: EAGLE3, K = 3, the draft's
attention on FLASH_ATTN), with the draft's `model` pointed at a random-weight EAGLE3 draft
made here (`vllm_minimax.tiny_eagle3`, the layout `LlamaForCausalLMEagle3` loads), and
gives the server a tokenizer with MiniMax M3's reasoning markers; the scaled file is
passed with `--config`, as a user would.

The server is vLLM's own (`python -m vllm.entrypoints.openai.api_server`, what
`vllm serve` runs). Checked: the indexer on FlashInfer, the engine's speculative config
(eagle3 with the file's K), the draft's layers on the backend the file names, the
spec-decode counters after a request (written to `speculative.json` in the run's
directory with the draft's acceptance), and, after completions asking for logprobs, nothing of
the series (FlashInfer programs, MiniMax M3's Triton kernels, vLLM's logprobs kernel where
patch 0009 warms it) compiled after the server was ready.

The random model calls no tool: the test checks that the request with `tools` is
accepted and parsed into a well-formed choice, not what it says; the random draft's
acceptance is recorded, not judged.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from vllm_minimax.evals.server import VllmServer
from vllm_minimax.testing import speculative_run
from vllm_minimax.testing.serve_chat import (
    DRAFT_SUBDIRECTORY,
    WEATHER_TOOL,
    tokenizer_with_reasoning_markers,
    write_scaled_config,
)
from vllm_minimax.tiny_eagle3 import make_tiny_eagle3_draft

START_TIMEOUT_S = 540
SERVED_NAME = "tiny-minimax-m3-chat"
SHIPPED_CONFIG = "h200-8x"


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read().decode()


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.status, json.loads(response.read())


def shipped_config_path() -> Path:
    """The file `vllm-minimax config path h200-8x` prints (what a user passes on)."""
    printed = subprocess.run(
        [sys.executable, "-m", "vllm_minimax", "config", "path", SHIPPED_CONFIG],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return Path(printed)


@pytest.fixture(scope="module")
def server(tiny_model, e2e_dir):
    tokenizer_dir = e2e_dir / "tiny-chat-tokenizer"
    shutil.rmtree(tokenizer_dir, ignore_errors=True)
    tokenizer_with_reasoning_markers(tiny_model, tokenizer_dir)
    draft = e2e_dir / DRAFT_SUBDIRECTORY
    shutil.rmtree(draft, ignore_errors=True)
    make_tiny_eagle3_draft(tiny_model, draft)
    source = shipped_config_path()
    config_path = write_scaled_config(draft, e2e_dir / "serve-chat.yaml", source)
    log_path = e2e_dir / "serve-chat.log"
    with VllmServer(
        model=str(tiny_model),
        log_path=log_path,
        command=[sys.executable, "-m", "vllm.entrypoints.openai.api_server"],
        config=config_path,
        served_name=SERVED_NAME,
        extra_args=["--tokenizer", str(tokenizer_dir)],
        env={"VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
        startup_timeout=START_TIMEOUT_S,
    ) as running:
        ready_offset = len(log_path.read_text(errors="replace"))
        yield {
            "base": running.base_url,
            "log_path": log_path,
            "ready_offset": ready_offset,
            "source": source,
            "scaled": yaml.safe_load(config_path.read_text()),
        }


def test_the_speculative_block_is_the_shipped_one(server):
    """The scaled file's block is the shipped file's, key for key, but the draft's path."""
    shipped = yaml.safe_load(server["source"].read_text())["speculative-config"]
    scaled = server["scaled"]["speculative-config"]
    assert shipped["method"] == "eagle3"
    assert {k: v for k, v in scaled.items() if k != "model"} == {
        k: v for k, v in shipped.items() if k != "model"
    }


def test_server_selected_flashinfer_with_the_draft_and_the_parsers(server):
    log = server["log_path"].read_text(errors="replace")
    selections = [ln for ln in log.splitlines() if "MiniMax M3 indexer: selected" in ln]
    assert selections, "no indexer selection logged"
    assert all("selected FlashInfer" in ln for ln in selections), selections
    spec = server["scaled"]["speculative-config"]
    engine = [ln for ln in log.splitlines() if "Initializing a V1 LLM engine" in ln]
    assert engine and "speculative_config=SpeculativeConfig(method='eagle3'" in engine[0], engine
    assert f"num_spec_tokens={spec['num_speculative_tokens']}" in engine[0], engine
    # The draft's layers on the backend the file names (the target's dense layers are
    # picked by vLLM: the file chooses no backend for them).
    configured = speculative_run.configured_backends(log)
    assert spec["attention_backend"] in configured, (configured, spec)
    arguments = next(ln for ln in log.splitlines() if "non-default args" in ln)
    for expected in (
        "'reasoning_parser': 'minimax_m3'",
        "'tool_call_parser': 'minimax_m3'",
        "'enable_auto_tool_choice': True",
        "'block_size': 128",
    ):
        assert expected in arguments, f"{expected} not in {arguments}"


def test_chat_request_with_tools_is_accepted_and_parsed(server):
    base = server["base"]
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
    counters = speculative_run.spec_decode_counters(_get(f"{base}/metrics"))
    spec = server["scaled"]["speculative-config"]
    record = {
        "config": str(server["source"]),
        "speculative_config": spec,
        "counters": counters,
        "configured_backends": speculative_run.configured_backends(
            server["log_path"].read_text(errors="replace")
        ),
    }
    out = server["log_path"].parent / "speculative.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["counters"]))
    assert counters["drafts"] > 0, "the EAGLE3 draft proposed nothing for the request"
    k = spec["num_speculative_tokens"]
    assert counters["drafts"] <= counters["draft_tokens"] <= counters["drafts"] * k
    assert 0 <= counters["accepted_tokens"] <= counters["draft_tokens"]
    assert len(counters["per_position"]) == spec["num_speculative_tokens"]


# 1 + each is the count of token ids vLLM's logprobs kernel scores a row (sampled and
# prompt): one number of each of its launch classes up to the default max_logprobs (20) that
# stock vLLM's warm-ups miss (patch 0009 warms them).
LOGPROBS = (0, 2, 8, 15, 20)


def test_logprobs_requests_are_answered(server):
    """Completions asking for sampled and, through ``echo``, prompt logprobs, one request per
    number, through the speculative verification; the next test reads what they compiled."""
    base = server["base"]
    for number in LOGPROBS:
        status, reply = _post(
            f"{base}/v1/completions",
            {
                "model": SERVED_NAME,
                "prompt": "The weather in Paris is",
                "max_tokens": 4,
                "temperature": 0,
                "logprobs": number,
                "echo": True,
            },
        )
        assert status == 200, reply
        logprobs = reply["choices"][0]["logprobs"]
        generated = reply["usage"]["completion_tokens"]
        assert len(logprobs["token_logprobs"]) > generated >= 1, (number, logprobs)


def test_nothing_of_the_series_compiled_after_ready(server):
    """Runs after the requests: the log past the ready offset holds no FlashInfer build and
    no JIT monitor event of the series' Triton kernels (MiniMax M3's, and vLLM's logprobs
    kernel where patch 0009 warms it; others are reported)."""
    import vllm

    log = server["log_path"].read_text(errors="replace")[server["ready_offset"] :]
    kernels = speculative_run.series_triton_kernels(Path(vllm.__file__).parents[1])
    assert kernels, "no MiniMax M3 Triton kernels found in the vLLM tree"
    compiled = speculative_run.compiled_after_ready(log, kernels)
    print(f"compiled after ready: {json.dumps(compiled)}")
    out = server["log_path"].parent / "speculative-compiled-after-ready.json"
    out.write_text(json.dumps(compiled, indent=2) + "\n")
    assert compiled["flashinfer"] == [], compiled
    assert compiled["series"] == [], compiled
