"""Which import initialises torch's CUDA state when vLLM's MiniMax M3 model is imported.

    python tests/gpu_e2e/cuda_init_probe.py [MODULE]

Wraps `torch.cuda._lazy_init` (every path to CUDA initialisation goes through it,
tensor creation on a CUDA device included) to keep the stack of its first call,
imports MODULE (default `vllm.models.minimax_m3`, what the old serve-chat launcher
imported before vLLM's server), and prints whether CUDA got initialised and from
where. A diagnostic for the H200 run: vLLM switches its engine core to `spawn`
when CUDA is initialised in the API server process.
"""

from __future__ import annotations

import importlib
import sys
import traceback

import torch


def main(argv: list[str]) -> int:
    module = argv[0] if argv else "vllm.models.minimax_m3"
    stacks: list[str] = []
    original = torch.cuda._lazy_init

    def recording_lazy_init() -> None:
        if not stacks and not torch.cuda.is_initialized():
            stacks.append("".join(traceback.format_stack()[:-1]))
        original()

    torch.cuda._lazy_init = recording_lazy_init
    importlib.import_module(module)
    print(f"import {module}: torch.cuda.is_initialized() = {torch.cuda.is_initialized()}")
    print(stacks[0] if stacks else "torch.cuda._lazy_init was not called")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
