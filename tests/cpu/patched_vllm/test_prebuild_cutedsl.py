"""`warmup --prebuild`'s CuTe-DSL step (`prebuild_cutedsl`) against the patched vLLM, on this CPU.

- The keys are what vLLM's `GateLinear` registers: for the EP-8 rank slice's 6144 x 16 gate,
  the 64 `LLFp32WGemm` keys its forward dispatches for 1 to 32 tokens in bf16 and fp32 and the
  `Sm90BF16x3RouterGemmKernel` tile configs of 1 to max_num_batched_tokens tokens on the GPU's
  SM count; MiniMax M3's 6144 x 128 gate (a precompiled fp32 kernel) registers no
  `LLFp32WGemm`.
- The entries it writes load in a fresh process that builds the gate as a GPU start does, the
  CuTe DSL detecting its arch from an SM90 device's capability, with no `cute.compile`: the
  digests agree. A subset (2 tokens, 64 batched tokens: 4 + 1 keys, ~0.5 s a compile here)
  keeps it to seconds; the full sets are the same code over more keys.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from vllm.model_executor.kernels.linear.cute_dsl import ll_fp32w
from vllm.model_executor.layers.fused_moe.router import bf16x3_router_gemm_sm90 as bf16x3
from vllm.model_executor.layers.fused_moe.router import gate_linear
from vllm.model_executor.warmup import jit_warmup_cutedsl_cache as cache

from vllm_minimax import prebuild_cutedsl, prebuild_inputs
from vllm_minimax.m3_geometry import rank_text_config
from vllm_minimax.prebuild_cutedsl import GateShape
from vllm_minimax.prebuild_inputs import GPU_TARGETS, PrebuildError

H200, H20 = GPU_TARGETS["h200"], GPU_TARGETS["h20"]
SLICE_GATE, M3_GATE = GateShape(6144, 16), GateShape(6144, 128)
LL, BF16X3 = ll_fp32w.LLFp32WGemm, bf16x3.Sm90BF16x3RouterGemmKernel


def _dsl_arch(monkeypatch, arch: str) -> None:
    """The CuTe DSL's target, as CUTE_DSL_ARCH sets it (it reads the variable once)."""
    from cutlass.cutlass_dsl import CuTeDSL

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    monkeypatch.setattr(CuTeDSL._get_dsl().envar, "_arch", arch)


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    """A fresh vLLM cache root, the CuTe DSL targeting SM90a as the prebuild sets it."""
    _dsl_arch(monkeypatch, "sm_90a")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    monkeypatch.delenv("VLLM_DISABLE_CUTEDSL_CACHE", raising=False)
    monkeypatch.setattr(cache, "_unreadable", set())
    monkeypatch.setattr(cache, "_unwritable", set())
    return tmp_path / "vllm"


def _dispatched_ll(gate: GateShape, max_tokens: int = 32) -> set:
    """The keys the gate's forward hands `LLFp32WGemm` (tier 3: up to 32 tokens)."""
    kernel = LL()
    return {
        kernel.dispatch(M=m, K=gate.hidden_size, N=gate.num_experts, a_dtype=dtype)
        for m in range(1, max_tokens + 1)
        for dtype in (torch.bfloat16, torch.float32)
    }


def _dispatched_bf16x3(gate: GateShape, max_tokens: int, sm_count: int) -> set:
    kernel = BF16X3()
    return {
        kernel.dispatch(num_tokens=t, K=gate.hidden_size, E=gate.num_experts, num_sms=sm_count)
        for t in range(1, max_tokens + 1)
    }


def test_the_slices_gate_registers_both_router_gemms():
    keys = prebuild_cutedsl.registered_keys(SLICE_GATE, 8192, 1024, H200)
    assert set(keys) == {LL, BF16X3}
    assert len(keys[LL]) == 64 and set(keys[LL]) == _dispatched_ll(SLICE_GATE)
    assert set(keys[BF16X3]) == _dispatched_bf16x3(SLICE_GATE, 8192, 132)
    assert len(keys[BF16X3]) == 9


def test_m3s_gate_registers_no_llfp32w_and_the_sm_count_picks_the_tiles():
    """6144 x 128 is in GateLinear.FP32_SUPPORTED_SHAPES: a precompiled kernel, no LLFp32WGemm.
    An H20's 78 SMs pick other tile configs than an H200's 132."""
    on_h200 = prebuild_cutedsl.registered_keys(M3_GATE, 8192, 1024, H200)
    on_h20 = prebuild_cutedsl.registered_keys(M3_GATE, 8192, 1024, H20)
    assert set(on_h200) == set(on_h20) == {BF16X3}
    assert set(on_h200[BF16X3]) == _dispatched_bf16x3(M3_GATE, 8192, 132)
    assert set(on_h20[BF16X3]) == _dispatched_bf16x3(M3_GATE, 8192, 78)
    assert set(on_h200[BF16X3]) != set(on_h20[BF16X3])


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return path


def _model(tmp_path: Path) -> tuple[str, prebuild_inputs.ModelGeometry]:
    model = tmp_path / "slice"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(rank_text_config(8, experts="ep")))
    return str(model), prebuild_inputs.read_model_geometry(str(model))


def test_plans_follow_the_config_and_the_model(tmp_path, monkeypatch):
    model, geometry = _model(tmp_path)
    assert prebuild_cutedsl.gate_shape(model)[0] == SLICE_GATE
    assert prebuild_cutedsl.gate_shape("MiniMaxAI/MiniMax-M3-MXFP8")[0] == M3_GATE
    config = _config(tmp_path, "max-model-len: 4096\nmax-num-batched-tokens: 2048\n")
    [plan] = prebuild_cutedsl.plans_for([config], [None], model, geometry, [H200])
    assert plan.skipped is None and plan.max_num_batched_tokens == 2048
    assert set(plan.keys[BF16X3]) == _dispatched_bf16x3(SLICE_GATE, 2048, 132)
    eager = _config(tmp_path, "max-model-len: 4096\nenforce-eager: true\n")
    [plan] = prebuild_cutedsl.plans_for([eager], [None], model, geometry, [H200])
    assert plan.skipped and "enforce-eager" in plan.skipped and not plan.keys
    monkeypatch.setenv("VLLM_DISABLE_CUTEDSL_CACHE", "1")
    [plan] = prebuild_cutedsl.plans_for([config], [None], model, geometry, [H200])
    assert plan.skipped and "VLLM_DISABLE_CUTEDSL_CACHE" in plan.skipped


def test_another_arch_or_an_unwritable_cache_stops_it_before_it_builds(root, monkeypatch, tmp_path):
    key = LL().dispatch(M=1, K=64, N=4, a_dtype=torch.float32)
    plan = prebuild_cutedsl.CuteDslPlan("h200", 64, {LL: [key]})
    _dsl_arch(monkeypatch, "sm_100a")
    with pytest.raises(PrebuildError, match=r"another arch than sm_90a .*CUTE_DSL_ARCH=sm_90a"):
        prebuild_cutedsl.check_ready([plan])
    _dsl_arch(monkeypatch, "sm_90a")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(blocker / "vllm"))
    with pytest.raises(PrebuildError, match=f"{blocker}/vllm/cutedsl cannot be created"):
        prebuild_cutedsl.check_ready([plan])
    assert not (tmp_path / "vllm").exists()


def test_a_compile_that_fails_is_one_error_naming_the_key(root, monkeypatch):
    import cutlass.cute as cute

    def fail(*args, **kwargs):
        raise RuntimeError("\x1b[91merror:\x1b[0m ptxas died\n  --> the kernel's source line")

    monkeypatch.setattr(cute, "compile", fail)
    key = LL().dispatch(M=1, K=64, N=4, a_dtype=torch.float32)
    plan = prebuild_cutedsl.CuteDslPlan("h200", 64, {LL: [key]})
    with pytest.raises(PrebuildError) as error:
        prebuild_cutedsl.prebuild([plan], GPU_TARGETS, False, lambda text: None)
    assert str(error.value) == (
        f"the CuTe DSL could not compile LLFp32WGemm {key!r}: error: ptxas died (the entries"
        " finished before it stay in the cache)"
    )


# What a GPU start does with the gate, in a fresh process: vLLM's JIT warm-up over the keys its
# GateLinear registers, patch 0010 loading each. What only a GPU answers is given as an SM90
# answers it: the compute capability the CuTe DSL detects its arch from (no CUTE_DSL_ARCH), PDL
# (vLLM's CUDA platform: from SM90 on), the SM count; the stream and the TP group of one rank
# as the CPU must have them.
_GPU_START = textwrap.dedent(
    """
    import json, sys
    from types import SimpleNamespace

    from cutlass.base_dsl import env_manager
    env_manager.get_compute_capability_major_minor = lambda device_id=0: (9, 0)
    import cutlass.cute as cute
    import torch
    from vllm.config import DeviceConfig, SchedulerConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.kernels.linear.cute_dsl import ll_fp32w
    from vllm.model_executor.layers.fused_moe.router import bf16x3_router_gemm_sm90 as bf16x3
    from vllm.model_executor.layers.fused_moe.router import gate_linear
    from vllm.model_executor.warmup import jit_warmup_cutedsl_cache as cache
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
    from vllm_minimax.probe import simulated_cuda_platform

    hidden, experts, fp32_tokens, batched, seqs = (int(a) for a in sys.argv[1:6])
    gate_linear.current_platform = simulated_cuda_platform((9, 0))
    gate_linear.GateLinear.FP32_MAX_TOKENS = fp32_tokens
    ll_fp32w.use_pdl = lambda: True
    ll_fp32w.current_cuda_stream = lambda: cute.runtime.make_fake_stream(
        use_tvm_ffi_env_stream=False
    )
    bf16x3.num_compute_units = lambda device_id: 132
    torch.accelerator.current_device_index = lambda: 0
    parallel_state._TP = SimpleNamespace(rank_in_group=0, world_size=1)
    compiles = []
    inner = cute.compile
    cute.compile = lambda *a, **k: compiles.append(type(a[0]).__name__) or inner(*a, **k)

    scheduler = SchedulerConfig(
        max_num_batched_tokens=batched,
        max_num_seqs=seqs,
        max_model_len=batched,
        is_encoder_decoder=False,
    )
    config = VllmConfig(scheduler_config=scheduler, device_config=DeviceConfig(device="cpu"))
    registry = JitWarmupRegistry(config)
    with set_current_vllm_config(config), registry.activate():
        gate_linear.GateLinear(
            hidden, experts, bias=False, params_dtype=torch.float32, out_dtype=torch.float32
        )
    registry.warmup()
    kernels = {
        type(k).__qualname__: {repr(key): type(e).__name__ for key, e in k._compiled_cache.items()}
        for k in (ll_fp32w.LL_FP32W_GEMM_KERNEL, bf16x3._SM90_BF16X3_ROUTER_GEMM_KERNEL)
    }
    settings = cache.cute_dsl_settings()
    print(json.dumps({"compiles": compiles, "kernels": kernels, "settings": settings}))
    """
)


def test_the_prebuilt_entries_load_in_a_gpu_start_without_compiling(
    root, monkeypatch, tmp_path, patched_vllm_root, capsys
):
    monkeypatch.setattr(gate_linear.GateLinear, "FP32_MAX_TOKENS", 2)
    model, geometry = _model(tmp_path)
    config = _config(tmp_path, "max-model-len: 4096\nmax-num-batched-tokens: 64\nmax-num-seqs: 8\n")
    plans = prebuild_cutedsl.plans_for([config], [None], model, geometry, [H200])
    assert prebuild_cutedsl.prebuild(plans, GPU_TARGETS, False, print) == 5
    out = capsys.readouterr().out
    assert "cutedsl (h200): 4 LLFp32WGemm, 1 Sm90BF16x3RouterGemmKernel keys" in out
    assert "cutedsl: 5 entries, 5 built, 0 already there" in out
    [plan] = plans
    assert set(plan.keys[LL]) == _dispatched_ll(SLICE_GATE, 2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(patched_vllm_root), os.getcwd()])}
    env.pop("CUTE_DSL_ARCH")
    argv = [sys.executable, "-c", _GPU_START, "6144", "16", "2", "64", "8"]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["settings"] == cache.cute_dsl_settings()
    assert report["compiles"] == [], "the GPU start compiled what the prebuild built"
    assert report["kernels"] == {
        cls.__qualname__: dict.fromkeys(map(repr, keys), "Function")
        for cls, keys in plan.keys.items()
    }
    assert prebuild_cutedsl.prebuild(plans, GPU_TARGETS, False, print) == 5
    assert "cutedsl: 5 entries, 0 built, 5 already there" in capsys.readouterr().out
