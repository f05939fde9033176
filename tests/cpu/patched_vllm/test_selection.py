"""Gating and selection of the MiniMax M3 indexer in the patched vLLM.

Every case runs vLLM's own `select_indexer_impl_cls` on a simulated GPU; the
expected outcome is written out below from the issue's rules, independently of
the patch's code.
"""

from __future__ import annotations

import inspect
import itertools
import types

import pytest
import torch
import vllm
import vllm.models.minimax_m3.nvidia.indexer_flashinfer_gate as gate
from vllm.config import AttentionConfig, DeviceConfig, VllmConfig, set_current_vllm_config

from vllm_minimax.probe import platform_override, select_indexer, simulated_cuda_platform

CAPABILITIES = [(8, 0), (9, 0), (10, 0), (12, 0), (12, 1)]
DTYPES = ["bf16", "fp8", "nvfp4"]
TOPKS = [16, 8]
FLASHINFER_STATES = {
    "present": None,
    "absent": "flashinfer-python is not installed or cannot JIT its kernels",
    "too-old": "flashinfer-python 0.7.3 is older than 0.7.4, the first release validated",
}
OVERRIDES = ["auto", "flashinfer", "triton"]
FLASHINFER_ARCHS = {(9, 0), (12, 0), (12, 1)}
# Not yet run on an SM12x card: FlashInfer only when asked for.
OPT_IN_ARCHS = {(12, 0), (12, 1)}
OPT_IN = (
    "SM120/SM121 is not yet validated for this indexer (its regime and warm-up rules follow"
    " SM90); opt in with minimax_m3_indexer_backend=flashinfer"
)
# vLLM 0.33.0 refuses an nvfp4 index cache before any selection; 0.34.0 added the
# NVFP4 indexer (SM100/SM103/SM107).
HAS_NVFP4_INDEXER = vllm.__version__ != "0.33.0"


def expected_outcome(cap, dtype, topk, fi_state, override) -> tuple[str, str]:
    """(kind, text): kind is an impl class name or an exception type name; text is
    a fragment the log line (for an impl) or the message (for an error) contains."""
    if dtype == "fp8" and cap < (8, 9):
        return "NotImplementedError", "requires CUDA fp8 support"
    if dtype == "nvfp4":
        if not HAS_NVFP4_INDEXER:
            return "NotImplementedError", "needs the (not-yet-added) CuteDSL indexer impl"
        if override != "auto":
            return "ValueError", "cannot serve an nvfp4 index cache"
        if cap == (10, 0):
            return "MiniMaxM3IndexerNvfp4Impl", "selected NVFP4"
        return "NotImplementedError", "requires an SM100, SM103 or SM107 GPU"
    if cap not in FLASHINFER_ARCHS:
        reason = "compute capability"
    elif FLASHINFER_STATES[fi_state] is not None:
        reason = FLASHINFER_STATES[fi_state]
    elif topk != 16:
        reason = f"topk_blocks={topk}; msa_topk_select takes 16"
    elif cap == (9, 0) and dtype != "fp8":
        reason = "index cache is bf16; SM90 FlashInfer prefill needs fp8: set indexer_kv_dtype=fp8"
    elif cap in OPT_IN_ARCHS and override != "flashinfer":
        reason = OPT_IN
    else:
        reason = None
    if override == "triton":
        if cap in FLASHINFER_ARCHS:
            return "MiniMaxM3IndexerTritonImpl", "FlashInfer not used: minimax_m3_indexer_backend"
        return "MiniMaxM3IndexerTritonImpl", "selected Triton"
    if reason is None:
        return "MiniMaxM3IndexerFlashInferImpl", "selected FlashInfer"
    if override == "flashinfer":
        return "ValueError", f"minimax_m3_indexer_backend='flashinfer' cannot run here: {reason}"
    if cap == (10, 0) and topk == 16:
        return "MiniMaxM3IndexerMSAImpl", "selected MSA"
    if cap in FLASHINFER_ARCHS:
        return "MiniMaxM3IndexerTritonImpl", f"FlashInfer not used: {reason}"
    return "MiniMaxM3IndexerTritonImpl", "selected Triton (no fmha_sm100)"


@pytest.mark.parametrize(
    ("cap", "dtype", "topk", "fi_state", "override"),
    list(itertools.product(CAPABILITIES, DTYPES, TOPKS, FLASHINFER_STATES, OVERRIDES)),
    ids=lambda v: f"sm{v[0]}{v[1]}" if isinstance(v, tuple) else str(v),
)
def test_selection_matrix(monkeypatch, cap, dtype, topk, fi_state, override):
    monkeypatch.setattr(
        gate, "flashinfer_msa_indexer_unavailable", lambda: FLASHINFER_STATES[fi_state]
    )
    selection = select_indexer(
        indexer_kv_dtype=dtype, topk_blocks=topk, indexer_backend=override, capability=cap
    )
    kind, fragment = expected_outcome(cap, dtype, topk, fi_state, override)
    if kind.endswith("Error"):
        assert selection.error is not None, selection
        assert selection.error.startswith(kind), selection.error
        assert fragment in selection.error
    else:
        assert selection.error is None, selection.error
        assert selection.impl == kind
        assert selection.log is not None and fragment in selection.log, selection.log


def test_flashinfer_is_not_chosen_without_the_probe_on_the_real_cpu_platform():
    selection = select_indexer(indexer_kv_dtype="bf16")
    assert selection.impl == "MiniMaxM3IndexerTritonImpl"
    forced = select_indexer(indexer_kv_dtype="bf16", indexer_backend="flashinfer")
    assert forced.error is not None and "not a CUDA platform" in forced.error


def _gate(**overrides):
    kwargs = dict(
        backend="flashinfer",
        topk_blocks=16,
        index_head_dim=128,
        sparse_block_size=128,
        num_index_heads=1,
        indexer_kv_dtype="fp8",
    )
    kwargs.update(overrides)
    return gate.minimax_m3_use_flashinfer_msa(**kwargs)


@pytest.mark.parametrize(
    ("cap", "overrides", "fragment"),
    [
        ((9, 0), {}, None),
        ((9, 0), {"num_index_heads": 4}, None),
        ((9, 0), {"indexer_kv_dtype": "fp8_e4m3"}, None),
        ((12, 1), {"indexer_kv_dtype": "bf16", "num_index_heads": 8}, None),
        ((9, 0), {"backend": "auto"}, None),
        ((12, 0), {"backend": "auto"}, OPT_IN),
        ((12, 1), {"backend": "auto", "indexer_kv_dtype": "bf16"}, OPT_IN),
        ((9, 0), {"backend": "triton"}, "minimax_m3_indexer_backend='triton'"),
        ((9, 0), {"index_head_dim": 64}, "index head dim 64"),
        ((9, 0), {"sparse_block_size": 64}, "sparse block 64"),
        ((9, 0), {"num_index_heads": 8}, "8 index heads per rank"),
        ((9, 0), {"indexer_kv_dtype": "bf16"}, "set indexer_kv_dtype=fp8"),
        ((12, 0), {"indexer_kv_dtype": "nvfp4"}, "index cache is nvfp4"),
        ((10, 3), {}, "compute capability 10.3"),
    ],
)
def test_gate_conditions(monkeypatch, cap, overrides, fragment):
    monkeypatch.setattr(gate, "flashinfer_msa_indexer_unavailable", lambda: None)
    with platform_override(simulated_cuda_platform(cap)):
        use, reason = _gate(**overrides)
    if fragment is None:
        assert use and reason is None
    else:
        assert not use and reason is not None and fragment in reason, reason


def test_gate_refuses_rocm(monkeypatch):
    from vllm.platforms.interface import PlatformEnum

    monkeypatch.setattr(gate, "flashinfer_msa_indexer_unavailable", lambda: None)
    platform = simulated_cuda_platform((9, 0))
    platform._enum = PlatformEnum.ROCM
    with platform_override(platform):
        assert _gate() == (False, "not a CUDA platform")


def _fake_msa_ops(**functions):
    return types.SimpleNamespace(**functions)


def _real_msa_ops():
    import flashinfer.msa_ops

    return flashinfer.msa_ops


@pytest.fixture
def probe(monkeypatch):
    """The real probe with its environment (package, version, module) replaceable."""
    monkeypatch.setattr(gate, "has_flashinfer", lambda: True)
    gate.flashinfer_msa_indexer_unavailable.cache_clear()
    yield gate.flashinfer_msa_indexer_unavailable
    gate.flashinfer_msa_indexer_unavailable.cache_clear()


def test_probe_accepts_the_installed_flashinfer(probe):
    assert probe() is None


def test_probe_refuses_missing_flashinfer(probe, monkeypatch):
    monkeypatch.setattr(gate, "has_flashinfer", lambda: False)
    assert "not installed" in probe()


def test_probe_refuses_0_7_3(probe, monkeypatch):
    monkeypatch.setattr(gate, "_flashinfer_version", lambda: "0.7.3")
    assert probe() == (
        "flashinfer-python 0.7.3 is older than 0.7.4, the first release validated for this indexer"
    )


def test_probe_accepts_a_newer_release_with_the_same_api(probe, monkeypatch):
    monkeypatch.setattr(gate, "_flashinfer_version", lambda: "0.8.1")
    assert probe() is None


def test_probe_refuses_a_build_without_topk(probe, monkeypatch):
    real = _real_msa_ops()
    fake = _fake_msa_ops(msa_proxy_score=real.msa_proxy_score)
    monkeypatch.setattr(gate, "_import_msa_ops", lambda: fake)
    assert probe() == "flashinfer.msa_ops has no msa_topk_select"


def test_probe_reports_a_module_that_does_not_import(probe, monkeypatch):
    """A broken build can raise more than ImportError at import (an OSError loading a
    library, a RuntimeError from mismatched CUDA bindings): that is the reason, not an
    exception out of the selection; an ImportError says the same."""

    def broken():
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.setattr(gate, "_import_msa_ops", broken)
    assert probe() == (
        "flashinfer.msa_ops does not import (RuntimeError: CUDA driver version is insufficient)"
    )
    probe.cache_clear()

    def missing():
        raise ModuleNotFoundError("No module named 'flashinfer.msa_ops'")

    monkeypatch.setattr(gate, "_import_msa_ops", missing)
    assert probe() == (
        "flashinfer.msa_ops does not import (ModuleNotFoundError: No module named"
        " 'flashinfer.msa_ops')"
    )


def test_probe_refuses_a_newer_release_whose_topk_changed(probe, monkeypatch):
    real = _real_msa_ops()

    def msa_topk_select(max_score, topk, output=None, force_begin_blocks=0, force_end_blocks=0):
        raise AssertionError("never called")

    assert "num_valid_pages" in inspect.signature(real.msa_topk_select).parameters
    fake = _fake_msa_ops(msa_proxy_score=real.msa_proxy_score, msa_topk_select=msa_topk_select)
    monkeypatch.setattr(gate, "_flashinfer_version", lambda: "0.9.0")
    monkeypatch.setattr(gate, "_import_msa_ops", lambda: fake)
    assert probe() == "flashinfer.msa_ops.msa_topk_select does not take num_valid_pages"


def test_attention_config_validates_the_override():
    assert AttentionConfig().minimax_m3_indexer_backend == "auto"
    with pytest.raises(ValueError, match="minimax_m3_indexer_backend"):
        AttentionConfig(minimax_m3_indexer_backend="cutlass")
    with pytest.raises(ValueError, match="cannot be combined"):
        AttentionConfig(minimax_m3_indexer_cp=True, minimax_m3_indexer_backend="flashinfer")


def test_forced_flashinfer_stops_model_construction(monkeypatch):
    """The indexer module a MiniMax M3 attention layer builds refuses to exist."""
    from vllm.models.minimax_m3.common import indexer

    monkeypatch.setattr(gate, "flashinfer_msa_indexer_unavailable", lambda: None)
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        attention_config=AttentionConfig(minimax_m3_indexer_backend="flashinfer"),
    )
    with (
        set_current_vllm_config(config),
        platform_override(simulated_cuda_platform((9, 0))),
        pytest.raises(ValueError, match="index cache is bf16; SM90 FlashInfer prefill needs fp8"),
    ):
        indexer.MiniMaxM3Indexer(
            num_kv_heads=1,
            scale=1.0,
            topk_blocks=16,
            sparse_block_size=128,
            num_index_heads=1,
            index_head_dim=128,
            prefix="model.layers.1.self_attn.attn",
            indexer_kv_dtype="bf16",
            topk_indices_buffer=torch.empty(8, 1, 16, dtype=torch.int32),
        )
