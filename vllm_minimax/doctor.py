"""`vllm-minimax doctor`: what `vllm serve --config FILE` would run on this machine (or on a
GPU of a given compute capability).

It reports the series state, the GPU, the FlashInfer build, and, for the serve config (the
shipped configs' settings when none is given), the MiniMax M3 kernels the patched vLLM
selects (`vllm_minimax.selection`), and exits with a status that says whether the engine
runs as configured (`EXIT_CODES`). torch's, FlashInfer's and vLLM's own warnings and log
lines are kept back unless `--verbose`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import importlib.metadata
import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

from vllm_minimax import checkpoint_weights, cuda_bindings, doctor_cache, patchset, w8a8_doctor
from vllm_minimax.serve_config import (
    ServeConfig,
    ServeConfigError,
    default_serve_config,
    read_serve_config,
    read_serve_options,
)

if TYPE_CHECKING:
    from vllm_minimax import selection

MSA_FUNCTIONS = ("msa_proxy_score", "msa_topk_select")
# How `flashinfer_line` ends when msa_ops imports with both entry points.
HEALTHY_FLASHINFER = f"flashinfer.msa_ops has {' and '.join(MSA_FUNCTIONS)}"

EXIT_READY = 0
EXIT_NOT_APPLIED = 1
EXIT_USAGE = 2
EXIT_FALLBACK = 3
EXIT_CANNOT_CHECK = 4
EXIT_FAILS = 5

EXIT_CODES = f"""exit status:
  {EXIT_READY}  ready: the series is applied and the GPU (or --capability) runs the config as
     written, FlashInfer wherever a backend is auto and FlashInfer can run. A bf16 KV
     cache (the shipped configs') keeps the sparse attention on Triton as configured:
     exit 0, its row says "as configured" and names kv-cache-dtype: fp8
  {EXIT_NOT_APPLIED}  not applied: the series is not cleanly applied to this vLLM (status says why)
  {EXIT_USAGE}  bad usage: an unknown option, or a config that cannot be found or read
  {EXIT_FALLBACK}  will fall back to Triton: the indexer left at auto gets Triton, or the sparse
     attention left at auto gets Triton with an fp8 KV cache (the line says why and which
     key or flag changes it, or that none does on this GPU); or (--model) the config's
     quantization-config W8A8 key has no effect: over a bf16 checkpoint vLLM ignores it and
     serves bf16
  {EXIT_CANNOT_CHECK}  cannot check here: no GPU and no --capability (pass --capability 9.0, say)
  {EXIT_FAILS}  will not start as configured: vLLM refuses the config or a forced backend, or
     the vLLM tree fails to import, or (--model) the checkpoint lacks the speculative draft's
     weights (an unquantized one stops vLLM at load; a quantized checkpoint or an EAGLE3
     draft starts with them unset), or the config's quantization-config W8A8
     requantization (fp8_per_channel) cannot run: below SM 8.9, a series without patch
     0008, moe-backend humming, or (--model) a quantized checkpoint that is not MXFP8
     (patch 0008 stops the load over most other formats)
  With --model, a checkpoint whose weight index (or, for the W8A8 row, config.json) is
  not here turns exit 0 into exit {EXIT_CANNOT_CHECK}"""


class Captured:
    """Text written to file descriptors 1 and 2 (by Python, torch's C++ or a library's
    logger) inside `captured_output`."""

    text = ""


@contextlib.contextmanager
def captured_output() -> Iterator[Captured]:
    """Keep what imports and vLLM's selection print off the terminal (file descriptors 1
    and 2, and Python's sys.stdout and sys.stderr); hand it back."""
    captured = Captured()
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = [os.dup(1), os.dup(2)]
        stream = open(sink.fileno(), "w", closefd=False, encoding="utf-8", errors="replace")  # noqa: SIM115
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
                yield captured
        finally:
            stream.flush()
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for descriptor in saved:
                os.close(descriptor)
            stream.close()
            sink.seek(0)
            captured.text = sink.read().decode("utf-8", "replace")


# What torch finds a GPU through on Linux: the CUDA driver (the runtime's device count loads
# it), NVML (PYTORCH_NVML_BASED_CUDA_CHECK counts with it), and ROCm's kernel driver.
CUDA_DRIVER_LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")
ROCM_DRIVER_NODE = "/dev/kfd"


def gpu_drivers() -> list[str]:
    """The GPU drivers torch could find a GPU through here: each library of
    `CUDA_DRIVER_LIBRARIES` the dynamic loader opens, and `ROCM_DRIVER_NODE` if it exists."""
    found = []
    for library in CUDA_DRIVER_LIBRARIES:
        try:
            ctypes.CDLL(library)
        except OSError:
            continue
        found.append(library)
    if os.path.exists(ROCM_DRIVER_NODE):
        found.append(ROCM_DRIVER_NODE)
    return found


def gpu_line() -> tuple[str, tuple[int, int] | None]:
    """A description of the first CUDA GPU and its capability, without vLLM. On Linux
    without a GPU driver (`gpu_drivers`), torch finds no GPU, and is not imported to say so."""
    if importlib.util.find_spec("torch") is None:
        return "none (torch is not installed)", None
    if sys.platform == "linux" and not gpu_drivers():
        return "none", None
    import torch

    if not torch.cuda.is_available():
        return "none", None
    major, minor = torch.cuda.get_device_capability(0)
    return f"{torch.cuda.get_device_name(0)} (compute capability {major}.{minor})", (major, minor)


def flashinfer_line() -> str:
    try:
        version = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    try:
        import flashinfer.msa_ops as msa_ops
    except Exception as exc:  # a broken build is something doctor must report, not raise
        return f"{version}; flashinfer.msa_ops does not import ({type(exc).__name__}: {exc})"
    present = [name for name in MSA_FUNCTIONS if callable(getattr(msa_ops, name, None))]
    missing = [name for name in MSA_FUNCTIONS if name not in present]
    if missing:
        return f"{version}; flashinfer.msa_ops lacks {', '.join(missing)}"
    return f"{version}; {HEALTHY_FLASHINFER}"


def cuda_bindings_problem() -> str | None:
    """What is wrong with the CUDA bindings FlashInfer's msa_ops imports; None when they
    are whole or FlashInfer is not installed."""
    if importlib.util.find_spec("flashinfer") is None:
        return None
    return cuda_bindings.pair_problem()


def cuda_bindings_lines(problem: str | None) -> list[str]:
    """The problem, and the command that repairs it."""
    if problem is None:
        return []
    return [f"  CUDA bindings: {problem}", f"  repair: {cuda_bindings.repair_command()}"]


def serve_config_from(args: argparse.Namespace) -> ServeConfig:
    """The config file (or the shipped configs' defaults) with doctor's overriding flags on
    top, as flags after `--config` override the file for `vllm serve`."""
    config = default_serve_config() if args.config is None else read_serve_config(args.config)
    attention = dict(config.attention_config)
    if args.indexer_kv_dtype is not None:
        attention["indexer_kv_dtype"] = args.indexer_kv_dtype
    if args.indexer_backend is not None:
        attention["minimax_m3_indexer_backend"] = args.indexer_backend
    changes: dict[str, object] = {"attention_config": attention}
    if args.kv_cache_dtype is not None:
        changes["kv_cache_dtype"] = args.kv_cache_dtype
    if args.tensor_parallel_size is not None:
        changes["tensor_parallel_size"] = args.tensor_parallel_size
    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]


def describe_config(config: ServeConfig) -> list[str]:
    attention = ", ".join(f"{key}={value}" for key, value in config.attention_config.items())
    return [
        f"config:       {config.source}",
        f"  tensor-parallel-size {config.tensor_parallel_size} (a rank: "
        f"{config.query_heads_per_rank} query heads, {config.kv_heads_per_rank} KV head(s),"
        f" {config.index_heads_per_rank} index head(s)); kv-cache-dtype {config.kv_cache_dtype};"
        f" block-size {config.block_size or 'unset (128)'}",
        f"  attention-config: {attention or 'unset'}",
    ]


def status_lines(state: patchset.SeriesState, verbose: bool) -> list[str]:
    """The series state; the per-file lines only when something is off (or `--verbose`)."""
    lines = patchset.format_status(state).splitlines()
    if state.clean and not verbose:
        lines = [line for line in lines if not line.startswith("  ")]
    return lines


def main(args: argparse.Namespace) -> int:
    try:
        config = serve_config_from(args)
    except ServeConfigError as error:
        print(f"vllm-minimax: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        checkpoint = checkpoint_row(args)
        w8a8 = w8a8_request(args)
    except (ServeConfigError, ValueError) as error:
        print(f"vllm-minimax: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    state = patchset.series_state(args.target)
    print("\n".join(status_lines(state, args.verbose)))
    logs: list[str] = []
    try:
        return report(args, config, state, logs, checkpoint, w8a8)
    finally:
        if args.verbose and any(logs):
            print("--- what torch, FlashInfer and vLLM printed ---", file=sys.stderr)
            print("".join(logs), file=sys.stderr, end="")


def checkpoint_row(args: argparse.Namespace) -> checkpoint_weights.CheckpointRow | None:
    """With --model, whether the checkpoint carries the config's speculative weights."""
    if getattr(args, "model", None) is None:
        return None
    options = {} if args.config is None else read_serve_options(args.config)
    speculative = checkpoint_weights.speculative_options(options)
    return checkpoint_weights.check(speculative, args.model)


def w8a8_request(args: argparse.Namespace) -> w8a8_doctor.Request | None:
    """The config's W8A8 requantization request (None: it sets no quantization-config)."""
    if args.config is None:
        return None
    return w8a8_doctor.request_of(read_serve_options(args.config), args.config)


def with_w8a8(
    code: int,
    text: str,
    request: w8a8_doctor.Request | None,
    args: argparse.Namespace,
    state: patchset.SeriesState,
    real_capability: tuple[int, int] | None,
) -> tuple[int, str]:
    """The W8A8 row printed, and the exit status once it is counted, as the checkpoint
    row's: a requantization that cannot run is exit 5, a key the engine ignores 3; one not
    checked turns 0 into 4."""
    if request is None:
        return code, text
    simulated = args.capability is not None
    capability = args.capability if simulated else real_capability
    row = w8a8_doctor.row(request, capability, simulated, state, getattr(args, "model", None))
    print(f"W8A8:         {row.outcome.value}: {row.text}")
    if row.stops_serve and code in (EXIT_READY, EXIT_FALLBACK, EXIT_CANNOT_CHECK):
        return EXIT_FAILS, "quantization-config's W8A8 requantization cannot run (see above)"
    if row.falls_back and code in (EXIT_READY, EXIT_CANNOT_CHECK):
        return EXIT_FALLBACK, "starts, but serves without the W8A8 requantization (see above)"
    if row.outcome is w8a8_doctor.Outcome.CANNOT_CHECK and code == EXIT_READY:
        return EXIT_CANNOT_CHECK, "runs as configured, but the W8A8 row was not checked"
    return code, text


def with_checkpoint(
    code: int, text: str, checkpoint: checkpoint_weights.CheckpointRow | None
) -> tuple[int, str]:
    """The exit status once the checkpoint row is counted: missing draft weights stop the
    engine (exit 5); an index not here leaves a ready result unchecked (exit 4)."""
    if checkpoint is None:
        return code, text
    print(f"checkpoint:   {checkpoint.outcome.value}: {checkpoint.text}")
    if checkpoint.stops_serve and code in (EXIT_READY, EXIT_FALLBACK, EXIT_CANNOT_CHECK):
        return EXIT_FAILS, "the checkpoint lacks the speculative draft's weights (see above)"
    if checkpoint.outcome is checkpoint_weights.Outcome.CANNOT_CHECK and code == EXIT_READY:
        return EXIT_CANNOT_CHECK, "runs as configured, but the checkpoint was not checked"
    return code, text


def report(
    args: argparse.Namespace,
    config: ServeConfig,
    state: patchset.SeriesState,
    logs: list[str],
    checkpoint: checkpoint_weights.CheckpointRow | None = None,
    w8a8: w8a8_doctor.Request | None = None,
) -> int:
    with captured_output() as captured:
        gpu, real_capability = gpu_line()
    logs.append(captured.text)
    problem = cuda_bindings_problem()
    store = answer_store(args, state, real_capability, problem)
    flashinfer = stored_flashinfer_line(store, logs)
    if not flashinfer.endswith(HEALTHY_FLASHINFER):
        # Neither read nor stored until repaired: a repair the fingerprint does not see
        # (files put back by hand) must still show.
        store = None
    print(f"GPU:          {gpu}")
    print(f"FlashInfer:   {flashinfer}")
    print("\n".join([*cuda_bindings_lines(problem), *describe_config(config)]))
    code, text = verdict(args, config, state, real_capability, store, logs)
    code, text = with_checkpoint(code, text, checkpoint)
    code, text = with_w8a8(code, text, w8a8, args, state, real_capability)
    if store is not None and store.used:
        print(
            f"stored:       answers above found {min(store.used)} in this same environment,"
            " reused (--no-cache asks FlashInfer and vLLM again)"
        )
    return result(code, text)


def answer_store(
    args: argparse.Namespace,
    state: patchset.SeriesState,
    capability: tuple[int, int] | None,
    cuda_bindings_problem: str | None,
) -> doctor_cache.AnswerStore | None:
    """Where this environment's answers are stored; None with --no-cache, or --verbose
    (which shows what the imports print)."""
    if args.no_cache or args.verbose:
        return None
    fingerprint = doctor_cache.environment_fingerprint(
        (state, cuda_bindings_problem), state.target / patchset.STATE_FILE, capability
    )
    return doctor_cache.AnswerStore(fingerprint)


def stored_flashinfer_line(store: doctor_cache.AnswerStore | None, logs: list[str]) -> str:
    """`flashinfer_line()`, from the store when it holds one for this environment; only a
    line that finds msa_ops whole is stored."""
    question = {"flashinfer": MSA_FUNCTIONS}
    stored = store.load(question) if store is not None else None
    if isinstance(stored, str):
        return stored
    with captured_output() as captured:
        line = flashinfer_line()
    logs.append(captured.text)
    if store is not None and line.endswith(HEALTHY_FLASHINFER):
        store.save(question, line)
    return line


def verdict(
    args: argparse.Namespace,
    config: ServeConfig,
    state: patchset.SeriesState,
    real_capability: tuple[int, int] | None,
    store: doctor_cache.AnswerStore | None,
    logs: list[str],
) -> tuple[int, str]:
    """The selection rows printed, and the exit status with its result line."""
    if not state.clean:
        print("selection:    not checked: the series is not cleanly applied to this vLLM")
        return EXIT_NOT_APPLIED, way_to_a_clean_series(state)
    # Validated by the CLI: a (major, minor) of a known GPU, or None for this machine.
    capability: tuple[int, int] | None = args.capability
    if capability is None and real_capability is None:
        print("selection:    not checked: no GPU here")
        return (
            EXIT_CANNOT_CHECK,
            "pass --capability X.Y for the serving GPU (9.0: H100, H200, H20; 12.0: RTX PRO 6000)",
        )
    simulated = capability is not None
    checked = capability if capability is not None else real_capability
    assert checked is not None
    where = f"simulated compute capability {checked[0]}.{checked[1]}" if simulated else "this GPU"
    print(f"selection:    on {where}")
    from vllm_minimax import selection

    question = {
        "rows": {k: v for k, v in dataclasses.asdict(config).items() if k != "source"},
        "capability": checked,
        "simulated": simulated,
    }
    rows = selection.rows_from_json(store.load(question)) if store is not None else None
    if rows is None:
        rows = select(args, config, state, checked, simulated, logs)
        if store is not None and all(row.component != "vLLM" for row in rows):
            store.save(question, selection.rows_to_json(rows))
    width = max(len(row.component) for row in rows) + 1
    for row in rows:
        print(f"  {row.component + ':':<{width}} {row.backend}: {one_line(row.reason)}")
        if row.hint is not None:
            print(f"  {'':<{width}} change: {row.hint}")
    outcomes = {row.outcome for row in rows}
    if selection.Outcome.FAILS in outcomes:
        return EXIT_FAILS, "vllm serve with this config stops at start-up (see above)"
    if selection.Outcome.FALLBACK in outcomes:
        return EXIT_FALLBACK, "runs, with Triton where FlashInfer could be used"
    return EXIT_READY, "runs as configured"


def select(
    args: argparse.Namespace,
    config: ServeConfig,
    state: patchset.SeriesState,
    checked: tuple[int, int],
    simulated: bool,
    logs: list[str],
) -> list[selection.Row]:
    """vLLM's own selection for the config (`vllm_minimax.selection`), with what it prints
    kept in `logs`; a vLLM that fails to import or to select is a row of its own."""
    from vllm_minimax import selection

    if args.target is not None and sys.path[:1] != [str(state.target)]:
        # Select with the vLLM tree that was checked above, not another one.
        sys.path.insert(0, str(state.target))
    with captured_output() as captured:
        try:
            rows = selection.select_rows(config, checked, simulated=simulated)
        except Exception as exc:  # a vLLM that does not import is a finding, as in status
            rows = [
                selection.Row(
                    "vLLM",
                    "-",
                    f"vLLM at {state.target} failed to import or to run its selection"
                    f" ({type(exc).__name__}: {exc})",
                    selection.Outcome.FAILS,
                )
            ]
    logs.append(captured.text)
    return rows


def way_to_a_clean_series(state: patchset.SeriesState) -> str:
    """What to run when the series is not cleanly applied: `apply` only where it would work."""
    if not state.applied and state.problem is None:
        return "run `vllm-minimax apply` (status shows each file)"
    if state.applied and all(file_state == "as-applied" for _, file_state in state.files):
        # Another revision or release of the series: `apply` refuses until it is reverted.
        return "run `vllm-minimax revert`, then `vllm-minimax apply` (the problem above)"
    return "`vllm-minimax apply` alone does not fix this: see the lines above"


def one_line(text: str) -> str:
    """A multi-line error (pydantic's) as one line, without its pointer to the web."""
    lines = [line.strip() for line in text.splitlines()]
    return "; ".join(line for line in lines if line and not line.startswith("For further"))


def result(code: int, text: str) -> int:
    print(f"result:       {text} (exit {code})")
    return code
