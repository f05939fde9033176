"""Build vLLM 0.34.0's own MiniMax M3 MTP draft on the CPU; print what it did, as JSON.

    python tests/cpu/mtp_draft_probe.py TINY_DIR [--drop CHECKPOINT_NAME]

Run in a process of its own by test_tiny_model.py, forked from probe_host.py (it
initialises torch.distributed for the process). TINY_DIR is a `make-tiny-model
--mtp-modules N` checkpoint; the draft is `TINY_DIR/mtp`. What it does, with vLLM's code throughout:

- `SpeculativeConfig(method="mtp", model=TINY_DIR/mtp)` over the target's
  `ModelConfig`, as `LLM(speculative_config=...)` builds it;
- `MiniMaxM3MTP` on the CPU from that config, `load_weights` over the
  checkpoint, then the default loader's strict check (`track_weights_loading`:
  every parameter and every fused-projection shard must come from the checkpoint);
- `--drop` leaves one checkpoint tensor out of the load (the strict check must
  then name it);
- the target `MiniMaxM3SparseForCausalLM` on the meta device, then the draft
  beside it with vLLM's empty prefix (which collides) and, after the e2e
  harness's `mtp_draft.install()`, as vLLM's registry resolves the draft's
  architecture (the prefixed class, which does not collide).

vLLM's own draft class is passed explicitly until then: `get_model_architecture`
caches what the registry resolved for a model config, and the last build must be
the registry's first resolution of the draft.

Only the platform-bound choices vLLM makes at construction are pinned (this host
has no GPU): the unquantized MoE backend (Triton) and the full-attention backend
(Triton); neither changes a parameter name.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def _pin_platform_choices() -> None:
    import vllm.model_executor.layers.attention.attention as attention
    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as moe_method
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    moe_method.select_unquantized_moe_backend = lambda moe_config: (
        UnquantizedMoeBackend.TRITON,
        None,
    )
    triton_attention = AttentionBackendEnum.TRITON_ATTN.get_class()
    attention.get_attn_backend = lambda *args, **kwargs: triton_attention


def probe(tiny_dir: Path, drop: str | None = None) -> dict:
    import torch
    from safetensors.torch import load_file
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
    from vllm.models.minimax_m3 import MiniMaxM3MTP

    from vllm_minimax.testing import mtp_draft

    target_config = ModelConfig(model=str(tiny_dir), tokenizer=str(tiny_dir), dtype="bfloat16")
    parallel_config = ParallelConfig()
    speculative_config = SpeculativeConfig(
        method="mtp",
        model=str(tiny_dir / "mtp"),
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
        "draft_model_type": draft_config.hf_config.model_type,
        "draft_architectures": list(draft_config.architectures),
        "n_predict": getattr(draft_config.hf_config, "n_predict", None),
        "num_mtp_modules": speculative_config.num_mtp_modules(),
        "multi_module_speculator": speculative_config.use_multi_module_mtp(),
    }
    _pin_platform_choices()
    checkpoint = load_file(str(tiny_dir / "mtp" / "model.safetensors"))
    to_load = {name: tensor for name, tensor in checkpoint.items() if name != drop}
    context = vllm_config.compilation_config.static_forward_context
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tempfile.mktemp(prefix='mtp-probe-')}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)

        with torch.device("cpu"):
            draft = initialize_model(
                vllm_config=vllm_config, model_config=draft_config, model_class=MiniMaxM3MTP
            )
        result["unmapped_checkpoint_names"] = sorted(
            name for name in checkpoint if draft._map_checkpoint_name(name) is None
        )
        result["parameters"] = sorted(name for name, _ in draft.named_parameters())
        loaded = draft.load_weights(iter(to_load.items()))
        result["loaded"] = sorted(loaded)
        try:
            DefaultModelLoader(LoadConfig()).track_weights_loading(draft, set(loaded))
            result["strict_check_error"] = None
        except ValueError as exc:
            result["strict_check_error"] = str(exc)
        params = dict(draft.named_parameters())
        result["loaded_values_equal"] = {
            name: bool(torch.equal(params[name].data, checkpoint[draft_to_checkpoint_name(name)]))
            for name in ("model.layers.0.eh_proj.weight", "model.layers.0.enorm.weight")
        }

        context.clear()
        with torch.device("meta"):
            initialize_model(vllm_config=vllm_config)
            result["target_layers"] = sorted(context)
            try:
                initialize_model(
                    vllm_config=vllm_config, model_config=draft_config, model_class=MiniMaxM3MTP
                )
                result["collision_error"] = None
            except ValueError as exc:
                result["collision_error"] = str(exc)
            for name in set(context) - set(result["target_layers"]):
                del context[name]
            mtp_draft.install()
            prefixed = initialize_model(vllm_config=vllm_config, model_config=draft_config)
            result["draft_class_after_install"] = type(prefixed).__qualname__
            result["draft_layers_with_harness_prefix"] = sorted(
                set(context) - set(result["target_layers"])
            )
    return result


def draft_to_checkpoint_name(parameter: str) -> str:
    return parameter.replace("model.layers.", "model.mtp.layers.", 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tiny_dir", type=Path)
    parser.add_argument("--drop", default=None, help="a checkpoint tensor to leave out")
    args = parser.parse_args(argv)
    print(json.dumps(probe(args.tiny_dir, drop=args.drop)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
