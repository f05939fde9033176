"""Patch 0006's warm-up compiles every variant of the Triton fused-MoE kernel an engine can reach.

The reference is Triton itself: unquantized `TritonExperts.apply` runs on CPU tensors with
`fused_moe_kernel`'s launches intercepted, and each launch's compile key is what Triton's own
argument binder (`create_function_from_signature` over the kernel's signature) makes of the
arguments: the constexprs and launch options, each integer's type and 1 / divisible-by-16
class, each pointer's dtype and 16-byte alignment. The kernel is the one of the vLLM under test
(its own `fused_moe.py`), so the keys follow that release's signature: 0.34.0's takes the TMA
descriptors and their constexprs, 0.33.0's does not. vLLM's CUDA-only helpers around the GEMMs
(the alignment op's fill, the activation, the sum) become no-ops; every buffer size still comes
from vLLM's Python. The runtime side sweeps every token count 1 to max_num_batched_tokens with
random routing; the warm-up side runs only the token counts `moe_warmup_token_counts` chose.
The two key sets must be equal.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language
from triton.runtime.jit import JITFunction
from triton_launch_keys import compile_key, kernel_from_module
from vllm import _custom_ops
from vllm.model_executor.layers.fused_moe import fused_moe
from vllm.model_executor.layers.fused_moe import triton_moe_warmup as warmup
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEConfig,
    FusedMoEParallelConfig,
    RoutingMethodType,
)
from vllm.model_executor.layers.fused_moe.experts import triton_moe
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

# (experts, top_k, hidden, intermediate per rank): the tiny model of make-tiny-model, and one
# rank of MiniMax M3 at TP 8 (every rank holds all 128 experts, each 3072 wide split 8 ways).
GEOMETRIES = {"tiny": (4, 2, 256, 256), "m3-tp8-rank": (128, 4, 6144, 384)}
MAX_TOKENS = 8192


@functools.cache
def _triton_kernel() -> JITFunction:
    return kernel_from_module(
        fused_moe,
        "fused_moe_kernel",
        (("\ndirect_register_custom_op(", "\n_skip_register = dict("),),
    )


@contextmanager
def _recorded_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    keys: set[str] = set()
    kernel = _triton_kernel()

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                keys.add(compile_key(kernel, args, kwargs))

            return launch

    with monkeypatch.context() as patch:
        patch.setattr(fused_moe, "fused_moe_kernel", Recorder())
        # The tuned-config lookup names the GPU; the engine of issue 15 ran on an H200.
        patch.setattr(fused_moe, "get_device_name_as_file_name", lambda: "NVIDIA_H200")
        patch.setattr(triton_moe, "tl", triton.language)  # apply picks compute_type from it
        patch.setattr(_custom_ops, "moe_align_block_size", lambda *a, **k: None)
        patch.setattr(TritonExperts, "activation", lambda self, *a, **k: None)
        patch.setattr(TritonExperts, "moe_sum", lambda self, *a, **k: None, raising=False)
        yield keys


def _experts(num_experts: int, top_k: int, hidden: int, width: int) -> TritonExperts:
    moe_config = FusedMoEConfig(
        num_experts=num_experts,
        experts_per_token=top_k,
        hidden_dim=hidden,
        intermediate_size=width,
        num_local_experts=num_experts,
        num_logical_experts=num_experts,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16,
        max_num_tokens=MAX_TOKENS,
    )
    return TritonExperts(moe_config, FUSED_MOE_UNQUANTIZED_CONFIG)


def _weights(num_experts: int, hidden: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Never written or read on CPU: empty keeps the 1.2 GB of M3's gate/up weights virtual.
    w1 = torch.empty(num_experts, 2 * width, hidden, dtype=torch.bfloat16)
    w2 = torch.empty(num_experts, hidden, width, dtype=torch.bfloat16)
    return w1, w2


def _geometry(experts: TritonExperts, w1, w2) -> warmup.TritonMoEGeometry:
    return warmup.TritonMoEGeometry(
        w1_shape=tuple(w1.shape),
        w2_shape=tuple(w2.shape),
        top_k=experts.moe_config.experts_per_token,
        dtype=w1.dtype,
        config_dtype=experts.quant_config.config_name(w1.dtype),
        activation=experts.moe_config.activation,
        max_num_tokens=MAX_TOKENS,
    )


def _engine_step(experts: TritonExperts, w1, w2, routing: torch.Tensor, m: int) -> None:
    """One step of ``m`` tokens as the modular kernel hands it to ``apply``."""
    num_experts, n, k = w1.shape
    top_k = routing.size(1)
    ws13, ws2, out_shape = experts.workspace_shapes(
        m, n, k, top_k, num_experts, num_experts, None, MoEActivation.SILU
    )
    experts.apply(
        output=torch.empty(out_shape, dtype=w1.dtype),
        hidden_states=torch.empty(m, k, dtype=w1.dtype),
        w1=w1,
        w2=w2,
        topk_weights=torch.rand(m, top_k),
        topk_ids=routing[:m],
        activation=MoEActivation.SILU,
        global_num_experts=num_experts,
        expert_map=None,
        a1q_scale=None,
        a2_scale=None,
        workspace13=torch.empty(ws13, dtype=w1.dtype),
        workspace2=torch.empty(ws2, dtype=w1.dtype),
        expert_tokens_meta=None,
        apply_router_weight_on_input=False,
    )


@pytest.mark.parametrize("name", GEOMETRIES)
def test_warmup_covers_every_fused_moe_variant(name, monkeypatch):
    num_experts, top_k, hidden, width = GEOMETRIES[name]
    experts = _experts(*GEOMETRIES[name])
    w1, w2 = _weights(num_experts, hidden, width)
    routing = torch.rand(MAX_TOKENS, num_experts).argsort(dim=1)[:, :top_k].to(torch.int32)
    with _recorded_launches(monkeypatch) as reachable:
        for m in range(1, MAX_TOKENS + 1):
            _engine_step(experts, w1, w2, routing, m)
    token_counts = warmup.moe_warmup_token_counts(_geometry(experts, w1, w2))
    with _recorded_launches(monkeypatch) as warmed:
        for m in token_counts:
            warmup.run_moe_launch(experts, w1, w2, m)
    assert reachable - warmed == set(), f"{name}: variants the warm-up misses"
    assert warmed - reachable == set(), f"{name}: the warm-up compiles unreachable variants"
    assert len(token_counts) == len(set(token_counts))


def _layer(experts: TritonExperts, w1, w2, expert_map=None) -> SimpleNamespace:
    return SimpleNamespace(w13_weight=w1, w2_weight=w2, expert_map=expert_map)


@pytest.mark.parametrize("jit_warmup", [True, False])
def test_registration_follows_enable_jit_warmup(jit_warmup, monkeypatch):
    compiled = []
    monkeypatch.setattr(warmup._JIT, "compile", compiled.append)
    config = SimpleNamespace(
        kernel_config=SimpleNamespace(enable_jit_warmup=jit_warmup),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=MAX_TOKENS),
    )
    monkeypatch.setattr(warmup, "get_current_vllm_config", lambda: config)
    experts = _experts(*GEOMETRIES["tiny"])
    w1, w2 = _weights(4, 256, 256)
    kernel = SimpleNamespace(fused_experts=experts)
    registry = JitWarmupRegistry(vllm_config=None)
    with registry.activate():
        for _layer_index in range(3):  # every MoE layer of one geometry registers it once
            warmup.register_triton_moe_warmup(_layer(experts, w1, w2), kernel)
        # Expert parallelism: not covered, nothing registered.
        warmup.register_triton_moe_warmup(
            _layer(experts, w1, w2, expert_map=torch.arange(4)), kernel
        )
    assert len(registry) == (1 if jit_warmup else 0)
    registry.warmup()
    assert compiled == ([_geometry(experts, w1, w2)] if jit_warmup else [])


@pytest.fixture
def engine(monkeypatch):
    """A JIT warm-up registry with the module's layer table emptied, the launches of each
    warm-up recorded as the (experts, w1, w2) they ran on."""
    monkeypatch.setattr(warmup._JIT, "_layers", {})
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)
    config = SimpleNamespace(
        kernel_config=SimpleNamespace(enable_jit_warmup=True),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
    )
    monkeypatch.setattr(warmup, "get_current_vllm_config", lambda: config)
    monkeypatch.setattr(fused_moe, "get_device_name_as_file_name", lambda: "NVIDIA_H200")
    launches: list[tuple] = []
    monkeypatch.setattr(
        warmup, "run_moe_launch", lambda experts, w1, w2, m: launches.append((experts, w1, w2))
    )
    return SimpleNamespace(registry=JitWarmupRegistry(vllm_config=None), launches=launches)


def _register_tiny_layer(engine) -> tuple[TritonExperts, torch.Tensor, torch.Tensor]:
    """A new layer of the tiny model's geometry, registered in ``engine``'s registry."""
    experts = _experts(*GEOMETRIES["tiny"])
    w1, w2 = _weights(4, 256, 256)
    with engine.registry.activate():
        warmup.register_triton_moe_warmup(
            _layer(experts, w1, w2), SimpleNamespace(fused_experts=experts)
        )
    return experts, w1, w2


def test_weights_moved_off_their_device_after_registration_are_not_launched_on(engine):
    """CPU offload without UVA: vLLM moves offloaded weights to the GPU for
    process_weights_after_loading (where the layer registers) and rebinds the same
    parameters to host copies afterwards. The warm-up must not launch on those."""
    _, w1, _ = _register_tiny_layer(engine)
    [(geometry, [held])] = warmup._JIT._layers.items()
    assert held.device == w1.device
    _pretend_registered_on_a_gpu(geometry, 0)
    engine.registry.warmup()
    assert engine.launches == []
    assert warmup._JIT._layers == {}, "a skipped layer is let go of too"


def _pretend_registered_on_a_gpu(geometry, index: int) -> None:
    """This host has no GPU: make the record of the geometry's ``index``-th layer say its
    weights were on one when it registered, as inside vLLM's device_loading_context; they are
    on the host now, as after CPU offload without UVA."""
    held = warmup._JIT._layers[geometry]
    held[index] = dataclasses.replace(held[index], device=torch.device("cuda", 0))


def test_an_offloaded_first_layer_hands_the_warmup_to_a_resident_one(engine):
    """The offloader moves layers in module order until its budget is spent, so the first
    layer of a geometry is the one likely moved: the warm-up runs on a later one instead."""
    _register_tiny_layer(engine)
    resident, w1, w2 = _register_tiny_layer(engine)
    [geometry] = warmup._JIT._layers
    _pretend_registered_on_a_gpu(geometry, 0)
    engine.registry.warmup()
    assert engine.launches
    assert all(
        launch[0] is resident and launch[1] is w1 and launch[2] is w2 for launch in engine.launches
    )


def test_the_skip_names_the_weight_that_moved():
    w1, w2 = _weights(4, 256, 256)
    record = warmup._RegisteredLayer(_experts(*GEOMETRIES["tiny"]), w1, w2, torch.device("cuda", 0))
    assert record.skip_reason() == "weights left cuda:0 (w13 is on cpu, w2 is on cpu)"
    record = dataclasses.replace(record, w1=w1.to("meta"), device=torch.device("cpu"))
    assert record.skip_reason() == "weights left cpu (w13 is on meta)"
    assert dataclasses.replace(record, w1=w1).skip_reason() is None


def test_a_layer_registered_with_no_active_registry_is_not_held(engine):
    """A model loaded outside the runner's registry (vLLM loads a draft model so) registers
    nothing, so nothing keeps its weights alive."""
    experts = _experts(*GEOMETRIES["tiny"])
    w1, w2 = _weights(4, 256, 256)
    warmup.register_triton_moe_warmup(
        _layer(experts, w1, w2), SimpleNamespace(fused_experts=experts)
    )
    assert warmup._JIT._layers == {}
    assert len(engine.registry) == 0


def test_a_second_warmup_of_the_same_registry_launches_nothing_more(engine):
    _register_tiny_layer(engine)
    engine.registry.warmup()
    launched = len(engine.launches)
    assert launched
    engine.registry.warmup()
    assert len(engine.launches) == launched


def test_a_lora_context_set_after_registration_skips_the_layer(engine):
    experts, _, _ = _register_tiny_layer(engine)
    experts.set_lora_context(SimpleNamespace())
    engine.registry.warmup()
    assert engine.launches == []


def test_the_warmup_lets_go_of_the_layer_and_a_later_engine_warms_its_own(engine):
    first, first_w1, first_w2 = _register_tiny_layer(engine)
    engine.registry.warmup()
    assert engine.launches and all(launch[0] is first for launch in engine.launches)
    released = weakref.ref(first_w1)
    engine.launches.clear()
    del first, first_w1, first_w2
    gc.collect()
    assert released() is None, "the warm-up kept a released engine's weights alive"

    engine.registry = JitWarmupRegistry(vllm_config=None)
    second, w1, w2 = _register_tiny_layer(engine)
    engine.registry.warmup()
    assert engine.launches
    assert all(
        launch[0] is second and launch[1] is w1 and launch[2] is w2 for launch in engine.launches
    )
