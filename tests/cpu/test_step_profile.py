"""benchmarks/step_profile.py without a GPU: its argument checks, and its figures from a
hand-made torch-profiler trace whose answers are worked out below."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import pytest

from benchmarks import step_profile
from benchmarks.step_profile import INDEXER_RANGE, STEP_RANGE, analyze_trace

HOST = {"pid": 1, "tid": 1}


def _range(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, **HOST}


def _launch(correlation: int, ts: float) -> dict:
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "ts": ts,
        "dur": 1,
        "args": {"correlation": correlation},
        **HOST,
    }


def _kernel(correlation: int, name: str, ts: float, dur: float, stream: int = 7) -> dict:
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "ts": ts,
        "dur": dur,
        "pid": 0,
        "tid": stream,
        "args": {"correlation": correlation},
    }


def recorded_trace() -> dict:
    """Three steps of 100 us (the first to be skipped), two indexer calls of 10 us in each.

    In the two kept steps (window 100..300 us): kernels of 10 (FlashInfer, indexer), 5
    (PyTorch, indexer), 40 (GEMM), 20 (GEMM on another stream, inside the 40), 10
    (FlashInfer, indexer), 10 (FlashInfer, indexer), 40 (GEMM), 10 (FlashInfer, indexer)
    and 4 (Triton indexer kernel, indexer) us: 149 us of kernels, 49 of them the
    indexer's; busy (union) 129 us of the 200 us window; indexer host time 40 us.
    """
    msa = "msa_kernel_CopyAtom_ThrID10_TVLayout"
    events = [
        _range(STEP_RANGE, 0, 100),
        _range(STEP_RANGE, 100, 100),
        _range(STEP_RANGE, 200, 100),
        _range(INDEXER_RANGE, 10, 10),
        _range(INDEXER_RANGE, 110, 10),
        _range(INDEXER_RANGE, 150, 10),
        _range(INDEXER_RANGE, 210, 10),
        _range(INDEXER_RANGE, 250, 10),
        _launch(8, 12),
        _kernel(8, msa, 30, 50),  # skipped step
        _launch(1, 112),
        _kernel(1, msa, 120, 10),
        _launch(2, 115),
        _kernel(2, "void at::native::vectorized_elementwise_kernel<4>", 131, 5),
        _launch(3, 130),
        _kernel(3, "sm90_xmma_gemm_e4m3", 136, 40),
        _launch(9, 135),
        _kernel(9, "sm90_xmma_gemm_e4m3", 140, 20, stream=8),
        _launch(4, 152),
        _kernel(4, msa, 176, 10),
        _launch(5, 212),
        _kernel(5, msa, 220, 10),
        _launch(6, 230),
        _kernel(6, "sm90_xmma_gemm_e4m3", 231, 40),
        _launch(7, 252),
        _kernel(7, msa, 271, 10),
        _launch(10, 254),
        _kernel(10, "_decode_index_score_kernel", 282, 4),
        # A profiler range on the GPU timeline has the same name; it is not a step.
        {"ph": "X", "cat": "gpu_user_annotation", "name": STEP_RANGE, "ts": 0, "dur": 999},
    ]
    return {"traceEvents": events}


def test_figures_of_a_recorded_trace():
    figures = analyze_trace(recorded_trace(), sparse_layers=2, skip_steps=1, host_bound_below=0.9)
    assert figures["steps"] == 2 and figures["forwards"] == 2
    assert figures["step_ms"] == pytest.approx(0.1)
    assert figures["gpu_busy_ms_per_step"] == pytest.approx(129 / 2 / 1000)
    assert figures["gpu_busy_fraction"] == pytest.approx(129 / 200)
    assert figures["host_bound"] is True
    assert figures["indexer_calls_per_forward"] == 2
    assert figures["indexer_gpu_share"] == pytest.approx(49 / 149)
    assert figures["indexer_gpu_ms_per_step"] == pytest.approx(49 / 2 / 1000)
    assert figures["indexer_host_share"] == pytest.approx(40 / 200)
    assert figures["indexer_host_us_per_call"] == pytest.approx(10)
    # By name: the four MSA kernels (40 us) and the Triton indexer kernel (4 us), range or not.
    assert figures["indexer_kernels_ms_per_step"] == pytest.approx(44 / 2 / 1000)
    assert figures["indexer_kernels_share"] == pytest.approx(44 / 149)
    assert figures["kernels_per_sparse_layer"] == {
        "flashinfer": 1.0,
        "triton": 0.25,
        "torch": 0.25,
    }


def test_busy_threshold_decides_host_bound():
    figures = analyze_trace(recorded_trace(), sparse_layers=2, skip_steps=1, host_bound_below=0.6)
    assert figures["host_bound"] is False


def test_kernels_outside_every_range_count_by_name():
    """A full CUDA graph launches the indexer's kernels with one graph launch outside any
    indexer range: by launch they are not the indexer's, by name they are."""
    trace = recorded_trace()
    events = trace["traceEvents"]
    events[:] = [e for e in events if e.get("name") != INDEXER_RANGE]
    figures = analyze_trace(trace, sparse_layers=2, skip_steps=1, host_bound_below=0.9)
    assert figures["indexer_gpu_ms_per_step"] == 0
    assert figures["indexer_kernels_ms_per_step"] == pytest.approx(44 / 2 / 1000)


def test_only_the_steps_asked_for_are_reported():
    """With ``max_steps=1`` only the second step (100..200 us) counts: kernels at 120..130,
    131..136, 136..176 (and 140..160 inside it) and 176..186 us, busy 65 us; two indexer
    calls of 10 us."""
    figures = analyze_trace(
        recorded_trace(), sparse_layers=2, skip_steps=1, host_bound_below=0.9, max_steps=1
    )
    assert figures["steps"] == 1
    assert figures["gpu_busy_ms_per_step"] == pytest.approx(65 / 1000)
    assert figures["indexer_host_ms_per_step"] == pytest.approx(20 / 1000)


def test_every_step_of_a_mixed_run_holds_a_prefill_chunk_beside_the_decodes():
    parsed = argparse.Namespace(
        mixed_long_context=98304, max_num_batched_tokens=8192, decode_batch=4,
        decode_context=256, mixed_decodes=3,
    )  # fmt: skip
    cached = step_profile.point_prompts(parsed, "mixed", vocab=1000)
    prompts, params = step_profile.point_run(parsed, "mixed", cached, 1000, seed=3, steps=10)
    assert len(prompts) == 4 and prompts[:3] == cached
    assert len(prompts[3]["prompt_token_ids"]) == 98304
    # 12 chunks: the decodes run 13 steps, the long prompt stops after its prefill.
    assert [p.max_tokens for p in params] == [13, 13, 13, 1]
    again, _ = step_profile.point_run(parsed, "mixed", cached, 1000, seed=4, steps=10)
    assert again[3] != prompts[3]  # a new, uncached long prompt each run
    prompts, params = step_profile.point_run(parsed, "decode", cached, 1000, seed=3, steps=10)
    assert prompts is cached and {p.max_tokens for p in params} == {10}


def test_a_prefill_run_is_lone_new_prompts_filling_the_steps_asked_for():
    parsed = argparse.Namespace(prefill_context=32768, max_num_batched_tokens=8192)
    assert step_profile.point_prompts(parsed, "prefill", vocab=1000) == []
    # 4 chunks a prompt: 10 steps take 3 prompts (12 steps), each ending with its prefill.
    prompts, params = step_profile.point_run(parsed, "prefill", [], 1000, seed=3, steps=10)
    assert [len(p["prompt_token_ids"]) for p in prompts] == [32768] * 3
    assert len({tuple(p["prompt_token_ids"]) for p in prompts}) == 3
    assert [p.max_tokens for p in params] == [1, 1, 1]
    again, _ = step_profile.point_run(parsed, "prefill", [], 1000, seed=4, steps=10)
    assert not {tuple(p["prompt_token_ids"]) for p in again} & {
        tuple(p["prompt_token_ids"]) for p in prompts
    }  # uncached: new prompts each run
    outputs = [argparse.Namespace(outputs=[argparse.Namespace(token_ids=[7])])] * 3
    assert step_profile.engine_steps(parsed, "prefill", outputs) == 12


def test_engine_steps_of_a_run_that_started_together_is_its_longest_output():
    outputs = [argparse.Namespace(outputs=[argparse.Namespace(token_ids=[0] * n)]) for n in (5, 9)]
    assert step_profile.engine_steps(argparse.Namespace(), "mixed", outputs) == 9


def test_too_few_steps_is_an_error():
    with pytest.raises(ValueError, match="3 steps"):
        analyze_trace(recorded_trace(), sparse_layers=2, skip_steps=3, host_bound_below=0.9)


def test_report_from_saved_traces(tmp_path, capsys):
    traces = tmp_path / "traces"
    (traces / "flashinfer").mkdir(parents=True)
    with gzip.open(traces / "flashinfer" / "decode.trace.json.gz", "wt") as handle:
        json.dump(recorded_trace(), handle)
    out = tmp_path / "out"
    argv = ["--from-traces", str(traces), "--out", str(out), "--sparse-layers", "2"]
    assert step_profile.main([*argv, "--skip-steps", "1"]) == 0
    saved = json.loads((out / "step_profile.json").read_text())
    assert saved["results"]["flashinfer"]["decode"]["indexer_gpu_share"] == pytest.approx(49 / 149)
    report = (out / "step_profile.md").read_text()
    assert "| indexer share of GPU time | 32.9% |" in report
    assert "| host-bound | yes |" in report
    assert "| kernels / sparse layer: FlashInfer | 1.00 |" in report
    assert report in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be positive"),
        (["--skip-steps", "-1"], "--skip-steps"),
        (["--arms", "triton", "triton"], "--arms takes distinct values"),
        (["--arms", "cutlass"], "--arms takes distinct values"),
        (["--points", "bogus"], "--points"),
        (["--points", "prefill", "--prefill-context", "60000"], "whole chunks"),
        (["--points", "prefill", "--steps", "6"], "--steps 6 a multiple"),
        (["--host-bound-below", "1.5"], "--host-bound-below"),
        (["--from-traces", "MODEL"], "--model would not be used"),
        (["--from-traces", "TRACES"], "--sparse-layers"),
        ([], "--model must be a directory with a config.json"),
    ],
)
def test_bad_arguments_exit_2_and_write_nothing(tmp_path, capsys, argv, message):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    traces = tmp_path / "traces"
    traces.mkdir()
    out = tmp_path / "out"
    argv = [str(traces) if a == "TRACES" else a for a in argv]
    if argv[:2] == ["--from-traces", "MODEL"]:
        argv = ["--from-traces", str(traces), "--model", str(model), "--sparse-layers", "57"]
    elif "--from-traces" not in argv and argv:
        argv = [*argv, "--model", str(model)]
    assert step_profile.main([*argv, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_missing_traces_exit_2(tmp_path, capsys):
    (tmp_path / "traces").mkdir()
    argv = ["--from-traces", str(tmp_path / "traces"), "--out", str(tmp_path / "out")]
    assert step_profile.main([*argv, "--sparse-layers", "57"]) == 2
    assert "no ARM/POINT.trace.json.gz" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_sparse_layer_count_reads_the_layer_pattern(tmp_path):
    from vllm_minimax.m3_geometry import M3_TEXT_CONFIG

    (tmp_path / "config.json").write_text(json.dumps(M3_TEXT_CONFIG))
    assert step_profile.sparse_layer_count(Path(tmp_path)) == 57


def test_a_mixed_point_too_short_for_the_profiled_steps_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    argv = ["--model", str(tmp_path), "--out", str(tmp_path / "out")]
    assert step_profile.main([*argv, "--mixed-long-context", "65536"]) == 2
    assert "8 chunks" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_engine_takes_the_serve_config_and_the_arm(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "load-format: dummy\nmax-model-len: 4096\nattention-config:\n  indexer_kv_dtype: fp8\n"
    )
    kwargs = step_profile.engine_kwargs(config, "flashinfer", 8192)
    assert kwargs == {
        "load_format": "dummy",
        "max_model_len": 4096,
        "attention_config": {"indexer_kv_dtype": "fp8", "minimax_m3_indexer_backend": "flashinfer"},
        "max_num_batched_tokens": 8192,
    }


def test_the_default_serve_config_is_the_rank_slices():
    kwargs = step_profile.engine_kwargs(step_profile.DEFAULT_SERVE_CONFIG, "triton", 8192)
    assert kwargs["load_format"] == "dummy"
    assert kwargs["quantization"] == "fp8"
    assert kwargs["attention_config"]["indexer_kv_dtype"] == "fp8"
    assert kwargs["max_model_len"] >= 98304 + 2048 + 12


def test_a_missing_serve_config_exits_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    argv = ["--model", str(tmp_path), "--out", str(tmp_path / "out")]
    assert step_profile.main([*argv, "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml does not exist" in capsys.readouterr().err
