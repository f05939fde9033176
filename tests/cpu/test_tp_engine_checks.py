"""The checks of the tensor-parallel engine runs (tests/gpu_e2e/test_tp_engine.py) on
synthetic saved runs: a clean set passes every check, and a set with planted faults
(a rank that logged no selection, a program built after ready, a TP run that is the
bf16 control's logprobs, an attend that fell back to Triton) fails exactly the checks
that guard against them. The selection lines the checks look for are the series' own."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEST = ROOT / "tests" / "gpu_e2e" / "test_tp_engine.py"
TOKENS = 400
# Spreads of the synthetic logprobs: the TP N runs around their TP 1 reference, the bf16
# control around the fp8 Triton run (measured nowhere: chosen so the clean set sits at a
# tenth of the control).
TP_NOISE = 0.004
CONTROL_NOISE = 0.05


def _checks():
    spec = importlib.util.spec_from_file_location("tp_engine_checks", TEST)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _logprobs(base: list, noise: float, seed: int) -> list[float | None]:
    """``base`` moved by Gaussian noise, its first token without a logprob (as vLLM's)."""
    rng = random.Random(seed)
    return [None] + [x + rng.gauss(0.0, noise) for x in base[1:]]


def _log(tp: int, attend: str, skip_rank: int | None = None) -> str:
    """A run's log as vLLM writes it: a front-end line, then each rank's selection lines."""
    lines = ["(EngineCore pid=100) INFO 12-09 10:00:00 [core.py:1] engine ready"]
    attend_line = {
        "flashinfer": "MiniMax M3 sparse attention: selected FlashInfer (msa_sparse_attention"
        " + msa_sparse_decode_attention) [kv_cache_dtype=fp8, topk_blocks=16, heads=8/1 per rank]",
        "triton": "MiniMax M3 sparse attention: selected Triton (FlashInfer not used: pinned)"
        " [kv_cache_dtype=fp8, topk_blocks=16]",
    }[attend]
    for rank in range(tp):
        if rank == skip_rank:
            continue
        name = "MainProcess" if tp == 1 else f"Worker_TP{rank}_EP{rank}"
        prefix = f"\x1b[0;36m({name} pid={200 + rank})\x1b[0;0m INFO 12-09 10:00:01 [x.py:9]"
        lines.append(
            f"{prefix} MiniMax M3 indexer: selected FlashInfer (msa_proxy_score +"
            " msa_topk_select) [topk_blocks=16, indexer_kv_dtype=fp8]"
        )
        lines.append(f"{prefix} {attend_line}")
    return "\n".join(lines) + "\n"


def _write(directory: Path, name: str, tp: int, attend: str, logprobs, jit=(), log=None):
    run = {
        "tensor_parallel_size": tp,
        "attend": attend,
        "jit_built_after_ready": list(jit),
        "requests": [{"prompt_logprobs": logprobs, "tokens": [5, 6]}],
    }
    (directory / f"{name}.json").write_text(json.dumps(run))
    resolved = "flashinfer" if attend == "auto" else attend
    (directory / f"{name}.log").write_text(log if log is not None else _log(tp, resolved))


def _clean_runs(directory: Path) -> dict[str, list]:
    rng = random.Random(0)
    base = [-rng.uniform(1.0, 9.0) for _ in range(TOKENS)]
    tp1 = {
        "triton": _logprobs(base, 0.0, 1),
        "flashinfer": _logprobs(base, TP_NOISE, 2),
    }
    bf16 = _logprobs(base, CONTROL_NOISE, 3)
    _write(directory, "tp1-triton", 1, "triton", tp1["triton"])
    _write(directory, "tp1-flashinfer", 1, "flashinfer", tp1["flashinfer"])
    _write(directory, "tp1-triton-bf16", 1, "triton", bf16)
    for seed, (tp, attend) in enumerate(
        [(2, "flashinfer"), (4, "flashinfer"), (8, "flashinfer"), (8, "auto"), (8, "triton")]
    ):
        reference = tp1["triton" if attend == "triton" else "flashinfer"]
        _write(directory, f"tp{tp}-{attend}", tp, attend, _logprobs(reference, TP_NOISE, 10 + seed))
    return {"bf16": bf16, **tp1}


def _pytest(runs: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", str(TEST)],
        env={**os.environ, "VLLM_MINIMAX_TP_RUNS": str(runs)},
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )


def _failed(output: str) -> set[str]:
    return set(re.findall(r"^FAILED \S+::(\S+)", output, flags=re.MULTILINE))


def test_clean_runs_pass_every_check(tmp_path):
    _clean_runs(tmp_path)
    result = _pytest(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    # 2 + 7 runs x (selection, JIT) + 5 TP > 1 runs x (agreement, control pair).
    assert "26 passed" in result.stdout, result.stdout[-3000:]


def test_planted_faults_fail_exactly_their_checks(tmp_path):
    made = _clean_runs(tmp_path)
    # Rank 3 of TP 4 logged no selection (it never reached the patched code).
    _write(
        tmp_path,
        "tp4-flashinfer",
        4,
        "flashinfer",
        made["flashinfer"],
        log=_log(4, "flashinfer", 3),
    )
    # A rank of TP 8 built a FlashInfer program while serving.
    _write(
        tmp_path,
        "tp8-flashinfer",
        8,
        "flashinfer",
        made["flashinfer"],
        jit=["msa_sparse_decode.so"],
    )
    # TP 2's logprobs moved as far as the bf16 cache moves them.
    _write(tmp_path, "tp2-flashinfer", 2, "flashinfer", made["bf16"])
    # auto fell back to Triton on every rank.
    _write(tmp_path, "tp8-auto", 8, "auto", made["flashinfer"], log=_log(8, "triton"))
    result = _pytest(tmp_path)
    assert result.returncode != 0
    assert _failed(result.stdout) == {
        "test_every_rank_logs_the_flashinfer_selection[tp4-flashinfer]",
        "test_no_flashinfer_program_built_after_ready[tp8-flashinfer]",
        "test_prompt_logprobs_agree_with_tp1[tp2-flashinfer]",
        "test_against_the_bf16_control_run_it_fails_the_bound[tp2-flashinfer]",
        "test_every_rank_logs_the_flashinfer_selection[tp8-auto]",
    }, result.stdout[-3000:]


def test_a_missing_rank_and_a_wrong_attend_are_named():
    checks = _checks()
    faults = checks.selection_faults(_log(4, "flashinfer", skip_rank=2), 4, "flashinfer")
    assert len(faults) == 2 and all("[2]" in fault for fault in faults)
    faults = checks.selection_faults(_log(2, "triton"), 2, "flashinfer")
    assert any("did not log" in f and "FlashInfer" in f for f in faults)
    assert any("[0, 1] logged" in f for f in faults)
    # Lines of processes that are not TP workers do not stand in for a rank at TP > 1.
    front_end_only = _log(1, "flashinfer").replace("MainProcess", "EngineCore")
    assert checks.ranks_logging(front_end_only, checks.INDEXER_FLASHINFER, 2) == set()
    assert checks.ranks_logging(front_end_only, checks.INDEXER_FLASHINFER, 1) == {0}


def test_a_still_control_and_a_missing_reference_fail(tmp_path):
    made = _clean_runs(tmp_path)
    # The "bf16" control ran on the fp8 cache after all: it no longer measures anything.
    _write(tmp_path, "tp1-triton-bf16", 1, "triton", made["triton"])
    (tmp_path / "tp1-flashinfer.json").unlink()
    failed = _failed(_pytest(tmp_path).stdout)
    assert "test_control_pair_moves_the_logprobs" in failed
    assert "test_the_references_and_a_multi_gpu_run_are_there" in failed


def test_the_bound_is_the_derived_ratio_with_room_and_under_the_control():
    checks = _checks()
    assert abs(checks.TP_ROUNDING_RATIO - 5.5**0.5 / 16) < 1e-12
    assert abs(checks.RATIO_BOUND - 0.44) < 0.005
    assert checks.RATIO_BOUND < 0.5


@pytest.mark.parametrize("series", ["0.34.0", "0.33.0"])
def test_the_selection_lines_are_the_series_own(series):
    checks = _checks()
    patches = "".join(p.read_text() for p in (ROOT / "patches" / f"vllm-{series}").glob("*.patch"))
    for marker in (checks.INDEXER_FLASHINFER, *checks.ATTEND_SELECTED.values()):
        assert f'"{marker}' in patches, f"{marker!r} is not a log line of the {series} series"
