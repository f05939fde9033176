"""``vllm-minimax eval accuracy|throughput|ab``: the options, checked before anything runs.

:func:`add_eval_parsers` is called by :mod:`vllm_minimax.cli`; every handler here turns bad
input, an unwritable ``--out`` and any ``OSError`` into an :class:`EvalError` (one line, exit
2, nothing started), and SIGTERM into the same unwinding as Ctrl-C.

``eval accuracy`` and ``eval throughput`` have no default preset: which one fits depends on
the server (the real-model presets need a GPU server with long contexts, and gsm8k the hub
or its cached copy), so the error lists the presets instead of failing later.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import tempfile
from collections.abc import Callable
from pathlib import Path

from vllm_minimax.evals import presets, throughput
from vllm_minimax.evals.accuracy import DEFAULT_Z
from vllm_minimax.evals.common import EvalError, read_json, write_text
from vllm_minimax.evals.throughput import (
    DEFAULT_FIRST_BYTE_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    RequestTimeouts,
)
from vllm_minimax.options import path_argument
from vllm_minimax.serve_config import config_option

AB_DEFAULT_ACCURACY = ["gsm8k", "ruler-32k"]
AB_DEFAULT_THROUGHPUT = "indexer"


# --- options several eval commands take ---------------------------------------------


def out_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=path_argument,
        required=True,
        metavar="DIR",
        help="directory for the results",
    )


def server_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--model", required=True, help="the model name the server serves (its --model)"
    )


def preset_option(parser: argparse.ArgumentParser, kind: str) -> None:
    parser.add_argument(
        "--preset",
        required=True,
        help=f"{kind} preset, one of: {', '.join(presets.available(kind)) or 'none'}"
        " (evals/README.md says which fits which server), or a .yaml path",
    )


def accuracy_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--limit", type=int, metavar="N", help="at most N samples per task (for a quick try)"
    )
    parser.add_argument(
        "--z",
        type=float,
        default=DEFAULT_Z,
        help=f"pass bound in standard errors of the difference (default: {DEFAULT_Z})",
    )


def client_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--client",
        choices=throughput.CLIENTS,
        default="vllm-bench",
        help="who sends the load of a one-shape scenario: vLLM's `vllm bench serve`, run"
        " in this process (needs vLLM here), or this project's client; scenarios that mix"
        " shapes always use this project's (default: vllm-bench)",
    )


def timeout_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--first-byte-timeout",
        type=float,
        default=DEFAULT_FIRST_BYTE_TIMEOUT_S,
        metavar="S",
        help="throughput: seconds a request may wait for the server's response headers"
        f" (default: {DEFAULT_FIRST_BYTE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        metavar="S",
        help="seconds one whole request may take (throughput; accuracy passes it to lm-eval"
        f" as `timeout`) (default: {DEFAULT_REQUEST_TIMEOUT_S:g})",
    )


def add_eval_parsers(commands: argparse._SubParsersAction) -> None:
    """``eval accuracy|throughput|ab``; the work is in :mod:`vllm_minimax.evals`."""
    eval_parser = commands.add_parser(
        "eval",
        help="accuracy (lm-eval) and throughput against a vLLM server; A/B of configs",
        description="See evals/README.md for how to start a server and run these.",
    )
    eval_commands = eval_parser.add_subparsers(
        dest="eval_command", required=True, metavar="COMMAND"
    )
    add_accuracy_parser(eval_commands)
    add_throughput_parser(eval_commands)
    add_ab_parser(eval_commands)


def add_accuracy_parser(eval_commands: argparse._SubParsersAction) -> None:
    """``eval accuracy``."""
    accuracy_parser = eval_commands.add_parser(
        "accuracy", help="run lm-eval tasks against a server and compare with a baseline"
    )
    server_options(accuracy_parser)
    out_option(accuracy_parser)
    accuracy_parser.add_argument(
        "--tokenizer",
        metavar="NAME_OR_DIR",
        help="tokenizer lm-eval loads (default: --model); refused with a preset whose"
        " model_args set tokenizer_backend: None (cpu-tiny), which loads none",
    )
    preset_option(accuracy_parser, "accuracy")
    accuracy_options(accuracy_parser)
    accuracy_parser.add_argument(
        "--baseline", type=path_argument, metavar="JSON", help="an accuracy.json of an earlier run"
    )
    accuracy_parser.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds one request may take, lm-eval's `timeout` (default: lm-eval's, 300)",
    )
    accuracy_parser.set_defaults(handler=run_eval_accuracy)


def add_throughput_parser(eval_commands: argparse._SubParsersAction) -> None:
    """``eval throughput``."""
    throughput_parser = eval_commands.add_parser(
        "throughput", help="streaming load at a sweep of concurrencies: tok/s, TTFT, TPOT, ITL"
    )
    server_options(throughput_parser)
    out_option(throughput_parser)
    throughput_parser.add_argument(
        "--tokenizer",
        metavar="NAME_OR_DIR",
        help="tokenizer whose vocabulary the random prompts are drawn from, and that vllm"
        " bench serve loads (default: --model)",
    )
    preset_option(throughput_parser, "throughput")
    client_option(throughput_parser)
    throughput_parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the sweep N times; the report gives median and min..max (default: 1)",
    )
    timeout_options(throughput_parser)
    throughput_parser.set_defaults(handler=run_eval_throughput)


def add_ab_parser(eval_commands: argparse._SubParsersAction) -> None:
    """``eval ab``."""
    ab_parser = eval_commands.add_parser(
        "ab", help="start one server per arm (default: triton, flashinfer indexer) and compare"
    )
    out_option(ab_parser)
    ab_parser.add_argument(
        "--tokenizer",
        metavar="NAME_OR_DIR",
        help="tokenizer for lm-eval and for the random prompts (default: --model)",
    )
    ab_parser.add_argument("--model", required=True, help="model to serve (name or directory)")
    ab_parser.add_argument(
        "--config",
        type=config_option,
        metavar="YAML_OR_NAME",
        help="`vllm serve --config` file, or a shipped config's name (`vllm-minimax config"
        " list`), e.g. h200-8x",
    )
    ab_parser.add_argument(
        "--arm",
        action="append",
        metavar="NAME=JSON",
        help="an arm: a name and a JSON object of serve arguments merged into --config;"
        " repeatable (default: triton and flashinfer, via attention-config's"
        " minimax_m3_indexer_backend). The first arm is the reference",
    )
    ab_parser.add_argument(
        "--accuracy-preset",
        action="append",
        metavar="PRESET",
        help="accuracy preset from evals/accuracy/ or a .yaml path; repeatable"
        f" (default: {' and '.join(AB_DEFAULT_ACCURACY)}, for MiniMax M3 on GPUs)",
    )
    accuracy_options(ab_parser)
    ab_parser.add_argument(
        "--throughput-preset",
        default=AB_DEFAULT_THROUGHPUT,
        help=f"throughput preset, or `none` (default: {AB_DEFAULT_THROUGHPUT})",
    )
    client_option(ab_parser)
    ab_parser.add_argument(
        "--no-accuracy", action="store_true", help="skip accuracy (throughput only)"
    )
    ab_parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        metavar="N",
        help="rounds; each starts every arm's server anew, the order rotating per round"
        " (default: 3)",
    )
    ab_parser.add_argument(
        "--server-rounds",
        type=int,
        default=1,
        metavar="N",
        help="throughput rounds on each server before it stops (default: 1); with --repeat 1,"
        " one start per arm",
    )
    timeout_options(ab_parser)
    ab_parser.add_argument(
        "--server-command",
        default="vllm serve",
        help="how to start a server, split as a shell would; it gets --model, --host, --port,"
        " --config (default: 'vllm serve')",
    )
    ab_parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for the server; repeatable",
    )
    ab_parser.add_argument(
        "--arm-env",
        action="append",
        default=[],
        metavar="ARM:KEY=VALUE",
        help="environment variable for one arm's servers, over --server-env; repeatable"
        " (e.g. stock:PYTHONPATH=/tmp/stock-vllm:... serves an unpatched vLLM in that arm)",
    )
    ab_parser.add_argument("--port", type=port_number, help="server port (default: a free one)")
    ab_parser.add_argument(
        "--startup-timeout",
        type=float,
        default=1800.0,
        metavar="S",
        help="seconds to wait for /health (default: 1800)",
    )
    ab_parser.set_defaults(handler=run_eval_ab)


def port_number(text: str) -> int:
    """``--port``: a TCP port a server can listen on."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (1 to 65535)")
    return port


def eval_command(handler: Callable[[argparse.Namespace], int]) -> Callable[..., int]:
    """SIGTERM unwinds like Ctrl-C; ``--out`` is checked first; an OSError is one line."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        from vllm_minimax.evals import server

        server.raise_on_sigterm()
        prepare_out_dir(args.out)
        try:
            return handler(args)
        except OSError as error:
            where = f": {error.filename}" if error.filename else ""
            raise EvalError(f"{error.strerror or error}{where}") from None

    return run


def prepare_out_dir(path: Path) -> None:
    """Refuse an ``--out`` that cannot hold results, without creating anything: it must be a
    writable directory, or not exist below a writable one (the run creates it)."""
    if path.exists() and not path.is_dir():
        raise EvalError(f"--out {path} exists and is not a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise EvalError(f"--out {path} is not writable: {existing} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise EvalError(f"--out {path} is not writable: {error.strerror or error}") from None


def check_positive(value: float | None, option: str) -> None:
    if value is not None and not 0 < value < math.inf:
        raise EvalError(f"{option} must be positive and finite, got {value}")


def timeouts_from(args: argparse.Namespace) -> RequestTimeouts:
    check_positive(args.first_byte_timeout, "--first-byte-timeout")
    check_positive(args.request_timeout, "--request-timeout")
    return RequestTimeouts(args.first_byte_timeout, args.request_timeout)


def check_repeat(repeat: int) -> None:
    if repeat < 1:
        raise EvalError(f"--repeat must be 1 or more, got {repeat}")


@eval_command
def run_eval_accuracy(args: argparse.Namespace) -> int:
    from vllm_minimax.evals import accuracy, report

    check_positive(args.request_timeout, "--request-timeout")
    check_positive(args.z, "--z")
    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit must be 1 or more, got {args.limit}")
    preset = presets.load_accuracy_preset(args.preset)
    backend = {**preset.model_args}.get("tokenizer_backend")
    if args.tokenizer and str(backend).lower() == "none":
        raise EvalError(
            f"--tokenizer has no effect with preset {preset.name!r}: its model_args set"
            " tokenizer_backend: None, so lm-eval loads no tokenizer"
        )
    summary = accuracy.run_accuracy(
        preset,
        args.base_url,
        args.model,
        args.out,
        tokenizer=args.tokenizer,
        limit=args.limit,
        baseline_path=args.baseline,
        z=args.z,
        request_timeout=args.request_timeout,
    )
    markdown = report.accuracy_markdown(summary)
    write_text(args.out / "accuracy.md", markdown)
    print(markdown)
    return 0 if summary.get("baseline", {}).get("passed", True) else 1


@eval_command
def run_eval_throughput(args: argparse.Namespace) -> int:
    from vllm_minimax.evals.common import progress
    from vllm_minimax.evals.server import check_server

    check_repeat(args.repeat)
    timeouts = timeouts_from(args)
    preset = presets.load_throughput_preset(args.preset)
    # The server first: a stopped one or a preset too long for it fails before the tokenizer.
    throughput.check_fits(preset, check_server(args.base_url, args.model), args.base_url)
    progress(f"loading the tokenizer {args.tokenizer or args.model} for the random prompts")
    vocabulary = throughput.Vocabulary.from_tokenizer(args.tokenizer or args.model)
    results_path = args.out / "throughput.json"
    report_path = args.out / "throughput.md"
    try:
        throughput.run_throughput(
            preset, args.base_url, args.model, results_path, vocabulary,
            repeat=args.repeat, timeouts=timeouts, client=args.client, tokenizer=args.tokenizer,
        )  # fmt: skip
    except BaseException:
        # A partial run gets its report too, unless making it fails: the run's own error is
        # the one to report, and throughput.json keeps every finished level either way.
        if results_path.exists():
            with contextlib.suppress(Exception):
                write_text(report_path, throughput_report(results_path))
        raise
    markdown = throughput_report(results_path)
    write_text(report_path, markdown)
    print(markdown)
    return 0


def throughput_report(results_path: Path) -> str:
    from vllm_minimax.evals import report

    return report.throughput_markdown(read_json(results_path, "results"))


@eval_command
def run_eval_ab(args: argparse.Namespace) -> int:
    from vllm_minimax.evals import ab
    from vllm_minimax.evals.server import split_command

    check_repeat(args.repeat)
    timeouts = timeouts_from(args)
    check_positive(args.z, "--z")
    check_positive(args.startup_timeout, "--startup-timeout")
    split_command(args.server_command)
    arms = [ab.parse_arm(text) for text in args.arm] if args.arm else ab.default_arms()
    arms = ab.parse_arm_env(args.arm_env, arms)
    env = {}
    for item in args.server_env:
        key, separator, value = item.partition("=")
        if not separator or not key:
            raise EvalError(f"--server-env {item!r}: expected KEY=VALUE")
        env[key] = value
    accuracy_presets = (
        []
        if args.no_accuracy
        else [
            presets.load_accuracy_preset(name)
            for name in args.accuracy_preset or AB_DEFAULT_ACCURACY
        ]
    )
    throughput_preset = (
        None
        if args.throughput_preset == "none"
        else presets.load_throughput_preset(args.throughput_preset)
    )
    launch = ab.ServerLaunch(
        model=args.model,
        command=args.server_command,
        env=env,
        startup_timeout=args.startup_timeout,
        port=args.port,
    )
    result = ab.run_ab(
        arms,
        launch,
        args.config,
        accuracy_presets,
        throughput_preset,
        args.out,
        tokenizer=args.tokenizer,
        limit=args.limit,
        z=args.z,
        repeat=args.repeat,
        timeouts=timeouts,
        client=args.client,
        server_rounds=args.server_rounds,
    )
    print((args.out / "report.md").read_text(encoding="utf-8"))
    return 0 if result["accuracy_passed"] else 1
