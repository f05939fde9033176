"""Command line: ``vllm-minimax {apply,revert,status,doctor,dev,make-tiny-model,eval}``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_minimax import __version__
from vllm_minimax.evals.cli import add_eval_parsers
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
    tiny_parser.set_defaults(handler=run_make_tiny_model)

    add_eval_parsers(commands)
    return parser


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


def run_make_tiny_model(args: argparse.Namespace) -> int:
    from vllm_minimax import tiny_model

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
