"""Command line: ``vllm-minimax {apply,revert,status,doctor,config,dev,make-tiny-model,eval}``."""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vllm_minimax import __version__
from vllm_minimax.doctor import EXIT_CODES as DOCTOR_EXIT_CODES
from vllm_minimax.errors import Interrupted, UserError, describe_os_error
from vllm_minimax.evals.cli import add_eval_parsers
from vllm_minimax.evals.common import EvalError
from vllm_minimax.evals.server import raise_on_sigterm
from vllm_minimax.options import path_argument
from vllm_minimax.patchset import (
    PatchError,
    apply_series,
    format_status,
    revert_series,
    series_state,
    supported_versions,
)
from vllm_minimax.prebuild_inputs import GPU_TARGETS as GPU_TARGET_NAMES
from vllm_minimax.serve_config import config_name_option, config_option
from vllm_minimax.terminal import printable

PROGRAM = "vllm-minimax"
# The commands that work on the vLLM tree the series applies to (an OSError's advice is
# about that tree); the others write models, checkouts, caches and reports of their own.
VLLM_TREE_COMMANDS = ("apply", "revert", "status", "doctor")

STATUS_EXIT_CODES = """exit status:
  0  the series for this vLLM is applied and every file it touched is as it left it
  1  not applied, and the series would apply (each file's line says whether it is vLLM's)
  2  anything else: no series for this vLLM version, the series does not apply, files
     edited or half-applied since apply, a changed series, or an error"""

APPLY_EXIT_CODES = """exit status:
  0    applied, or already applied (nothing changed); also when the writes finished but
       the report could not be written to standard output (standard error says so)
  2    nothing changed, and the error line says why: no series for this vLLM, the series
       does not apply, another apply or revert at work on the target, a write that failed
       and was rolled back, or bad usage (a rollback that fails too is said with what it
       left and what to run)
  130  interrupted (Ctrl-C, SIGTERM): rolled back, nothing changed, unless the line says
       the writes had finished"""

REVERT_EXIT_CODES = """exit status:
  0    reverted: every file apply changed is restored and its state file removed; also
       when the report could not be written to standard output (standard error says so)
  2    nothing changed, and the error line says why: nothing applied, a file edited since
       apply, another apply or revert at work on the target, a write that failed and was
       rolled back, or bad usage (a rollback that fails too is said with what it left)
  130  interrupted (Ctrl-C, SIGTERM): rolled back, nothing changed, unless the line says
       the writes had finished"""

# Compute capabilities of NVIDIA GPUs that CUDA and vLLM know (Volta to Blackwell). The
# FlashInfer MSA indexer gates on 9.0, 12.0 and 12.1; doctor shows what the others select.
KNOWN_CAPABILITIES = (
    (7, 0), (7, 2), (7, 5),
    (8, 0), (8, 6), (8, 7), (8, 9),
    (9, 0),
    (10, 0), (10, 1), (10, 3),
    (11, 0),
    (12, 0), (12, 1),
)  # fmt: skip
# Sanity bounds of make-tiny-model's options (the checkpoint is a smoke-test toy).
MAX_INITIALIZER_RANGE = 1.0
MAX_MTP_MODULES = 8
MAX_SEED = 2**63 - 1

TARGET_HELP = (
    "directory containing vllm/ (a vLLM source checkout root or a site-packages);"
    " default: the vLLM installed in this Python environment"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description="FlashInfer's MSA kernels for MiniMax M3 (the indexer; the sparse attention"
        " with an fp8 KV cache on SM90), as a patch series over vLLM.",
    )
    try:
        series = ", ".join(supported_versions()) or "none"
    except PatchError:
        series = "unreadable"
    parser.add_argument(
        "--version",
        action="version",
        version=f"{PROGRAM} {__version__} (patch series for vLLM {series})",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser in (
        add_apply_parser,
        add_revert_parser,
        add_status_parser,
        add_doctor_parser,
        add_config_parser,
        add_dev_parser,
        add_make_tiny_model_parser,
        add_warmup_parser,
    ):
        add_parser(commands)
    add_eval_parsers(commands)
    return parser


# --- option types and output, shared by the commands -----------------------------------------


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in [{low}, {high}]")
        return value

    return parse


def positive_float(high: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and 0 < value <= high):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number in (0, {high}]")
        return value

    return parse


def say(text: str) -> None:
    """Print a line that may hold values read from the target, escaped (see `printable`)."""
    print(printable(text, keep_newlines=False))


def print_litter(removed: list[str]) -> None:
    for path in removed:
        say(f"  removed  {path} (left by an interrupted run)")


class ReportFailed(Exception):
    """apply or revert finished, but writing its report to standard output failed."""


@contextlib.contextmanager
def reporting_after_writing(done: str) -> Iterator[None]:
    """A finished apply or revert reports what it wrote. Ctrl-C meanwhile, or standard output
    that cannot be written (a full disk, a closed pipe), is said as such: the work is done."""
    try:
        try:
            yield
        finally:
            sys.stdout.flush()
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted while reporting, after the writes finished: {done}"
        ) from None
    except OSError as error:
        discard_standard_output()
        raise ReportFailed(
            f"{done}, but its report could not be written to standard output:"
            f" {error.strerror or error}"
        ) from None


def discard_standard_output() -> None:
    """Point standard output at /dev/null, so that what is still buffered cannot fail again
    when Python exits."""
    with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
        descriptor = sys.stdout.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, descriptor)
        os.close(null)


# --- apply, revert, status -------------------------------------------------------------------


def add_apply_parser(commands: Any) -> None:
    """``apply``: the series onto the target's vLLM."""
    apply_parser = commands.add_parser(
        "apply",
        help="apply the patch series to vLLM",
        description="Apply the patch series for the target's vLLM release, all or nothing;"
        " applying it again changes nothing. `vllm-minimax revert` undoes it.",
        epilog=APPLY_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    apply_parser.add_argument("--target", type=path_argument, metavar="DIR", help=TARGET_HELP)
    apply_parser.set_defaults(handler=run_apply)


def run_apply(args: argparse.Namespace) -> int:
    raise_on_sigterm()  # before and after the transaction too, SIGTERM reports like Ctrl-C
    result = apply_series(args.target)
    with reporting_after_writing(f"{result.series_dir.name} is applied to {result.root}"):
        print_litter(result.litter_removed)
        if result.already_applied:
            say(f"already applied: {result.series_dir.name} on {result.root}; nothing changed")
            return 0
        say(f"applied {result.series_dir.name} to {result.root} (vLLM {result.vllm_version})")
        for path in result.changed:
            say(f"  patched  {path}")
    return 0


def add_revert_parser(commands: Any) -> None:
    """``revert``: the files apply changed, restored."""
    revert_parser = commands.add_parser(
        "revert",
        help="restore vLLM's original files",
        description="Restore every file `vllm-minimax apply` changed, byte for byte and with"
        " its mode, all or nothing; refused when a file was edited since.",
        epilog=REVERT_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    revert_parser.add_argument("--target", type=path_argument, metavar="DIR", help=TARGET_HELP)
    revert_parser.set_defaults(handler=run_revert)


def run_revert(args: argparse.Namespace) -> int:
    raise_on_sigterm()  # before and after the transaction too, SIGTERM reports like Ctrl-C
    result = revert_series(args.target)
    with reporting_after_writing(f"{result.series} is reverted on {result.root}"):
        print_litter(result.litter_removed)
        say(f"reverted {result.series} on {result.root}")
        for path in result.restored:
            say(f"  restored {path}")
        for path in result.removed:
            say(f"  removed  {path}")
    return 0


def add_status_parser(commands: Any) -> None:
    """``status``: whether the series is applied, file by file."""
    status_parser = commands.add_parser(
        "status",
        help="show whether the series is applied",
        description="Show whether the series is applied, file by file.",
        epilog=STATUS_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    status_parser.add_argument("--target", type=path_argument, metavar="DIR", help=TARGET_HELP)
    status_parser.set_defaults(handler=run_status)


def run_status(args: argparse.Namespace) -> int:
    state = series_state(args.target)
    print(format_status(state))
    return state.exit_code


# --- doctor ----------------------------------------------------------------------------------


def add_doctor_parser(commands: Any) -> None:
    """``doctor``: what `vllm serve --config FILE` would run here or on a given GPU."""
    target_help = TARGET_HELP
    doctor_parser = commands.add_parser(
        "doctor",
        help="check what `vllm serve --config FILE` would run on this machine or a given GPU",
        description="Check the series, the GPU and FlashInfer, and report the MiniMax M3"
        " kernels (indexer, sparse attention) that `vllm serve --config FILE` selects: on this"
        " GPU, or with --capability on a simulated one. Without --config, the shipped configs'"
        " settings (fp8 index cache, TP 8). The flags below override the config's values, as"
        " flags after --config do for vllm serve.",
        epilog=DOCTOR_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor_parser.add_argument("--target", type=path_argument, metavar="DIR", help=target_help)
    doctor_parser.add_argument(
        "--config",
        type=config_option,
        metavar="YAML_OR_NAME",
        help="the `vllm serve --config` file, or a shipped config's name (`vllm-minimax config"
        " list`), e.g. h200-8x",
    )
    doctor_parser.add_argument(
        "--model",
        metavar="PATH_OR_ID",
        help="the checkpoint vllm serve is given: doctor reads its weight index (a directory,"
        " or the local Hugging Face cache; nothing is downloaded) for the config's speculative"
        " draft weights, and its config.json for MXFP8 when the config asks quantization-config"
        " for the W8A8 requantization",
    )
    doctor_parser.add_argument(
        "--capability",
        type=capability_option,
        metavar="X.Y",
        help="GPU compute capability to check for, MAJOR.MINOR of a known GPU (e.g. 9.0, 12.1)",
    )
    doctor_parser.add_argument(
        "--indexer-kv-dtype",
        choices=["auto", "bf16", "fp8", "fp8_e4m3", "nvfp4"],
        help="attention-config's indexer_kv_dtype",
    )
    doctor_parser.add_argument(
        "--indexer-backend",
        choices=["auto", "flashinfer", "triton"],
        help="attention-config's minimax_m3_indexer_backend",
    )
    doctor_parser.add_argument(
        "--kv-cache-dtype", metavar="DTYPE", help="kv-cache-dtype (auto: bf16 for MiniMax M3)"
    )
    doctor_parser.add_argument(
        "--tensor-parallel-size",
        type=bounded_int(1, 64),
        metavar="N",
        help="tensor-parallel-size (sets the heads each rank holds)",
    )
    doctor_parser.add_argument(
        "--verbose",
        action="store_true",
        help="also print each touched file's state and what torch, FlashInfer and vLLM logged"
        " (asks vLLM and FlashInfer again, as --no-cache does)",
    )
    doctor_parser.add_argument(
        "--no-cache",
        action="store_true",
        help="ask vLLM and FlashInfer again even when this environment's answers are stored"
        " (doctor stores them, keyed on the installed packages, the series state, the"
        " environment variables vLLM and FlashInfer read, the CUDA toolkit and driver and"
        " the GPU, to answer the next call without importing vLLM)",
    )
    doctor_parser.set_defaults(handler=run_doctor)


def capability_option(text: str) -> tuple[int, int]:
    """``--capability``: MAJOR.MINOR of a known GPU generation."""
    by_name = {f"{major}.{minor}": (major, minor) for major, minor in KNOWN_CAPABILITIES}
    capability = by_name.get(text.strip())
    if capability is not None:
        return capability
    known = ", ".join(by_name)
    raise argparse.ArgumentTypeError(
        f"{text!r} is not the MAJOR.MINOR compute capability of a known GPU; one of: {known}"
    )


def run_doctor(args: argparse.Namespace) -> int:
    from vllm_minimax import doctor

    return int(doctor.main(args))


# --- config ----------------------------------------------------------------------------------


def add_config_parser(commands: Any) -> None:
    """``config list`` and ``config path NAME``: the shipped serve configs."""
    config_parser = commands.add_parser(
        "config",
        help="list the shipped vllm serve configs, or print one's path",
        description="The `vllm serve --config` files that ship with this package: the serving"
        " configs (configs/serve/) and the eval suite's server configs (evals/). Use a path"
        ' anywhere: vllm serve MODEL --config "$(vllm-minimax config path h200-8x)".',
    )
    config_commands = config_parser.add_subparsers(
        dest="config_command", required=True, metavar="COMMAND"
    )
    config_commands.add_parser(
        "list", help="the serving configs (name, checkpoint, file), then the eval suite's"
    ).set_defaults(handler=run_config_list)
    config_path_parser = config_commands.add_parser("path", help="print a shipped config's file")
    config_path_parser.add_argument("name", metavar="NAME", help="e.g. h200-8x")
    config_path_parser.set_defaults(handler=run_config_path)


def run_config_list(args: argparse.Namespace) -> int:
    from vllm_minimax.serve_config import shipped_config_groups, stated_checkpoint

    serving, eval_suite = shipped_config_groups()
    width = max((len(name) for name in serving), default=0)
    checkpoints = {
        name: stated_checkpoint(path) or "(no checkpoint sized)" for name, path in serving.items()
    }
    checkpoint_width = max((len(text) for text in checkpoints.values()), default=0)
    print('serving configs: vllm serve CHECKPOINT --config "$(vllm-minimax config path NAME)"')
    for name, path in serving.items():
        print(f"  {name:<{width}}  {checkpoints[name]:<{checkpoint_width}}  {path}")
    print(
        "the eval suite's server configs (tiny models, one rank with dummy weights; not for"
        " serving MiniMax M3: evals/README.md)"
    )
    eval_width = max((len(name) for name in eval_suite), default=0)
    for name, path in eval_suite.items():
        print(f"  {name:<{eval_width}}  {path}")
    return 0


def run_config_path(args: argparse.Namespace) -> int:
    from vllm_minimax.serve_config import ServeConfigError, resolve_config

    try:
        path = resolve_config(args.name)
    except ServeConfigError as error:
        raise PatchError(str(error)) from None
    print(path.resolve())
    return 0


# --- dev -------------------------------------------------------------------------------------


def add_dev_parser(commands: Any) -> None:
    """``dev checkout`` and ``dev export``: the series as commits on pristine vLLM."""
    dev_parser = commands.add_parser("dev", help="work on the series in a git checkout of vLLM")
    dev_commands = dev_parser.add_subparsers(dest="dev_command", required=True, metavar="COMMAND")
    checkout_parser = dev_commands.add_parser(
        "checkout",
        help="download vLLM's sdist into DIR as a git repo with one commit per patch",
    )
    checkout_parser.add_argument("version", metavar="VERSION", help="vLLM version, e.g. 0.34.0")
    checkout_parser.add_argument("directory", type=path_argument, metavar="DIR")
    checkout_parser.add_argument(
        "--pristine",
        action="store_true",
        help="only the pristine tree, tagged, without the series (the start of a rebase onto a"
        " release that has no series yet: docs/rebasing.md)",
    )
    checkout_parser.set_defaults(handler=run_dev_checkout)
    export_parser = dev_commands.add_parser(
        "export", help="write the commits since the pristine tag back as the patch series"
    )
    export_parser.add_argument("directory", type=path_argument, metavar="DIR")
    export_parser.set_defaults(handler=run_dev_export)


def run_dev_checkout(args: argparse.Namespace) -> int:
    from vllm_minimax import devtree

    raise_on_sigterm()  # so that a killed checkout removes what it made
    checkout = devtree.checkout(args.version, args.directory, with_series=not args.pristine)
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


# --- make-tiny-model -------------------------------------------------------------------------


def tiny_model_config_layouts() -> tuple[str, ...]:
    from vllm_minimax.tiny_model import CONFIG_LAYOUTS

    return CONFIG_LAYOUTS


def tiny_model_geometries() -> tuple[str, ...]:
    from vllm_minimax.tiny_model import GEOMETRIES

    return GEOMETRIES


def add_make_tiny_model_parser(commands: Any) -> None:
    """``make-tiny-model DIR``: a random-weight (or config-only) MiniMax M3 checkpoint."""
    tiny_parser = commands.add_parser(
        "make-tiny-model",
        help="write a random-weight tiny MiniMax M3 checkpoint (real indexer geometry) to DIR",
    )
    tiny_parser.add_argument(
        "directory",
        type=path_argument,
        metavar="DIR",
        help="where to write it (must be absent or empty)",
    )
    tiny_parser.add_argument(
        "--force", action="store_true", help="replace DIR even if it is not empty"
    )
    tiny_parser.add_argument(
        "--kind",
        choices=["minimax-m3", "llama"],
        default="minimax-m3",
        help="minimax-m3 (default), or llama: the model the vLLM CPU server of the eval"
        " suite's test serves",
    )
    tiny_parser.add_argument(
        "--seed",
        type=bounded_int(0, MAX_SEED),
        default=0,
        help="seed for the random weights (default: 0)",
    )
    tiny_parser.add_argument(
        "--initializer-range",
        type=positive_float(MAX_INITIALIZER_RANGE),
        default=None,
        help="std of the random weights, in (0, 1] (default: transformers' 0.02)",
    )
    tiny_parser.add_argument(
        "--mtp-modules",
        type=bounded_int(0, MAX_MTP_MODULES),
        default=0,
        metavar="N",
        help="also write an N-module MTP draft (speculative decoding) to DIR/mtp, N <="
        f" {MAX_MTP_MODULES} (default: 0, none)",
    )
    tiny_parser.add_argument(
        "--for-vllm",
        choices=tiny_model_config_layouts(),
        default=None,
        metavar="VERSION",
        help="the vLLM release whose config parsing the config.json files are written for:"
        " 0.34.0 (default: transformers' flat minimax_m3_vl_text, which transformers also"
        " loads) or 0.33.0 (the published minimax_m3_vl schema, which vLLM 0.34.0 also serves"
        " with the same geometry); the weights are the same bytes either way",
    )
    tiny_parser.add_argument(
        "--geometry",
        choices=tiny_model_geometries(),
        default="tiny",
        help="tiny (default: random weights, 4 small layers); m3-heads: random weights, 4"
        " narrow layers with MiniMax M3's 64 query, 4 KV and 4 index heads (serve it at TP 1,"
        " 2, 4 or 8; see docs/multi-gpu.md); m3-tpN-rank: config and tokenizer of one GPU's"
        " share of MiniMax M3 served with tensor parallelism N; m3: config and tokenizer of"
        " the whole model in the published layout (no weights for either: serve with"
        " load-format dummy; see docs/real-geometry.md)",
    )
    add_rank_layout_options(tiny_parser)
    tiny_parser.set_defaults(handler=run_make_tiny_model)


def add_rank_layout_options(tiny_parser: argparse.ArgumentParser) -> None:
    """make-tiny-model's --weights and --experts: how a rank slice's weights are laid out."""
    tiny_parser.add_argument(
        "--weights",
        choices=("fp8-online", "mxfp8", "bf16"),
        default=None,
        help="with --geometry m3-tpN-rank: how the dummy weights are stored when served:"
        " fp8-online (default: the serve config sets quantization fp8), mxfp8 (config.json"
        " carries MiniMaxAI/MiniMax-M3-MXFP8's quantization config) or bf16; with the"
        " random-weight geometries: bf16 (default) or mxfp8 (the projections stored as"
        " MXFP8 values and e8m0 scales, as MiniMaxAI/MiniMax-M3-MXFP8 stores them)",
    )
    tiny_parser.add_argument(
        "--experts",
        choices=("tp", "ep"),
        default=None,
        help="with --geometry m3-tpN-rank: tp (default: all 128 experts, 3072 / N wide) or ep"
        " (128 / N whole experts, as enable-expert-parallel serves them)",
    )


def run_make_rank_model(args: argparse.Namespace) -> int:
    """``make-tiny-model --geometry m3-tpN-rank`` or ``m3``: a config, no weights to draw."""
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
        raise UserError(
            f"--geometry {args.geometry} writes MiniMax M3's config without weights;"
            f" {', '.join(ignored)} would do nothing there"
        )
    weights = args.weights or tiny_model.DEFAULT_WEIGHT_LAYOUT
    experts = args.experts or tiny_model.DEFAULT_EXPERT_LAYOUT
    check_model_directory(args.directory, args.force)
    if args.geometry == tiny_model.M3_GEOMETRY:
        made = write_directory_whole(args.directory, tiny_model.make_m3_model)
        size = made["bytes"]
        print(
            f"wrote MiniMax M3 ({tiny_model.PUBLISHED_MODEL_TYPE} layout,"
            f" {tiny_model.M3_MTP_MODULES} MTP module declared, {made['parameters']:,}"
            f" parameters without it: {size['mxfp8'] / 1e9:.0f} GB as MXFP8; config and"
            " tokenizer only, serve with load-format dummy) to"
            f" {args.directory}"
        )
        return 0
    made = write_directory_whole(
        args.directory,
        lambda d: tiny_model.make_rank_model(d, args.geometry, weights, experts),
    )
    size = made["bytes"][{"fp8-online": "fp8", "mxfp8": "mxfp8", "bf16": "bf16"}[weights]]
    held = "whole experts (expert parallel)" if experts == "ep" else "expert slices (TP)"
    print(
        f"wrote one rank of MiniMax M3 at tensor parallelism {made['tensor_parallel_size']}"
        f" ({tiny_model.ARCHITECTURE}, {held}, {made['parameters']:,} parameters:"
        f" {size / 1e9:.1f} GB as {weights}; config and tokenizer only, serve with load-format"
        f" dummy{SERVE_HINT[weights]}) to {args.directory}"
    )
    return 0


# What a rank slice's serve config must say for its weight layout.
SERVE_HINT = {
    "fp8-online": " and quantization fp8",
    "mxfp8": ", no quantization option: config.json names it",
    "bf16": ", no quantization option",
}


# What writing a random-weight checkpoint imports; a vLLM environment has them all.
TINY_MODEL_MODULES = ("torch", "safetensors", "tokenizers", "transformers")


def require_importable(command: str, modules: tuple[str, ...]) -> None:
    """Refuse, before anything is written, when this Python lacks a module ``command`` needs."""
    import importlib.util

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(
            f"{command} needs {', '.join(missing)}, which {sys.executable} cannot import: run"
            " it in the environment where vLLM is installed (vLLM brings them)"
        )


def run_make_tiny_model(args: argparse.Namespace) -> int:
    from vllm_minimax import tiny_model

    random_weights = args.geometry in tiny_model.RANDOM_WEIGHT_GEOMETRIES
    if args.for_vllm is not None and (not random_weights or args.kind == "llama"):
        raise UserError(
            "--for-vllm applies to the tiny MiniMax M3 and the other random-weight geometries"
            f" ({', '.join(tiny_model.RANDOM_WEIGHT_GEOMETRIES)}) only"
        )
    if (
        random_weights
        and args.weights is not None
        and (args.weights not in tiny_model.RANDOM_WEIGHT_LAYOUTS or args.kind == "llama")
    ):
        raise UserError(
            f"--weights {args.weights}: the random-weight MiniMax M3 geometries take"
            f" {' or '.join(tiny_model.RANDOM_WEIGHT_LAYOUTS)}"
        )
    rank_only = [
        option
        for option, given in (
            ("--weights", None if random_weights else args.weights),
            ("--experts", args.experts),
        )
        if given is not None
    ]
    if rank_only and args.geometry not in tiny_model.RANK_GEOMETRIES:
        raise UserError(
            f"{', '.join(rank_only)} applies to the rank geometries (--geometry m3-tpN-rank) only"
        )
    if not random_weights:
        return run_make_rank_model(args)
    if args.kind == "llama" and (args.initializer_range is not None or args.mtp_modules):
        raise UserError("--initializer-range and --mtp-modules apply to --kind minimax-m3 only")
    if args.kind == "llama" and args.geometry != tiny_model.TINY_GEOMETRY:
        raise UserError(f"--geometry {args.geometry} is a MiniMax M3; --kind llama has its own")
    require_importable("make-tiny-model", TINY_MODEL_MODULES)
    directory: Path = args.directory
    check_model_directory(directory, args.force)
    if args.kind == "llama":
        from vllm_minimax.evals.tiny_llama import make_tiny_llama

        made = write_directory_whole(directory, lambda d: make_tiny_llama(d, seed=args.seed))
        print(
            f"wrote a tiny Llama (LlamaForCausalLM, {made['parameters']:,} parameters, vocab"
            f" {made['vocab_size']}) to {directory}"
        )
        return 0

    initializer_range = args.initializer_range or tiny_model.DEFAULT_INITIALIZER_RANGE
    made = write_directory_whole(
        directory,
        lambda d: tiny_model.make_tiny_model(
            d,
            seed=args.seed,
            initializer_range=initializer_range,
            mtp_modules=args.mtp_modules,
            config_layout=args.for_vllm or tiny_model.DEFAULT_CONFIG_LAYOUT,
            text_config=tiny_model.RANDOM_WEIGHT_GEOMETRIES[args.geometry],
            weights_layout=args.weights or "bf16",
        ),
    )
    stored = ", projections in MXFP8" if args.weights == "mxfp8" else ""
    print(
        f"wrote a {args.geometry} MiniMax M3 ({tiny_model.ARCHITECTURE},"
        f" {made['parameters']:,} parameters"
        f" in {made['tensors']} tensors{stored}, config for vLLM"
        f" {args.for_vllm or tiny_model.DEFAULT_CONFIG_LAYOUT}) to {directory}"
    )
    if "mtp" in made:
        draft = made["mtp"]
        print(
            f"wrote its {args.mtp_modules}-module MTP draft ({tiny_model.MTP_ARCHITECTURE},"
            f" {draft['parameters']:,} parameters in {draft['tensors']} tensors) to"
            f" {directory / tiny_model.MTP_SUBDIRECTORY}"
        )
    return 0


def check_model_directory(directory: Path, force: bool) -> None:
    """Refuse a DIR that is a file, a link, a mount point, a non-empty directory (unless
    ``force``), or under a file."""
    if directory.is_symlink():
        raise UserError(f"{directory} is a symbolic link; pass a real directory")
    for ancestor in directory.absolute().parents:
        if ancestor.exists() and not ancestor.is_dir():
            raise UserError(f"{ancestor} is not a directory, so {directory} cannot be made there")
    if not directory.exists():
        return
    location = real_location(directory)
    if Path.cwd().resolve().is_relative_to(location):
        raise UserError(
            f"{directory} is or holds the current directory, which replacing it would delete;"
            f" run the command from outside {directory}"
        )
    if directory.is_dir() and os.path.ismount(directory):
        raise UserError(
            f"{directory} is a mount point, which cannot be replaced whole (the model is written"
            " beside it, then renamed into place); pass a directory inside it"
        )
    if not directory.is_dir():
        raise UserError(f"{directory} exists and is not a directory; pick another DIR")
    if any(directory.iterdir()) and not force:
        raise UserError(
            f"{directory} is not empty; pass --force to replace what is in it, or pick another DIR"
        )


def real_location(directory: Path) -> Path:
    """``directory`` as an absolute path with no link or ``..`` above its last component, so
    that it names the same place after the directory itself is renamed away (``../x`` run from
    inside ``x`` would not)."""
    absolute = directory.absolute()
    if absolute.name == "..":
        return absolute.resolve()
    return absolute.parent.resolve() / absolute.name


def write_directory_whole(directory: Path, write: Callable[[Path], Any]) -> Any:
    """Run ``write`` on a fresh directory beside ``directory``, then move it into place, so a
    failure leaves ``directory`` as it was (absent, empty, or the old contents).

    A writer's I/O failure reported as a Rust ``os error N`` (safetensors, tokenizers) is
    raised as that OSError, naming ``directory``."""
    target = real_location(directory)
    parent = target.parent
    created_parents = [p for p in [parent, *parent.parents] if not p.exists()]
    parent.mkdir(parents=True, exist_ok=True)
    try:
        staging = Path(
            tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".vllm-minimax-tmp", dir=parent)
        )
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(parent)) from error
    old = None
    raise_on_sigterm()  # so that a killed run removes its staging directory too
    try:
        try:
            result = write(staging)
        except OSError:
            raise
        except Exception as error:
            code = re.search(r"\(os error (\d+)\)", str(error))
            if code is None:
                raise
            number = int(code.group(1))
            raise OSError(number, os.strerror(number), str(directory)) from error
        os.chmod(staging, 0o755)
        give_files_the_umask_mode(staging)
        if target.exists() and any(target.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=parent))
            os.rename(target, old / "contents")
        os.replace(staging, target)  # onto an absent or empty directory
    except BaseException:
        if old is not None and not target.exists():
            os.rename(old / "contents", target)
        shutil.rmtree(staging, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        for created in created_parents:
            if created.is_dir() and not any(created.iterdir()):
                created.rmdir()
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return result


def give_files_the_umask_mode(root: Path) -> None:
    """Give every file under ``root`` the mode ``open()`` gives a new file: safetensors writes
    its file 0600, which a server running as another user (a container's) could not read."""
    umask = os.umask(0)
    os.umask(umask)
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, 0o666 & ~umask)


# --- warmup ----------------------------------------------------------------------------------


def add_warmup_parser(commands: Any) -> None:
    """``warmup``: a serving config's compile caches (FlashInfer's, or all with --engine)."""
    warmup_parser = commands.add_parser(
        "warmup",
        help="prebuild FlashInfer's JIT cache for a serving config (on the serving GPU, or"
        " with --prebuild on any machine with the CUDA compiler); with --engine, fill every"
        " compile cache by starting the engine once",
    )
    warmup_parser.add_argument(
        "--config",
        type=config_name_option,
        required=True,
        action="append",
        metavar="YAML_OR_NAME",
        help="a vllm serve config file, or a shipped config's name (e.g. h200-8x); with"
        " --prebuild, repeat it for several",
    )
    warmup_parser.add_argument(
        "--model",
        default="MiniMaxAI/MiniMax-M3-MXFP8",
        help="the model served (name or local path; default: MiniMaxAI/MiniMax-M3-MXFP8,"
        " the checkpoint the SM90 configs are for)",
    )
    warmup_parser.add_argument(
        "--cache-dir",
        type=path_argument,
        metavar="DIR",
        help="FLASHINFER_WORKSPACE_BASE to build into (default: $FLASHINFER_WORKSPACE_BASE,"
        " else the home directory); the cache lands in DIR/.cache/flashinfer",
    )
    add_prebuild_options(warmup_parser)
    engine = warmup_parser.add_argument_group(
        "--engine",
        "on the serving machine: start the configured engine briefly, so that every compile"
        " cache a start fills (FlashInfer's, Humming's, Triton's, vLLM's) is filled once"
        " (docs/compile-caches.md)",
    )
    engine.add_argument(
        "--engine",
        action="store_true",
        help="start vllm serve with the config until it is ready, send a few requests, stop it",
    )
    from vllm_minimax import warm_engine

    warm_engine.add_arguments(engine)
    warmup_parser.set_defaults(handler=run_warmup)


def add_prebuild_options(warmup_parser: argparse.ArgumentParser) -> None:
    """``warmup --prebuild`` and the options that go with it."""
    prebuild = warmup_parser.add_argument_group(
        "--prebuild",
        "build without a GPU: FlashInfer picks each program as on the --gpu given, the CUDA"
        " compiler builds it (docs/warm-start.md)",
    )
    prebuild.add_argument(
        "--prebuild",
        action="store_true",
        help="build on this machine's CPU with the CUDA compiler, for SM90 (no GPU needed)",
    )
    prebuild.add_argument(
        "--gpu",
        action="append",
        choices=sorted(GPU_TARGET_NAMES),
        help="the SM90 GPU the server runs on (its SM count and vLLM's defaults for its"
        " memory decide the programs); repeat for several; default: h100 and h200",
    )
    prebuild.add_argument(
        "--kv-cache-dtype",
        action="append",
        default=None,
        help="as vllm serve's --kv-cache-dtype, over the config's (fp8: also the sparse"
        " attention's programs); repeat it for each dtype the server may run with",
    )
    prebuild.add_argument(
        "--jobs",
        type=bounded_int(1, 256),
        default=None,
        help="nvcc programs built at once (default: half the CPUs)",
    )
    prebuild.add_argument(
        "--only",
        metavar="GLOB",
        action="append",
        default=None,
        help="build only the programs whose names match GLOB (repeatable; the rest are listed)",
    )
    prebuild.add_argument(
        "--dry-run",
        action="store_true",
        help="list the programs FlashInfer would build; build nothing",
    )


def run_warmup(args: argparse.Namespace) -> int:
    if args.engine:
        if (
            args.prebuild
            or args.gpu
            or args.kv_cache_dtype
            or args.jobs
            or args.only
            or args.dry_run
        ):
            print(
                "vllm-minimax warmup: error: --engine starts the engine on this machine's GPUs;"
                " --prebuild and its options build without one",
                file=sys.stderr,
            )
            return 2
        if len(args.config) > 1:
            print("vllm-minimax warmup: error: one --config with --engine", file=sys.stderr)
            return 2
        from vllm_minimax import warm_engine

        args.config = args.config[0]
        return warm_engine.run(args)
    if args.prebuild:
        from vllm_minimax import prebuild

        return prebuild.main(args)
    if args.gpu or args.kv_cache_dtype or args.jobs or args.only or args.dry_run:
        print(
            "vllm-minimax warmup: error: --gpu, --kv-cache-dtype, --jobs, --only and --dry-run"
            " go with --prebuild",
            file=sys.stderr,
        )
        return 2
    if len(args.config) > 1:
        print(
            "vllm-minimax warmup: error: one --config on the GPU (several go with --prebuild)",
            file=sys.stderr,
        )
        return 2
    from vllm_minimax import warmup

    args.config = args.config[0]
    return warmup.main(args)


def main(argv: list[str] | None = None) -> int:
    if isinstance(sys.stdout, io.TextIOWrapper):
        # A path or report that the terminal's encoding cannot show is escaped, not fatal.
        sys.stdout.reconfigure(errors="backslashreplace")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (UserError, EvalError) as error:
        complain(f"error: {error}")
        return 2
    except ReportFailed as error:
        complain(str(error))
        return 0
    except OSError as error:
        on_vllm_tree = args.command in VLLM_TREE_COMMANDS
        complain(f"error: {describe_os_error(error, vllm_tree=on_vllm_tree)}")
        return 2
    except Interrupted as error:
        complain(str(error))
        return 130
    except KeyboardInterrupt:
        if args.command in ("apply", "revert"):
            complain("interrupted before any write: nothing was changed")
        else:
            complain("interrupted")
        return 130


def complain(message: str) -> None:
    """One message on standard error, escaped; a standard error that cannot be written is
    given up on (the exit status still tells)."""
    with contextlib.suppress(OSError):
        print(f"{PROGRAM}: {printable(message)}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
