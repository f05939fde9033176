"""`vllm-minimax eval accuracy` scores what the server answered.

A fixture server (an OpenAI completions endpoint, standard library only) answers
the `tiny_arithmetic` questions of `evals/tasks` from the task's own JSONL: right
where the answer is even, wrong elsewhere. So the expected `exact_match` is known
before the run (the even answers' share), and the server counts the prompts it
answered, which must be the task's samples, each once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from patchset_helpers import REPO_ROOT

TASK_FILE = REPO_ROOT / "evals" / "tasks" / "tiny_arithmetic.jsonl"
PROMPT = "Question: {question}\nAnswer:"
WRONG_ANSWER = "not a number"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def task_answers() -> dict[str, str]:
    rows = [json.loads(line) for line in TASK_FILE.read_text().splitlines() if line.strip()]
    return {PROMPT.format(question=row["question"]): row["answer"] for row in rows}


def answered_right(answer: str) -> bool:
    return int(answer) % 2 == 0


class KnownAnswers(ThreadingHTTPServer):
    """Serves `/v1/completions`; `prompts` counts each prompt it was sent."""

    def __init__(self, answers: dict[str, str]) -> None:
        super().__init__(("127.0.0.1", 0), CompletionsHandler)
        self.answers = answers
        self.prompts: Counter[str] = Counter()
        self.lock = threading.Lock()

    def reply(self, prompt: str) -> str:
        with self.lock:
            self.prompts[prompt] += 1
        answer = self.answers.get(prompt)
        # No leading space: the task's exact_match scores " 27" against "27" as wrong.
        return answer if answer is not None and answered_right(answer) else WRONG_ANSWER


class CompletionsHandler(BaseHTTPRequestHandler):
    server: KnownAnswers

    def do_GET(self) -> None:
        # What the client checks before lm-eval starts: health, and that the model is served.
        if self.path == "/health":
            self.send_json({})
        elif self.path == "/v1/models":
            model = {"id": "fixture-model", "object": "model", "max_model_len": 4096}
            self.send_json({"object": "list", "data": [model]})
        else:
            self.send_error(404)

    def send_json(self, payload: dict) -> None:
        data = json.dumps(payload)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self.send_error(404)
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        choices = [
            {"index": i, "text": self.server.reply(p), "finish_reason": "stop", "logprobs": None}
            for i, p in enumerate(prompts)
        ]
        self.send_json({"id": "fixture", "object": "text_completion", "choices": choices})

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def known_answers() -> Iterator[KnownAnswers]:
    server = KnownAnswers(task_answers())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_accuracy_scores_the_known_answers(known_answers: KnownAnswers, tmp_path: Path):
    answers = known_answers.answers
    expected = sum(answered_right(a) for a in answers.values()) / len(answers)
    assert 0 < expected < 1  # some right, some wrong: neither 0 nor 1 can pass by accident
    base_url = f"http://127.0.0.1:{known_answers.server_address[1]}"
    command = [sys.executable, "-m", "vllm_minimax", "eval", "accuracy", "--base-url", base_url]
    command += ["--model", "fixture-model", "--preset", "cpu-tiny", "--out", str(tmp_path)]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **OFFLINE, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [score] = json.loads((tmp_path / "accuracy.json").read_text())["scores"]
    assert (score["task"], score["metric"], score["samples"]) == (
        "tiny_arithmetic",
        "exact_match,none",
        len(answers),
    )
    assert score["value"] == pytest.approx(expected, abs=1e-9)
    assert known_answers.prompts == Counter(answers.keys()), "every question asked exactly once"
