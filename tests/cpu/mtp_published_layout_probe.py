"""vLLM 0.34.0's ``method: mtp`` on the CPU against the published layout without MTP
tensors (`speculative_run.published_layout`), up to the default loader's check; prints JSON.

    python tests/cpu/mtp_published_layout_probe.py TINY_DIR WORK_DIR

Run in a process of its own by test_mtp_published_layout.py, forked from probe_host.py (it
initialises torch.distributed). TINY_DIR is a `make-tiny-model` checkpoint made without
``--mtp-modules``; WORK_DIR receives its published layout. With vLLM's code throughout, as
``LLM(speculative_config={"method": "mtp", ...}, limit_mm_per_prompt={"image": 0, "video": 0})``
builds the engine:

- the target's ``ModelConfig`` and the ``SpeculativeConfig`` that rewrites it into a draft;
- the target (the VL class, tower skipped) on the CPU, and the default loader's
  ``load_weights`` over the checkpoint with its check of parameters not loaded;
- the draft ``MiniMaxM3MTP`` beside it in the same forward context (where a layer name
  shared with the target raises), then the same loader over the same checkpoint.

Only the platform-bound choices vLLM makes at construction are pinned, as in
mtp_draft_probe.py (this host has no GPU); neither changes a parameter or layer name.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from mtp_draft_probe import _pin_platform_choices

IMAGE_AND_VIDEO_OFF = {"image": 0, "video": 0}


def _load(loader, model, model_config) -> str | None:
    """The loader's error, or None when every parameter was loaded."""
    try:
        loader.load_weights(model, model_config)
    except ValueError as exc:
        return str(exc)
    return None


def probe(tiny_dir: Path, work_dir: Path) -> dict:
    import torch
    from vllm.config import (
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model

    from vllm_minimax.testing.speculative_run import published_layout

    work = published_layout(tiny_dir, work_dir)
    target_config = ModelConfig(
        model=str(work),
        tokenizer=str(work),
        dtype="bfloat16",
        limit_mm_per_prompt=IMAGE_AND_VIDEO_OFF,
    )
    parallel_config = ParallelConfig()
    speculative_config = SpeculativeConfig(
        method="mtp",
        num_speculative_tokens=2,
        target_model_config=target_config,
        target_parallel_config=parallel_config,
    )
    vllm_config = VllmConfig(
        model_config=target_config,
        parallel_config=parallel_config,
        speculative_config=speculative_config,
        device_config=DeviceConfig(device="cpu"),
    )
    draft_config = speculative_config.draft_model_config
    result: dict = {
        "target_architectures": list(target_config.architectures),
        "target_is_multimodal": target_config.is_multimodal_model,
        "draft_model_type": draft_config.hf_config.model_type,
        "draft_architectures": list(draft_config.architectures),
        "draft_quantization": draft_config.quantization,
    }
    _pin_platform_choices()
    loader = DefaultModelLoader(LoadConfig())
    context = vllm_config.compilation_config.static_forward_context
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tempfile.mktemp(prefix='mtp-published-')}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        with torch.device("cpu"):
            target = initialize_model(vllm_config=vllm_config)
            result["target_class"] = type(target).__qualname__
            result["target_layers"] = sorted(context)
            result["target_load_error"] = _load(loader, target, target_config)
            try:
                draft = initialize_model(vllm_config=vllm_config, model_config=draft_config)
            except ValueError as exc:
                result["draft_construction_error"] = str(exc)
                return result
            result["draft_construction_error"] = None
            result["draft_class"] = type(draft).__qualname__
            result["draft_layers"] = sorted(set(context) - set(result["target_layers"]))
            result["draft_load_error"] = _load(loader, draft, draft_config)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tiny_dir", type=Path)
    parser.add_argument("work_dir", type=Path)
    args = parser.parse_args(argv)
    print(json.dumps(probe(args.tiny_dir, args.work_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
