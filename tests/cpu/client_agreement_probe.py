"""Measure one request shape on one server with both throughput clients, alternated; print
the level records as JSON.

    python tests/cpu/client_agreement_probe.py BASE_URL MODEL OUT_DIR \\
        --input-tokens N --output-tokens M --num-requests K --concurrency 1 4 --rounds 3 \\
        [--wait-for FILE]

Run in a subprocess by test_eval_e2e.py (vLLM's benchmark client is imported once, here).
Per round and concurrency, this project's client (``eval throughput --client own``) and
vLLM's ``vllm bench serve`` each run the level, the one first in even rounds, the other in
odd ones, so a drift of the shared machine weighs on both. Around every level the server's
own ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total`` (Prometheus
``/metrics``) are read, so the test sees what reached the server, not what a client counted.
For bench's levels the probe also recomputes the level record from bench's per-request
detail (``--save-detailed``) with this project's :func:`level_metrics`, so definitions are
compared without timing noise.

With ``--wait-for``, the probe imports that client and builds its prompts first, then waits
until FILE exists before it sends anything (scripts/test makes it when the other lanes are
done), so the imports overlap their end and only the levels need the CPU alone; the
seconds it waited are ``waited_s`` in its JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from vllm_minimax.evals import bench
from vllm_minimax.evals.presets import RequestShape, ThroughputScenario
from vllm_minimax.evals.throughput import (
    RequestTimeouts,
    RequestTiming,
    Vocabulary,
    level_metrics,
    run_level,
    scenario_prompts,
    warmup_prompts,
)

SEED = 0


def server_counters(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    totals = {"prompt_tokens": 0.0, "generation_tokens": 0.0}
    for line in lines:
        for name in totals:
            if line.startswith(f"vllm:{name}_total{{"):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def bench_per_request_metrics(data: dict[str, Any]) -> dict[str, Any]:
    """bench's per-request timings through this project's definitions."""
    timings = [
        RequestTiming(inputs, outputs, ttft, latency, list(itl))
        for inputs, outputs, ttft, latency, itl in zip(
            data["input_lens"],
            data["output_lens"],
            data["ttfts"],
            data["latencies"],
            data["itls"],
            strict=True,
        )
    ]
    return level_metrics(timings, data["duration"])


def wait_for(path: Path, limit_s: float = 3600) -> float:
    """Seconds until ``path`` exists; fail after ``limit_s``."""
    start = time.monotonic()
    while not path.exists():
        if time.monotonic() > start + limit_s:
            raise SystemExit(f"{path} did not appear in {limit_s:.0f} s")
        time.sleep(1)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("base_url")
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--input-tokens", type=int, required=True)
    parser.add_argument("--output-tokens", type=int, required=True)
    parser.add_argument("--num-requests", type=int, required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--wait-for", type=Path, help="send nothing before this file exists")
    args = parser.parse_args()

    shape = RequestShape(args.input_tokens, args.output_tokens)
    scenario = ThroughputScenario("agree", [shape], list(args.concurrency), args.num_requests)
    vocabulary = Vocabulary.from_tokenizer(args.model)
    timeouts = RequestTimeouts()
    prompts = scenario_prompts(scenario, vocabulary, SEED)

    def own(concurrency: int) -> dict[str, Any]:
        timings, duration = asyncio.run(
            run_level(args.base_url, args.model, prompts, concurrency, "own", timeouts)
        )
        return level_metrics(timings, duration)

    def vllm_bench(concurrency: int, round_number: int) -> dict[str, Any]:
        result_file = args.out / f"bench-c{concurrency}-round{round_number + 1}.json"
        arguments = bench.bench_arguments(
            args.base_url, args.model, args.model, shape.input_tokens, shape.output_tokens,
            concurrency, args.num_requests, SEED, result_file,
        )  # fmt: skip
        data = bench.run_bench_level(arguments, result_file, result_file.with_suffix(".log"), 600)
        return {**bench.level_from_bench(data), "recomputed": bench_per_request_metrics(data)}

    warmup = warmup_prompts(scenario, vocabulary, SEED)
    bench.import_bench()
    waited_s = wait_for(args.wait_for) if args.wait_for is not None else 0.0
    asyncio.run(run_level(args.base_url, args.model, warmup, 1, "warm-up", timeouts))
    levels: list[dict[str, Any]] = []
    for round_number in range(args.rounds):
        order = ["own", "vllm-bench"] if round_number % 2 == 0 else ["vllm-bench", "own"]
        for concurrency in args.concurrency:
            for client in order:
                before = server_counters(args.base_url)
                if client == "own":
                    record = own(concurrency)
                else:
                    record = vllm_bench(concurrency, round_number)
                after = server_counters(args.base_url)
                served = {name: after[name] - before[name] for name in after}
                levels.append(
                    {"client": client, "concurrency": concurrency, "round": round_number,
                     "served": served, **record}
                )  # fmt: skip
    print(json.dumps({"levels": levels, "waited_s": waited_s}))


if __name__ == "__main__":
    main()
