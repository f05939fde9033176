"""vllm_minimax/prebuild_humming.py: the Humming GEMM kernels an MXFP8 start builds on an SM90
GPU, enumerated and built with no GPU, under the keys Humming's own compiler gives them.

NVRTC is not on this CPU: its version and CUDA include paths are stood in for, and its
compile writes an empty cubin. What is compared is what Humming keys: the kernel directories.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import humming  # noqa: F401  (in the lock: a missing Humming fails here, not skips)
import pytest

from vllm_minimax import prebuild_humming as ph
from vllm_minimax.cli import main
from vllm_minimax.m3_geometry import M3_TEXT_CONFIG, rank_text_config
from vllm_minimax.prebuild_inputs import GPU_TARGETS, PrebuildError

REPO = Path(__file__).resolve().parents[2]
H100_LOG = REPO / "results" / "h100" / "cold-start" / "rank-mxfp8-ep-prebuilt.log"
MXFP8 = {"quant_method": "mxfp8", "ignored_layers": ["lm_head"]}


def _h100_as_logged() -> dict:
    """The H100 as the device machine's vLLM log names it (num_sms), not as the module says."""
    text = H100_LOG.read_text()
    (sm_count,) = set(re.findall(r"num_sms=(\d+)", text))
    return {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "is_ppu": False,
        "sm_version": 90,
        "sm_major": 9,
        "sm_minor": 0,
        "sm_count": int(sm_count),
        "l2_cache_size": 50 * 2**20,
        "max_registers_per_sm": 64 * 1024,
    }


@pytest.fixture
def nvrtc(monkeypatch, tmp_path):
    """Humming's NVRTC path with the compiler itself stood in for; the cache in tmp_path."""
    from humming.jit.compiler import NVRTCCompiler
    from humming.jit.runtime import KernelRuntime
    from humming.utils import jit

    def compile_(cls, source_path, cache_dirname, sm_version, kernel_expr, flags):
        (Path(cache_dirname) / "kernel_tmp.cubin").write_bytes(b"")
        return 0, "", ""

    monkeypatch.setattr(NVRTCCompiler, "_get_version", classmethod(lambda cls: (12, 9)))
    monkeypatch.setattr(
        NVRTCCompiler,
        "_get_include_dirs",
        classmethod(lambda cls: [*cls.include_dirs(), "/usr/local/cuda/include"]),
    )
    monkeypatch.setattr(NVRTCCompiler, "_compile", classmethod(compile_))
    monkeypatch.setenv("HUMMING_CACHE_DIR", str(tmp_path / "humming"))
    monkeypatch.delenv("VLLM_HUMMING_MOE_GEMM_TYPE", raising=False)
    jit.get_humming_cache_dir.cache_clear()
    KernelRuntime._instances.clear()
    yield tmp_path / "humming"
    jit.get_humming_cache_dir.cache_clear()
    KernelRuntime._instances.clear()


def _slice_layers() -> list[ph.HummingLayer]:
    return ph.humming_layers(rank_text_config(8, experts="ep"), 1, 1, "grouped_contiguous")


def test_the_layers_of_the_slice_and_of_a_tp8_rank():
    """Shapes as vLLM's MiniMax M3 builds them, worked out here from the heads and widths."""
    shapes = {(x.shape_n, x.shape_k, x.num_experts) for x in _slice_layers()}
    q, kv, hidden = 8 * 128, 128, 6144
    assert shapes == {
        (q + 2 * kv, hidden, 0),  # full attention's qkv
        (q + 2 * kv + 128 + 128, hidden, 0),  # with index_q and index_k
        (hidden, q, 0),  # o_proj
        (2 * 1536, hidden, 0),
        (hidden, 1536, 0),  # the dense MLP, 12288 / 8
        (2 * 3072, hidden, 0),
        (hidden, 3072, 0),  # the shared expert, whole at TP 1
        (2 * 3072, hidden, 16),
        (hidden, 3072, 16),  # 16 whole experts
    }
    rank = ph.humming_layers(M3_TEXT_CONFIG, 8, 8, "grouped_contiguous")
    shared = {(x.shape_n, x.shape_k) for x in rank if "shared" in x.name}
    assert shared == {(2 * 384, hidden), (hidden, 384)}  # 3072 / 8
    experts = {(x.shape_n, x.shape_k, x.num_experts) for x in rank if x.num_experts}
    assert experts == {(2 * 3072, hidden, 16), (hidden, 3072, 16)}
    two_nodes = ph.humming_layers(M3_TEXT_CONFIG, 8, 16, "grouped_contiguous")
    assert {x.num_experts for x in two_nodes if x.num_experts} == {8}  # TP 8 x DP 2
    tp = ph.humming_layers(M3_TEXT_CONFIG, 8, 1, "indexed")
    assert {(x.shape_n, x.num_experts, x.gemm_type) for x in tp if x.num_experts} == {
        (2 * 384, 128, "indexed"),
        (hidden, 128, "indexed"),
    }


def _reference_kernels(layers: list[ph.HummingLayer], properties: dict) -> set[str]:
    """Humming's own prepare_kernels with no tuning given (Humming tunes every interval
    itself), for layer configs written out here: e4m3 weights, e8m0 scales per 32, bf16
    activations; the kernel directories it keys."""
    import torch
    from humming import dtypes
    from humming.config import WeightScaleType
    from humming.kernel.humming import HummingKernel
    from humming.schema import HummingWeightSchema
    from humming.transform import prepare_layer_config

    schema = HummingWeightSchema(
        b_dtype=dtypes.float8e4m3,
        bs_dtype=dtypes.float8e8m0,
        weight_scale_group_size=32,
        weight_scale_type=WeightScaleType.GROUP,
    )
    with ph.humming_device(properties), ph.recorded_kernels() as paths:
        for layer in layers:
            config = prepare_layer_config(
                shape_n=layer.shape_n,
                shape_k=layer.shape_k,
                weight_schema=schema,
                num_experts=layer.num_experts or None,
                pad_n_to_multiple=256,
                pad_k_to_multiple=128,
                torch_dtype=torch.bfloat16,
                device=0,
            )
            compute = {"use_batch_invariant": False, "use_f16_accum": False}
            compute["gemm_type"] = layer.gemm_type
            HummingKernel.prepare_kernels(config.to_str(), json.dumps(compute), None, 0)
    return {Path(p).parent.name for p in paths}


def test_the_prebuilds_kernels_are_hummings_own_for_the_h100(nvrtc, capsys):
    """A dense layer and the experts' w2 (seconds, not the slice's minute): the prebuild's
    kernel directories are those Humming's prepare_kernels keys on the H100 as logged, every
    one built into $HUMMING_CACHE_DIR (Humming skips those there: compiler.py)."""
    from humming.jit.runtime import KernelRuntime

    layers = [x for x in _slice_layers() if x.name in ("o_proj", "experts w2")]
    item = ph.HummingPlan("h100", layers)
    assert ph.prebuild([item], GPU_TARGETS, False, print) > 0
    built = {p.parent.name for p in nvrtc.glob("*/kernel.cubin")}
    out = capsys.readouterr().out
    assert f"{len(built)} GEMM kernels of 2 layer shapes, {len(built)} built, 0 already" in out
    assert "NVRTCCompiler (nvrtc+12.9, includes " in out and "/usr/local/cuda/include" in out
    KernelRuntime._instances.clear()
    assert _reference_kernels(layers, _h100_as_logged()) == built


def test_a_kernel_that_does_not_compile_names_its_layer_and_keeps_the_others(
    nvrtc, monkeypatch, capsys
):
    """NVRTC fails on the third kernel: one PrebuildError naming the layer (the CLI's exit 2
    with that line), not Humming's traceback; the kernels that compiled stay in the cache."""
    from humming.jit.compiler import NVRTCCompiler

    compiled: list[str] = []

    def fails_third(cls, source_path, cache_dirname, sm_version, kernel_expr, flags):
        compiled.append(str(cache_dirname))
        if len(compiled) == 3:
            return 1, "", "kernel.cu(1): error: planted"
        (Path(cache_dirname) / "kernel_tmp.cubin").write_bytes(b"")
        return 0, "", ""

    monkeypatch.setattr(NVRTCCompiler, "_compile", classmethod(fails_third))
    layers = [x for x in _slice_layers() if x.name == "o_proj"]
    with pytest.raises(PrebuildError) as raised:
        ph.prebuild([ph.HummingPlan("h100", layers)], GPU_TARGETS, False, print)
    message = str(raised.value)
    assert message.startswith("Humming could not build the kernels of o_proj (")
    assert "NVRTCCompiler failed with exit code 1" in message
    assert message.endswith("(the kernels it finished stay in the cache)")
    failed = Path(compiled[2])
    assert str(failed) in message and not (failed / "kernel.cubin").exists()
    built = {p.parent for p in nvrtc.glob("*/kernel.cubin")}
    assert built == {Path(d) for d in compiled} - {failed} and len(built) >= 2
    capsys.readouterr()


def test_another_cuda_include_path_is_another_key(nvrtc, monkeypatch):
    """What the server's CUDA_HOME gives Humming's include paths is in every key: a prebuild
    under another one builds kernels the server never finds (o_proj alone: no MoE tuning)."""
    from humming.jit.compiler import NVRTCCompiler
    from humming.jit.runtime import KernelRuntime

    layers = [x for x in _slice_layers() if x.name == "o_proj"]
    ph.prebuild([ph.HummingPlan("h100", layers)], GPU_TARGETS, False, print)
    built = {p.parent.name for p in nvrtc.glob("*/kernel.cubin")}
    KernelRuntime._instances.clear()
    assert _reference_kernels(layers, _h100_as_logged()) == built
    KernelRuntime._instances.clear()
    monkeypatch.setattr(
        NVRTCCompiler,
        "_get_include_dirs",
        classmethod(lambda cls: [*cls.include_dirs(), "/opt/other-cuda/include"]),
    )
    assert _reference_kernels(layers, _h100_as_logged()).isdisjoint(built)


def test_the_h100s_sm_count_is_the_logged_one():
    props = ph.device_properties(GPU_TARGETS["h100"])
    assert {k: props[k] for k in _h100_as_logged()} == _h100_as_logged()
    assert ph.device_properties(GPU_TARGETS["h200"])["name"] == "NVIDIA H200"


def test_what_is_not_prebuilt_says_why(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("VLLM_HUMMING_INPUT_QUANT_CONFIG", raising=False)
    text = rank_text_config(8, experts="ep")
    assert ph.plan(text, 1, 1, GPU_TARGETS["h100"]).skipped == (
        "the checkpoint is not MXFP8 (its Humming kernels are not prebuilt)"
    )
    pcie = ph.plan(text | {"quantization_config": MXFP8}, 1, 1, GPU_TARGETS["h100-pcie"])
    assert "known here for ('h100', 'h200') only" in str(pcie.skipped)
    monkeypatch.setenv("VLLM_HUMMING_INPUT_QUANT_CONFIG", '{"dtype": "int8"}')
    odd = ph.plan(text | {"quantization_config": MXFP8}, 1, 1, GPU_TARGETS["h100"])
    assert (
        odd.skipped
        == "VLLM_HUMMING_INPUT_QUANT_CONFIG is set (the prebuild builds vLLM's defaults)"
    )
    assert ph.prebuild([pcie, odd], GPU_TARGETS, False, print) == 0
    out = capsys.readouterr().out
    assert "humming (h100-pcie): skipped: Humming's device properties" in out
    assert "humming (h100): skipped: VLLM_HUMMING_INPUT_QUANT_CONFIG" in out


def _prebuild_an_mxfp8_rank(
    tmp_path: Path, humming_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> int:
    """`warmup --prebuild` of h200-8x for the H100 over an MXFP8 slice's config.json made in
    ``tmp_path``, Humming's cache at ``humming_cache``; its exit status."""
    from humming.utils import jit

    model = tmp_path / "model"
    model.mkdir()
    text = rank_text_config(8, experts="ep") | {"architectures": ["MiniMaxM3SparseForCausalLM"]}
    (model / "config.json").write_text(json.dumps(text | {"quantization_config": MXFP8}))
    config = REPO / "configs" / "serve" / "h200-8x.yaml"
    argv = ["warmup", "--prebuild", "--config", str(config), "--model", str(model)]
    monkeypatch.setenv("HUMMING_CACHE_DIR", str(humming_cache))
    jit.get_humming_cache_dir.cache_clear()
    try:
        return main([*argv, "--cache-dir", str(tmp_path / "fi"), "--gpu", "h100"])
    finally:
        jit.get_humming_cache_dir.cache_clear()


def test_an_unwritable_humming_cache_is_exit_2(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    assert _prebuild_an_mxfp8_rank(tmp_path, blocker / "cache", monkeypatch) == 2
    err = capsys.readouterr().err
    assert f"Humming's cache {blocker / 'cache'} cannot be created" in err
    assert not (tmp_path / "fi" / "vllm").exists()


def test_a_compiler_that_cannot_run_is_exit_2_before_anything_is_written(
    tmp_path, capsys, monkeypatch
):
    """No NVRTC here: one message, and neither vLLM's model-info entry nor a kernel written."""
    from humming.jit.compiler import NVRTCCompiler

    def missing(cls):
        raise OSError("libnvrtc.so: cannot open shared object file")

    monkeypatch.setenv("HUMMING_COMPILER", "nvrtc")
    monkeypatch.setattr(NVRTCCompiler, "_get_version", classmethod(missing))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    assert _prebuild_an_mxfp8_rank(tmp_path, tmp_path / "humming", monkeypatch) == 2
    assert "Humming's NVRTCCompiler cannot run here: libnvrtc.so" in capsys.readouterr().err
    assert not (tmp_path / "vllm" / "modelinfos").exists()
    assert not list((tmp_path / "humming").glob("*/kernel.cubin"))


def test_a_property_humming_asks_that_the_prebuild_lacks_fails_it():
    lacking = {k: v for k, v in _h100_as_logged().items() if k != "sm_count"}
    layers = [x for x in _slice_layers() if x.name == "experts w2"]
    with pytest.raises(PrebuildError, match="'sm_count'"), ph.humming_device(lacking):
        ph.kernel_calls(layers)


def test_the_shipped_configs_parallelism_decides_the_experts_shapes(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_HUMMING_MOE_GEMM_TYPE", raising=False)
    model = tmp_path / "m3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(M3_TEXT_CONFIG | {"quantization_config": MXFP8}))
    serve = REPO / "configs" / "serve"
    one, two = (
        ph.plans_for([serve / name], str(model), [GPU_TARGETS["h100"]])
        for name in ("h100-8x.yaml", "h100-16x-2node.yaml")
    )
    # TP 8 with expert parallelism: 16 whole experts a rank; over two nodes (DP 2) 8.
    assert {(x.num_experts, x.shape_n, x.gemm_type) for x in one[0].layers if x.num_experts} == {
        (16, 2 * 3072, "grouped_contiguous"),
        (16, 6144, "grouped_contiguous"),
    }
    assert {x.num_experts for x in two[0].layers if x.num_experts} == {8}
    assert {(x.shape_n, x.shape_k) for x in one[0].layers if x.name == "o_proj"} == {(6144, 1024)}


PUBLISHED = "MiniMaxAI/MiniMax-M3-MXFP8"
KNOWN = f"the known geometry of {PUBLISHED} (vllm_minimax/m3_geometry.py, MXFP8)"
SM90_CONFIGS = ["h100-8x", "h100-16x-2node", "h200-8x", "h200-8x-bf16"]
RECORD_ARGV = """#!/bin/sh
printf '%s\\n' "$@" > "$RECORD"
"""


@pytest.fixture
def no_hub_copy(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache (no snapshot of any model here), which it returns."""
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    return hub


def _plans(model: str, configs: list[str] = SM90_CONFIGS, gpus=("h100", "h200")) -> list:
    serve = REPO / "configs" / "serve"
    paths = [serve / f"{name}.yaml" for name in configs]
    return ph.plans_for(paths, model, [GPU_TARGETS[gpu] for gpu in gpus])


def _experts(item: ph.HummingPlan) -> set[tuple[int, int, int, str]]:
    return {
        (x.num_experts, x.shape_n, x.shape_k, x.gemm_type) for x in item.layers if x.num_experts
    }


def test_the_published_checkpoints_name_plans_what_its_config_json_would(
    tmp_path, no_hub_copy, monkeypatch
):
    """No copy of MiniMaxAI/MiniMax-M3-MXFP8 here: its name plans the layers of the config.json
    `make-tiny-model --geometry m3` writes (the published minimax_m3_vl layout, MXFP8), per GPU
    and per TP/EP of the shipped SM90 configs, and says where they came from."""
    monkeypatch.delenv("VLLM_HUMMING_MOE_GEMM_TYPE", raising=False)
    model = tmp_path / "m3"
    assert main(["make-tiny-model", str(model), "--geometry", "m3"]) == 0
    text = json.loads((model / "config.json").read_text())["text_config"]
    assert "layer_types" not in text and "moe_layer_freq" in text  # the published schema
    from_file, from_name = _plans(str(model)), _plans(PUBLISHED)
    assert [(p.gpu, p.layers, p.skipped) for p in from_name] == [
        (p.gpu, p.layers, p.skipped) for p in from_file
    ]
    assert {p.source for p in from_file} == {str(model / "config.json")}
    assert {p.source.split(":")[0] for p in from_name} == {KNOWN}
    # TP 8 + EP 8 (h100-8x, h200-8x, h200-8x-bf16), and EP 16 over two nodes: each on both GPUs.
    assert [(p.gpu, p.skipped) for p in from_name] == [(g, None) for g in ("h100", "h200") * 2]
    whole = {(2 * 3072, 6144), (6144, 3072)}
    for item, experts in zip(from_name, (16, 16, 8, 8), strict=True):
        assert _experts(item) == {(experts, n, k, "grouped_contiguous") for n, k in whole}
    said: list[str] = []
    o_proj = [x for x in from_name[0].layers if x.name == "o_proj"]
    ph.prebuild(
        [ph.HummingPlan("h100", o_proj, source=from_name[0].source)], GPU_TARGETS, True, said.append
    )
    assert said == [
        f"humming: layer shapes from {KNOWN}: no config.json of it here, none downloaded",
        "humming (h100): 1 layer shapes (dry run: nothing built)",
    ]


def test_both_schemas_give_the_same_layer_kinds_and_index_dim():
    """The published schema's per-layer flags (1: sparse attention, MoE) and its index dim, here
    64 (not the head dim a missing one falls back to), as the flat schema spells them."""
    published = {
        "sparse_attention_config": {"sparse_attention_freq": [0, 1, 1], "sparse_index_dim": 64},
        "moe_layer_freq": [0, 0, 1],
    }
    flat = {
        "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
        "mlp_layer_types": ["dense", "dense", "sparse"],
        "index_head_dim": 64,
    }
    assert ph.layer_kinds(published) == ph.layer_kinds(flat) == (*flat.values(),)
    with pytest.raises(KeyError):
        ph.layer_kinds({"moe_layer_freq": [0, 1]})  # no attention kinds in either spelling


@pytest.mark.parametrize(
    "model",
    ["MiniMaxAI/MiniMax-M3", "MiniMaxAI/MiniMax-M3-MXFP8-EAGLE", "someone/MiniMax-M3-MXFP8"],
)
def test_another_hub_name_without_a_copy_here_is_skipped(no_hub_copy, model):
    """Only the published MXFP8 checkpoint's quantization is known: the BF16 checkpoint (the same
    prefix) and any other name are skipped as before, naming --model DIR."""
    why = f"no config.json for {model} here to tell its quantization (pass --model DIR)"
    assert [(p.gpu, p.layers, p.skipped) for p in _plans(model, ["h200-8x"])] == [
        ("h100", [], why),
        ("h200", [], why),
    ]


def test_a_cached_snapshot_of_the_published_checkpoint_wins_over_its_known_geometry(no_hub_copy):
    """A config.json in the Hugging Face cache is read, not the known geometry: here one
    without a quantization config, whose kernels are not prebuilt."""
    snapshot = no_hub_copy / "models--MiniMaxAI--MiniMax-M3-MXFP8" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"text_config": M3_TEXT_CONFIG}))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    [item] = _plans(PUBLISHED, ["h200-8x"], ["h200"])
    assert item.source == str(snapshot / "config.json")
    assert item.skipped == "the checkpoint is not MXFP8 (its Humming kernels are not prebuilt)"


def test_the_images_prebuild_plans_the_published_checkpoints_kernels(tmp_path, no_hub_copy):
    """docker/prebuild.sh (its build command recorded, not run) asks `warmup --prebuild` for the
    published checkpoint, whose Humming layers are planned for every config and GPU it names."""
    from vllm_minimax.cli import build_parser

    recorder = tmp_path / "record-argv"
    recorder.write_text(RECORD_ARGV)
    recorder.chmod(0o755)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PREBUILD_")},
        "PYTHON": sys.executable,
        "PIP": "echo PIP",
        "VLLM_MINIMAX": str(recorder),
        "RECORD": str(tmp_path / "argv"),
        "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "flashinfer"),
        "HUMMING_CACHE_DIR": str(tmp_path / "humming"),
    }
    script = REPO / "docker" / "prebuild.sh"
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    args = build_parser().parse_args((tmp_path / "argv").read_text().splitlines())
    assert args.prebuild and args.model == PUBLISHED
    plans = ph.plans_for(args.config, args.model, [GPU_TARGETS[gpu] for gpu in args.gpu])
    assert {(p.gpu, p.skipped) for p in plans} == {("h100", None), ("h200", None)}
    assert {x.num_experts for p in plans for x in p.layers if x.num_experts} == {8, 16}


def test_an_h100_pcie_tunes_for_itself_and_shares_only_kernels_of_the_same_code(nvrtc):
    """The SM count is in no kernel's key: it picks the tuning, whose kernels' source is keyed,
    and the launch grid, set at run time. An H100 PCIe (114 SMs) tuning full attention's qkv_proj
    picks kernels the H100's prebuild built and kernels it did not (built at its start)."""
    from humming.jit.runtime import KernelRuntime

    layers = [x for x in _slice_layers() if x.name == "qkv_proj (full attention)"]
    h100 = _reference_kernels(layers, _h100_as_logged())
    KernelRuntime._instances.clear()
    pcie = _reference_kernels(layers, _h100_as_logged() | {"sm_count": 114})
    assert h100 & pcie and pcie - h100
