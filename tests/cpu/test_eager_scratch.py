"""Issue 66's GPU check (`vllm_minimax.testing.eager_scratch`) on logs: it passes a pair
whose eager run reserved the scratch and checked the prebuild, and fails the behaviour of
a8fd942, whose eager engine did neither (the committed H100 runs of 2026-12-06 included)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vllm_minimax.testing import eager_scratch

REPO = Path(__file__).resolve().parents[2]
REVIEW_RUNS = REPO / "results/h100/sparse-attention-review/engine"
# The runs' records, less most prompt positions (tests/cpu/fixtures/.../README.md).
REVIEW_RECORDS = REPO / "tests/cpu/fixtures/sparse_attention_engine"

GEOMETRY = "SparseAttentionWarmupGeometry(num_heads=8, num_kv_heads=1, max_num_decodes=1024)"


def _log(*, warmup: bool, loading_gib: float, prebuild: bool) -> str:
    lines = ["INFO [startup.py:96] non-default args: {'max_num_seqs': 1024}"]
    if prebuild:
        lines.append(
            "WARNING [indexer_flashinfer_warmup.py:640] MiniMax M3: the prebuilt FlashInfer"
            " programs in /root/.cache/flashinfer/0.7.4/90a were built for another setup"
            " (CUDA 0.0 at /planted/cuda there, 13.0 at /usr/local/cuda here): 0 nvcc"
            " programs removed"
        )
    if warmup:
        lines.append(
            "INFO [sparse_attention_flashinfer.py:790] MiniMax M3 sparse attention warm-up:"
            " 1025 FlashInfer launches ready in 8.5s, holding 2.11 GiB of decode scratch,"
            f" 2.13 GiB less free GPU memory [{GEOMETRY}]"
        )
    lines.append(f"INFO [model_runner.py:441] Model loading took {loading_gib:.2f} GiB memory")
    lines.append("INFO [gpu_worker.py:795] Available KV cache memory: 21.40 GiB")
    return "\n".join(lines) + "\n"


def _write(runs: Path, name: str, log: str, record: dict) -> None:
    runs.mkdir(exist_ok=True)
    (runs / f"{name}.log").write_text(log)
    (runs / f"{name}.json").write_text(json.dumps(record))


def _pair(tmp_path: Path, eager_log: str, eager_record: dict | None = None) -> Path:
    runs = tmp_path / "runs"
    _write(
        runs,
        "flashinfer-graphs",
        _log(warmup=True, loading_gib=2.13, prebuild=False),
        {"gpu_used_after_ready_gib": 24.37},
    )
    _write(runs, "flashinfer-eager", eager_log, eager_record or {"gpu_used_after_ready_gib": 24.36})
    return runs


def _planted(tmp_path: Path, removed: bool) -> Path:
    manifest = tmp_path / "minimax_m3_prebuild.json"
    if not removed:
        manifest.write_text("{}")
    return manifest


def test_a_reserving_eager_engine_passes(tmp_path, capsys):
    runs = _pair(tmp_path, _log(warmup=True, loading_gib=2.12, prebuild=True))
    rc = eager_scratch.main([str(runs), "--planted-manifest", str(_planted(tmp_path, True))])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.splitlines()[-1] == "PASS"
    assert "FAIL" not in out


@pytest.mark.parametrize(
    ("eager_log", "removed", "failing"),
    [
        # a8fd942: no reservation, no check; the model's construction lacks the scratch.
        (
            _log(warmup=False, loading_gib=0.02, prebuild=False),
            False,
            {
                "eager launched what graphs did",
                "eager holds the same decode scratch",
                "the profiler counts it in eager too",
                "eager checked the prebuild",
            },
        ),
        # The reservation without the prebuild check.
        (
            _log(warmup=True, loading_gib=2.12, prebuild=False),
            False,
            {"eager checked the prebuild"},
        ),
        # A warm-up line but the scratch allocated elsewhere than the construction.
        (
            _log(warmup=True, loading_gib=0.02, prebuild=True),
            True,
            {"the profiler counts it in eager too"},
        ),
    ],
    ids=["a8fd942", "no-prebuild-check", "scratch-not-counted"],
)
def test_what_a8fd942_did_fails(tmp_path, capsys, eager_log, removed, failing):
    runs = _pair(tmp_path, eager_log)
    manifest = _planted(tmp_path, removed)
    found = eager_scratch.checks(
        eager_scratch.load(runs, "flashinfer-graphs"),
        eager_scratch.load(runs, "flashinfer-eager"),
        manifest,
    )
    assert {what for what, held, _ in found if not held} == failing
    assert eager_scratch.main([str(runs), "--planted-manifest", str(manifest)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "FAIL"


def test_an_eager_engine_that_did_not_start_fails(tmp_path, capsys):
    runs = _pair(tmp_path, "", {"error": "RuntimeError: out of GPU memory"})
    (runs / "flashinfer-eager.log").unlink()
    assert eager_scratch.main([str(runs)]) == 1
    out = capsys.readouterr().out
    assert "FAIL both engines served" in out and "out of GPU memory" in out
    assert out.splitlines()[-1] == "FAIL"


def test_a_missing_runs_directory_is_a_usage_error(tmp_path, capsys):
    assert eager_scratch.main([str(tmp_path / "none")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_the_committed_h100_runs_of_a8fd942s_series_fail(tmp_path, capsys):
    """results/h100/sparse-attention-review: 16 sequences, so a small scratch, but the eager
    log has no warm-up line at all."""
    runs = tmp_path / "runs"
    runs.mkdir()
    for name in ("flashinfer-graphs", "flashinfer-eager"):
        shutil.copy(REVIEW_RUNS / f"{name}.log", runs)
        shutil.copy(REVIEW_RECORDS / f"{name}.json", runs)
    assert eager_scratch.main([str(runs)]) == 1
    out = capsys.readouterr().out
    assert "FAIL eager launched what graphs did: launches 17 graphs, None eager" in out
    assert "ok   memory held once ready" in out  # the figure the reservation does not move
