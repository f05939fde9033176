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

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from flashinfer.jit.cake_hopper_msa import ROUTES
from flashinfer.msa_ops import cake_hopper_sm90
from test_indexer_flashinfer_warmup import _geometry, _Recorder
from vllm.models.minimax_m3.nvidia import indexer_flashinfer_warmup as iw
from vllm.models.minimax_m3.nvidia import sparse_attention_flashinfer as sa

from vllm_minimax import flashinfer_offline, prebuild

REPO = Path(__file__).resolve().parents[3]
H200 = prebuild.GPU_TARGETS["h200"]
H20 = prebuild.GPU_TARGETS["h20"]


@pytest.fixture(autouse=True)
def cute_dsl_target(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", flashinfer_offline.SM90_CUTE_DSL_ARCH)


def _plan(gpu=H200, *, indexer=None, sparse_attention=None) -> prebuild.Plan:
    plan = prebuild.Plan(gpu, indexer=indexer, sparse_attention=sparse_attention)
    builder = prebuild.Builder(build=False, jobs=1, only=None, say=lambda text: None)
    prebuild.plan_programs(plan, builder)
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
        builder = prebuild.Builder(build=False, jobs=1, only=None, say=lambda text: None)
        sink = prebuild._Sink(builder)
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
    plan = _plan(prebuild.GPU_TARGETS["h100"], indexer=indexer, sparse_attention=sparse)
    assert (len(plan.nvcc), len(plan.cute_dsl)) == (13, 21)
    assert {*plan.nvcc, *plan.cute_dsl} == built


# --- the geometry the prebuild reads -------------------------------------------------------


def _published() -> prebuild.ModelGeometry:
    return prebuild.read_model_geometry("MiniMaxAI/MiniMax-M3-MXFP8")


def test_h200_config_gives_the_engines_indexer_geometry():
    settings = prebuild.read_engine_settings(REPO / "configs/serve/h200-8x.yaml")
    shape = prebuild.engine_shape(settings, _published(), H200)
    geometry, reason = prebuild.indexer_geometry(settings, _published(), shape)
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
    sparse, why = prebuild.sparse_attention_geometry(settings, _published(), shape)
    assert sparse is None
    assert "kv_cache_dtype=auto" in why


def test_an_fp8_kv_cache_adds_the_sparse_attention():
    settings = prebuild.read_engine_settings(REPO / "configs/serve/h200-8x.yaml", "fp8")
    shape = prebuild.engine_shape(settings, _published(), H200)
    geometry, reason = prebuild.sparse_attention_geometry(settings, _published(), shape)
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


def test_unset_batch_bounds_take_vllms_defaults_for_the_gpu(tp8_rank_model):
    """The rank slice's config sets neither bound: vLLM's defaults for an H100 or H200
    (`vllm serve`: 8192 tokens, 1024 sequences), read from vLLM on a simulated GPU of that
    memory, and the rank's heads from its config.json."""
    settings = prebuild.read_engine_settings(REPO / "evals/h200-m3-tp8-rank-serve.yaml")
    geometry_of_model = prebuild.read_model_geometry(str(tp8_rank_model))
    for gpu in (prebuild.GPU_TARGETS["h100"], H200):
        shape = prebuild.engine_shape(settings, geometry_of_model, gpu)
        assert (shape.max_num_batched_tokens, shape.max_num_seqs) == (8192, 1024)
        assert shape.sources["max_num_seqs"] == f"vLLM's default for {gpu.device_name}"
    small = prebuild.GpuTarget("small", 132, 40.0, "NVIDIA L40S")
    shape = prebuild.engine_shape(settings, geometry_of_model, small)
    assert (shape.max_num_batched_tokens, shape.max_num_seqs) == (2048, 256)
    geometry, _ = prebuild.indexer_geometry(settings, geometry_of_model, shape)
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


def test_a_manifest_cannot_remove_outside_the_jit_cache(cache, tmp_path):
    outside = tmp_path / "keep"
    outside.mkdir()
    manifest = cache / iw.PREBUILD_MANIFEST
    manifest.write_text(
        json.dumps(
            {**HERE, "cuda": {"home": "/x", "version": "1"}, "nvcc_programs": ["../../../../keep"]}
        )
    )
    iw.check_prebuilt_programs(HERE)
    assert outside.is_dir()


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
