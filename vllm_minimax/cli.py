"""Command line: ``vllm-minimax {apply,revert,status,doctor,dev,make-tiny-model,eval}``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_minimax import __version__
from vllm_minimax.evals.common import EvalError
from vllm_minimax.patchset import (
    PatchError,
    apply_series,
    format_status,
    revert_series,
    series_state,
)

PROGRAM = "vllm-minimax"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description="FlashInfer's MSA indexer for MiniMax M3, as a patch series over vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"{PROGRAM} {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    target_help = (
        "directory containing vllm/ (a vLLM source checkout root or a site-packages);"
        " default: the vLLM installed in this Python environment"
    )
    apply_parser = commands.add_parser("apply", help="apply the patch series to vLLM")
    apply_parser.add_argument("--target", type=Path, metavar="DIR", help=target_help)
    apply_parser.set_defaults(handler=run_apply)

    revert_parser = commands.add_parser("revert", help="restore vLLM's original files")
    revert_parser.add_argument("--target", type=Path, metavar="DIR", help=target_help)
    revert_parser.set_defaults(handler=run_revert)

    status_parser = commands.add_parser("status", help="show whether the series is applied")
    status_parser.add_argument("--target", type=Path, metavar="DIR", help=target_help)
    status_parser.set_defaults(handler=run_status)

    doctor_parser = commands.add_parser(
        "doctor", help="check that this machine and vLLM can run the FlashInfer indexer"
    )
    doctor_parser.add_argument("--target", type=Path, metavar="DIR", help=target_help)
    doctor_parser.add_argument(
        "--capability", metavar="X.Y", help="GPU compute capability to check for (e.g. 9.0)"
    )
    doctor_parser.add_argument(
        "--indexer-kv-dtype", choices=["bf16", "fp8", "nvfp4"], help="indexer KV cache dtype"
    )
    doctor_parser.add_argument(
        "--topk-blocks", type=int, metavar="N", help="number of top-k blocks the indexer selects"
    )
    doctor_parser.add_argument(
        "--indexer-backend",
        choices=["auto", "flashinfer", "triton"],
        default="auto",
        help="indexer backend to check (default: auto)",
    )
    doctor_parser.set_defaults(handler=run_doctor)

    dev_parser = commands.add_parser("dev", help="work on the series in a git checkout of vLLM")
    dev_commands = dev_parser.add_subparsers(dest="dev_command", required=True, metavar="COMMAND")
    checkout_parser = dev_commands.add_parser(
        "checkout",
        help="download vLLM's sdist into DIR as a git repo with one commit per patch",
    )
    checkout_parser.add_argument("version", metavar="VERSION", help="vLLM version, e.g. 0.34.0")
    checkout_parser.add_argument("directory", type=Path, metavar="DIR")
    checkout_parser.set_defaults(handler=run_dev_checkout)
    export_parser = dev_commands.add_parser(
        "export", help="write the commits since the pristine tag back as the patch series"
    )
    export_parser.add_argument("directory", type=Path, metavar="DIR")
    export_parser.set_defaults(handler=run_dev_export)

    tiny_parser = commands.add_parser(
        "make-tiny-model",
        help="write a random-weight tiny MiniMax M3 checkpoint (real indexer geometry) to DIR",
    )
    tiny_parser.add_argument("directory", type=Path, metavar="DIR")
    tiny_parser.add_argument(
        "--kind",
        choices=["minimax-m3", "llama"],
        default="minimax-m3",
        help="minimax-m3 (default), or llama: the model the vLLM CPU server of the eval"
        " suite's test serves",
    )
    tiny_parser.add_argument(
        "--seed", type=int, default=0, help="seed for the random weights (default: 0)"
    )
    tiny_parser.add_argument(
        "--initializer-range",
        type=float,
        default=None,
        help="std of the random weights (default: transformers' 0.02)",
    )
    tiny_parser.add_argument(
        "--mtp-modules",
        type=int,
        default=0,
        metavar="N",
        help="also write an N-module MTP draft (speculative decoding) to DIR/mtp (default: 0,"
        " none)",
    )
    tiny_parser.add_argument(
        "--geometry",
        choices=tiny_model_geometries(),
        default="tiny",
        help="tiny (default: random weights, 4 small layers), or m3-tpN-rank: config and"
        " tokenizer of one GPU's share of MiniMax M3 served with tensor parallelism N (no"
        " weights: serve it with load-format dummy; see docs/real-geometry.md)",
    )
    tiny_parser.set_defaults(handler=run_make_tiny_model)

    add_eval_parsers(commands)
    return parser


def add_eval_parsers(commands: argparse._SubParsersAction) -> None:
    """``eval accuracy|throughput|ab``; the work is in :mod:`vllm_minimax.evals`."""
    eval_parser = commands.add_parser(
        "eval", help="accuracy (lm-eval) and throughput against a vLLM server; A/B of configs"
    )
    eval_commands = eval_parser.add_subparsers(
        dest="eval_command", required=True, metavar="COMMAND"
    )

    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--out", type=Path, required=True, metavar="DIR", help="directory for the results"
        )
        parser.add_argument(
            "--tokenizer",
            metavar="NAME_OR_DIR",
            help="tokenizer for lm-eval and for random prompts (default: --model)",
        )

    def client(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000"
        )
        parser.add_argument(
            "--model", required=True, help="the model name the server serves (its --model)"
        )

    def preset_option(parser: argparse.ArgumentParser, kind: str, default: str) -> None:
        parser.add_argument(
            "--preset",
            default=default,
            help=f"{kind} preset from evals/{kind}/ or a .yaml path (default: {default})",
        )

    def accuracy_options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--limit", type=int, metavar="N", help="at most N samples per task (for a quick try)"
        )
        parser.add_argument(
            "--z",
            type=float,
            default=1.96,
            help="pass bound in standard errors of the difference (default: 1.96)",
        )

    accuracy_parser = eval_commands.add_parser(
        "accuracy", help="run lm-eval tasks against a server and compare with a baseline"
    )
    client(accuracy_parser)
    common(accuracy_parser)
    preset_option(accuracy_parser, "accuracy", "gsm8k")
    accuracy_options(accuracy_parser)
    accuracy_parser.add_argument(
        "--baseline", type=Path, metavar="JSON", help="an accuracy.json of an earlier run"
    )
    accuracy_parser.set_defaults(handler=run_eval_accuracy)

    throughput_parser = eval_commands.add_parser(
        "throughput", help="streaming load at a sweep of concurrencies: tok/s, TTFT, TPOT, ITL"
    )
    client(throughput_parser)
    common(throughput_parser)
    preset_option(throughput_parser, "throughput", "indexer")
    throughput_parser.set_defaults(handler=run_eval_throughput)

    ab_parser = eval_commands.add_parser(
        "ab", help="start one server per arm (default: triton, flashinfer indexer) and compare"
    )
    common(ab_parser)
    ab_parser.add_argument("--model", required=True, help="model to serve (name or directory)")
    ab_parser.add_argument(
        "--config",
        type=Path,
        metavar="YAML",
        help="`vllm serve --config` file, e.g. from configs/serve/",
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
        " (default: gsm8k and ruler-32k)",
    )
    accuracy_options(ab_parser)
    ab_parser.add_argument(
        "--throughput-preset",
        default="indexer",
        help="throughput preset, or `none` (default: indexer)",
    )
    ab_parser.add_argument(
        "--no-accuracy", action="store_true", help="skip accuracy (throughput only)"
    )
    ab_parser.add_argument(
        "--server-command",
        default="vllm serve",
        help="how to start a server; it gets --model, --host, --port, --config"
        " (default: 'vllm serve')",
    )
    ab_parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for the server; repeatable",
    )
    ab_parser.add_argument("--port", type=int, help="server port (default: a free one)")
    ab_parser.add_argument(
        "--startup-timeout",
        type=float,
        default=1800.0,
        metavar="S",
        help="seconds to wait for /health (default: 1800)",
    )
    ab_parser.set_defaults(handler=run_eval_ab)


def run_apply(args: argparse.Namespace) -> int:
    result = apply_series(args.target)
    if result.already_applied:
        print(f"already applied: {result.series_dir.name} on {result.root}; nothing changed")
        return 0
    print(f"applied {result.series_dir.name} to {result.root} (vLLM {result.vllm_version})")
    for path in result.changed:
        print(f"  patched  {path}")
    return 0


def run_revert(args: argparse.Namespace) -> int:
    result = revert_series(args.target)
    print(f"reverted {result.series} on {result.root}")
    for path in result.restored:
        print(f"  restored {path}")
    for path in result.removed:
        print(f"  removed  {path}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    print(format_status(series_state(args.target)))
    return 0


def run_doctor(args: argparse.Namespace) -> int:
    from vllm_minimax import doctor

    return int(doctor.main(args))


def run_dev_checkout(args: argparse.Namespace) -> int:
    from vllm_minimax import devtree

    checkout = devtree.checkout(args.version, args.directory)
    print(
        f"checked out vLLM {checkout.version} in {checkout.directory}: pristine tree tagged"
        f" {checkout.pristine_tag}, {len(checkout.patch_commits)} patch commit(s) on top"
    )
    return 0


def run_dev_export(args: argparse.Namespace) -> int:
    from vllm_minimax import devtree

    exported = devtree.export(args.directory)
    print(f"wrote {len(exported.patch_files)} patch(es) and series to {exported.series_dir}")
    for path in exported.patch_files:
        print(f"  {path.name}")
    return 0


def tiny_model_geometries() -> tuple[str, ...]:
    from vllm_minimax.tiny_model import GEOMETRIES

    return GEOMETRIES


def run_make_rank_model(args: argparse.Namespace) -> int:
    """``make-tiny-model --geometry m3-tpN-rank``: a config, no weights to draw."""
    from vllm_minimax import tiny_model

    ignored = [
        option
        for option, given in (
            ("--kind llama", args.kind == "llama"),
            ("--initializer-range", args.initializer_range is not None),
            ("--mtp-modules", bool(args.mtp_modules)),
        )
        if given
    ]
    if ignored:
        print(
            f"--geometry {args.geometry} writes MiniMax M3's config without weights;"
            f" {', '.join(ignored)} would do nothing there",
            file=sys.stderr,
        )
        return 2
    made = tiny_model.make_rank_model(args.directory, args.geometry)
    size = made["bytes"]
    print(
        f"wrote one rank of MiniMax M3 at tensor parallelism {made['tensor_parallel_size']}"
        f" ({tiny_model.ARCHITECTURE}, {made['parameters']:,} parameters: {size['bf16'] / 1e9:.1f}"
        f" GB in bf16, {size['fp8'] / 1e9:.1f} GB with fp8 weights; config and tokenizer only,"
        f" serve with load-format dummy) to {made['directory']}"
    )
    return 0


def run_make_tiny_model(args: argparse.Namespace) -> int:
    from vllm_minimax import tiny_model

    if args.geometry != tiny_model.TINY_GEOMETRY:
        return run_make_rank_model(args)
    if args.kind == "llama" and (args.initializer_range is not None or args.mtp_modules):
        print(
            "--initializer-range and --mtp-modules apply to --kind minimax-m3 only",
            file=sys.stderr,
        )
        return 2
    if args.initializer_range is not None and args.initializer_range <= 0:
        print("--initializer-range must be positive", file=sys.stderr)
        return 2
    if args.kind == "llama":
        from vllm_minimax.evals.tiny_llama import make_tiny_llama

        made = make_tiny_llama(args.directory, seed=args.seed)
        print(
            f"wrote a tiny Llama (LlamaForCausalLM, {made['parameters']:,} parameters, vocab"
            f" {made['vocab_size']}) to {made['directory']}"
        )
        return 0

    initializer_range = args.initializer_range or tiny_model.DEFAULT_INITIALIZER_RANGE
    if args.mtp_modules < 0:
        print("--mtp-modules must be 0 or more", file=sys.stderr)
        return 2
    made = tiny_model.make_tiny_model(
        args.directory,
        seed=args.seed,
        initializer_range=initializer_range,
        mtp_modules=args.mtp_modules,
    )
    print(
        f"wrote a tiny MiniMax M3 ({tiny_model.ARCHITECTURE}, {made['parameters']:,} parameters"
        f" in {made['tensors']} tensors) to {made['directory']}"
    )
    if "mtp" in made:
        draft = made["mtp"]
        print(
            f"wrote its {args.mtp_modules}-module MTP draft ({tiny_model.MTP_ARCHITECTURE},"
            f" {draft['parameters']:,} parameters in {draft['tensors']} tensors) to"
            f" {draft['directory']}"
        )
    return 0


def run_eval_accuracy(args: argparse.Namespace) -> int:
    from vllm_minimax.evals import accuracy, presets, report, server

    server.raise_on_sigterm()
    summary = accuracy.run_accuracy(
        presets.load_accuracy_preset(args.preset),
        args.base_url,
        args.model,
        args.out,
        tokenizer=args.tokenizer,
        limit=args.limit,
        baseline_path=args.baseline,
        z=args.z,
    )
    markdown = report.accuracy_markdown(summary)
    (args.out / "accuracy.md").write_text(markdown)
    print(markdown)
    return 0 if summary.get("baseline", {}).get("passed", True) else 1


def run_eval_throughput(args: argparse.Namespace) -> int:
    from vllm_minimax.evals import presets, report, server, throughput

    server.raise_on_sigterm()
    preset = presets.load_throughput_preset(args.preset)
    vocabulary = throughput.Vocabulary.from_tokenizer(args.tokenizer or args.model)
    results = throughput.run_throughput(
        preset, args.base_url, args.model, args.out / "throughput.json", vocabulary
    )
    markdown = report.throughput_markdown(results)
    (args.out / "throughput.md").write_text(markdown)
    print(markdown)
    return 0


def run_eval_ab(args: argparse.Namespace) -> int:
    from vllm_minimax.evals import ab, presets, server

    server.raise_on_sigterm()
    arms = [ab.parse_arm(text) for text in args.arm] if args.arm else ab.default_arms()
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
            for name in args.accuracy_preset or ["gsm8k", "ruler-32k"]
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
    )
    print((args.out / "report.md").read_text())
    return 0 if result["accuracy_passed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (PatchError, EvalError) as error:
        print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROGRAM}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
