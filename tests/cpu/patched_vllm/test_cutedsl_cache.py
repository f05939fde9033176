"""Patch 0010's file cache of vLLM's CuTe-DSL router GEMMs, on this CPU-only host.

The kernels are the real ones (`LLFp32WGemm`, `Sm90BF16x3RouterGemmKernel`), compiled by the
CuTe DSL for SM90a (`CUTE_DSL_ARCH`), which needs no GPU, exported and loaded with
`cute.runtime.load_module`, which needs none either. `LLFp32WGemm` compiles with the current
CUDA stream as an argument; here a fake stream without TVM-FFI's environment stream stands in,
which gives the compiled function the same stream parameter (`Stream`) a `CUstream` does.

What the CPU cannot show: a loaded executor launching on a GPU. What it shows: the loaded
function takes the compiled one's arguments (the same signature, checked by the function
itself on CPU tensors, which it refuses for their device after accepting their count), every
factor of the key names another entry, a stale or damaged entry is compiled again, an
unwritable root only warns, the writes are atomic, and vLLM's JIT monitor still sees a compile
after the warm-up. That a fresh process, starting as a GPU start does, loads every entry
without calling `cute.compile` is test_prebuild_cutedsl.py's (its entries are written through
the same `compile`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

import cutlass.cute as cute
import pytest
import torch
from vllm.model_executor.kernels.linear.cute_dsl import ll_fp32w
from vllm.model_executor.warmup import jit_warmup_cutedsl_cache as cache
from vllm.utils import jit_monitor

HAS_BF16X3 = (
    importlib.util.find_spec("vllm.model_executor.layers.fused_moe.router.bf16x3_router_gemm_sm90")
    is not None
)
needs_bf16x3 = pytest.mark.skipif(
    not HAS_BF16X3, reason="this vLLM release has no Sm90BF16x3RouterGemmKernel"
)

# The EP-8 rank slice's gate: 6144 x 16, fp32.
K, N = 6144, 16


def _fake_stream():
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=False)


class CompileCounter:
    """`cute.compile`, counted (both kernels look it up at each call)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    """A fresh vLLM cache root, SM90a as the CuTe DSL's target, PDL on as on SM90."""
    from cutlass.cutlass_dsl import CuTeDSL

    # The DSL reads CUTE_DSL_ARCH once, when it is first imported (on a CPU it then defaults
    # to sm_100a); the subprocess below reads the variable.
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(CuTeDSL._get_dsl().envar, "_arch", "sm_90a")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    monkeypatch.delenv("VLLM_DISABLE_CUTEDSL_CACHE", raising=False)
    monkeypatch.setattr(ll_fp32w, "current_cuda_stream", _fake_stream)
    monkeypatch.setattr(ll_fp32w, "use_pdl", lambda: True)
    monkeypatch.setattr(cache, "_unreadable", set())
    monkeypatch.setattr(cache, "_unwritable", set())
    return tmp_path / "vllm"


@pytest.fixture
def compiles(root, monkeypatch) -> CompileCounter:
    counter = CompileCounter(cute.compile)
    monkeypatch.setattr(cute, "compile", counter)
    return counter


def _ll_key(m: int = 1, dtype: torch.dtype = torch.bfloat16):
    return ll_fp32w.LLFp32WGemm().dispatch(M=m, K=K, N=N, a_dtype=dtype)


def _entries(root: Path, kernel: str) -> list[Path]:
    directory = root / "cutedsl" / kernel
    return sorted(directory.glob("*.o")) if directory.is_dir() else []


def _refusal(executor, *args) -> str:
    """What the executor says of CPU tensors (it checks its arguments before launching)."""
    with pytest.raises((ValueError, TypeError)) as error:
        executor(*args)
    return str(error.value)


def _ll_args(m: int, dtype: torch.dtype = torch.bfloat16) -> tuple:
    from cuda.bindings.driver import CUstream

    x = torch.zeros(m, K, dtype=dtype)
    return x, torch.zeros(N, K), torch.zeros(m, N), N, CUstream(0)


def test_a_miss_compiles_and_saves_and_a_fresh_kernel_loads_it(root, compiles):
    key = _ll_key()
    first = ll_fp32w.LLFp32WGemm()
    first.compile(key)
    assert compiles.calls == 1
    (entry,) = _entries(root, "LLFp32WGemm")
    record = json.loads(entry.with_suffix(".json").read_text())
    assert record["factors"]["compile_key"] == repr(key)
    second = ll_fp32w.LLFp32WGemm()
    second.compile(key)
    assert compiles.calls == 1, "a current entry was compiled again"
    compiled, loaded = first._compiled_cache[key], second._compiled_cache[key]
    assert type(loaded).__name__ == "Function" and loaded is not compiled
    args = _ll_args(1)
    assert "Expects 5 parameters" in _refusal(loaded, *args[:4])
    refusal = _refusal(loaded, *args)
    assert "expected device_type=cuda" in refusal
    assert refusal == _refusal(compiled, *args)


def test_every_factor_of_the_key_names_another_entry(root, monkeypatch):
    kernel = ll_fp32w.LLFp32WGemm()

    def name(key=None, options="--enable-tvm-ffi", modules=ll_fp32w._KERNEL_MODULES, pdl=True):
        factors = cache.cache_factors(
            kernel, key or _ll_key(), options=options, modules=modules, extra={"use_pdl": pdl}
        )
        return cache.CuTeDSLCacheEntry(root, factors).object_path.name

    baseline = name()
    variants = {
        "compile key": name(key=_ll_key(m=2)),
        "activation dtype": name(key=_ll_key(dtype=torch.float32)),
        "options": name(options="--enable-tvm-ffi --opt-level 2"),
        "use_pdl": name(pdl=False),
        "sources": name(modules=ll_fp32w._KERNEL_MODULES[:2]),
    }
    settings, stack = cache.cute_dsl_settings(), cache.cute_dsl_stack()
    monkeypatch.setattr(cache, "cute_dsl_settings", lambda: settings.replace("sm_90a", "sm_100a"))
    variants["arch"] = name()
    monkeypatch.setattr(cache, "cute_dsl_settings", lambda: settings)
    monkeypatch.setattr(cache, "cute_dsl_stack", lambda: stack + ";nvidia-cutlass-dsl==9")
    variants["stack"] = name()
    monkeypatch.setattr(cache, "cute_dsl_stack", lambda: stack)

    class OtherKernel(ll_fp32w.LLFp32WGemm):
        pass

    other = cache.cache_factors(
        OtherKernel(), _ll_key(), options="--enable-tvm-ffi", modules=ll_fp32w._KERNEL_MODULES
    )
    variants["kernel class"] = cache.CuTeDSLCacheEntry(root, other).object_path.name
    assert name() == baseline, "the name is not a function of the factors"
    same = [factor for factor, variant in variants.items() if variant == baseline]
    assert not same, f"entries that ignore {same}"
    assert len(set(variants.values())) == len(variants)


def test_the_key_holds_the_real_arch_stack_and_sources(root):
    assert "arch='sm_90a'" in cache.cute_dsl_settings()
    stack = cache.cute_dsl_stack()
    for name in ("nvidia-cutlass-dsl==", "nvidia-cutlass-dsl-libs-", "apache-tvm-ffi==", "torch=="):
        assert name in stack, stack
    assert sys.implementation.cache_tag in stack
    factors = cache.cache_factors(
        ll_fp32w.LLFp32WGemm(),
        _ll_key(),
        options="--enable-tvm-ffi",
        modules=ll_fp32w._KERNEL_MODULES,
        extra={"use_pdl": True},
    )
    assert sorted(factors["sources"]) == sorted(ll_fp32w._KERNEL_MODULES)
    dotprod = importlib.util.find_spec(ll_fp32w._KERNEL_MODULES[1]).origin
    assert dotprod.endswith("_ll_fp32w_dotprod.py")
    digest = hashlib.sha256(Path(dotprod).read_bytes()).hexdigest()
    assert factors["sources"][ll_fp32w._KERNEL_MODULES[1]] == digest


def test_a_changed_source_compiles_again(root, compiles, monkeypatch, tmp_path):
    source = tmp_path / "src" / "cutedsl_cache_probe_source.py"
    source.parent.mkdir()
    source.write_text("VERSION = 1\n")
    monkeypatch.syspath_prepend(str(source.parent))
    modules = (*ll_fp32w._KERNEL_MODULES, "cutedsl_cache_probe_source")
    monkeypatch.setattr(ll_fp32w, "_KERNEL_MODULES", modules)
    key = _ll_key()
    ll_fp32w.LLFp32WGemm().compile(key)
    ll_fp32w.LLFp32WGemm().compile(key)
    assert compiles.calls == 1
    source.write_text("VERSION = 2\n")
    ll_fp32w.LLFp32WGemm().compile(key)
    assert compiles.calls == 2
    assert len(_entries(root, "LLFp32WGemm")) == 2


def test_a_stale_record_is_compiled_again_and_overwritten(root, compiles):
    key = _ll_key()
    ll_fp32w.LLFp32WGemm().compile(key)
    (entry,) = _entries(root, "LLFp32WGemm")
    record_path = entry.with_suffix(".json")
    current = json.loads(record_path.read_text())
    stale = json.loads(record_path.read_text())
    stale["factors"]["stack"] = "nvidia-cutlass-dsl==4.7.0"
    record_path.write_text(json.dumps(stale))
    kernel = ll_fp32w.LLFp32WGemm()
    kernel.compile(key)
    assert compiles.calls == 2, "a stale entry was loaded"
    assert json.loads(record_path.read_text()) == current
    ll_fp32w.LLFp32WGemm().compile(key)
    assert compiles.calls == 2


@pytest.mark.parametrize("damage", ["truncated", "not an object", "another key's object"])
def test_a_damaged_object_is_compiled_again_with_a_warning(root, compiles, caplog, damage):
    key = _ll_key(m=1)
    ll_fp32w.LLFp32WGemm().compile(key)
    (entry,) = _entries(root, "LLFp32WGemm")
    whole = entry.read_bytes()
    if damage == "truncated":
        entry.write_bytes(whole[: len(whole) // 2])
    elif damage == "not an object":
        # Its record says so too: load_module itself refuses it.
        entry.write_bytes(b"\0" * 64)
        record_path = entry.with_suffix(".json")
        record = json.loads(record_path.read_text())
        record["object_sha256"] = hashlib.sha256(b"\0" * 64).hexdigest()
        record_path.write_text(json.dumps(record))
    else:
        # A whole object with this entry's symbol, of M=2: load_module takes it, and only
        # the record's hash of the object tells it apart.
        other, other_key = ll_fp32w.LLFp32WGemm(), _ll_key(m=2)
        other.compile(other_key)
        symbol = f"vllm_cutedsl_{entry.stem}"
        other._compiled_cache[other_key].export_to_c(str(entry), function_name=symbol)
    compiled_before = compiles.calls
    kernel = ll_fp32w.LLFp32WGemm()
    with caplog.at_level(logging.WARNING):
        kernel.compile(key)
    assert compiles.calls == compiled_before + 1, "a damaged entry was loaded"
    warnings = [
        r for r in caplog.records if "Cannot load the cached CuTe-DSL kernel" in r.getMessage()
    ]
    assert len(warnings) == 1, caplog.text
    assert entry.read_bytes() == whole, "the entry was not written again"
    refusal = _refusal(kernel._compiled_cache[key], *_ll_args(1))
    assert "gA: Tensor([1, 6144], bfloat16)" in refusal and "device_type=cuda" in refusal


def test_an_unwritable_root_warns_once_and_compiles(root, compiles, caplog, monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(blocker))
    kernel = ll_fp32w.LLFp32WGemm()
    with caplog.at_level(logging.WARNING):
        kernel.compile(_ll_key(m=1))
        kernel.compile(_ll_key(m=2))
    assert compiles.calls == 2
    assert len(kernel._compiled_cache) == 2
    warnings = [r for r in caplog.records if "Cannot save CuTe-DSL kernels" in r.getMessage()]
    assert len(warnings) == 1, caplog.text


def test_writes_are_atomic_and_the_record_commits_the_entry(root, compiles, monkeypatch):
    replaced: list[tuple[str, str]] = []
    real_replace = os.replace

    def recording_replace(src, dst):
        replaced.append((str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(cache.os, "replace", recording_replace)
    key = _ll_key()
    ll_fp32w.LLFp32WGemm().compile(key)
    (entry,) = _entries(root, "LLFp32WGemm")
    assert [dst for _, dst in replaced] == [str(entry), str(entry.with_suffix(".json"))]
    for src, dst in replaced:
        assert Path(src).parent == Path(dst).parent and src != dst
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.stem + ".json", entry.name]


def test_an_export_that_fails_midway_leaves_no_entry(root, compiles, monkeypatch, caplog):
    from cutlass.cutlass_dsl.tvm_ffi_provider import TVMFFIJitCompiledFunctionBase

    def failing_export(self, path, function_name=None, **kwargs):
        Path(path).write_bytes(b"half an object")
        raise OSError("disk full")

    monkeypatch.setattr(TVMFFIJitCompiledFunctionBase, "export_to_c", failing_export)
    kernel = ll_fp32w.LLFp32WGemm()
    with caplog.at_level(logging.WARNING):
        kernel.compile(_ll_key())
    assert "Cannot save CuTe-DSL kernels" in caplog.text
    assert list((root / "cutedsl" / "LLFp32WGemm").iterdir()) == []


def test_the_disable_switch_compiles_every_time(root, compiles, monkeypatch):
    key = _ll_key()
    ll_fp32w.LLFp32WGemm().compile(key)
    monkeypatch.setenv("VLLM_DISABLE_CUTEDSL_CACHE", "1")
    ll_fp32w.LLFp32WGemm().compile(key)
    ll_fp32w.LLFp32WGemm().compile(_ll_key(m=2))
    assert compiles.calls == 3
    assert len(_entries(root, "LLFp32WGemm")) == 1


def test_the_jit_monitor_still_sees_a_compile_after_the_warmup(root, compiles, monkeypatch):
    key = _ll_key()
    ll_fp32w.LLFp32WGemm().compile(key)
    assert compiles.calls == 1
    # What jit_monitor.activate(mode="error") sets up for CuTe-DSL, undone after the test.
    monkeypatch.setattr(jit_monitor, "_active", True)
    monkeypatch.setattr(jit_monitor, "_mode", "error")
    monkeypatch.setattr(cute, "compile", jit_monitor._MonitoredCuteCompile(cute.compile))
    kernel = ll_fp32w.LLFp32WGemm()
    with pytest.raises(RuntimeError, match="CuTeDSL JIT compilation during inference"):
        kernel._get_or_compile(key)
    assert key not in kernel._compiled_cache


@needs_bf16x3
def test_the_bf16x3_router_gemm_round_trips(root, compiles):
    from vllm.model_executor.layers.fused_moe.router import bf16x3_router_gemm_sm90 as bf16x3

    kernel_cls = bf16x3.Sm90BF16x3RouterGemmKernel
    key = kernel_cls.CompileKey(k=3072, block_t=32, block_k=128, num_stages=3, split_k=1)
    first = kernel_cls()
    first.compile(key)
    second = kernel_cls()
    second.compile(key)
    assert compiles.calls == 1
    (entry,) = _entries(root, "Sm90BF16x3RouterGemmKernel")
    sources = json.loads(entry.with_suffix(".json").read_text())["factors"]["sources"]
    assert sorted(sources) == sorted(
        [bf16x3.__name__, "vllm.model_executor.warmup.jit_warmup_cutedsl_helper"]
    )
    args = (torch.zeros(4, 3072, dtype=torch.bfloat16), torch.zeros(8, 3072), torch.zeros(4, 8))
    refusal = _refusal(second._compiled_cache[key], *args)
    assert "expected device_type=cuda" in refusal
    assert refusal == _refusal(first._compiled_cache[key], *args)
