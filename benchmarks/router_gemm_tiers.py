"""Which router GEMM vLLM 0.34.0's ``GateLinear`` takes on an SM90 GPU for a gate shape, and
what it registers with vLLM's JIT warm-up (issue 64): run on the CPU, on a simulated SM90.

    python -m benchmarks.router_gemm_tiers [HIDDEN:EXPERTS ...]

MiniMax M3 builds its router as ``GateLinear(hidden_size, num_local_experts)`` with fp32
weights and fp32 logits. A shape in ``GateLinear.FP32_SUPPORTED_SHAPES`` runs vLLM's
precompiled fp32 router kernel up to 32 tokens; any other shape compiles the CuTe-DSL
``LLFp32WGemm`` for every token count 1 to 32 in bf16 and fp32 activations (64 compile keys,
in the process only: ``cute.compile`` writes no file cache). Both register the CuTe-DSL
bf16x3 kernel for larger batches. The default shapes: M3 as deployed (6144 x 128: its gate
is over all 128 experts at any TP or EP size), the EP-8 rank slice (6144 x 16) and the tiny
model (256 x 4). Prints one JSON line per shape.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

DEFAULT_SHAPES = ((6144, 128), (6144, 16), (256, 4))
GATE_MODULE = "vllm.model_executor.layers.fused_moe.router.gate_linear"


def _init_cpu_group() -> None:
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tempfile.mktemp(prefix='router-tiers-')}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)


def gate_tiers(hidden: int, experts: int) -> dict[str, Any]:
    """The tiers ``GateLinear`` allows for an fp32 gate of this shape on SM90, and the JIT
    kernels it registers (with LLFp32WGemm's compile keys counted)."""
    import torch
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    from vllm_minimax.probe import platform_override, simulated_cuda_platform

    _init_cpu_group()
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    registry = JitWarmupRegistry(config)
    with (
        set_current_vllm_config(config),
        platform_override(simulated_cuda_platform((9, 0)), (GATE_MODULE,)),
        registry.activate(),
    ):
        from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

        gate = GateLinear(
            hidden,
            experts,
            bias=False,
            params_dtype=torch.float32,
            out_dtype=torch.float32,
            prefix="gate",
        )
    registered: dict[str, Any] = {}
    for kernel, registrations in registry._registrations.items():
        name = type(kernel).__name__
        if name == "LLFp32WGemm":  # its keys need no device to list
            registered[name] = sum(len(kernel.get_warmup_keys(*a, **k)) for a, k in registrations)
        else:
            registered[name] = "registered"
    return {
        "shape": [hidden, experts],
        "precompiled_fp32_router": gate.allow_fp32_router_gemm,
        "jit_kernels": registered,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        shapes = [tuple(int(part) for part in arg.split(":")) for arg in args] or DEFAULT_SHAPES
    except ValueError:
        print("router_gemm_tiers: shapes are HIDDEN:EXPERTS, e.g. 6144:128", file=sys.stderr)
        return 2
    if any(len(shape) != 2 for shape in shapes):
        print("router_gemm_tiers: shapes are HIDDEN:EXPERTS, e.g. 6144:128", file=sys.stderr)
        return 2
    for hidden, experts in shapes:
        print(json.dumps(gate_tiers(hidden, experts)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
