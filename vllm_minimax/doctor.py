"""`vllm-minimax doctor`: what this machine (or a given GPU) would run.

It reports the series state, the GPU, the FlashInfer build, and the MiniMax M3
indexer the patched vLLM selects, by calling vLLM's own selection code through
`vllm_minimax.probe` (with `--capability`, on a simulated GPU of that kind).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys

from vllm_minimax import patchset, probe

MSA_FUNCTIONS = ("msa_proxy_score", "msa_topk_select")


def gpu_line() -> tuple[str, tuple[int, int] | None]:
    """A description of the first CUDA GPU and its capability, without vLLM."""
    if importlib.util.find_spec("torch") is None:
        return "none (torch is not installed)", None
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
    return f"{version}; flashinfer.msa_ops has {' and '.join(present)}"


def main(args: argparse.Namespace) -> int:
    state = patchset.series_state(args.target)
    print(patchset.format_status(state))
    gpu, real_capability = gpu_line()
    print(f"GPU:          {gpu}")
    print(f"FlashInfer:   {flashinfer_line()}")

    if not state.clean:
        print("indexer:      not checked: the series is not cleanly applied to this vLLM")
        return 1
    # Validated by the CLI: a (major, minor) of a known GPU, or None for this machine.
    capability: tuple[int, int] | None = args.capability
    if args.target is not None:
        # Select with the vLLM tree that was checked above, not another one.
        sys.path.insert(0, str(state.target))
    dtype = args.indexer_kv_dtype or "bf16"
    topk_blocks = 16 if args.topk_blocks is None else args.topk_blocks
    try:
        selection = probe.select_indexer(
            indexer_kv_dtype=dtype,
            topk_blocks=topk_blocks,
            indexer_backend=args.indexer_backend,
            capability=capability,
        )
    except Exception as exc:  # a vLLM that does not import is a finding, like a broken FlashInfer
        print(
            f"indexer:      not checked: vLLM at {state.target} failed to import or to run its"
            f" selection ({type(exc).__name__}: {exc})"
        )
        return 1
    if capability is not None:
        where = f"simulated compute capability {capability[0]}.{capability[1]}"
    elif real_capability is not None:
        where = "this GPU"
    else:
        where = "this machine (no GPU; pass --capability X.Y to ask for one)"
    print(
        f"indexer:      on {where}, indexer_kv_dtype={dtype}, topk_blocks={topk_blocks}, "
        f"minimax_m3_indexer_backend={args.indexer_backend}"
    )
    print(f"  -> {selection.describe()}")
    return 0 if selection.error is None else 1
