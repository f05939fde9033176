"""`benchmarks.decode_scratch_plan` against the scratch FlashInfer kept on an H100 after the
warm-up of each case (results/h100/sparse-attention-review/warmup-memory, measured by
`benchmarks.sparse_attention_warmup_memory` in a fresh process per case), and its buckets."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
from vllm.models.minimax_m3.nvidia import sparse_attention_flashinfer as sa

from benchmarks.decode_scratch_plan import bucket_of, decode_batches, plan_scratch
from benchmarks.sparse_attention_warmup_memory import WarmupCase

MEASURED = (
    Path(__file__).resolve().parents[3]
    / "results/h100/sparse-attention-review/warmup-memory/warmup_memory.json"
)
H100_SMS = 132


def _measured_cases() -> list[dict]:
    return [case for case in json.loads(MEASURED.read_text()) if "scratch_gib" in case]


def _geometry(case: dict) -> sa.SparseAttentionWarmupGeometry:
    """The geometry of a measured case, from the settings the measurement recorded."""
    return WarmupCase(**{field.name: case[field.name] for field in fields(WarmupCase)}).geometry()


def test_the_measured_file_holds_the_cases_of_the_configs() -> None:
    names = {case["name"] for case in _measured_cases()}
    assert {"engine-test-g8", "h100-8x-g8-mtp2", "h200-8x-g8-mtp2", "defaults-g8-mtp3"} <= names


@pytest.mark.parametrize("case", _measured_cases(), ids=lambda case: case["name"])
def test_the_plan_equals_the_scratch_measured_on_the_h100(case: dict) -> None:
    plan = plan_scratch(_geometry(case), H100_SMS)
    assert plan.launches == case["launches"]
    assert plan.entries == case["scratch_entries"]
    assert round(plan.gib, 3) == case["scratch_gib"]


def test_buckets_pad_to_powers_of_two_then_to_multiples() -> None:
    assert [bucket_of(b, 16) for b in (1, 2, 3, 5, 9, 15, 16, 17, 32, 33, 1000)] == [
        1, 2, 4, 8, 16, 16, 16, 32, 32, 48, 1008,
    ]  # fmt: skip
    launches = [("decode", 3, 1), ("decode", 4, 1), ("decode", 17, 2), ("prefill", 1, 801)]
    assert decode_batches(launches, 16) == {(4, 1), (32, 2)}
    assert decode_batches(launches, None) == {(3, 1), (4, 1), (17, 2)}


def test_buckets_hold_less_scratch_than_every_count() -> None:
    geometry = _geometry(next(c for c in _measured_cases() if c["name"] == "defaults-g8-mtp3"))
    every, bucketed = plan_scratch(geometry, H100_SMS), plan_scratch(geometry, H100_SMS, 16)
    assert bucketed.entries < every.entries / 10
    assert bucketed.gib < every.gib / 10


def test_a_command_line_case_takes_each_option_into_its_own_field() -> None:
    from argparse import Namespace

    args = Namespace(
        heads=16, kv_heads=2, max_num_seqs=3, max_num_batched_tokens=4, mtp=5, max_model_len=6
    )
    assert WarmupCase.from_args("cli", args) == WarmupCase("cli", 16, 2, 3, 4, 5, 6)


def test_the_command_line_plans_the_geometry_of_its_own_options(capsys) -> None:
    """A measured case given as options prints that case's plan."""
    from benchmarks.decode_scratch_plan import main

    case = next(c for c in _measured_cases() if c["name"] == "defaults-g8-mtp3")
    options = {
        "--heads": case["num_heads"],
        "--kv-heads": case["num_kv_heads"],
        "--max-num-seqs": case["max_num_seqs"],
        "--max-num-batched-tokens": case["max_num_batched_tokens"],
        "--mtp": case["num_speculative_tokens"],
        "--max-model-len": case["max_model_len"],
        "--sms": H100_SMS,
    }
    assert main([str(word) for option in options.items() for word in option]) == 0
    plan = plan_scratch(_geometry(case), H100_SMS)
    assert capsys.readouterr().out == (
        f"as launched: {plan.entries} scratch entries, {plan.gib:.3f} GiB"
        f" ({plan.launches} launches)\n"
    )
