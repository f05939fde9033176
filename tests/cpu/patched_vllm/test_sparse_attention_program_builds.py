"""The sparse attention's warm-up builds its FlashInfer programs side by side (issue 64).

Patch 0007's reservation (the launches at model construction that leave FlashInfer's decode
scratch for vLLM's profiler to count) names the Cake programs its launches will load, with
FlashInfer's SM90 planners, and builds them through patch 0004's `build_cake_programs`, the
indexer warm-up's side-by-side build, before the launches load them one after another.
Checked here, on this CPU-only host with FlashInfer's build replaced by a stand-in:

- the names are the programs FlashInfer's own dispatch loads for the same launches (run
  offline on host tensors, `flashinfer_offline`, as `warmup --prebuild` runs them);
- the builds run at once: each stand-in build waits at a barrier that only builds running
  together pass, so a build one after another breaks it; they start after the prebuild check
  and the free-memory read (the log's "less free GPU memory" counts them, as it counted the
  launches' own builds) and end before the first launch, with the JIT warm-up on and off
  (`--enforce-eager`: the reservation runs either way);
- a failed build is logged with its program's name and left to its launch, which fails as it
  did without the step: any error logged and the engine started, an out-of-memory one
  stopping the engine with the settings to lower;
- where FlashInfer's planners cannot name the programs, the launches build them, as before.
"""

from __future__ import annotations

import logging
import os
import threading
from types import SimpleNamespace

import pytest
import torch
from sparse_attention_helpers import registration_config

from vllm_minimax.probe import sparse_attention_in_series

pytestmark = pytest.mark.skipif(
    not sparse_attention_in_series(), reason="this release's series has no FlashInfer attend"
)

FA_MODULE = "vllm.models.minimax_m3.nvidia.sparse_attention_flashinfer"
IW_MODULE = "vllm.models.minimax_m3.nvidia.indexer_flashinfer_warmup"
H100_SMS = 132
H20_SMS = 78
# A stand-in build that waits longer than this at the barrier was not running beside the
# others (only a failing, serial build waits it out).
BARRIER_TIMEOUT_S = 10.0


def _modules():
    import importlib

    return importlib.import_module(FA_MODULE), importlib.import_module(IW_MODULE)


def _slice_geometry(max_num_seqs: int = 1024, mtp: int = 0):
    """One TP-8 rank of MiniMax M3 (8 query heads, 1 KV head) at a 128k context, the MXFP8
    EP slice's geometry (its 1024 sequences: 7 programs on an H100)."""
    sa, _ = _modules()
    return sa.sparse_attention_warmup_geometry(
        num_heads=8,
        num_kv_heads=1,
        scale=128**-0.5,
        num_speculative_tokens=mtp,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=16384,
        max_model_len=132096,
    )


class _OfflineSink:
    """What FlashInfer run offline would load: Cake programs by name, CuTe-DSL kernels."""

    def __init__(self) -> None:
        self.nvcc_names: list[str] = []
        self.cute_specs: list[object] = []

    def nvcc(self, name: str) -> None:
        self.nvcc_names.append(name)

    def cute_dsl(self, spec: object) -> None:
        self.cute_specs.append(spec)


@pytest.mark.parametrize(
    "heads,kv_heads,max_num_seqs,mtp,max_model_len,sms",
    [
        (8, 1, 200, 0, 132096, H100_SMS),
        (8, 1, 300, 0, 132096, H20_SMS),
        (32, 2, 40, 2, 32768, H100_SMS),
    ],
    ids=["h100-tp8-rank-128k", "h20-tp8-rank-128k", "h100-group16-mtp2-32k"],
)
def test_the_named_programs_are_the_ones_flashinfers_dispatch_loads(
    monkeypatch, heads, kv_heads, max_num_seqs, mtp, max_model_len, sms
):
    """FlashInfer's SM90 dispatch run offline through the warm-up's own launches (its public
    ops on host tensors; every choice FlashInfer's, a program handed over where it would load
    one) loads exactly the programs the reservation builds side by side, first uses in the
    same order, on the GPU's SM count (6 programs at 200 sequences and a 128k context on
    an H100; at 300 on an H20, whose 78 SMs hold fewer resident CTAs, FlashInfer's 64-key
    VSEQ decode makes 7, which the H100's planners do not pick)."""
    from vllm_minimax import flashinfer_offline

    sa, _ = _modules()
    monkeypatch.setenv("CUTE_DSL_ARCH", flashinfer_offline.SM90_CUTE_DSL_ARCH)
    geometry = sa.sparse_attention_warmup_geometry(
        num_heads=heads,
        num_kv_heads=kv_heads,
        scale=128**-0.5,
        num_speculative_tokens=mtp,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        max_model_len=max_model_len,
    )
    sink = _OfflineSink()
    with flashinfer_offline.offline_sm90(sms, sink):
        launches = sa.warmup_launches(geometry)
        buffers = sa.WarmupBuffers(geometry, launches, torch.device("cpu"))
        for launch in launches:
            sa.run_warmup_launch(geometry, *launch, buffers)
    loaded = list(dict.fromkeys(sink.nvcc_names))
    assert sink.cute_specs == []
    assert sa.warmup_programs(geometry, sms) == loaded
    assert len(loaded) >= 3
    if sms == H20_SMS:
        assert len(loaded) == 7 and sa.warmup_programs(geometry, H100_SMS) != loaded


class _Builds:
    """FlashInfer's `load_hopper_msa_module`, stood in for. A build on a worker thread waits
    at a barrier of `parties` builds, which only builds running at once pass; a name in
    `failing` raises `error` on any thread (its launch's own load too); a load on the main
    thread (a launch's first use) returns at once. `events` is shared with the test."""

    def __init__(
        self,
        events: list[str],
        parties: int,
        failing: tuple[str, ...] = (),
        error: BaseException | None = None,
    ) -> None:
        self.events = events
        self.barrier = threading.Barrier(max(1, parties), timeout=BARRIER_TIMEOUT_S)
        self.failing = failing
        self.error = error
        self.lock = threading.Lock()
        self.started: list[str] = []
        self.together: list[str] = []

    def __call__(self, name: str) -> object:
        on_worker = threading.current_thread() is not threading.main_thread()
        if on_worker:
            with self.lock:
                self.started.append(name)
                self.events.append(f"build {name}")
        if name in self.failing:
            assert self.error is not None
            raise self.error
        if on_worker:
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:
                return object()
            with self.lock:
                self.together.append(name)
        return object()


def _program_of(geometry, kind: str, batch: int, n: int) -> str:
    """The program a launch loads at its first use, as FlashInfer's planners pick it."""
    from flashinfer.jit.cake_hopper_msa import ROUTES
    from flashinfer.msa_ops import cake_hopper_sm90 as cake

    heads = {"num_q_heads": geometry.num_heads, "num_kv_heads": geometry.num_kv_heads}
    if kind == "decode":
        plan = cake.plan_sparse_decode(
            total_q=batch * n,
            num_sms=H100_SMS,
            seqlen_q=n,
            max_pages=geometry.block_table_width,
            **heads,
        )
    else:
        plan = cake.plan_sparse_prefill(max_pages=n, **heads)
    return ROUTES[plan.route]


@pytest.fixture
def gpu(monkeypatch):
    """The device calls of the reservation on this CPU-only host, recorded in `events`: an
    H100's SM count, the free-memory read, device 0, no-op synchronize and empty_cache, the
    launches' buffers in host memory, 16 CPUs (the side-by-side build takes up to half of
    them, at most 8), and the launches: each loads its program (`_Builds` on the main
    thread), as FlashInfer's first use does."""
    import flashinfer.jit.cake_hopper_msa as cake_jit

    sa, iw = _modules()
    events: list[str] = []
    buffers = sa.WarmupBuffers
    monkeypatch.setattr(
        sa, "WarmupBuffers", lambda g, launches, d: buffers(g, launches, torch.device("cpu"))
    )
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device: SimpleNamespace(multi_processor_count=H100_SMS),
    )

    def memory_info():
        events.append("free memory read")
        return 70 << 30, 80 << 30

    monkeypatch.setattr(torch.accelerator, "get_memory_info", memory_info)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(iw, "check_prebuilt_programs_once", lambda: events.append("prebuild"))
    state = SimpleNamespace(events=events, builds=None)

    def load(name):
        return state.builds(name)

    monkeypatch.setattr(cake_jit, "load_hopper_msa_module", load)

    def launch(geometry, kind, batch, n, buffers):
        state.builds(_program_of(geometry, kind, batch, n))
        events.append(f"launch {kind} {batch} {n}")

    monkeypatch.setattr(sa, "run_warmup_launch", launch)
    for module in (sa, iw):
        monkeypatch.setattr(module.logger, "propagate", True)
    return state


def _registration_config(*, jit_warmup: bool, max_num_seqs: int, mtp: int):
    """The slice's engine: a 128k context and 16384 batched tokens."""
    return registration_config(
        jit_warmup=jit_warmup,
        max_num_seqs=max_num_seqs,
        num_speculative_tokens=mtp,
        max_model_len=132096,
        max_num_batched_tokens=16384,
    )


class _Layer:
    """A sparse attention layer as the registration reads it (held by a weak reference)."""

    def __init__(self, impl, kv_cache: torch.Tensor) -> None:
        self.impl = impl
        self.kv_cache = kv_cache


def _register(sa, config) -> None:
    """A sparse layer of 8 query heads over 1 KV head (a TP-8 rank of MiniMax M3) on
    FlashInfer's attend registers its warm-up, as the layer's construction does."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    from vllm_minimax.testing import sparse_attention_cases as cases

    impl = cases.make_impl(
        sa.MiniMaxM3SparseFlashInferImpl,
        cases.StepShape(num_heads=8, num_kv_heads=1),
        scale=128**-0.5,
        kv_cache_dtype="fp8",
    )
    layer = _Layer(impl, torch.zeros(3, 1, 128, 256, dtype=torch.uint8))
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        sa.register_sparse_attention_warmup(layer, config)


@pytest.mark.parametrize("jit_warmup", [True, False], ids=["jit-warmup", "enforce-eager"])
def test_the_programs_build_side_by_side_before_the_launches(monkeypatch, gpu, caplog, jit_warmup):
    """The slice's 7 programs (1024 sequences, 128k context) build at once, after the
    prebuild check and the free-memory read and before the first launch, with the JIT
    warm-up on and off; every launch still runs (the decode scratch is reserved), and the
    log line says how many programs were built side by side."""
    sa, _ = _modules()
    jit = sa._SparseAttentionJit()
    monkeypatch.setattr(sa, "_JIT", jit)
    geometry = _slice_geometry()
    names = sa.warmup_programs(geometry, H100_SMS)
    assert len(names) == 7
    gpu.builds = _Builds(gpu.events, parties=len(names))
    with caplog.at_level(logging.INFO):
        _register(sa, _registration_config(jit_warmup=jit_warmup, max_num_seqs=1024, mtp=0))
    assert jit._launched == {geometry}
    assert sorted(gpu.builds.started) == sorted(names), "each program built once"
    assert sorted(gpu.builds.together) == sorted(names), "the builds ran one after another"
    events = gpu.events
    builds = [i for i, e in enumerate(events) if e.startswith("build ")]
    launches = [e for e in events if e.startswith("launch ")]
    assert launches == [f"launch {k} {b} {n}" for k, b, n in sa.warmup_launches(geometry)]
    assert events.index("prebuild") < events.index("free memory read") < builds[0]
    assert builds[-1] < events.index(launches[0])
    (line,) = [
        r.getMessage() for r in caplog.records if "sparse attention warm-up:" in r.getMessage()
    ]
    assert "7 programs built or loaded side by side" in line, line


def test_the_indexer_builds_its_cake_programs_through_the_same_step(monkeypatch, gpu):
    """Patch 0004's indexer warm-up hands its Cake programs (not its CuTe-DSL kernels) to
    the same side-by-side build."""
    _, iw = _modules()
    call = iw.TopkSelectCall(max_k_tiles=4, total_q=1)
    programs = [
        iw.FlashInferProgram("cake:cake_hopper_msa_a", call),
        iw.FlashInferProgram("cute:msa_topk_select_sm90/x", call),
        iw.FlashInferProgram("cake:cake_hopper_msa_b", call),
        iw.FlashInferProgram("cake:cake_hopper_msa_c", call),
    ]
    gpu.builds = _Builds(gpu.events, parties=3)
    iw._prebuild_cake_programs(programs)
    expected = ["cake_hopper_msa_a", "cake_hopper_msa_b", "cake_hopper_msa_c"]
    assert sorted(gpu.builds.together) == expected


@pytest.mark.parametrize(
    "error,stops",
    [
        (RuntimeError("Ninja build failed: nvcc exited with status 1"), False),
        (RuntimeError("cuModuleLoadData failed: CUDA_ERROR_OUT_OF_MEMORY"), True),
    ],
    ids=["build-error", "out-of-memory"],
)
def test_a_failed_build_names_its_program_and_its_launch_fails_as_before(
    monkeypatch, gpu, caplog, error, stops
):
    """One program's build fails: the others still build side by side, the warning names
    the program, and the launch that needs it raises what the build raised, as it did when
    the launches built their programs. A build error is logged and the engine starts (the
    remaining programs build at first use); an out-of-memory one stops the engine, naming
    the settings the decode scratch grows with."""
    sa, _ = _modules()
    jit = sa._SparseAttentionJit()
    monkeypatch.setattr(sa, "_JIT", jit)
    geometry = _slice_geometry()
    names = sa.warmup_programs(geometry, H100_SMS)
    broken = names[3]
    gpu.builds = _Builds(gpu.events, parties=len(names) - 1, failing=(broken,), error=error)
    config = _registration_config(jit_warmup=True, max_num_seqs=1024, mtp=0)
    with caplog.at_level(logging.WARNING):
        if stops:
            with pytest.raises(RuntimeError, match="--max-num-seqs") as stopped:
                _register(sa, config)
            assert stopped.value.__cause__ is error
        else:
            _register(sa, config)
    assert sorted(gpu.builds.together) == sorted(set(names) - {broken})
    messages = [r.getMessage() for r in caplog.records]
    assert f"Side-by-side build of {broken} failed" in messages
    if not stops:
        (line,) = [m for m in messages if "did not finish" in m]
        assert str(error) in line
    # The launches ran up to the first that needs the broken program.
    launched = [e for e in gpu.events if e.startswith("launch ")]
    first = next(
        i
        for i, launch in enumerate(sa.warmup_launches(geometry))
        if _program_of(geometry, *launch) == broken
    )
    assert len(launched) == first


def test_programs_flashinfer_cannot_name_are_built_by_the_launches(monkeypatch, gpu, caplog):
    """A FlashInfer release that moved what names the programs (here the route table's
    lookup): the warm-up says it builds them one after another, and every launch runs and
    builds its own program, as before."""
    import flashinfer.jit.cake_hopper_msa as cake_jit

    sa, _ = _modules()
    jit = sa._SparseAttentionJit()
    monkeypatch.setattr(sa, "_JIT", jit)
    monkeypatch.delattr(cake_jit, "route_program")
    geometry = _slice_geometry(max_num_seqs=64)
    gpu.builds = _Builds(gpu.events, parties=1)
    with caplog.at_level(logging.INFO):
        _register(sa, _registration_config(jit_warmup=False, max_num_seqs=64, mtp=0))
    messages = [r.getMessage() for r in caplog.records]
    assert any("one after another" in m and "ImportError" in m for m in messages), messages
    assert gpu.builds.started == []
    launched = [e for e in gpu.events if e.startswith("launch ")]
    assert len(launched) == len(sa.warmup_launches(geometry))
    (line,) = [m for m in messages if "sparse attention warm-up:" in m]
    assert "0 programs built or loaded side by side" in line
