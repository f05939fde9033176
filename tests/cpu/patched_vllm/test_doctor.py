"""`vllm-minimax doctor` reports what the patched vLLM's own selection does."""

from __future__ import annotations

import pytest
import vllm.models.minimax_m3.nvidia.indexer_flashinfer_gate as gate

from vllm_minimax import cli, probe


@pytest.fixture
def flashinfer_can_jit(monkeypatch):
    """FlashInfer's JIT tools (nvcc, ninja) differ between machines; the MSA probe
    itself still inspects the installed FlashInfer."""
    monkeypatch.setattr(gate, "has_flashinfer", lambda: True)
    gate.flashinfer_msa_indexer_unavailable.cache_clear()
    yield
    gate.flashinfer_msa_indexer_unavailable.cache_clear()


@pytest.fixture
def doctor(capsys, patched_vllm_root):
    def run(*args: str) -> tuple[int, str]:
        code = cli.main(["doctor", "--target", str(patched_vllm_root), *args])
        return code, capsys.readouterr().out

    return run


@pytest.mark.usefixtures("flashinfer_can_jit")
@pytest.mark.parametrize(
    ("capability", "dtype", "impl", "fragment"),
    [
        ("9.0", "fp8", "MiniMaxM3IndexerFlashInferImpl", "selected FlashInfer"),
        ("9.0", "fp8_e4m3", "MiniMaxM3IndexerFlashInferImpl", "selected FlashInfer"),
        ("9.0", "bf16", "MiniMaxM3IndexerTritonImpl", "SM90 FlashInfer prefill needs fp8"),
        ("12.0", "bf16", "MiniMaxM3IndexerTritonImpl", "opt in with minimax_m3_indexer_backend"),
        ("10.0", "fp8", "MiniMaxM3IndexerMSAImpl", "selected MSA"),
    ],
)
def test_doctor_reports_the_selection(doctor, capability, dtype, impl, fragment):
    code, out = doctor("--capability", capability, "--indexer-kv-dtype", dtype)
    assert code == 0, out
    assert "state:        applied" in out
    assert f"simulated compute capability {capability}" in out
    (result,) = [line for line in out.splitlines() if line.startswith("  -> ")]
    assert result.startswith(f"  -> {impl}: ") and fragment in result
    # The same answer as asking vLLM's selection directly.
    direct = probe.select_indexer(
        indexer_kv_dtype=dtype, capability=probe.parse_capability(capability)
    )
    assert result == f"  -> {direct.describe()}"


@pytest.mark.usefixtures("flashinfer_can_jit")
def test_doctor_fails_a_forced_backend_that_cannot_run(doctor):
    code, out = doctor(
        "--capability", "9.0", "--indexer-kv-dtype", "bf16", "--indexer-backend",
        "flashinfer",
    )  # fmt: skip
    assert code == 1
    assert "error: ValueError: minimax_m3_indexer_backend='flashinfer' cannot run here" in out


def test_doctor_reports_flashinfer(doctor):
    code, out = doctor("--capability", "12.1")
    assert code == 0
    assert "FlashInfer:   0.7.4; flashinfer.msa_ops has msa_proxy_score and msa_topk_select" in out
    assert "GPU:          none" in out
