"""`vllm-minimax warmup --prebuild` on this CPU-only host, against the patched vLLM.

- FlashInfer run offline (`flashinfer_offline`) picks, for the warm-ups' own calls, the
  programs an SM90 GPU would: the indexer's equal the reference of
  test_indexer_flashinfer_warmup.py (FlashInfer's dispatch on meta tensors with its build
  steps stubbed), the sparse attention's equal FlashInfer's own planners for every decode
  batch and the prefill width.
- The geometry comes from the config, the model's config.json and vLLM's own batch defaults
  for the GPU's memory, as the engine's does.
- The prebuild compiles real SM90a programs with the CUDA compiler from PyPI, which FlashInfer
  then finds up to date (ninja has nothing to do; a CuTe-DSL kernel carries FlashInfer's key
  and takes CUDA tensors).
- The engine uses a prebuild only when its FlashInfer, CUDA toolkit and CuTe-DSL stack match
  (patch 0004's `check_prebuilt_programs`); otherwise it removes what would load wrongly and
  says why.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from flashinfer.jit.cake_hopper_msa import ROUTES
from flashinfer.msa_ops import cake_hopper_sm90
from test_indexer_flashinfer_warmup import _geometry, _Recorder
from vllm.models.minimax_m3.nvidia import indexer_flashinfer_warmup as iw
from vllm.models.minimax_m3.nvidia import sparse_attention_flashinfer as sa

from vllm_minimax import (
    flashinfer_offline,
    prebuild,
    prebuild_geometry,
    prebuild_inputs,
    prebuild_programs,
)

REPO = Path(__file__).resolve().parents[3]
H200 = prebuild_inputs.GPU_TARGETS["h200"]
H20 = prebuild_inputs.GPU_TARGETS["h20"]


@pytest.fixture(autouse=True)
def cute_dsl_target(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", flashinfer_offline.SM90_CUTE_DSL_ARCH)


def _plan(gpu=H200, *, indexer=None, sparse_attention=None) -> prebuild_geometry.Plan:
    plan = prebuild_geometry.Plan(gpu, indexer=indexer, sparse_attention=sparse_attention)
    builder = prebuild_programs.Builder(build=False, jobs=1, only=None, say=lambda text: None)
    prebuild_programs.plan_programs(plan, builder)
    return plan


def _as_cached(recorded: set[str]) -> set[str]:
    """The reference recorder's names as FlashInfer's JIT cache spells them: a Cake
    program's module is ``<name>_sm90a_<digest>``, a CuTe-DSL kernel's directory
    ``<module>_sm90a_cute_dsl`` and its name a C symbol."""
    from flashinfer.jit.cake_hopper_msa import get_hopper_msa_uri
    from flashinfer.jit.cute_dsl_core import sanitize_symbol_name

    names = set()
    for name in recorded:
        kind, _, program = name.partition(":")
        if kind == "cake":
            names.add(get_hopper_msa_uri(program))
        else:
            module, kernel = program.split("/", 1)
            names.add(f"{module}_sm90a_cute_dsl/{sanitize_symbol_name(kernel)}")
    return names


@pytest.mark.parametrize(
    "heads,max_model_len,max_tokens,mtp", [(1, 16384, 2048, 2), (4, 4096, 512, 0)]
)
def test_offline_flashinfer_picks_the_warmup_reference_programs(
    heads, max_model_len, max_tokens, mtp
):
    geometry = _geometry(heads, max_model_len, max_tokens, mtp=mtp)
    plan = _plan(indexer=geometry)
    with pytest.MonkeyPatch.context() as patch:
        reference = _Recorder(patch).warmup_calls(geometry)
    assert {*plan.nvcc, *plan.cute_dsl} == _as_cached(reference)
    # Cake programs are nvcc modules of FlashInfer's own naming; the rest are CuTe-DSL.
    assert all(name.startswith("cake_hopper_msa_") for name in plan.nvcc)
    assert plan.nvcc and plan.cute_dsl


def test_offline_flashinfer_plans_with_the_gpus_sm_count():
    """The SM count is an input of FlashInfer's top-k planner: at 54 score tiles and 16384
    tokens an H200 has a Cake program for the plan, an H20 (78 SMs) takes a CuTe-DSL kernel."""
    import torch

    call = iw.TopkSelectCall(max_k_tiles=54, total_q=16384)
    picked = {}
    for gpu in (H200, H20):
        builder = prebuild_programs.Builder(build=False, jobs=1, only=None, say=lambda text: None)
        sink = prebuild_programs._Sink(builder)
        with flashinfer_offline.offline_sm90(gpu.sm_count, sink):
            iw._run_topk_select(call, 1, device=torch.device("cpu"))
        picked[gpu.name] = (sink.names, sink.cute_names)
    assert picked["h200"][0] and not picked["h200"][1]
    assert picked["h20"][1] and not picked["h20"][0]


def _sparse_geometry(max_decodes: int, query_len: int, width: int):
    return sa.SparseAttentionWarmupGeometry(
        num_heads=8,
        num_kv_heads=1,
        scale=128**-0.5,
        max_decode_query_len=query_len,
        max_num_decodes=max_decodes,
        max_num_batched_tokens=8192,
        block_table_width=width,
    )


def _sparse_reference(geometry, sm_count: int) -> set[str]:
    """FlashInfer's own planners over every decode batch the warm-up launches, and the
    prefill program of the width the builder passes."""
    programs = set()
    for query_len in range(1, geometry.max_decode_query_len + 1):
        for batch in range(1, geometry.max_num_decodes + 1):
            plan = cake_hopper_sm90.plan_sparse_decode(
                total_q=batch * query_len,
                num_q_heads=geometry.num_heads,
                num_kv_heads=geometry.num_kv_heads,
                num_sms=sm_count,
                seqlen_q=query_len,
                max_pages=geometry.block_table_width,
            )
            programs.add(ROUTES[plan.route])
    width = sa.prefill_page_table_width(geometry.block_table_width, 1)
    prefill = cake_hopper_sm90.plan_sparse_prefill(
        num_q_heads=geometry.num_heads, num_kv_heads=geometry.num_kv_heads, max_pages=width
    )
    programs.add(ROUTES[prefill.route])
    return programs


@pytest.mark.parametrize("max_decodes,query_len,width", [(256, 1, 1024), (64, 3, 256)])
def test_offline_flashinfer_picks_the_sparse_attention_programs(max_decodes, query_len, width):
    geometry = _sparse_geometry(max_decodes, query_len, width)
    plan = _plan(sparse_attention=geometry)
    picked = {uri.split("_sm90a_")[0] for uri in plan.nvcc}
    assert picked == _sparse_reference(geometry, H200.sm_count)
    assert plan.cute_dsl == []  # every launch of the series is a Cake program


def test_the_sparse_attention_reference_depends_on_the_sm_count():
    """The reference above has teeth: the decode planner's pick moves with the SM count."""
    geometry = _sparse_geometry(256, 1, 1024)
    assert _sparse_reference(geometry, H200.sm_count) != _sparse_reference(geometry, H20.sm_count)
    plan = _plan(H20, sparse_attention=geometry)
    assert {uri.split("_sm90a_")[0] for uri in plan.nvcc} == _sparse_reference(
        geometry, H20.sm_count
    )


H100_COLD_LOG = REPO / "results/h100/sparse-attention/engine/cold-flashinfer-graphs.log"


def test_offline_plan_is_what_the_h100_engine_built_on_empty_caches():
    """results/h100/sparse-attention's cold start (tiny model, TP-8 rank head group, fp8 KV
    cache, empty caches) logged each FlashInfer program it built: 13 Cake programs and 21
    CuTe-DSL kernels. Its two warm-up geometries, planned here offline, pick exactly those,
    content digests included."""
    import re

    log = H100_COLD_LOG.read_text()
    indexer = _geometry(1, 32768, 8192)
    sparse = sa.SparseAttentionWarmupGeometry(
        num_heads=8,
        num_kv_heads=1,
        scale=128**-0.5,
        max_decode_query_len=1,
        max_num_decodes=16,
        max_num_batched_tokens=8192,
        block_table_width=256,
    )
    assert f"[{indexer!r}]" in log and f"[{sparse!r}]" in log  # the engine's own geometries
    built = set(re.findall(r"Building JIT module (\S+);", log))
    built |= set(re.findall(r"Compiling CuTe-DSL kernel (\S+)", log))
    plan = _plan(prebuild_inputs.GPU_TARGETS["h100"], indexer=indexer, sparse_attention=sparse)
    assert (len(plan.nvcc), len(plan.cute_dsl)) == (13, 21)
    assert {*plan.nvcc, *plan.cute_dsl} == built


# --- the geometry the prebuild reads -------------------------------------------------------


def _published() -> prebuild_inputs.ModelGeometry:
    return prebuild_inputs.read_model_geometry("MiniMaxAI/MiniMax-M3-MXFP8")


def test_h200_config_gives_the_engines_indexer_geometry():
    settings = prebuild_inputs.read_engine_settings(REPO / "configs/serve/h200-8x.yaml")
    shape = prebuild_geometry.engine_shape(settings, _published(), H200)
    geometry, reason = prebuild_geometry.indexer_geometry(settings, _published(), shape)
    assert reason is None
    assert geometry == iw.IndexerFlashInferGeometry(
        arch="sm90",
        num_index_heads=1,
        kv_fp8=True,
        max_query_len=4,  # 1 + the EAGLE3 block's num_speculative_tokens (3)
        max_num_batched_tokens=16384,
        max_model_len=131072,
        num_sms=132,
    )
    sparse, why = prebuild_geometry.sparse_attention_geometry(settings, _published(), shape)
    assert sparse is None
    assert "kv_cache_dtype=auto" in why


def test_an_fp8_kv_cache_adds_the_sparse_attention():
    settings = prebuild_inputs.read_engine_settings(REPO / "configs/serve/h200-8x.yaml", "fp8")
    shape = prebuild_geometry.engine_shape(settings, _published(), H200)
    geometry, reason = prebuild_geometry.sparse_attention_geometry(settings, _published(), shape)
    assert reason is None
    assert geometry == sa.SparseAttentionWarmupGeometry(
        num_heads=8,
        num_kv_heads=1,
        scale=128**-0.5,
        max_decode_query_len=4,
        max_num_decodes=256,
        max_num_batched_tokens=16384,
        block_table_width=1024,
    )


class _Layer:
    def __init__(self, impl) -> None:
        self.impl = impl


def _registered_geometry(monkeypatch, settings, shape, model) -> sa.SparseAttentionWarmupGeometry:
    """The geometry patch 0007's registration derives for a layer of this engine (its rank's
    heads, the config's speculative tokens, batch bounds, context and DCP), reserved in
    place of launched."""
    from types import SimpleNamespace

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    from vllm_minimax.testing import sparse_attention_cases as cases

    tp = settings.tensor_parallel_size
    shape_of_rank = cases.StepShape(
        num_heads=model.num_attention_heads // tp,
        num_kv_heads=max(1, model.num_key_value_heads // tp),
    )
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        impl = cases.make_impl(
            sa.MiniMaxM3SparseFlashInferImpl,
            shape_of_rank,
            scale=model.head_dim**-0.5,
            kv_cache_dtype="fp8",
        )
    reserved = []
    jit = sa._SparseAttentionJit()
    monkeypatch.setattr(jit, "reserve", lambda geometry, device: reserved.append(geometry))
    monkeypatch.setattr(sa, "_JIT", jit)
    monkeypatch.setattr(iw, "check_prebuilt_programs_once", lambda: None)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    config = SimpleNamespace(
        kernel_config=SimpleNamespace(enable_jit_warmup=True),
        speculative_config=SimpleNamespace(num_speculative_tokens=settings.num_speculative_tokens),
        model_config=SimpleNamespace(dtype=torch.bfloat16, max_model_len=shape.max_model_len),
        scheduler_config=SimpleNamespace(
            max_num_seqs=shape.max_num_seqs, max_num_batched_tokens=shape.max_num_batched_tokens
        ),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=settings.decode_context_parallel_size
        ),
    )
    sa.register_sparse_attention_warmup(_Layer(impl), config)
    (geometry,) = reserved
    return geometry


@pytest.mark.parametrize(
    ("mtp", "dcp", "max_model_len"), [(2, 1, None), (0, 1, 40000), (3, 2, 131072), (1, 4, 1000)]
)
def test_the_prebuild_plans_the_geometry_the_engine_registers(monkeypatch, mtp, dcp, max_model_len):
    """One derivation of the sparse warm-up's geometry: what the prebuild plans for an
    engine is what that engine's layers register, speculative tokens, context parallelism
    and context length included. A change to the registration's formula that the prebuild
    does not follow fails here."""
    import dataclasses

    settings = prebuild_inputs.read_engine_settings(REPO / "configs/serve/h200-8x.yaml", "fp8")
    settings = dataclasses.replace(
        settings,
        num_speculative_tokens=mtp,
        decode_context_parallel_size=dcp,
        max_model_len=max_model_len or settings.max_model_len,
    )
    shape = prebuild_geometry.engine_shape(settings, _published(), H200)
    planned, reason = prebuild_geometry.sparse_attention_geometry(settings, _published(), shape)
    assert reason is None
    assert planned == _registered_geometry(monkeypatch, settings, shape, _published())


def test_unset_batch_bounds_take_vllms_defaults_for_the_gpu(tp8_rank_model):
    """The rank slice's config sets neither bound: vLLM's defaults for an H100 or H200
    (`vllm serve`: 8192 tokens, 1024 sequences), read from vLLM on a simulated GPU of that
    memory, and the rank's heads from its config.json."""
    settings = prebuild_inputs.read_engine_settings(REPO / "evals/h200-m3-tp8-rank-serve.yaml")
    geometry_of_model = prebuild_inputs.read_model_geometry(str(tp8_rank_model))
    for gpu in (prebuild_inputs.GPU_TARGETS["h100"], H200):
        shape = prebuild_geometry.engine_shape(settings, geometry_of_model, gpu)
        assert (shape.max_num_batched_tokens, shape.max_num_seqs) == (8192, 1024)
        assert shape.sources["max_num_seqs"] == f"vLLM's default for {gpu.device_name}"
    small = prebuild_inputs.GpuTarget("small", 132, 40.0, "NVIDIA L40S")
    shape = prebuild_geometry.engine_shape(settings, geometry_of_model, small)
    assert (shape.max_num_batched_tokens, shape.max_num_seqs) == (2048, 256)
    geometry, _ = prebuild_geometry.indexer_geometry(settings, geometry_of_model, shape)
    assert (geometry.num_index_heads, geometry.max_model_len) == (1, 132096)


# --- the engine's check of a prebuild (patch 0004) -----------------------------------------

HERE = {
    "flashinfer": "0.7.4",
    "cuda": {"home": "/usr/local/cuda", "version": "13.0"},
    "cute_dsl": "stack-a",
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """FlashInfer's cache directories under tmp_path, for 0.7.4 on 90a."""
    from flashinfer.jit import env as jit_env

    root = tmp_path / ".cache" / "flashinfer"
    workspace = root / "0.7.4" / "90a"
    (workspace / "cached_ops").mkdir(parents=True)
    monkeypatch.setattr(jit_env, "FLASHINFER_CACHE_DIR", root)
    monkeypatch.setattr(jit_env, "FLASHINFER_WORKSPACE_DIR", workspace)
    monkeypatch.setattr(jit_env, "FLASHINFER_JIT_DIR", workspace / "cached_ops")
    return workspace


def _prebuilt(workspace: Path, **changes) -> tuple[Path, list[Path]]:
    programs = []
    for name in ("cake_a_sm90a_1", "cake_b_sm90a_2"):
        program = workspace / "cached_ops" / name
        program.mkdir()
        (program / f"{name}.so").write_bytes(b"so")
        programs.append(program)
    manifest = workspace / iw.PREBUILD_MANIFEST
    manifest.write_text(
        json.dumps(
            {
                **HERE,
                **changes,
                "nvcc_programs": [p.name for p in programs],
                "cute_dsl_programs": ["msa_topk_select_sm90_sm90a_cute_dsl/fill"],
            }
        )
    )
    return manifest, programs


def test_a_matching_prebuild_is_used_and_named(cache, caplog):
    manifest, programs = _prebuilt(cache)
    with caplog.at_level(logging.INFO):
        iw.check_prebuilt_programs(HERE)
    assert all(program.is_dir() for program in programs)
    assert manifest.is_file()
    assert "3 prebuilt FlashInfer programs" in caplog.text
    assert "CUDA 13.0 at /usr/local/cuda" in caplog.text


def test_a_prebuild_of_another_cuda_is_removed_and_rebuilt(cache, caplog):
    """Same toolkit path, other version: FlashInfer's own keys would load the old programs."""
    manifest, programs = _prebuilt(cache, cuda={"home": "/usr/local/cuda", "version": "12.8"})
    unlisted = cache / "cached_ops" / "cake_c_sm90a_3"
    unlisted.mkdir()
    with caplog.at_level(logging.INFO):
        iw.check_prebuilt_programs(HERE)
    assert not any(program.exists() for program in programs)
    assert unlisted.is_dir()  # not the prebuild's: left to FlashInfer
    assert not manifest.exists()
    assert "CUDA 12.8 at /usr/local/cuda there, 13.0 at /usr/local/cuda here" in caplog.text
    assert "2 nvcc programs removed" in caplog.text


def test_the_first_sparse_layer_checks_the_prebuild_before_any_program_loads(cache, monkeypatch):
    """The sparse attention launches its programs while the model is built (patch 0007), so
    the check runs when the first sparse layer registers its warm-ups, whatever indexer it
    has, and only then."""
    monkeypatch.setattr(iw, "_prebuilt_checked", False)
    monkeypatch.setattr(iw, "_prebuild_environment", lambda: HERE)
    stale = {"home": "/usr/local/cuda", "version": "12.8"}
    _, programs = _prebuilt(cache, cuda=stale)
    iw.register_indexer_flashinfer_warmup(object(), vllm_config=None)  # a Triton indexer
    assert not any(program.exists() for program in programs)
    _, programs = _prebuilt(cache, cuda=stale)
    iw.register_indexer_flashinfer_warmup(object(), vllm_config=None)
    assert all(program.is_dir() for program in programs)  # once per process


def test_a_prebuild_of_another_cute_dsl_stack_is_left_to_flashinfer(cache, caplog):
    manifest, programs = _prebuilt(cache, cute_dsl="stack-b")
    with caplog.at_level(logging.INFO):
        iw.check_prebuilt_programs(HERE)
    assert all(program.is_dir() for program in programs)
    assert not manifest.exists()
    assert "another CuTe-DSL stack" in caplog.text


def test_a_manifest_cannot_remove_outside_the_jit_cache(cache, tmp_path, caplog):
    """A CUDA mismatch removes the manifest's nvcc programs, which it names by plain
    directory names of the JIT cache. No other entry removes anything: `..` (the workspace
    itself, which the check `program.parent == jit_dir` let through), `.`, empty, a
    relative or absolute path, FlashInfer's lock directory `tmp`, nor a link to a directory
    elsewhere, which is left, named, and not counted as removed."""
    jit_dir = cache / "cached_ops"
    outside = tmp_path / "keep"
    outside.mkdir()
    (outside / "kept.so").write_bytes(b"so")
    beside = cache / "beside.json"  # in the workspace, beside the JIT cache
    beside.write_text("{}")
    unlisted = jit_dir / "cake_c_sm90a_3"
    unlisted.mkdir()
    (jit_dir / "tmp").mkdir()
    (jit_dir / "tmp" / "cake_c_sm90a_3.lock").write_text("")
    (jit_dir / "linked").symlink_to(outside, target_is_directory=True)
    entries = ["..", ".", "", "../../../../keep", "../cached_ops", str(outside), "tmp", "linked"]
    manifest = cache / iw.PREBUILD_MANIFEST
    manifest.write_text(
        json.dumps({**HERE, "cuda": {"home": "/x", "version": "1"}, "nvcc_programs": entries})
    )
    with caplog.at_level(logging.WARNING):
        iw.check_prebuilt_programs(HERE)
    assert (outside / "kept.so").is_file() and beside.is_file()
    assert unlisted.is_dir() and (jit_dir / "tmp" / "cake_c_sm90a_3.lock").is_file()
    assert (jit_dir / "linked").is_symlink()
    assert not manifest.exists()
    assert "0 nvcc programs removed" in caplog.text
    assert "left 1 linked program directories" in caplog.text and "linked" in caplog.text


def test_one_toolkit_under_two_paths_is_one_cuda_home(cache, tmp_path, caplog):
    """`/usr/local/cuda` linking to `/usr/local/cuda-13.0`: the prebuild recorded one
    spelling, the engine finds the other; the programs are the same toolkit's and stay."""
    real = tmp_path / "cuda-13.0"
    real.mkdir()
    (tmp_path / "cuda").symlink_to(real, target_is_directory=True)
    manifest, programs = _prebuilt(cache, cuda={"home": str(real), "version": "13.0"})
    here = {**HERE, "cuda": {"home": str(tmp_path / "cuda"), "version": "13.0"}}
    with caplog.at_level(logging.INFO):
        iw.check_prebuilt_programs(here)
    assert all(program.is_dir() for program in programs)
    assert manifest.is_file()
    assert "3 prebuilt FlashInfer programs" in caplog.text


def _held_elsewhere(lock_path: Path) -> bool:
    """Whether another holder (a lock of its own, as another process's) has ``lock_path``."""
    from filelock import FileLock, Timeout

    result = []

    def probe() -> None:
        try:
            with FileLock(str(lock_path), timeout=0):
                result.append(False)
        except Timeout:
            result.append(True)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return result[0]


def test_the_engine_removes_a_program_under_flashinfers_lock_for_it(cache):
    """FlashInfer builds and loads an nvcc program under its own lock
    (`<jit dir>/tmp/<name>.lock`): while another process holds it, the engine's removal of
    that program waits; then it removes it."""
    from filelock import FileLock

    _, programs = _prebuilt(cache, cuda={"home": "/usr/local/cuda", "version": "12.8"})
    lock_dir = cache / "cached_ops" / "tmp"
    lock_dir.mkdir()
    building = FileLock(str(lock_dir / f"{programs[0].name}.lock"), thread_local=False)
    building.acquire()
    check = threading.Thread(target=iw.check_prebuilt_programs, args=(HERE,))
    try:
        check.start()
        check.join(timeout=1.0)
        assert check.is_alive(), "the removal did not wait for FlashInfer's lock"
        assert programs[0].is_dir()
    finally:
        building.release()
        check.join(timeout=10)
    assert not check.is_alive()
    assert not any(program.exists() for program in programs)


def test_the_engines_check_waits_for_a_prebuild_holding_its_lock(cache):
    """The prebuild holds patch 0004's prebuild lock across its check, build and write: an
    engine's check (another process: another lock object) waits for it."""
    from filelock import FileLock

    manifest, programs = _prebuilt(cache, cuda={"home": "/usr/local/cuda", "version": "12.8"})
    prebuilding = FileLock(str(manifest.with_suffix(".lock")), thread_local=False)
    prebuilding.acquire()
    check = threading.Thread(target=iw.check_prebuilt_programs, args=(HERE,))
    try:
        check.start()
        check.join(timeout=1.0)
        assert check.is_alive() and manifest.is_file()
    finally:
        prebuilding.release()
        check.join(timeout=10)
    assert not manifest.exists() and not any(program.exists() for program in programs)


@pytest.fixture
def vllm_cache(tmp_path, monkeypatch) -> Path:
    """``VLLM_CACHE_ROOT`` under tmp_path, vLLM's model-class inspection run in this process
    (its ``_run_in_subprocess`` given the function to call)."""
    from vllm.model_executor.models import registry

    root = tmp_path / "vllm-cache"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root))
    monkeypatch.setattr(registry, "_run_in_subprocess", lambda fn: fn())
    return root


@pytest.fixture
def humming_plans(monkeypatch) -> list:
    """The prebuild's Humming step stood in for, in the tests of its other steps (the published
    checkpoint's name gives it the full geometry's kernels, minutes of NVRTC): the plans it is
    handed, nothing checked or built (test_prebuild_humming.py and the test below build)."""
    from vllm_minimax import prebuild_humming

    handed: list = []
    monkeypatch.setattr(prebuild_humming, "check_ready", lambda plans, gpus: "stood in")
    monkeypatch.setattr(prebuild_humming, "prebuild", lambda plans, *a: handed.extend(plans) or 0)
    return handed


@pytest.fixture
def cutedsl_plans(monkeypatch) -> list:
    """The prebuild's CuTe-DSL step stood in for, in the tests of its other steps (seconds of
    `cute.compile` a key): the plans it is handed, nothing checked or built
    (test_prebuild_cutedsl.py and the slow test below build)."""
    from vllm_minimax import prebuild_cutedsl

    handed: list = []
    monkeypatch.setattr(prebuild_cutedsl, "check_ready", lambda plans: "stood in")
    monkeypatch.setattr(prebuild_cutedsl, "prebuild", lambda plans, *a: handed.extend(plans) or 0)
    return handed


def _prebuild_args(tmp_path: Path, model: str = "MiniMaxAI/MiniMax-M3-MXFP8"):
    import argparse

    return argparse.Namespace(
        cache_dir=tmp_path / "base",
        config=[REPO / "configs/serve/h200-8x.yaml"],
        gpu=["h200"],
        kv_cache_dtype=["fp8"],
        dry_run=False,
        model=model,
        jobs=1,
        only=None,
    )


def _stand_in_flashinfer_builds(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """FlashInfer's side of the prebuild (its check, plan, manifest and toolchain) stood in for,
    for the tests of what the prebuild writes beside FlashInfer's programs."""
    monkeypatch.setattr(iw, "check_prebuilt_programs", lambda: None)
    monkeypatch.setattr(prebuild, "plan_programs", lambda plan, builder: None)
    monkeypatch.setattr(prebuild, "write_manifest", lambda *a: cache / iw.PREBUILD_MANIFEST)
    monkeypatch.setattr(prebuild, "_set_environment", lambda location: None)
    monkeypatch.setattr(prebuild, "_check_flashinfer_paths", lambda location: cache / "cached_ops")
    monkeypatch.setattr(prebuild, "_check_toolchain", lambda: "/usr/local/cuda")


def test_the_prebuild_fills_vllms_model_info_for_the_served_architecture(
    cache,
    vllm_cache,
    monkeypatch,
    tmp_path,
    capsys,
    patched_vllm_root,
    humming_plans,
    cutedsl_plans,
):
    """The patched model package (its hash covers the series' files) gets the file a fresh
    server reads; the prebuild names it in one line. FlashInfer's builds are stand-ins, and
    Humming's step is handed the published checkpoint's layers (no config.json of it here)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "no-hub"))
    from vllm.model_executor.models import registry

    _stand_in_flashinfer_builds(monkeypatch, cache)
    architecture = "MiniMaxM3SparseForConditionalGeneration"
    entry = registry.ModelRegistry.models[architecture]
    path = vllm_cache / "modelinfos" / entry._get_cache_filename()

    assert prebuild.main(_prebuild_args(tmp_path)) == 0

    assert f"vLLM model info: {architecture}: {path} (written)\n" in capsys.readouterr().out
    assert [(p.gpu, p.skipped) for p in humming_plans] == [("h200", None)]
    assert humming_plans[0].layers
    assert humming_plans[0].source.startswith("the known geometry of MiniMaxAI/MiniMax-M3-MXFP8")
    # M3's 6144 x 128 gate: the SM90 bf16x3 router GEMM's keys, no LLFp32WGemm.
    [cutedsl] = cutedsl_plans
    assert (cutedsl.gpu, cutedsl.skipped) == ("h200", None)
    assert [cls.__name__ for cls in cutedsl.keys] == ["Sm90BF16x3RouterGemmKernel"]
    fresh = registry._LazyRegisteredModel(entry.module_name, entry.class_name)
    # The hash vLLM keys it on is of the patched tree's package (the series' files in it).
    origin = importlib.util.find_spec(entry.module_name).origin
    assert Path(origin).is_relative_to(patched_vllm_root)
    assert (Path(origin).parent / "nvidia" / "indexer_flashinfer_warmup.py").is_file()

    # A fresh server's lookup (any release's) answers from the file, inspecting nothing.
    def no_inspection(fn):
        raise AssertionError("vLLM inspected the class: its model-info file missed")

    monkeypatch.setattr(registry, "_run_in_subprocess", no_inspection)
    assert fresh.inspect_model_cls().architecture == architecture
    assert prebuild.main(_prebuild_args(tmp_path)) == 0
    assert f"{path} (already current)" in capsys.readouterr().out


def test_the_prebuild_builds_an_mxfp8_models_humming_gemm_kernels(
    cache, vllm_cache, monkeypatch, tmp_path, capsys, cutedsl_plans
):
    """`warmup --prebuild` of an MXFP8 config.json builds Humming's GEMM kernels into
    $HUMMING_CACHE_DIR and says so in one line; one layer shape (o_proj) keeps it to seconds,
    and NVRTC's compile writes empty cubins (no NVRTC on the CPU runner)."""
    from humming.jit.compiler import NVRTCCompiler
    from humming.jit.runtime import KernelRuntime
    from humming.utils import jit

    from vllm_minimax import prebuild_humming
    from vllm_minimax.m3_geometry import rank_text_config

    _stand_in_flashinfer_builds(monkeypatch, cache)

    def compile_(cls, source_path, cache_dirname, sm_version, kernel_expr, flags):
        (Path(cache_dirname) / "kernel_tmp.cubin").write_bytes(b"")
        return 0, "", ""

    monkeypatch.setattr(NVRTCCompiler, "_get_version", classmethod(lambda cls: (12, 9)))
    monkeypatch.setattr(
        NVRTCCompiler, "_get_include_dirs", classmethod(lambda cls: list(cls.include_dirs()))
    )
    monkeypatch.setattr(NVRTCCompiler, "_compile", classmethod(compile_))
    humming_cache = tmp_path / "humming"
    monkeypatch.setenv("HUMMING_CACHE_DIR", str(humming_cache))
    jit.get_humming_cache_dir.cache_clear()
    KernelRuntime._instances.clear()
    layers = prebuild_humming.humming_layers
    monkeypatch.setattr(
        prebuild_humming,
        "humming_layers",
        lambda *a: [x for x in layers(*a) if x.name == "o_proj"],
    )
    model = tmp_path / "mxfp8"
    model.mkdir()
    quantization = {"quant_method": "mxfp8", "ignored_layers": ["lm_head"]}
    text = rank_text_config(8, experts="ep") | {"quantization_config": quantization}
    (model / "config.json").write_text(json.dumps(text))
    try:
        assert prebuild.main(_prebuild_args(tmp_path, str(model))) == 0
    finally:
        jit.get_humming_cache_dir.cache_clear()
        KernelRuntime._instances.clear()
    kernels = list(humming_cache.glob("*/kernel.cubin"))
    assert kernels
    out = capsys.readouterr().out
    assert (
        f"humming (h200): {len(kernels)} GEMM kernels of 1 layer shapes, {len(kernels)} built"
        in out
    )


def test_an_unwritable_vllm_cache_stops_the_prebuild_before_it_builds(
    cache, vllm_cache, monkeypatch, tmp_path, capsys, humming_plans, cutedsl_plans
):
    built: list[object] = []
    monkeypatch.setattr(prebuild, "plan_programs", lambda plan, builder: built.append(plan))
    monkeypatch.setattr(prebuild, "_set_environment", lambda location: None)
    monkeypatch.setattr(prebuild, "_check_flashinfer_paths", lambda location: cache / "cached_ops")
    monkeypatch.setattr(prebuild, "_check_toolchain", lambda: "/usr/local/cuda")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(blocker / "vllm"))

    assert prebuild.main(_prebuild_args(tmp_path)) == 2

    err = capsys.readouterr().err
    assert err == (
        "vllm-minimax warmup --prebuild: error: vLLM's model-info cache"
        f" {blocker}/vllm/modelinfos is not writable: {blocker} is not a directory (set"
        " VLLM_CACHE_ROOT to the directory the server reads)\n"
    )
    assert built == []


def test_the_prebuild_holds_one_lock_over_its_check_build_and_write(
    cache, vllm_cache, monkeypatch, tmp_path, humming_plans, cutedsl_plans
):
    """`vllm-minimax warmup --prebuild` (prebuild.run) checks the cache, builds and writes
    its manifest under the lock the engine's check takes, held throughout; FlashInfer's
    paths, the toolchain and the builds are stand-ins (the slow test below runs them)."""
    lock_path = cache / iw.PREBUILD_MANIFEST
    lock_path = lock_path.with_suffix(".lock")
    seen: dict[str, bool] = {}

    def write_manifest(*args) -> Path:
        seen["write"] = _held_elsewhere(lock_path)
        return cache / iw.PREBUILD_MANIFEST

    monkeypatch.setattr(
        iw, "check_prebuilt_programs", lambda: seen.update(check=_held_elsewhere(lock_path))
    )
    monkeypatch.setattr(
        prebuild,
        "plan_programs",
        lambda plan, builder: seen.update(build=_held_elsewhere(lock_path)),
    )
    monkeypatch.setattr(prebuild, "write_manifest", write_manifest)
    monkeypatch.setattr(prebuild, "_set_environment", lambda location: None)
    monkeypatch.setattr(prebuild, "_check_flashinfer_paths", lambda location: cache / "cached_ops")
    monkeypatch.setattr(prebuild, "_check_toolchain", lambda: "/usr/local/cuda")
    assert prebuild.run(_prebuild_args(tmp_path)) == 0
    assert seen == {"check": True, "build": True, "write": True}
    assert not _held_elsewhere(lock_path)


def test_a_prebuild_for_another_release_or_arch_is_named_unused(cache, caplog):
    other = cache.parent.parent / "0.7.3" / "90a"
    other.mkdir(parents=True)
    (other / iw.PREBUILD_MANIFEST).write_text("{}")
    with caplog.at_level(logging.INFO):
        iw.check_prebuilt_programs(HERE)
    assert f"prebuilt FlashInfer programs in {other} are for FlashInfer 0.7.3 on 90a" in (
        caplog.text
    )


# --- real SM90a programs from the CUDA compiler on PyPI ------------------------------------

# The smallest Cake program of the config below (a top-k kernel of one warp), and the fp8
# decode proxy score's first CuTe-DSL kernel.
NVCC_PROGRAM = "cake_hopper_msa_6400f9b940af49476321_sm90a_*"
CUTE_KERNEL = "msa_proxy_score_decode_sm90_sm90a_cute_dsl/hq1_sq1_bf1_*"


@pytest.mark.slow
def test_prebuild_compiles_sm90a_programs_flashinfer_then_loads(
    tmp_path, patched_vllm_root, tp8_rank_model
):
    """One nvcc program and one CuTe-DSL kernel of a small TP-8-rank config, compiled on this
    host with the CUDA compiler from PyPI (nvidia-cuda-nvcc 13.x), into a fresh cache.

    Measured on the CI host: about 70 s, 11 s of them nvcc (the rest is importing vLLM and
    FlashInfer and planning)."""
    from vllm_minimax.testing.pypi_cuda import make_cuda_home

    cuda_home = make_cuda_home(tmp_path / "cuda")
    model = tp8_rank_model
    config = tmp_path / "small.yaml"
    config.write_text(
        "max-model-len: 4096\nmax-num-seqs: 4\nmax-num-batched-tokens: 512\n"
        "kv-cache-dtype: fp8\nattention-config:\n  indexer_kv_dtype: fp8\n"
    )
    base = tmp_path / "base"
    env = {
        **os.environ,
        "CUDA_HOME": str(cuda_home),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(patched_vllm_root),
    }
    for name in ("FLASHINFER_CUDA_ARCH_LIST", "CUTE_DSL_ARCH", "FLASHINFER_WORKSPACE_BASE"):
        env.pop(name, None)
    argv = [
        sys.executable, "-m", "vllm_minimax", "warmup", "--prebuild", "--config", str(config),
        "--model", str(model), "--gpu", "h200", "--cache-dir", str(base), "--jobs", "1",
        "--only", NVCC_PROGRAM, "--only", CUTE_KERNEL,
    ]  # fmt: skip
    result = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 programs built, 0 already there" in result.stdout
    # The gate's router GEMM keys (its 6144 x 128: the bf16x3 kernel's, 512 tokens), built
    # into the tree's vLLM cache (VLLM_CACHE_ROOT, as its model-info file) or found there.
    [line] = [x for x in result.stdout.splitlines() if x.startswith("cutedsl: ") and "built" in x]
    entries = int(line.split()[1])
    assert entries > 0 and line.endswith("each loads with no cute.compile")
    written = Path(os.environ["VLLM_CACHE_ROOT"], "cutedsl", "Sm90BF16x3RouterGemmKernel")
    assert len(list(written.glob("*.json"))) >= entries

    workspace = base / ".cache" / "flashinfer" / "0.7.4" / "90a"
    [program] = (workspace / "cached_ops").glob(NVCC_PROGRAM)
    library = program / f"{program.name}.so"
    sections = subprocess.run(
        ["readelf", "-S", "-d", str(library)], capture_output=True, text=True, check=True
    ).stdout
    assert ".nv_fatbin" in sections  # device code is in the library
    assert "libcudart.so.13" in sections  # and it loads the runtime of its toolkit
    assert "-gencode=arch=compute_90a,code=sm_90a" in (program / "build.ninja").read_text()
    # What FlashInfer's start-up build runs: ninja, in the program's directory.
    ninja = [shutil.which("ninja", path=env["PATH"]), "-n", "-C", str(program)]
    assert "no work to do" in subprocess.run(ninja, capture_output=True, text=True).stdout
    os.utime(library, ns=(1, 1))  # a library older than its objects: ninja relinks it
    assert "no work to do" not in subprocess.run(ninja, capture_output=True, text=True).stdout

    [kernel] = (workspace / "cached_ops").glob(f"{CUTE_KERNEL}.o")
    meta = json.loads((kernel.parent / "meta.json").read_text())
    assert meta["arch"] == "sm90a"
    code = kernel.read_bytes()
    assert b"-arch sm_90a" in code
    # The kernel checks its tensors are on CUDA, as the engine passes them.
    assert b"expected device_type=cuda" in code and b"expected device_type=cpu" not in code

    manifest = json.loads((workspace / iw.PREBUILD_MANIFEST).read_text())
    assert manifest["nvcc_programs"] == [program.name]
    assert manifest["cute_dsl_programs"] == [f"{kernel.parent.name}/{kernel.stem}"]
    assert manifest["cuda"]["home"] == str(cuda_home)
    assert manifest["cuda"]["version"].startswith("13.")  # the nvidia-cuda-nvcc wheel's
