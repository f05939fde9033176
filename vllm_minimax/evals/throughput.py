"""``vllm-minimax eval throughput``: serving speed through streaming ``/v1/completions``.

Two clients measure a level. A scenario of one request shape runs through vLLM's own
``vllm bench serve`` (:mod:`vllm_minimax.evals.bench`), the numbers users quote; a scenario
that mixes shapes in one level, which bench's datasets cannot express, runs through the
asyncio client here, whose definitions are bench's. ``--client own`` runs every scenario
on the client here (where vLLM is not importable). Both give the same level record, so the
reports and the A/B runner do not depend on which one measured.

Each level's prompts come from a seed of its own (:func:`level_seed`: per scenario, level
and round), so no level re-sends the prompts of an earlier one on the same server,
where prefix caching would serve them from the cache, and every server of an A/B gets the same
prompts. This project's client: each request's prompt is random token ids, sent as a token
list so the prompt length is exact, with ``ignore_eos`` so the output length is exact too.
Per request: TTFT is the time to the first streamed chunk, ITL the gaps between later chunks, TPOT
``(latency - TTFT) / (output tokens - 1)``, with the output token count from the usage chunk.
Per concurrency level: output tokens/s is all output tokens over the wall time of the level.
While a level runs, the server's ``/metrics`` is sampled (:mod:`.server_figures`): the
level's record says how many requests the server ran at once (max and median) and how many
waited, so a level that queued for want of KV cache shows it.
Before its first level each scenario sends one unrecorded request per shape (prompts of their
own), so JIT compilation and first-use allocations for those shapes land outside the numbers.
A scenario marked ``prefix_cached`` sends the same prompts in every round, and its warm-up
sends the level's own prompts: the measured levels find them in the prefix cache, so a decode
level times decode steps alone rather than decode beside the other requests' prefill.

Before any request the server is checked: ``/health`` answers, ``/v1/models`` lists the
model, and the preset's longest request fits the model's ``max_model_len``.

Any failed request stops the run: numbers with failures in them are not comparable. The
results file is rewritten after every level, so what finished is on disk either way; a run
that fails or is interrupted (Ctrl-C) lists the levels it did not measure
(``missing_levels``).
``--repeat N`` runs the whole sweep N times (each level's record names its round); reports
give the median of the rounds and their min..max.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_minimax.evals import bench
from vllm_minimax.evals.common import EvalError, progress, require, write_json
from vllm_minimax.evals.presets import RequestShape, ThroughputPreset, ThroughputScenario
from vllm_minimax.evals.server import ServedModel, check_server, require_model_len
from vllm_minimax.evals.server_figures import RunningSampler

PERCENTILES = (50, 90, 99)
DEFAULT_FIRST_BYTE_TIMEOUT_S = 30.0
DEFAULT_REQUEST_TIMEOUT_S = 1800.0
LEVEL_HEARTBEAT_S = 30.0
CLIENTS = ("vllm-bench", "own")


class RequestFailed(EvalError):
    pass


@dataclass
class RequestTiming:
    input_tokens: int
    output_tokens: int
    ttft_s: float
    latency_s: float
    itl_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Vocabulary:
    """The token ids random prompts are drawn from: the tokenizer's, minus special tokens."""

    size: int
    special_ids: frozenset[int]

    @classmethod
    def from_tokenizer(cls, name_or_path: str) -> Vocabulary:
        from transformers import AutoTokenizer

        if (
            name_or_path.startswith(("/", "./", "../", "~"))
            and not Path(name_or_path).expanduser().exists()
        ):
            raise EvalError(f"cannot load tokenizer {name_or_path!r}: no such directory")
        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            raise EvalError(f"cannot load tokenizer {name_or_path!r}: {reason}") from None
        return cls(len(tokenizer), frozenset(tokenizer.all_special_ids))

    def random_prompt(self, rng: random.Random, length: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < length:
            token = rng.randrange(self.size)
            if token not in self.special_ids:
                ids.append(token)
        return ids


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(values_s: list[float]) -> dict[str, float]:
    """Mean and percentiles, in milliseconds."""
    if not values_s:
        return {}
    values = [value * 1000 for value in values_s]
    summary = {"mean": statistics.fmean(values)}
    summary |= {f"p{q}": percentile(values, q) for q in PERCENTILES}
    return summary


def level_metrics(timings: list[RequestTiming], duration_s: float) -> dict[str, Any]:
    output_tokens = sum(timing.output_tokens for timing in timings)
    input_tokens = sum(timing.input_tokens for timing in timings)
    tpots = [
        (timing.latency_s - timing.ttft_s) / (timing.output_tokens - 1)
        for timing in timings
        if timing.output_tokens > 1
    ]
    return {
        "completed": len(timings),
        "duration_s": duration_s,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(timings) / duration_s,
        "output_tokens_per_s": output_tokens / duration_s,
        "total_tokens_per_s": (input_tokens + output_tokens) / duration_s,
        "ttft_ms": summarize([timing.ttft_s for timing in timings]),
        "tpot_ms": summarize(tpots),
        "itl_ms": summarize([gap for timing in timings for gap in timing.itl_s]),
        "e2e_latency_ms": summarize([timing.latency_s for timing in timings]),
    }


@dataclass(frozen=True)
class RequestTimeouts:
    """Per request: seconds until the response headers (vLLM sends them before the first token
    is computed, so this catches a server that accepts connections and never answers), and
    seconds for the whole streamed response."""

    first_byte_s: float = DEFAULT_FIRST_BYTE_TIMEOUT_S
    total_s: float = DEFAULT_REQUEST_TIMEOUT_S


async def send_request(
    session: Any,
    url: str,
    model: str,
    prompt: list[int],
    shape: RequestShape,
    timeouts: RequestTimeouts,
) -> RequestTiming:
    import aiohttp

    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": shape.output_tokens,
        "min_tokens": shape.output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    last = started
    gaps: list[float] = []
    output_tokens = 0
    try:
        try:
            async with asyncio.timeout(timeouts.first_byte_s) as waiting:
                response = await session.post(url, json=payload)
        except TimeoutError:
            if not waiting.expired():
                raise  # the whole request's timeout, reported below
            raise RequestFailed(
                f"{url} sent no response within {timeouts.first_byte_s:g} s"
                " (--first-byte-timeout); the server accepts connections but does not answer"
            ) from None
        try:
            if response.status != 200:
                body = (await response.text())[:500]
                raise RequestFailed(f"{url} answered HTTP {response.status}: {body}")
            async for raw_line in response.content:
                line = raw_line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:") :].strip()
                if data == b"[DONE]":
                    break
                chunk = stream_chunk(url, data)
                if chunk.get("usage"):
                    output_tokens = completion_tokens(url, chunk["usage"])
                # Every chunk with a choice is a token step, also one with empty text
                # (vLLM holds back text that ends inside a UTF-8 character).
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
        finally:
            response.release()
    except TimeoutError:
        raise RequestFailed(
            f"a {shape.input_tokens}-in/{shape.output_tokens}-out request to {url} took over"
            f" {timeouts.total_s:g} s (--request-timeout)"
        ) from None
    except aiohttp.ClientError as error:
        raise RequestFailed(
            f"request to {url} failed ({type(error).__name__}: {error}); is the server up?"
        ) from None
    latency = time.perf_counter() - started
    if first is None:
        raise RequestFailed(f"{url} streamed nothing for a {shape.output_tokens}-token request")
    return RequestTiming(len(prompt), output_tokens, first - started, latency, gaps)


def stream_chunk(url: str, data: bytes) -> dict[str, Any]:
    """One ``data:`` line of the stream as a JSON object; anything else fails the request."""
    try:
        chunk = json.loads(data)
    except (ValueError, RecursionError):
        raise RequestFailed(f"{url} streamed a line that is not JSON: {data[:200]!r}") from None
    if not isinstance(chunk, dict):
        raise RequestFailed(f"{url} streamed {type(chunk).__name__} where a JSON object belongs")
    return chunk


def completion_tokens(url: str, usage: object) -> int:
    """``usage.completion_tokens`` of a stream's last chunk: a count, or the request fails."""
    if not isinstance(usage, dict):
        raise RequestFailed(f"{url} streamed a usage that is {type(usage).__name__}, not an object")
    tokens = usage.get("completion_tokens")
    if tokens is None:
        return 0
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise RequestFailed(f"{url} streamed a usage whose completion_tokens is {tokens!r}")
    return tokens


async def run_level(
    base_url: str,
    model: str,
    prompts: list[tuple[list[int], RequestShape]],
    concurrency: int,
    label: str,
    timeouts: RequestTimeouts,
) -> tuple[list[RequestTiming], float]:
    """Send every prompt, at most ``concurrency`` in flight; stop at the first failure.

    A level that runs longer than a heartbeat says how far it got, every heartbeat."""
    import aiohttp

    url = f"{base_url}/v1/completions"
    limit = asyncio.Semaphore(concurrency)
    timings: list[RequestTiming] = []
    timeout = aiohttp.ClientTimeout(total=timeouts.total_s)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(prompt: list[int], shape: RequestShape) -> None:
            async with limit:
                timings.append(await send_request(session, url, model, prompt, shape, timeouts))

        async def heartbeat() -> None:
            while True:
                await asyncio.sleep(LEVEL_HEARTBEAT_S)
                waited = time.perf_counter() - started
                progress(f"{label}: {len(timings)}/{len(prompts)} requests, {waited:.0f} s")

        started = time.perf_counter()
        tasks = [asyncio.create_task(one(prompt, shape)) for prompt, shape in prompts]
        beat = asyncio.create_task(heartbeat())
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in [*tasks, beat]:
                task.cancel()
            await asyncio.gather(*tasks, beat, return_exceptions=True)
        return timings, time.perf_counter() - started


def level_seed(
    preset_seed: int, scenario: str, level_index: int, concurrency: int, round_number: int
) -> int:
    """The seed of one level's prompts, for both clients: distinct per scenario, level (its
    place in the scenario's concurrency list, which may name a concurrency twice) and round
    (vLLM's benchmark client draws the same prompts from the same seed whatever the scenario,
    so one seed for the whole preset re-sent earlier levels' prompts), the same for every
    server of an A/B."""
    key = f"{preset_seed}/{scenario}/{level_index}:c{concurrency}/round{round_number}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "big")


def scenario_prompts(
    scenario: ThroughputScenario, vocabulary: Vocabulary, seed: int
) -> list[tuple[list[int], RequestShape]]:
    """The scenario's requests for one level seeded by ``seed`` (:func:`level_seed`)."""
    rng = random.Random(seed)
    shapes = [scenario.shapes[i % len(scenario.shapes)] for i in range(scenario.num_requests)]
    return [(vocabulary.random_prompt(rng, shape.input_tokens), shape) for shape in shapes]


def check_fits(preset: ThroughputPreset, served: ServedModel, base_url: str) -> None:
    """Refuse a preset whose longest request does not fit the server's ``max_model_len``."""
    scenario, shape = preset.longest_request()
    require_model_len(
        served,
        shape.input_tokens + shape.output_tokens,
        f"throughput preset {preset.name!r} (scenario {scenario.name}:"
        f" {shape.input_tokens} in + {shape.output_tokens} out)",
        base_url,
    )


def scenario_client(scenario: ThroughputScenario, client: str) -> str:
    """``vllm-bench`` for a one-shape scenario unless ``client`` is ``own``; mixed, or a
    prefix-cached scenario (whose warm-up must send the very prompts the level sends): ``own``."""
    if client not in CLIENTS:
        raise EvalError(f"--client {client!r}: expected one of {', '.join(CLIENTS)}")
    one_shape = len(scenario.shapes) == 1 and not scenario.prefix_cached
    return "vllm-bench" if client == "vllm-bench" and one_shape else "own"


def missing_levels(results: dict[str, Any], first_round: int = 0) -> list[str]:
    """The planned levels (scenario x concurrency x round) that no record holds, in the
    order they would have run; a concurrency listed twice is planned twice."""
    missing = []
    for scenario in results["scenarios"]:
        have = Counter((level["concurrency"], level["round"]) for level in scenario["levels"])
        for round_number in range(first_round, first_round + results["repeat"]):
            for concurrency in scenario["concurrency"]:
                if have[concurrency, round_number]:
                    have[concurrency, round_number] -= 1
                else:
                    missing.append(f"{scenario['name']} c={concurrency} round {round_number + 1}")
    return missing


def initial_results(
    preset: ThroughputPreset, base_url: str, model: str, repeat: int, clients: list[str]
) -> dict[str, Any]:
    """The results file before its first level: the preset, the server and, per scenario,
    its client, shapes and sweep, with no levels yet."""
    return {
        "preset": preset.name,
        "preset_file": str(preset.path),
        "base_url": base_url,
        "model": model,
        "repeat": repeat,
        "complete": False,
        "scenarios": [
            {
                "name": scenario.name,
                "client": scenario_client_name,
                "shapes": [asdict(shape) for shape in scenario.shapes],
                "num_requests": scenario.num_requests,
                "concurrency": list(scenario.concurrency),
                "warmup_requests": len(scenario.shapes),
                "levels": [],
            }
            for scenario, scenario_client_name in zip(preset.scenarios, clients, strict=True)
        ],
    }


def bench_level(
    scenario: ThroughputScenario,
    concurrency: int,
    seed: int,
    served: tuple[str, str, str],
    result_file: Path,
    timeouts: RequestTimeouts,
) -> dict[str, Any]:
    """One level of a one-shape scenario through `vllm bench serve` (``served``: the base
    URL, the model and the tokenizer), its JSON kept at ``result_file``."""
    base_url, model, tokenizer = served
    [shape] = scenario.shapes
    arguments = bench.bench_arguments(
        base_url, model, tokenizer, shape.input_tokens, shape.output_tokens,
        concurrency, scenario.num_requests, seed, result_file,
    )  # fmt: skip
    deadline = bench.level_deadline(timeouts.total_s, scenario.num_requests, concurrency)
    data = bench.run_bench_level(arguments, result_file, result_file.with_suffix(".log"), deadline)
    return {
        **bench.level_from_bench(data),
        "prompt_seed": seed,
        "bench_command": bench.bench_command(arguments),
        "bench_result": str(result_file),
    }


def level_line(label: str, metrics: dict[str, Any], client: str) -> str:
    """The progress line of a finished level."""
    return (
        f"{label}: {metrics['output_tokens_per_s']:.1f} output tok/s,"
        f" TTFT p50 {metrics['ttft_ms']['p50']:.0f} ms,"
        f" TPOT p50 {metrics['tpot_ms'].get('p50', float('nan')):.1f} ms"
        f" ({metrics['completed']} requests in {metrics['duration_s']:.1f} s, {client})"
    )


def run_throughput(
    preset: ThroughputPreset,
    base_url: str,
    model: str,
    out_path: Path,
    vocabulary: Vocabulary,
    on_level_done: Any = None,
    repeat: int = 1,
    timeouts: RequestTimeouts | None = None,
    round_index: int = 0,
    client: str = "vllm-bench",
    tokenizer: str | None = None,
) -> dict[str, Any]:
    """Run every scenario at every concurrency, ``repeat`` rounds; rewrite ``out_path`` after
    each level. Each level's record carries its round (``round_index`` is the first one's).

    The server is checked first (``/health``, ``/v1/models``, the preset against its
    ``max_model_len``). ``client`` picks the client of one-shape scenarios
    (:func:`scenario_client`); bench loads ``tokenizer`` (default: ``model``) and saves its
    JSON per level under ``<out_path's directory>/bench/``. ``on_level_done`` (optional, no
    arguments) runs after each level; ``eval ab`` uses it to check that its server is still
    alive."""
    require("aiohttp")
    timeouts = timeouts or RequestTimeouts()
    base_url = base_url.rstrip("/")
    clients = [scenario_client(scenario, client) for scenario in preset.scenarios]
    if "vllm-bench" in clients:
        bench.require_bench()
    check_fits(preset, check_server(base_url, model), base_url)
    bench_dir = out_path.parent / "bench"
    results = initial_results(preset, base_url, model, repeat, clients)
    write_json(out_path, results)

    def stopped(key: str, text: str) -> None:
        results[key] = text
        results["missing_levels"] = missing_levels(results, round_index)
        write_json(out_path, results)

    def send(
        prompts: list[tuple[list[int], RequestShape]], concurrency: int, label: str
    ) -> tuple[list[RequestTiming], float]:
        """This project's client for one level (or warm-up)."""
        return asyncio.run(run_level(base_url, model, prompts, concurrency, label, timeouts))

    def measure(
        scenario: ThroughputScenario,
        record: dict[str, Any],
        level_index: int,
        concurrency: int,
        round_number: int,
        label: str,
    ) -> dict[str, Any]:
        """One level's record, from the scenario's client, with how many requests the
        server ran at once meanwhile (``running_requests``; absent without ``/metrics``)."""
        with RunningSampler(base_url) as sampler:
            metrics = run_client(scenario, record, level_index, concurrency, round_number, label)
        running = sampler.summary()
        return {**metrics, "running_requests": running} if running else metrics

    def run_client(
        scenario: ThroughputScenario,
        record: dict[str, Any],
        level_index: int,
        concurrency: int,
        round_number: int,
        label: str,
    ) -> dict[str, Any]:
        seed = level_seed(
            preset.seed, scenario.name, level_index, concurrency,
            0 if scenario.prefix_cached else round_number,
        )  # fmt: skip
        if record["client"] == "own":
            prompts = scenario_prompts(scenario, vocabulary, seed)
            timings, duration = send(prompts, concurrency, label)
            return {**level_metrics(timings, duration), "prompt_seed": seed}
        result_file = bench_dir / f"{scenario.name}-c{concurrency}-round{round_number + 1}.json"
        served = (base_url, model, tokenizer or model)
        return bench_level(scenario, concurrency, seed, served, result_file, timeouts)

    label = "throughput"
    try:
        for offset in range(repeat):
            round_number = round_index + offset
            for scenario, record in zip(preset.scenarios, results["scenarios"], strict=True):
                if offset == 0:
                    label = f"throughput {scenario.name} warm-up"
                    for prompts, concurrency in warmup_sends(scenario, vocabulary, preset.seed):
                        send(prompts, concurrency, label)
                for level_index, concurrency in enumerate(scenario.concurrency):
                    label = f"throughput {scenario.name} concurrency {concurrency}"
                    if repeat > 1 or round_number:
                        label += f" round {round_number + 1}"
                    metrics = measure(
                        scenario, record, level_index, concurrency, round_number, label
                    )
                    record["levels"].append(
                        {"concurrency": concurrency, "round": round_number, **metrics}
                    )
                    write_json(out_path, results)
                    progress(level_line(label, metrics, record["client"]))
                    if on_level_done is not None:
                        on_level_done()
    except (RequestFailed, bench.BenchFailed) as error:
        stopped("error", f"{label}: {error}")
        raise EvalError(
            f"{label}: {error}\nresults of the finished levels are in {out_path};"
            f" not measured: {', '.join(results['missing_levels'])}"
        ) from None
    except KeyboardInterrupt:
        stopped("interrupted", f"{label}: interrupted")
        raise
    results["complete"] = True
    write_json(out_path, results)
    return results


def warmup_sends(
    scenario: ThroughputScenario, vocabulary: Vocabulary, seed: int
) -> list[tuple[list[tuple[list[int], RequestShape]], int]]:
    """What a scenario's warm-up sends, as (prompts, concurrency) pairs: a prefix-cached
    scenario sends each level's own prompts at the level's concurrency (the measured levels
    then find them cached); any other, one request per shape at once (`warmup_prompts`)."""
    if scenario.prefix_cached:
        return [
            (scenario_prompts(scenario, vocabulary, level_seed(seed, scenario.name, i, c, 0)), c)
            for i, c in enumerate(scenario.concurrency)
        ]
    warmup = warmup_prompts(scenario, vocabulary, seed)
    return [(warmup, len(warmup))]


def warmup_prompts(
    scenario: ThroughputScenario, vocabulary: Vocabulary, seed: int
) -> list[tuple[list[int], RequestShape]]:
    """One prompt per shape, from a random stream of their own (no prefix shared with the run)."""
    rng = random.Random(f"{seed}/{scenario.name}/warm-up")
    return [(vocabulary.random_prompt(rng, shape.input_tokens), shape) for shape in scenario.shapes]
