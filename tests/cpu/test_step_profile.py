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


# --- Kernel families (issue 62) ------------------------------------------------------------

HUMMING = (
    "void humming<MmaOpClass, Shape<0, 6144, 6144>, Shape<64, 128, 128>, Shape<64, 32, 128>,"
    " Shape<0, 0, 0>, BFloat16, Float8E4M3, BFloat16, Float8E8M0, LayerConfig, ComputeConfig,"
    " TuningConfig>(int4 const*)"
)


def _graph_launch(correlation: int, ts: float) -> dict:
    return {**_launch(correlation, ts), "name": "cudaGraphLaunch"}


def family_trace() -> dict:
    """Three steps of 100 us, the first skipped. Kept kernels (us): in the indexer's range a
    PyTorch kernel (5) and FlashInfer's top-k program (10): indexer 15; in the MoE experts'
    ranges a Humming GEMM (30), moe_align (3) and Triton's fused_moe (16): MoE GEMMs 46,
    MoE routing 3; launched directly outside them a Humming GEMM (20) and cuBLAS (8): linear
    28; FlashInfer's sparse decode program (12): attention; an RMSNorm (4) and a copy (2);
    one CUDA graph with a Humming GEMM (6, unresolved), an NCCL all-reduce (7) and an
    unknown kernel (9). 132 us in all; the skipped step's fused_moe (50) is not counted."""
    memcpy = {
        **_kernel(9, "Memcpy HtoD (Pinned -> Device)", 186, 2),
        "cat": "gpu_memcpy",
    }
    events = [
        _range(STEP_RANGE, 0, 100),
        _range(STEP_RANGE, 100, 100),
        _range(STEP_RANGE, 200, 100),
        _range(INDEXER_RANGE, 110, 10),
        _range(step_profile.MOE_RANGE, 130, 20),
        _range(step_profile.MOE_RANGE, 230, 20),
        _launch(12, 12),
        _kernel(12, "fused_moe_kernel", 20, 50),
        _launch(1, 112),
        _kernel(1, "void at::native::vectorized_elementwise_kernel<4>", 113, 5),
        _launch(2, 114),
        _kernel(2, "kernel_cake_hopper_msa_fc14209ebc6cac7e0653", 118, 10),
        _launch(3, 132),
        _kernel(3, HUMMING, 133, 30),
        _launch(4, 135),
        _kernel(4, "moe_align_block_size_kernel", 163, 3),
        _launch(5, 160),
        _kernel(5, HUMMING, 166, 20),
        _launch(6, 170),
        _kernel(6, "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 186, 8),
        _launch(7, 175),
        _kernel(7, "kernel_cake_hopper_msa_200ffb0330dbc8893eeb", 194, 12),
        _launch(8, 180),
        _kernel(8, "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(int)", 206, 4),
        {**_launch(9, 185), "name": "cudaMemcpyAsync"},
        memcpy,
        _launch(10, 232),
        _kernel(10, "fused_moe_kernel", 233, 16),
        _graph_launch(11, 260),
        _kernel(11, HUMMING, 262, 6),
        _kernel(11, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage)", 268, 7),
        _kernel(11, "some_unknown_kernel_xyz", 275, 9),
    ]
    return {"traceEvents": events}


FAMILY_US = {
    "indexer": 15,
    "moe_gemm": 46,
    "linear_gemm": 28,
    "attention": 12,
    "communication": 7,
    "rest": 9,
    "gemm_unresolved": 6,
    "other": 9,
}


def test_gpu_time_by_kernel_family_of_a_synthetic_trace():
    figures = analyze_trace(family_trace(), sparse_layers=1, skip_steps=1, host_bound_below=0.9)
    total = sum(FAMILY_US.values())
    assert figures["gpu_ms_per_step"] == pytest.approx(total / 2 / 1000)
    assert figures["families_ms_per_step"] == pytest.approx(
        {family: us / 2 / 1000 for family, us in FAMILY_US.items()}
    )
    assert figures["families_share"] == pytest.approx(
        {family: us / total for family, us in FAMILY_US.items()}
    )
    assert sum(figures["families_share"].values()) == pytest.approx(1)
    rest = dict(figures["family_kinds_ms_per_step"]["rest"])
    assert rest == pytest.approx({"MoE routing": 0.0015, "norm": 0.002, "copy": 0.001})
    assert [name for name, _ in figures["family_kinds_ms_per_step"]["rest"]] == [
        "norm",
        "MoE routing",
        "copy",
    ]  # largest first
    assert figures["family_top_kernels"]["other"] == [["some_unknown_kernel_xyz", 0.0045]]
    assert figures["family_top_kernels"]["moe_gemm"] == [
        [HUMMING, 0.015],
        ["fused_moe_kernel", 0.008],
    ]
    assert figures["moe_ranges_per_step"] == 1


def test_the_humming_registry_places_a_cuda_graphs_humming_gemm(tmp_path):
    registry = tmp_path / step_profile.HUMMING_KERNELS_FILE
    registry.write_text(json.dumps([{"name": "_Z7hummingI", "demangled": HUMMING, "moe": False}]))
    humming_moe = step_profile.humming_registry(registry)
    figures = analyze_trace(
        family_trace(), sparse_layers=1, skip_steps=1, host_bound_below=0.9,
        humming_moe=humming_moe,
    )  # fmt: skip
    assert figures["families_ms_per_step"]["gemm_unresolved"] == 0
    assert figures["families_ms_per_step"]["linear_gemm"] == pytest.approx((28 + 6) / 2 / 1000)


def test_without_moe_ranges_a_direct_humming_launch_stays_unresolved():
    trace = family_trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e["name"] != step_profile.MOE_RANGE]
    figures = analyze_trace(trace, sparse_layers=1, skip_steps=1, host_bound_below=0.9)
    by_family = figures["families_ms_per_step"]
    assert by_family["gemm_unresolved"] == pytest.approx((30 + 20 + 6) / 2 / 1000)
    assert by_family["moe_gemm"] == pytest.approx(16 / 2 / 1000)  # fused_moe by its name


def test_the_humming_registry_leaves_out_names_that_are_both_or_unknown(tmp_path):
    registry = tmp_path / "kernels.json"
    registry.write_text(
        json.dumps(
            [
                {"name": "_Z1a", "demangled": "a()", "moe": True},
                {"name": "_Z1b", "demangled": None, "moe": True},
                {"name": "_Z1b", "demangled": None, "moe": False},
                {"name": "_Z1c", "demangled": "c()", "moe": None},
            ]
        )
    )
    assert step_profile.humming_registry(registry) == {"_Z1a": True, "a()": True}
    assert step_profile.humming_registry(tmp_path / "none.json") is None


def test_demangle_reads_a_cxx_name():
    assert step_profile.demangle("_ZN3foo3barEv") == "foo::bar()"
    assert step_profile.demangle("not_mangled") is None


def test_the_report_gives_the_families_and_the_unknown_names(tmp_path):
    traces = tmp_path / "traces"
    (traces / "mxfp8-ep.w8a8").mkdir(parents=True)
    with gzip.open(traces / "mxfp8-ep.w8a8" / "prefill.trace.json.gz", "wt") as handle:
        json.dump(family_trace(), handle)
    out = tmp_path / "out"
    argv = ["--from-traces", str(traces), "--out", str(out), "--sparse-layers", "1"]
    argv += ["--arms", "mxfp8-ep.w8a8", "--points", "prefill", "--prefill-context", "8192"]
    assert step_profile.main([*argv, "--skip-steps", "1", "--steps", "2"]) == 0
    report = (out / "step_profile.md").read_text()
    assert "| MoE GEMMs | 0.02 (34.8%) |" in report
    assert "| Humming GEMM, MoE or linear unresolved | 0.00 (4.5%) |" in report
    assert "| other (no pattern) | 0.00 (6.8%) |" in report
    assert "top other (no pattern), ms / step: `some_unknown_kernel_xyz` 0.004" in report  # 4.5 us
    assert "the rest by kind, ms / step: norm 0.00, MoE routing 0.00, copy 0.00" in report


def test_a_prefill_after_a_cached_prefix():
    parsed = argparse.Namespace(
        prefill_context=8192, max_num_batched_tokens=8192, prefill_prefix=512
    )
    cached = step_profile.point_prompts(parsed, "prefill", vocab=1000)
    assert [len(p["prompt_token_ids"]) for p in cached] == [512]
    prompts, params = step_profile.point_run(parsed, "prefill", cached, 1000, seed=3, steps=3)
    prefix = cached[0]["prompt_token_ids"]
    assert [len(p["prompt_token_ids"]) for p in prompts] == [512 + 8192] * 3
    assert all(p["prompt_token_ids"][:512] == prefix for p in prompts)
    assert len({tuple(p["prompt_token_ids"][512:]) for p in prompts}) == 3
    assert [p.max_tokens for p in params] == [1, 1, 1]
    outputs = [argparse.Namespace(outputs=[argparse.Namespace(token_ids=[7])])] * 3
    assert step_profile.engine_steps(parsed, "prefill", outputs) == 3  # one chunk a prompt


def test_a_negative_prefix_exits_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    argv = ["--model", str(tmp_path), "--out", str(tmp_path / "out"), "--prefill-prefix", "-1"]
    assert step_profile.main(argv) == 2
    assert "--prefill-prefix must be 0 or more" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
