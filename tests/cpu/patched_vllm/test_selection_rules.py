"""Literal selection rows, written from the rules, not derived from the gate.

`test_selection.py` computes its expectation with a function that follows the
gate's decision order; if that order were wrong, both would agree. Each row here
states one configuration and its outcome as the README's gating rules and the
release's own selection (MSA on the SM100 family with topk 16, Triton elsewhere;
nvfp4 only on SM100/SM103/SM107 in 0.34.0, nowhere in 0.33.0) say it, varying
the index-head count, which the matrix keeps at 1: on SM90 only 1, 2 or 4 index heads per rank take
FlashInfer; SM120/SM121 take any count, and only when `minimax_m3_indexer_backend` asks
for FlashInfer.
"""

from __future__ import annotations

import pytest
import vllm
import vllm.models.minimax_m3.nvidia.indexer_flashinfer_gate as gate

from vllm_minimax.probe import platform_override, select_indexer, simulated_cuda_platform

FLASHINFER = "MiniMaxM3IndexerFlashInferImpl"
TRITON = "MiniMaxM3IndexerTritonImpl"
MSA = "MiniMaxM3IndexerMSAImpl"
NVFP4 = "MiniMaxM3IndexerNvfp4Impl"
TOO_OLD = "flashinfer-python 0.7.3 is older than 0.7.4, the first release validated"
ABSENT = "flashinfer-python is not installed or cannot JIT its kernels"
OPT_IN = "FlashInfer not used: SM120/SM121 is not yet validated for this indexer"

# (capability, indexer_kv_dtype, num_index_heads, topk_blocks, probe says, override)
#   -> (impl class or exception type, fragment of its log line or message)
ROWS = [
    (((9, 0), "fp8", 1, 16, None, "auto"), (FLASHINFER, "selected FlashInfer")),
    (((9, 0), "fp8", 2, 16, None, "auto"), (FLASHINFER, "selected FlashInfer")),
    (((9, 0), "fp8", 4, 16, None, "flashinfer"), (FLASHINFER, "selected FlashInfer")),
    (((9, 0), "fp8_e4m3", 4, 16, None, "auto"), (FLASHINFER, "selected FlashInfer")),
    (((9, 0), "fp8", 3, 16, None, "auto"), (TRITON, "3 index heads per rank")),
    (((9, 0), "fp8", 8, 16, None, "auto"), (TRITON, "8 index heads per rank")),
    (((9, 0), "fp8", 8, 16, None, "flashinfer"), ("ValueError", "8 index heads per rank")),
    (((9, 0), "bf16", 1, 16, None, "auto"), (TRITON, "set indexer_kv_dtype=fp8")),
    (((9, 0), "bf16", 2, 16, None, "flashinfer"), ("ValueError", "index cache is bf16")),
    (((9, 0), "fp8", 2, 8, None, "auto"), (TRITON, "topk_blocks=8")),
    (((9, 0), "fp8", 4, 16, TOO_OLD, "auto"), (TRITON, "older than 0.7.4")),
    (((9, 0), "fp8", 1, 16, ABSENT, "flashinfer"), ("ValueError", "not installed")),
    (((9, 0), "fp8", 2, 16, None, "triton"), (TRITON, "minimax_m3_indexer_backend")),
    # SM120/SM121: Triton unless FlashInfer is asked for (not yet run on an SM12x card).
    (((12, 0), "bf16", 8, 16, None, "auto"), (TRITON, OPT_IN)),
    (((12, 0), "fp8", 4, 16, None, "auto"), (TRITON, OPT_IN)),
    (((12, 1), "bf16", 2, 16, None, "auto"), (TRITON, OPT_IN)),
    (((12, 0), "bf16", 8, 16, None, "flashinfer"), (FLASHINFER, "selected FlashInfer")),
    (((12, 1), "fp8", 3, 16, None, "flashinfer"), (FLASHINFER, "selected FlashInfer")),
    (((12, 0), "bf16", 8, 8, None, "flashinfer"), ("ValueError", "topk_blocks=8")),
    (((12, 0), "fp8", 4, 16, ABSENT, "auto"), (TRITON, "not installed")),
    (((10, 0), "fp8", 1, 16, None, "auto"), (MSA, "selected MSA")),
    (((10, 0), "bf16", 8, 16, None, "auto"), (MSA, "selected MSA")),
    (((10, 3), "fp8", 4, 16, None, "auto"), (MSA, "selected MSA")),
    (((10, 0), "fp8", 2, 16, None, "triton"), (TRITON, "selected Triton")),
    (((10, 0), "bf16", 1, 16, None, "flashinfer"), ("ValueError", "cannot run here")),
    (((10, 0), "bf16", 1, 8, None, "auto"), (TRITON, "no fmha_sm100")),
    (((8, 0), "bf16", 4, 16, None, "auto"), (TRITON, "no fmha_sm100")),
    (((8, 0), "fp8", 1, 16, None, "auto"), ("NotImplementedError", "requires CUDA fp8 support")),
    (((8, 9), "fp8", 2, 16, None, "auto"), (TRITON, "no fmha_sm100")),
]

# An nvfp4 index cache, as each release treats it: 0.34.0's NVFP4 indexer runs on
# SM100/SM103/SM107 only and takes no override; 0.33.0 has no NVFP4 indexer.
NVFP4_ROWS = {
    "0.34.0": [
        (((12, 0), "nvfp4", 1, 16, None, "auto"), ("NotImplementedError", "SM100, SM103 or SM107")),
        (((10, 0), "nvfp4", 2, 16, None, "auto"), (NVFP4, "selected NVFP4")),
        (((9, 0), "nvfp4", 1, 16, None, "flashinfer"), ("ValueError", "nvfp4")),
    ],
    "0.33.0": [
        (((12, 0), "nvfp4", 1, 16, None, "auto"), ("NotImplementedError", "CuteDSL indexer")),
        (((10, 0), "nvfp4", 2, 16, None, "auto"), ("NotImplementedError", "CuteDSL indexer")),
        (((9, 0), "nvfp4", 1, 16, None, "flashinfer"), ("NotImplementedError", "CuteDSL")),
    ],
}
ROWS += NVFP4_ROWS[vllm.__version__]


@pytest.mark.parametrize(("config", "outcome"), ROWS, ids=lambda v: "-".join(map(str, v)))
def test_selection_row(monkeypatch, config, outcome):
    cap, dtype, heads, topk, probe_says, override = config
    kind, fragment = outcome
    monkeypatch.setattr(gate, "flashinfer_msa_indexer_unavailable", lambda: probe_says)
    selection = select_indexer(
        indexer_kv_dtype=dtype,
        topk_blocks=topk,
        num_index_heads=heads,
        indexer_backend=override,
        capability=cap,
    )
    if kind.endswith("Error"):
        assert selection.error is not None, selection.describe()
        assert selection.error.startswith(kind), selection.error
        assert fragment in selection.error, selection.error
    else:
        assert selection.error is None, selection.error
        assert selection.impl == kind, selection.describe()
        assert selection.log is not None and fragment in selection.log, selection.log


# The gate's conditions in the order the series README lists them, each with the arguments
# that fail it alone (on an otherwise eligible SM90 GPU with a usable FlashInfer) and a
# fragment of its reason. The gate names the first failing condition, so wherever two fail
# together, users read the earlier one's reason.
GATE_ORDER = [
    ("capability", {"cap": (10, 0)}, "compute capability 10.0"),
    ("flashinfer", {"probe_says": TOO_OLD}, "older than 0.7.4"),
    ("topk", {"topk_blocks": 8}, "topk_blocks=8"),
    ("head dim", {"index_head_dim": 64}, "index head dim 64"),
    ("sparse block", {"sparse_block_size": 64}, "sparse block 64"),
    ("SM90 dtype", {"indexer_kv_dtype": "bf16"}, "index cache is bf16"),
    ("SM90 heads", {"num_index_heads": 8}, "8 index heads per rank"),
]
GATE_PAIRS = [
    (earlier, later) for i, earlier in enumerate(GATE_ORDER) for later in GATE_ORDER[i + 1 :]
]


def gate_reason(monkeypatch, failing: dict) -> str | None:
    arguments = dict(
        cap=(9, 0),
        probe_says=None,
        topk_blocks=16,
        index_head_dim=128,
        sparse_block_size=128,
        num_index_heads=1,
        indexer_kv_dtype="fp8",
    )
    arguments.update(failing)
    cap, probe_says = arguments.pop("cap"), arguments.pop("probe_says")
    monkeypatch.setattr(gate, "flashinfer_msa_indexer_unavailable", lambda: probe_says)
    with platform_override(simulated_cuda_platform(cap)):
        use, reason = gate.minimax_m3_use_flashinfer_msa(backend="auto", **arguments)
    assert use == (reason is None)
    return reason


@pytest.mark.parametrize("condition", GATE_ORDER, ids=lambda c: c[0])
def test_each_gate_condition_fails_alone(monkeypatch, condition):
    _, failing, fragment = condition
    reason = gate_reason(monkeypatch, failing)
    assert reason is not None and fragment in reason, reason
    assert gate_reason(monkeypatch, {}) is None


@pytest.mark.parametrize(("earlier", "later"), GATE_PAIRS, ids=lambda c: c[0])
def test_two_failing_conditions_give_the_earlier_ones_reason(monkeypatch, earlier, later):
    reason = gate_reason(monkeypatch, {**earlier[1], **later[1]})
    assert reason is not None and earlier[2] in reason and later[2] not in reason, reason


# Through the whole selection (`select_indexer`, the engine's path): rows with two failing
# conditions, outcome and the earlier one's reason, never the later one's.
TWO_FAILING_ROWS = [
    (((9, 0), "bf16", 8, 16, None, "auto"), (TRITON, "index cache is bf16"), "8 index heads"),
    (((9, 0), "bf16", 8, 16, None, "flashinfer"), ("ValueError", "index cache is bf16"),
     "8 index heads"),
    (((9, 0), "bf16", 2, 8, None, "auto"), (TRITON, "topk_blocks=8"), "index cache is bf16"),
    (((9, 0), "fp8", 8, 8, None, "flashinfer"), ("ValueError", "topk_blocks=8"), "8 index heads"),
    (((9, 0), "fp8", 1, 8, TOO_OLD, "auto"), (TRITON, "older than 0.7.4"), "takes 16"),
    (((12, 0), "bf16", 8, 8, ABSENT, "flashinfer"), ("ValueError", "not installed"), "takes 16"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("config", "outcome", "later"), TWO_FAILING_ROWS, ids=lambda v: "-".join(map(str, v))
)
def test_selection_row_with_two_failing_conditions(monkeypatch, config, outcome, later):
    test_selection_row(monkeypatch, config, outcome)
    cap, dtype, heads, topk, _, override = config
    selection = select_indexer(
        indexer_kv_dtype=dtype,
        topk_blocks=topk,
        num_index_heads=heads,
        indexer_backend=override,
        capability=cap,
    )
    assert later not in (selection.error or selection.log or ""), selection.describe()
