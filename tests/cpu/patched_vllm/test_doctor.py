"""`vllm-minimax doctor` reports what the patched vLLM's own selection does for a serve
config, with an exit status per outcome."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import vllm.models.minimax_m3.nvidia.indexer_flashinfer_gate as gate
from test_serve_configs import minimax_m3_text_config, parse_serve_args
from vllm.engine.arg_utils import EngineArgs

from vllm_minimax import cli, cuda_bindings, doctor, probe, selection, serve_config

REPO = Path(__file__).resolve().parents[3]
SERVE_CONFIGS = sorted((REPO / "configs" / "serve").glob("*.yaml"))
# The GPU each shipped config is written for.
CONFIG_CAPABILITY = {
    "h200-8x": "9.0",
    "h200-8x-bf16": "9.0",
    "h100-8x": "9.0",
    "h100-16x-2node": "9.0",
    "rtx-pro-6000-4x": "12.0",
    "rtx-pro-6000-8x": "12.0",
}
BROKEN_MSA_OPS = (
    "flashinfer.msa_ops does not import (AttributeError: module 'cuda.bindings.runtime'"
    " has no attribute 'cudaLibrary_t')"
)


@pytest.fixture
def flashinfer_can_jit(monkeypatch):
    """FlashInfer's JIT tools (nvcc, ninja) differ between machines; the MSA probe
    itself still inspects the installed FlashInfer."""
    monkeypatch.setattr(gate, "has_flashinfer", lambda: True)
    gate.flashinfer_msa_indexer_unavailable.cache_clear()
    yield
    gate.flashinfer_msa_indexer_unavailable.cache_clear()


@pytest.fixture
def doctor_run(capsys, patched_vllm_root):
    def run(*args: str) -> tuple[int, str]:
        code = cli.main(["doctor", "--target", str(patched_vllm_root), *args])
        captured = capsys.readouterr()
        return code, captured.out + captured.err

    return run


def rows(out: str) -> dict[str, str]:
    """The selection's rows: component -> `backend: reason` (and its `change:` hint)."""
    found: dict[str, str] = {}
    last = None
    for line in out.splitlines():
        stripped = line.strip()
        if line.startswith("  ") and stripped.startswith("change: ") and last:
            found[last] += " | " + stripped
        elif line.startswith("  ") and stripped.split(":")[0] in ("indexer", "sparse attention"):
            last, _, rest = stripped.partition(": ")
            found[last] = rest.strip()
    return found


@pytest.mark.usefixtures("flashinfer_can_jit")
def test_the_shipped_h200_config_runs_flashinfer_on_sm90(doctor_run):
    code, out = doctor_run("--config", "h200-8x", "--capability", "9.0")
    assert code == doctor.EXIT_READY, out
    found = rows(out)
    assert found["indexer"].startswith("FlashInfer: MiniMax M3 indexer: selected FlashInfer")
    direct = probe.select_indexer(indexer_kv_dtype="fp8", capability=(9, 0))
    assert found["indexer"] == f"FlashInfer: {direct.log}"
    # The shipped config keeps a bf16 KV cache: Triton attends, as configured, and the row
    # is vLLM's own selection.
    attend = probe.select_sparse_attention(kv_cache_dtype="bf16", capability=(9, 0))
    assert attend.impl == "MiniMaxM3SparseTritonImpl", attend
    assert found["sparse attention"] == (
        f"Triton: as configured: {attend.log} | change: kv-cache-dtype: fp8 in the config"
    )
    assert "result:       runs as configured (exit 0)" in out


@pytest.mark.usefixtures("flashinfer_can_jit")
def test_without_a_config_doctor_checks_the_shipped_settings(doctor_run):
    """The bug of issue 43: doctor's defaults were a bf16 index cache, which on SM90 says
    Triton for a machine whose every shipped config runs FlashInfer."""
    code, out = doctor_run("--capability", "9.0")
    assert code == doctor.EXIT_READY, out
    assert rows(out)["indexer"].startswith("FlashInfer: ")


@pytest.mark.usefixtures("flashinfer_can_jit")
@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda path: path.stem)
def test_every_shipped_config_is_ready_on_its_gpu(doctor_run, path):
    capability = CONFIG_CAPABILITY[path.stem]
    code, out = doctor_run("--config", str(path), "--capability", capability)
    if capability.startswith("12."):
        # SM120/SM121 keeps Triton under `auto` until the series has run there (issue 45).
        assert code == doctor.EXIT_FALLBACK, out
        assert "opt in with minimax_m3_indexer_backend" in rows(out)["indexer"], out
        return
    assert code == doctor.EXIT_READY, out
    assert rows(out)["indexer"].startswith("FlashInfer: "), out


@pytest.mark.usefixtures("flashinfer_can_jit")
@pytest.mark.parametrize("capability", ["own", "9.0", "10.0"])
@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda path: path.stem)
def test_a_stored_answer_is_the_answer_vllm_gives(doctor_run, path, capability, monkeypatch):
    """Issue 57: doctor reuses its answers within one environment; for every shipped config,
    on its own GPU and others, the reused answer is the one vLLM gives when asked again."""
    capability = CONFIG_CAPABILITY[path.stem] if capability == "own" else capability
    args = ("--config", str(path), "--capability", capability)
    asked = doctor_run(*args, "--no-cache")
    stored_first = doctor_run(*args)
    calls = []
    monkeypatch.setattr(selection, "select_rows", lambda *a, **k: calls.append(a))
    code, out = doctor_run(*args)
    assert calls == [], "the stored answer was not used"
    lines = out.splitlines()
    [stored] = [line for line in lines if line.startswith("stored:")]
    assert (code, "\n".join(line for line in lines if line != stored) + "\n") == asked
    assert stored_first == asked


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda path: path.stem)
def test_doctor_reads_a_config_as_vllm_serve_does(path, monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_type", "cpu")
    engine = EngineArgs.from_cli_args(parse_serve_args(path))
    ours = serve_config.read_serve_config(path)
    assert ours.tensor_parallel_size == engine.tensor_parallel_size
    assert ours.kv_cache_dtype == engine.kv_cache_dtype
    assert ours.block_size == engine.block_size
    attention = engine.attention_config
    for key, value in ours.attention_config.items():
        assert getattr(attention, key) == value, key
    assert ours.indexer_kv_dtype == attention.resolve_indexer_kv_dtype("bf16")


def test_the_geometry_is_minimax_m3s():
    config = minimax_m3_text_config()
    assert config.num_attention_heads == serve_config.M3_ATTENTION_HEADS
    assert config.num_key_value_heads == serve_config.M3_KV_HEADS
    assert config.index_n_heads == serve_config.M3_INDEX_HEADS
    assert config.head_dim == serve_config.M3_HEAD_DIM
    assert config.index_head_dim == serve_config.M3_INDEX_HEAD_DIM
    assert config.index_block_size == serve_config.M3_SPARSE_BLOCK
    assert config.index_topk_blocks == serve_config.M3_TOPK_BLOCKS


@pytest.mark.usefixtures("flashinfer_can_jit")
def test_a_bf16_index_cache_falls_back_and_names_the_key(doctor_run):
    code, out = doctor_run(
        "--config", "h200-8x", "--capability", "9.0", "--indexer-kv-dtype", "bf16"
    )
    assert code == doctor.EXIT_FALLBACK, out
    indexer = rows(out)["indexer"]
    assert indexer.startswith("Triton: ") and "SM90 FlashInfer prefill needs fp8" in indexer
    assert "change: set attention-config.indexer_kv_dtype: fp8" in indexer


@pytest.mark.usefixtures("flashinfer_can_jit")
def test_msa_ops_that_do_not_import_fall_back_with_the_install_hint(doctor_run, monkeypatch):
    """Issue 43's second bug: with a FlashInfer whose msa_ops does not import, doctor said 0."""
    broken = functools.cache(lambda: BROKEN_MSA_OPS)
    monkeypatch.setattr(gate, "flashinfer_msa_indexer_unavailable", broken)
    code, out = doctor_run("--config", "h200-8x", "--capability", "9.0")
    assert code == doctor.EXIT_FALLBACK, out
    indexer = rows(out)["indexer"]
    assert "cudaLibrary_t" in indexer
    assert indexer.endswith(f"change: {selection.INSTALL_HINT}")


@pytest.mark.usefixtures("flashinfer_can_jit")
def test_broken_cuda_bindings_get_the_repair_not_the_recipe(doctor_run, monkeypatch):
    """Issue 57: after pip's removal of cuda-python 12 deleted cuda-bindings' files, the
    recipe the hint named was 'already satisfied', and doctor kept advising it."""
    broken = functools.cache(lambda: BROKEN_MSA_OPS)
    monkeypatch.setattr(gate, "flashinfer_msa_indexer_unavailable", broken)
    monkeypatch.setattr(cuda_bindings, "pair_problem", lambda path=None: "2 files gone")
    code, out = doctor_run("--config", "h200-8x", "--capability", "9.0")
    assert code == doctor.EXIT_FALLBACK, out
    repair = cuda_bindings.repair_command()
    assert rows(out)["indexer"].endswith(f"change: repair the CUDA bindings: {repair}")
    assert f"  CUDA bindings: 2 files gone\n  repair: {repair}\n" in out


@pytest.mark.usefixtures("flashinfer_can_jit")
def test_a_forced_backend_that_cannot_run_will_not_start(doctor_run):
    code, out = doctor_run(
        "--capability", "9.0", "--indexer-kv-dtype", "bf16", "--indexer-backend", "flashinfer"
    )
    assert code == doctor.EXIT_FAILS, out
    assert "minimax_m3_indexer_backend='flashinfer' cannot run here" in rows(out)["indexer"]


@pytest.mark.usefixtures("flashinfer_can_jit")
def test_a_forced_triton_is_as_configured(doctor_run):
    code, out = doctor_run("--capability", "9.0", "--indexer-backend", "triton")
    assert code == doctor.EXIT_READY, out
    assert rows(out)["indexer"].startswith("Triton: ")


def test_an_attention_key_this_series_lacks_will_not_start(doctor_run, tmp_path):
    config = tmp_path / "unknown.yaml"
    config.write_text(
        "tensor-parallel-size: 8\nattention-config:\n  indexer_kv_dtype: fp8\n"
        "  minimax_m3_no_such_backend: auto\n"
    )
    code, out = doctor_run("--config", str(config), "--capability", "9.0")
    assert code == doctor.EXIT_FAILS, out
    assert "minimax_m3_no_such_backend" in rows(out)["indexer"]


@pytest.mark.usefixtures("flashinfer_can_jit")
def test_the_sparse_attention_row_follows_the_kv_cache_dtype(doctor_run):
    code, out = doctor_run("--config", "h200-8x", "--capability", "9.0", "--kv-cache-dtype", "fp8")
    assert code == doctor.EXIT_READY, out
    assert rows(out)["sparse attention"].startswith("FlashInfer: "), out
    # 4 query heads per KV head at TP 16: no FlashInfer prefill schedule takes that group.
    code, out = doctor_run(
        "--config",
        "h200-8x",
        "--capability",
        "9.0",
        "--kv-cache-dtype",
        "fp8",
        "--tensor-parallel-size",
        "16",
    )
    assert code == doctor.EXIT_FALLBACK, out
    row = rows(out)["sparse attention"]
    assert "groups of 8 or 16" in row, out
    # The change that brings FlashInfer back is the tensor parallelism, not the backend key.
    assert "| change: tensor-parallel-size" in row, out


@pytest.mark.usefixtures("flashinfer_can_jit")
def test_a_forced_triton_sparse_attention_is_as_configured(doctor_run, tmp_path):
    """An fp8 KV cache on 9.0 with the sparse attention forced to Triton: the config asks
    for what runs, so the row is ready (exit 0), not a fallback to change."""
    config = tmp_path / "forced-triton.yaml"
    config.write_text(
        "tensor-parallel-size: 8\nkv-cache-dtype: fp8\nattention-config:\n"
        f"  indexer_kv_dtype: fp8\n  {probe.SPARSE_ATTENTION_KEY}: triton\n"
    )
    code, out = doctor_run("--config", str(config), "--capability", "9.0")
    assert code == doctor.EXIT_READY, out
    row = rows(out)["sparse attention"]
    assert row.startswith("Triton: ") and "change:" not in row, out


def test_an_sm100_gpu_gets_vllms_own_msa_indexer(doctor_run):
    code, out = doctor_run("--capability", "10.0")
    assert code == doctor.EXIT_READY, out
    assert rows(out)["indexer"].startswith("MSA: ")


def test_an_sm100_gpu_with_an_fp8_kv_cache_attends_with_vllms_own_msa(doctor_run, tmp_path):
    """The row is vLLM's selection, not FlashInfer's gate alone: SM100 runs its MSA attend."""
    code, out = doctor_run("--capability", "10.0", "--kv-cache-dtype", "fp8")
    assert code == doctor.EXIT_READY, out
    assert rows(out)["sparse attention"].startswith("MSA: "), out
    # Forcing FlashInfer there is refused at start-up, with vLLM's reason.
    config = tmp_path / "forced.yaml"
    config.write_text(
        "tensor-parallel-size: 8\nkv-cache-dtype: fp8\nattention-config:\n"
        f"  {probe.SPARSE_ATTENTION_KEY}: flashinfer\n"
    )
    code, out = doctor_run("--config", str(config), "--capability", "10.0")
    assert code == doctor.EXIT_FAILS, out
    assert "runs the SM100 MSA attention" in rows(out)["sparse attention"], out


def test_what_torch_and_vllm_print_stays_off_the_terminal(patched_vllm_root, capfd, monkeypatch):
    """A library that writes to the terminal while selecting (torch's C++ warnings on file
    descriptor 2, vLLM's logger on sys.stdout) is kept back; --verbose shows it."""
    real = probe.select_indexer

    def noisy(**kwargs):
        os.write(2, b"W1205 torch noise on fd 2\n")
        print("vLLM log line on sys.stdout")
        return real(**kwargs)

    monkeypatch.setattr(probe, "select_indexer", noisy)
    doctor_args = ["doctor", "--target", str(patched_vllm_root), "--capability", "10.0"]
    assert cli.main(doctor_args) == doctor.EXIT_READY
    quiet = capfd.readouterr()
    assert "noise" not in quiet.out + quiet.err and "log line" not in quiet.out + quiet.err
    assert "indexer:" in quiet.out
    assert cli.main([*doctor_args, "--verbose"]) == doctor.EXIT_READY
    verbose = capfd.readouterr().err
    assert "W1205 torch noise on fd 2" in verbose and "vLLM log line on sys.stdout" in verbose
