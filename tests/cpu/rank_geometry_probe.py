"""Build vLLM 0.34.0's MiniMax M3 on the meta device as one rank of a TP-N run; print each
model's parameter shapes, as JSON.

    python tests/cpu/rank_geometry_probe.py DIR:N [DIR:N ...]

Run in a process of its own by test_rank_geometry.py, forked from probe_host.py (it initialises
torch.distributed for the process). Each DIR goes through vLLM's own ``ModelConfig``
(``load_format: dummy``, as the slice is served) and ``initialize_model`` with the
tensor-parallel group's size set to N and this process its rank 0: no collective runs while a
model is built on the meta device, so vLLM's layers shard exactly as on rank 0 of N GPUs.
``DIR:1`` is a plain TP=1 build. Only the platform-bound choices vLLM makes at construction are
pinned, as in mtp_draft_probe.py (this host has no GPU); neither changes a parameter's shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from mtp_draft_probe import _pin_platform_choices


def rank_shapes(model_dir: Path, tensor_parallel_size: int) -> dict[str, list[int]]:
    import torch
    from vllm.config import (
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized
    from vllm.model_executor.model_loader.utils import initialize_model

    model_config = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), dtype="bfloat16")
    vllm_config = VllmConfig(
        model_config=model_config,
        parallel_config=ParallelConfig(),
        load_config=LoadConfig(load_format="dummy"),
        device_config=DeviceConfig(device="cpu"),
    )
    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"file://{tempfile.mktemp(prefix='rank-probe-')}",
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
        group = get_tp_group()
        vllm_config.compilation_config.static_forward_context.clear()
        group.world_size, group.rank_in_group = tensor_parallel_size, 0
        try:
            with torch.device("meta"):
                model = initialize_model(vllm_config=vllm_config)
        finally:
            group.world_size, group.rank_in_group = 1, 0
    return {name: list(parameter.shape) for name, parameter in model.named_parameters()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", metavar="DIR:N")
    args = parser.parse_args(argv)
    _pin_platform_choices()
    result = {}
    for spec in args.models:
        directory, _, size = spec.rpartition(":")
        result[spec] = rank_shapes(Path(directory), int(size))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
