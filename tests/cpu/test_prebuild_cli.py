"""`vllm-minimax warmup --prebuild` without the patched vLLM: its options, the inputs it reads,
and the pieces that make FlashInfer's programs on a CPU-only host (tests/cpu/patched_vllm/
test_prebuild.py runs the whole prebuild)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from vllm_minimax import prebuild, prebuild_inputs
from vllm_minimax.cli import main
from vllm_minimax.m3_geometry import M3_TEXT_CONFIG

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "serve" / "h200-8x.yaml"


def _run(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["warmup", *argv])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["--gpu", "h200"], ["--kv-cache-dtype", "fp8"], ["--dry-run"], ["--only", "cake_*"]],
)
def test_prebuild_options_need_prebuild(capsys, tmp_path, argv):
    rc, err = _run(capsys, "--config", str(CONFIG), "--cache-dir", str(tmp_path), *argv)
    assert rc == 2
    assert "go with --prebuild" in err
    assert list(tmp_path.iterdir()) == []


def test_several_configs_need_prebuild(capsys, tmp_path):
    rc, err = _run(capsys, "--config", str(CONFIG), "--config", str(CONFIG))
    assert rc == 2
    assert "one --config on the GPU" in err


def test_prebuild_of_a_missing_config_exits_2(capsys, tmp_path):
    missing = tmp_path / "nope.yaml"
    rc, err = _run(capsys, "--prebuild", "--config", str(CONFIG), "--config", str(missing))
    assert rc == 2
    assert f"serving config {missing} does not exist" in err


def test_prebuild_refuses_another_arch_list(capsys, tmp_path, monkeypatch):
    """The server reads FlashInfer's 90a directory only with this unset (or 9.0)."""
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0 10.0")
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.delenv("FLASHINFER_WORKSPACE_BASE", raising=False)
    rc, err = _run(capsys, "--prebuild", "--config", str(CONFIG), "--cache-dir", str(tmp_path))
    assert rc == 2
    assert "FLASHINFER_CUDA_ARCH_LIST=9.0 10.0" in err
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_gpu_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["warmup", "--prebuild", "--config", str(CONFIG), "--gpu", "a100"])
    assert "invalid choice: 'a100'" in capsys.readouterr().err


# --- what the prebuild reads --------------------------------------------------------------


def test_engine_settings_of_a_shipped_config():
    settings = prebuild_inputs.read_engine_settings(CONFIG)
    assert (settings.tensor_parallel_size, settings.max_model_len) == (8, 131072)
    assert (settings.max_num_seqs, settings.max_num_batched_tokens) == (256, 16384)
    assert settings.num_speculative_tokens == 3  # h200-8x: EAGLE3 with K = 3
    assert settings.kv_cache_dtype == "auto"
    assert prebuild_inputs.read_engine_settings(CONFIG, "fp8").kv_cache_dtype == "fp8"


def test_engine_settings_refuse_what_they_cannot_read_exactly(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("max-model-len: 128k\n")
    with pytest.raises(
        prebuild_inputs.PrebuildError, match="max-model-len must be a positive integer"
    ):
        prebuild_inputs.read_engine_settings(config)
    config.write_text('speculative-config: \'{"method": "mtp", "num_speculative_tokens": 3}\'\n')
    assert prebuild_inputs.read_engine_settings(config).num_speculative_tokens == 3
    config.write_text("enforce-eager: true\n")
    assert "enforce-eager" in str(prebuild_inputs.read_engine_settings(config).warmup_off)


def test_model_geometry_from_either_config_layout(tmp_path, tp8_rank_model):
    """vLLM 0.34.0's flat config and 0.33.0's published one (``sparse_attention_config``)."""
    flat = tp8_rank_model
    published = tmp_path / "published"
    published.mkdir()
    sparse = {
        "sparse_num_index_heads": 1,
        "sparse_index_dim": 128,
        "sparse_topk_blocks": 16,
        "sparse_block_size": 128,
    }
    text = {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 128}
    (published / "config.json").write_text(
        json.dumps({"text_config": {**text, "sparse_attention_config": sparse}})
    )
    first, second = (prebuild_inputs.read_model_geometry(str(p)) for p in (flat, published))
    assert first.num_attention_heads == second.num_attention_heads == 8
    assert first.num_key_value_heads == second.num_key_value_heads == 1
    assert first.index_heads == second.index_heads == 1
    assert first.topk_blocks == second.topk_blocks == 16


def test_m3_checkpoints_take_the_published_geometry_and_others_a_config():
    geometry = prebuild_inputs.read_model_geometry("MiniMaxAI/MiniMax-M3-MXFP8")
    assert geometry.num_attention_heads == M3_TEXT_CONFIG["num_attention_heads"] == 64
    assert geometry.index_heads == 4
    with pytest.raises(prebuild_inputs.PrebuildError, match=r"no config\.json for model"):
        prebuild_inputs.read_model_geometry("someone/other-model")


# --- FlashInfer's own kernel wheels --------------------------------------------------------


def test_kernel_wheels_of_another_flashinfer_are_found():
    installed = {
        "flashinfer-python": "0.7.4",
        "flashinfer-cubin": "0.7.3",
        "flashinfer-jit-cache": "0.7.4+cu130",
        "flashinfer-jit-cache-sm90a": "0.7.3+cu130",
        "flashinfer-jit-cache-sm100a": "0.7.40+cu130",
        "flashinfer-jit-cache-sm120f": "0.7.4",
        "torch": "2.14.0",
    }
    assert prebuild.mismatched_kernel_wheels(installed, "0.7.4") == [
        "flashinfer-cubin",
        "flashinfer-jit-cache-sm100a",
        "flashinfer-jit-cache-sm90a",
    ]
    assert prebuild.mismatched_kernel_wheels({"flashinfer-cubin": "0.7.4"}, "0.7.4") == []


# --- the pieces that build on a CPU-only host ----------------------------------------------


def test_a_host_tensor_goes_to_cute_dsl_as_a_cuda_tensor_of_its_layout():
    import torch
    import tvm_ffi

    from vllm_minimax.flashinfer_offline import CudaClaim

    host = torch.empty((4, 6, 8), dtype=torch.float32)[:, 1:5]
    claimed = tvm_ffi.from_dlpack(CudaClaim(host))
    assert str(claimed.device) == "cuda:0"
    assert tuple(claimed.shape) == tuple(host.shape)
    assert tuple(claimed.strides) == tuple(host.stride())
    assert host.device.type == "cpu"


def test_a_cuda_home_of_the_pypi_wheels(tmp_path):
    from vllm_minimax.testing.pypi_cuda import make_cuda_home

    home = make_cuda_home(tmp_path / "cuda")
    assert (home / "bin" / "nvcc").is_file()
    assert (home / "lib64" / "libcudart.so").resolve().name == "libcudart.so.13"
    dynamic = subprocess.run(
        ["readelf", "-d", str(home / "lib64" / "stubs" / "libcuda.so")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # A program linked against the stub loads the driver's library by its real name.
    assert "Library soname: [libcuda.so.1]" in dynamic
    assert make_cuda_home(home) == home  # again: nothing to do
