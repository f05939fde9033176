"""``vllm-minimax warmup --engine``: fill every compile cache a server start fills, once, on
the serving machine's own GPUs, by starting the configured engine briefly.

Some of what a MiniMax M3 start builds can only be built on the GPU it runs on (Humming's
NVRTC kernels pick their tiles from the GPU's SM count; vLLM's Triton kernels compile for the
arguments of the launches the engine makes), and some is never kept on disk (vLLM's CuTe-DSL
kernels, compiled in each process): docs/warm-start.md has the table. Rather than replay each
owner's compiles from outside, this starts ``vllm serve MODEL --config CONFIG`` itself, in
the caller's environment (so it fills the caches where the real server will read them),
waits until it is ready, sends a short prompt, a long one and one asking for logprobs, and
stops it. The programs depend on the checkpoint's ``config.json`` (its geometry and
quantization config), not on its weights, so the weights are vLLM's dummy ones unless
``--load-format`` says otherwise.

It prints each cache's directory with its files before and after, and exits 0 when the
server became ready and answered, 1 when it did not (the log's path and tail are printed),
2 on bad input (nothing started).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_minimax import compile_caches

SERVED_NAME = "warmup"
# A short prompt, one long enough for a prefill chunk of several thousand tokens, and what an
# lm-eval loglikelihood task sends (vLLM's sampler compiles its logprobs kernel at the first).
REQUESTS: tuple[tuple[str, int, dict[str, Any]], ...] = (
    ("hello", 8, {}),
    (" ".join(["hello"] * 6000), 4, {}),
    ("the logprobs of this", 4, {"logprobs": 2, "prompt_logprobs": 1}),
)


def default_server_command() -> list[str]:
    """vLLM's OpenAI server of this Python, which is the environment the server runs in."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def send(base_url: str, prompt: str, max_tokens: int, extra: Mapping[str, Any]) -> str:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body | dict(extra)).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return str(json.loads(response.read())["choices"][0]["text"])


def describe(
    before: Mapping[str, Mapping[str, Any]], after: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    """One line per cache: its directory, files before and after, and files written."""
    lines = []
    for name, entry in after.items():
        lines.append(
            f"  {name}: {entry['dir']}: {before[name]['files']} -> {entry['files']} files"
            f" ({entry['since_files']} written, {entry['bytes'] / 2**20:.1f} MiB)"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    from vllm_minimax.evals.server import ServerError, VllmServer

    config = Path(args.config)
    if not config.is_file():
        what = "is not a file" if config.exists() else "does not exist"
        print(f"vllm-minimax warmup: error: serving config {config} {what}", file=sys.stderr)
        return 2
    if args.cache_dir is not None:
        # FlashInfer's programs go where --cache-dir says, as without --engine.
        os.environ["FLASHINFER_WORKSPACE_BASE"] = str(Path(args.cache_dir).absolute())
    log_path = Path(args.log) if args.log else Path(tempfile.mkstemp(suffix=".log")[1])
    dirs = compile_caches.cache_dirs(os.environ)
    before = compile_caches.inventory(dirs)
    extra = ["--load-format", args.load_format, *args.serve_arg]
    server = VllmServer(
        model=args.model,
        log_path=log_path,
        command=args.server_command or default_server_command(),
        config=config,
        extra_args=extra,
        startup_timeout=args.timeout,
        served_name=SERVED_NAME,
    )
    began = time.time()
    status = 0
    try:
        server.start()
        ready = time.time() - began
        print(f"ready after {ready:.0f} s; sending {len(REQUESTS)} requests", flush=True)
        for prompt, max_tokens, options in REQUESTS:
            send(server.base_url, prompt, max_tokens, options)
        server.check_alive()
    except ServerError as error:
        print(f"vllm-minimax warmup: the engine failed: {error}", file=sys.stderr)
        status = 1
    except (OSError, KeyError, ValueError) as error:  # URLError and HTTPError are OSErrors
        print(
            f"vllm-minimax warmup: a request failed ({type(error).__name__}: {error}); log:"
            f" {log_path}",
            file=sys.stderr,
        )
        status = 1
    finally:
        server.stop()
    print(f"the compile caches (log: {log_path}):")
    for line in describe(before, compile_caches.inventory(dirs, since=began)):
        print(line)
    if status == 0:
        print(
            "keep these directories across containers (docs/warm-start.md); a later start"
            " with the same config, GPU and installation loads what it can from them"
        )
    return status


def add_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """The options of ``--engine`` (on ``parser`` or an argument group of it)."""
    parser.add_argument(
        "--load-format",
        default="dummy",
        help="with --engine: vllm serve's --load-format (default dummy: the programs depend"
        " on the checkpoint's config.json, not its weights)",
    )
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="with --engine: one more vllm serve argument (repeat it; --serve-arg=--flag)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="with --engine: seconds to wait for the server to be ready (default 1800)",
    )
    parser.add_argument(
        "--log", metavar="FILE", help="with --engine: the server's log (default: a temp file)"
    )
    parser.add_argument(
        "--server-command",
        metavar="CMD",
        help="with --engine: the server to start (default: this Python's vLLM OpenAI server)",
    )
