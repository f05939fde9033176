"""Serving throughput of the tiny MiniMax M3, Triton indexer against FlashInfer.

    python evals/tiny_serve_throughput.py --model DIR --out DIR

For each backend: start the OpenAI server on the patched vLLM with an fp8 index
cache and `minimax_m3_indexer_backend` forced, run `vllm bench serve` (random
prompts, EOS ignored) at each shape in `SHAPES`, stop the server. Writes
vLLM's own result JSONs and `summary.md`.

A tiny model's numbers: four layers of hidden 256, so the indexer is a far
larger share of each step than in MiniMax M3 (60 layers of hidden 6144); read
them as "the FlashInfer path holds up in a serving loop", not as M3 speed-ups.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BACKENDS = ("triton", "flashinfer")
# (name, input tokens, output tokens, prompts, concurrency)
SHAPES = (
    ("8k-c16", 8192, 128, 64, 16),
    ("32k-c4", 32000, 128, 16, 4),
)
METRICS = (
    ("output_throughput", "out tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"no {url} within {timeout_s}s:\n{log.read_text()[-3000:]}")


def serve_and_bench(model: str, backend: str, out: Path) -> None:
    port = free_port()
    log = out / f"serve-{backend}.log"
    attention = {"indexer_kv_dtype": "fp8", "minimax_m3_indexer_backend": backend}
    server_cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        f"--model={model}",
        f"--port={port}",
        "--host=127.0.0.1",
        "--max-model-len=32768",
        "--max-num-seqs=64",
        "--gpu-memory-utilization=0.3",
        "--no-enable-prefix-caching",
        f"--attention-config={json.dumps(attention)}",
    ]
    with log.open("w") as handle:
        proc = subprocess.Popen(
            server_cmd, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        began = time.monotonic()
        wait_healthy(proc, f"http://127.0.0.1:{port}/health", log, timeout_s=420)
        print(f"{backend}: server up in {time.monotonic() - began:.0f}s", flush=True)
        for name, input_len, output_len, prompts, concurrency in SHAPES:
            bench_cmd = [
                sys.executable,
                "-m",
                "vllm.entrypoints.cli.main",
                "bench",
                "serve",
                f"--base-url=http://127.0.0.1:{port}",
                f"--model={model}",
                "--dataset-name=random",
                f"--random-input-len={input_len}",
                f"--random-output-len={output_len}",
                f"--num-prompts={prompts}",
                f"--max-concurrency={concurrency}",
                "--ignore-eos",
                "--seed=0",
                "--percentile-metrics=ttft,tpot,itl",
                "--metric-percentiles=50,99",
                "--save-result",
                f"--result-dir={out}",
                f"--result-filename={backend}-{name}.json",
            ]
            subprocess.run(bench_cmd, check=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def summary(out: Path) -> str:
    header = "| shape | backend | " + " | ".join(label for _, label in METRICS) + " |"
    lines = [header, "|" + "---|" * (len(METRICS) + 2)]
    for name, *_ in SHAPES:
        for backend in BACKENDS:
            path = out / f"{backend}-{name}.json"
            if not path.exists():
                continue
            result = json.loads(path.read_text())
            cells = [f"{result.get(key, float('nan')):.1f}" for key, _ in METRICS]
            lines.append(f"| {name} | {backend} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for backend in args.backends:
        serve_and_bench(args.model, backend, args.out)
    table = summary(args.out)
    (args.out / "summary.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
