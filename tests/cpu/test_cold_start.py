"""benchmarks/cold_start.py, issue 58's measurement, on the CPU: each arm's home (a carried
cache keeps its modification times, which ninja compares), the engine figures read from a real
H100 engine log, FlashInfer's builds split at ready, and one whole run against a stand-in server
that logs as vLLM does."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from benchmarks import cold_start
from vllm_minimax import compile_caches

REPO = Path(__file__).resolve().parents[2]
H100_COLD_LOG = REPO / "results/h100/sparse-attention/engine/cold-flashinfer-graphs.log"
SLICE = cold_start.SLICE


def test_carried_arm_starts_in_the_empty_arms_own_home(tmp_path):
    # FlashInfer's ninja files name objects by absolute path: a copy elsewhere rebuilds.
    empty = tmp_path / "home-tiny-empty" / ".cache" / "flashinfer"
    empty.mkdir(parents=True)
    program = empty / "program.so"
    program.write_bytes(b"so")
    os.utime(program, ns=(10**18, 10**18))
    (tmp_path / "home-tiny-empty" / "flashinfer-builds.jsonl").write_text("{}\n")
    (tmp_path / "home-tiny-empty" / "flashinfer-builds-carried.jsonl").write_text("{}\n")
    env = cold_start.prepare_home(tmp_path, "tiny", "carried", None)
    assert env["HOME"] == str(tmp_path / "home-tiny-empty")
    assert program.read_bytes() == b"so" and program.stat().st_mtime_ns == 10**18
    # its own build log, empty; the empty arm's kept
    assert env["FLASHINFER_JIT_BUILD_LOG"] != str(
        tmp_path / "home-tiny-empty" / "flashinfer-builds.jsonl"
    )
    assert not Path(env["FLASHINFER_JIT_BUILD_LOG"]).exists()
    assert (tmp_path / "home-tiny-empty" / "flashinfer-builds.jsonl").exists()
    assert "FLASHINFER_WORKSPACE_BASE" not in env
    assert not (tmp_path / "home-tiny-carried").exists()


def test_prebuilt_arm_serves_the_prebuild_in_place_as_it_was_built(tmp_path):
    prebuilt = tmp_path / "prebuilt-rank"
    (prebuilt / ".cache").mkdir(parents=True)
    (prebuilt / ".cache" / "x.o").write_bytes(b"o")
    os.utime(prebuilt / ".cache" / "x.o", ns=(10**18, 10**18))
    env = cold_start.prepare_home(tmp_path, "rank", "prebuilt", prebuilt)
    assert env["FLASHINFER_WORKSPACE_BASE"] == str(prebuilt)
    assert list(Path(env["HOME"]).iterdir()) == []  # everything else starts empty
    # What a start added there is gone at the next prebuilt start; the prebuild's times stay.
    (prebuilt / ".cache" / "built-at-start.o").write_bytes(b"n")
    (prebuilt / ".cache" / "x.o").write_bytes(b"rebuilt")
    env = cold_start.prepare_home(tmp_path, "rank", "prebuilt", prebuilt)
    assert env["FLASHINFER_WORKSPACE_BASE"] == str(prebuilt)
    assert sorted(p.name for p in (prebuilt / ".cache").iterdir()) == ["x.o"]
    assert (prebuilt / ".cache" / "x.o").read_bytes() == b"o"
    assert (prebuilt / ".cache" / "x.o").stat().st_mtime_ns == 10**18


def test_prebuilt_arm_finds_the_prebuilds_vllm_model_info_in_its_home(tmp_path):
    prebuilt = tmp_path / "prebuilt-tiny"
    entry = prebuilt / "vllm" / "modelinfos" / "vllm-models-minimax_m3-M.json"
    entry.parent.mkdir(parents=True)
    entry.write_text('{"hash": "h"}')
    kernel = prebuilt / "vllm" / "cutedsl" / "LLFp32WGemm" / "0123.o"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"object")
    env = cold_start.prepare_home(tmp_path, "tiny", "prebuilt", prebuilt)
    # vLLM's default VLLM_CACHE_ROOT is XDG_CACHE_HOME/vllm; the server inherits no other.
    served = Path(env["XDG_CACHE_HOME"]) / "vllm"
    assert (served / "modelinfos" / entry.name).read_text() == '{"hash": "h"}'
    assert (served / "cutedsl" / "LLFp32WGemm" / "0123.o").read_bytes() == b"object"
    assert "VLLM_CACHE_ROOT" not in env


def test_prebuilt_arm_serves_the_prebuilds_humming_kernels_from_its_home(tmp_path):
    from vllm_minimax.compile_caches import cache_dirs

    prebuilt = tmp_path / "prebuilt-rank-mxfp8-ep"
    kernel = prebuilt / "humming" / "0123abcd" / "kernel.cubin"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"cubin")
    env = cold_start.prepare_home(tmp_path, "rank-mxfp8-ep", "prebuilt", prebuilt)
    # Where the server's Humming reads (its default: no HUMMING_CACHE_DIR is inherited).
    assert "HUMMING_CACHE_DIR" not in env
    served = cache_dirs(env)["humming"] / "0123abcd" / "kernel.cubin"
    assert served.read_bytes() == b"cubin"


def test_arms_that_need_an_earlier_one_say_so(tmp_path):
    with pytest.raises(SystemExit, match="run the empty arm first"):
        cold_start.prepare_home(tmp_path, "tiny", "carried", None)
    with pytest.raises(SystemExit, match="needs --prebuilt"):
        cold_start.prepare_home(tmp_path, "tiny", "prebuilt", None)


def test_engine_figures_of_the_h100_cold_start_log():
    found = cold_start.parse_log(H100_COLD_LOG.read_text())
    assert found["model_loading_s"] == pytest.approx(3.397923)
    assert found["indexer_warmup_s"] == 56.0
    assert found["indexer_artifacts_built"] == 51
    assert found["sparse_attention_warmup_s"] == 29.6
    assert found["moe_warmup_s"] == 23.5
    assert found["graph_capture_s"] == 1.0
    assert found["init_engine_s"] == 160.88
    assert found["cute_dsl_compile_lines"] == 21
    assert found["triton_after_ready"] == ["_topk_log_softmax_kernel"]
    assert found["prebuilt_check"] is None
    assert not found["vllm_cutedsl_loaded"] and not found["vllm_cutedsl_saved"]


def test_the_cutedsl_cache_lines_say_whether_a_start_loaded_or_saved():
    log = (
        "(EngineCore pid=1) INFO 12-08 01:00:00 [jit_warmup_cutedsl_cache.py:173] Loading"
        " CuTe-DSL kernels from /h/.cache/vllm/cutedsl\n"
    )
    found = cold_start.parse_log(log)
    assert found["vllm_cutedsl_loaded"] and not found["vllm_cutedsl_saved"]
    found = cold_start.parse_log(log.replace("Loading", "Saving").replace(" from ", " to "))
    assert found["vllm_cutedsl_saved"] and not found["vllm_cutedsl_loaded"]


def test_builds_split_at_ready(tmp_path):
    log = tmp_path / "builds.jsonl"
    entries = [
        {"toolchain": "nvcc", "name": "a", "seconds": 9.5, "time": 100.0},
        {"toolchain": "cute_dsl", "name": "b", "seconds": 2.0, "time": 101.0},
        {"toolchain": "nvcc", "name": "c", "seconds": 0.01, "time": 102.0},  # ninja no-op
        {"toolchain": "cute_dsl", "name": "d", "seconds": 1.5, "time": 300.0},
    ]
    log.write_text("".join(json.dumps(e) + "\n" for e in entries) + "not json\n")
    builds = cold_start.read_builds(log, ready_at=200.0)
    assert builds["before_ready"]["count"] == 2
    assert builds["before_ready"]["by_toolchain"]["nvcc"] == {"n": 1, "s": 9.5}
    assert builds["after_ready"]["count"] == 1
    assert builds["after_ready_names"] == ["d"]


FAKE_SERVER = textwrap.dedent(
    """
    import http.server, json, os, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    home = os.environ["HOME"]
    log = os.environ["FLASHINFER_JIT_BUILD_LOG"]
    with open(log, "a") as f:
        f.write(json.dumps({"toolchain": "nvcc", "name": "p", "seconds": 3.0,
                            "time": time.time()}) + "\\n")
    def stamp(words):
        print(time.strftime("(EngineCore pid=1) INFO %m-%d %H:%M:%S [x.py:1] ") + words)
    stamp("Initializing a V1 LLM engine (v0.34.0) with config: model='m'")
    stamp("Model loading took 0.5 GiB memory and 2.000000 seconds")
    humming = os.path.join(home, ".humming", "cache", "abc")
    os.makedirs(humming)
    open(os.path.join(humming, "kernel.cubin"), "w").write("cubin")
    stamp("Available KV cache memory: 1.00 GiB")
    stamp("JIT kernel warmup starting.")
    print("JIT kernel warmup (3 compile keys):  50%|#    | 1/2 [00:00<00:00, 1.0s/kernel,"
          " LLFp32WGemm (2 keys)]\\rJIT kernel warmup (3 compile keys): 100%|#####| 2/2"
          " [00:00<00:00, 1.0s/kernel, Sm90BF16x3RouterGemmKernel (1 keys)]")
    stamp("JIT kernel warmup finished in 0.10s.")
    print("MiniMax M3: 12 prebuilt FlashInfer programs in /x (10 nvcc, 2 CuTe-DSL)")
    stamp("Graph capturing finished in 0 secs, took 0.01 GiB")
    stamp("init engine (profile, create kv cache, warmup model) took 4.00 s")
    print("home", home, flush=True)
    bodies = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["model"] == "cold-start"
            if body.get("logprobs"):
                # What vLLM's sampler does at its first logprobs request: a Triton kernel
                # compiled after ready.
                triton = os.path.join(home, ".triton", "cache", "k")
                os.makedirs(triton, exist_ok=True)
                open(os.path.join(triton, "k.cubin"), "w").write("k")
                print("(EngineCore pid=1) WARNING 12-06 05:32:29 [jit_monitor.py:143] Triton"
                      " kernel JIT compilation during inference: _topk_log_softmax_kernel."
                      " This causes a latency spike", flush=True)
            self.send_response(200); self.end_headers()
            reply = {"choices": [{"text": body["prompt"][-2:]}]}
            self.wfile.write(json.dumps(reply).encode())
        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def test_one_run_against_a_server_that_logs_as_vllm(tmp_path):
    server = tmp_path / "fake_server.py"
    server.write_text(FAKE_SERVER)
    out = tmp_path / "runs" / "tiny-empty.json"
    out.parent.mkdir()
    config = tmp_path / "c.yaml"
    config.write_text("max-model-len: 1024\n")
    began = time.monotonic()
    rc = cold_start.main(
        [
            "run", "--name", "tiny", "--arm", "empty", "--model", "m", "--config", str(config),
            "--work", str(tmp_path / "work"), "--out", str(out), "--requests", "3",
            "--server-command", f"{sys.executable} {server}", "--timeout", "60",
        ]
    )  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    # ready_s is rounded to 0.1 s: up to 0.05 s over the time the whole run took.
    assert 0 < result["ready_s"] < time.monotonic() - began + 0.05
    assert result["model_loading_s"] == 2.0
    assert result["init_engine_s"] == 4.0
    assert result["other_s"] == pytest.approx(result["ready_s"] - 6.0, abs=0.11)
    assert result["prebuilt_check"].startswith("12 prebuilt FlashInfer programs")
    assert result["flashinfer_builds"]["before_ready"]["count"] == 1
    assert result["flashinfer_builds"]["after_ready"]["count"] == 0
    log = out.with_suffix(".log").read_text()
    assert f"home {tmp_path / 'work' / 'home-tiny-empty'}" in log

    assert result["replies"] == ["lo", "lo", "lo", "is", "0:", "1:", "2:"]
    assert result["state"] == "fresh_empty"
    # The start wrote a Humming cubin before ready and a Triton kernel after it (at the
    # logprobs request); the monitor's warning names the kernel.
    assert result["caches"]["humming"]["built"] == 1
    assert result["caches"]["humming"]["built_after_ready"] == 0
    assert result["caches"]["triton"]["built_after_ready"] == 1
    assert result["caches"]["triton"]["files_before"] == 0
    assert result["triton_after_ready"] == ["_topk_log_softmax_kernel"]
    assert cold_start.built_after_ready(result) == [
        "JIT monitor: Triton _topk_log_softmax_kernel",
        "triton cache: 1 files written after ready",
    ]
    assert [k["kernel"] for k in result["jit_warmup_kernels"]] == [
        "LLFp32WGemm",
        "Sm90BF16x3RouterGemmKernel",
    ]
    assert 0 <= result["before_engine_s"] <= result["ready_s"] + 1
    assert result["profile_run_s"] in (0.0, 1.0)  # the fake's lines, a second apart at most

    prebuilt = dict(result, arm="prebuilt")
    differing = dict(result, arm="carried", replies=["other"])
    for row in (prebuilt, differing):
        (tmp_path / f"{row['arm']}.json").write_text(json.dumps(row))
    runs = [out, tmp_path / "prebuilt.json", tmp_path / "carried.json"]
    table = cold_start.report(runs, tmp_path / "report.md")
    assert "| tiny | empty |" in table
    assert "12 prebuilt FlashInfer programs" in table
    assert "tiny prebuilt: greedy replies the same as the empty arm's" in table
    assert "tiny carried: greedy replies DIFFER from the empty arm's" in table


H100_WARM_LOG = REPO / "results/h100/sparse-attention-review/engine/flashinfer-graphs.log"


def test_phases_of_an_h100_engine_log():
    # Its lines: engine config 05:31:34, weights 05:31:49, KV cache 05:31:52, JIT warm-up
    # 05:31:52 to 05:32:26, graphs 05:32:29, engine ready 05:32:29.
    launched = datetime(2026, 12, 6, 5, 31, 10).timestamp()
    found = cold_start.phase_seconds(H100_WARM_LOG.read_text(), launched)
    assert found == {
        "imports_s": 24.0,
        "before_engine_s": 24.0,
        "engine_config_to_load_s": 15.0,
        "profile_run_s": 3.0,
        "kv_to_jit_s": 0.0,
        "jit_warmup_wall_s": 34.0,
        "jit_to_graphs_s": 3.0,
        "graphs_to_engine_s": 0.0,
    }
    assert "imports_s" not in cold_start.phase_seconds(H100_WARM_LOG.read_text())


def test_jit_warmup_kernels_from_vllms_progress_bar():
    kernels = cold_start.jit_warmup_kernels(H100_WARM_LOG.read_text())
    # Bars at 1/5 00:12, 3/5 00:32 (2/5 never drawn), 4/5 00:33, 5/5 00:33 (drawn twice).
    assert kernels == [
        {"kernel": "_IndexerFlashInferJit", "keys": 1, "s": 12.0, "with": 0},
        {"kernel": "LLFp32WGemm", "keys": 64, "s": 20.0, "with": 1},
        {"kernel": "Sm90BF16x3RouterGemmKernel", "keys": 3, "s": 1.0, "with": 0},
        {"kernel": "_TritonMoEJit", "keys": 1, "s": 0.0, "with": 0},
    ]


def _bar(done: int, total: int, elapsed: str, kernel: str, keys: int) -> str:
    return (
        f"JIT kernel warmup (70 compile keys):  50%|#   | {done}/{total} [{elapsed}<00:10,"
        f" 3.1s/kernel, {kernel} ({keys} keys)]\r"
    )


def test_jit_warmup_kernels_over_an_hour_and_a_second_engine():
    first = _bar(1, 2, "1:00:05", "A", 1) + _bar(2, 2, "1:01:05", "B", 2)
    assert cold_start.jit_warmup_kernels(first) == [
        {"kernel": "A", "keys": 1, "s": 3605.0, "with": 0},
        {"kernel": "B", "keys": 2, "s": 60.0, "with": 0},
    ]
    second = _bar(1, 3, "00:04", "C", 3) + _bar(3, 3, "00:09", "D", 4)
    assert cold_start.jit_warmup_kernels(first + "\n" + second) == [
        {"kernel": "C", "keys": 3, "s": 4.0, "with": 0},
        {"kernel": "D", "keys": 4, "s": 5.0, "with": 1},
    ]


def _slice_log(before: int, load: int, profile: int, jit: dict[str, int], graphs: int) -> str:
    """A log of the MXFP8 EP slice's start with the given phase seconds (the H200 start of
    2026-12-06 was 40, 20, 157, LLFp32WGemm 55 of 69, 12)."""
    clock = datetime(2026, 12, 6, 20, 0, 0)

    def line(words: str) -> str:
        return f"(EngineCore pid=1) INFO {clock:%m-%d %H:%M:%S} [x.py:1] {words}\n"

    text = line("non-default args: {}")
    clock += timedelta(seconds=before)
    text += line("Initializing a V1 LLM engine (v0.34.0) with config: ...")
    clock += timedelta(seconds=load)
    text += line("Model loading took 6.7 GiB memory and 12.000000 seconds")
    clock += timedelta(seconds=profile)
    text += line("Available KV cache memory: 80.00 GiB")
    clock += timedelta(seconds=2)  # the KV cache's allocation
    text += line("JIT kernel warmup starting.")
    elapsed = 0
    for done, (kernel, seconds) in enumerate(jit.items(), 1):
        elapsed += seconds
        text += _bar(done, len(jit), f"{elapsed // 60:02d}:{elapsed % 60:02d}", kernel, 64)
    clock += timedelta(seconds=elapsed)
    text += line(f"JIT kernel warmup finished in {elapsed}.00s.")
    clock += timedelta(seconds=graphs)
    text += line(f"Graph capturing finished in {graphs} secs, took 0.50 GiB")
    text += line("init engine (profile, create kv cache, warmup model) took 250.00 s")
    return text


def _slice_row(arm: str, ready: float, log: str, humming: int, after: int = 0) -> dict:
    launched = datetime(2026, 12, 6, 19, 59, 55).timestamp()
    row = {"name": "rank-mxfp8-ep", "arm": arm, "state": cold_start.STATE_OF_ARM[arm]}
    row["ready_s"] = ready
    row.update(cold_start.parse_log(log, launched))
    row["flashinfer_builds"] = {
        "before_ready": {"count": 0, "by_toolchain": {}},
        "after_ready": {"count": 0, "by_toolchain": {}},
        "after_ready_names": [],
    }
    caches = {name: {"dir": "/x", "built": 0, "built_after_ready": 0} for name in ("triton",)}
    caches["humming"] = {"dir": "/h", "built": humming, "built_after_ready": after}
    row["caches"] = caches
    return row


def test_summary_names_the_target_rows_and_what_holds_a_miss(tmp_path):
    jit = {"_IndexerFlashInferJit": 4, "LLFp32WGemm": 55, "Sm90BF16x3RouterGemmKernel": 10}
    empty = _slice_row("empty", 311.0, _slice_log(40, 20, 157, jit, 12), humming=212)
    loaded = "INFO [jit_warmup_cutedsl_cache.py:173] Loading CuTe-DSL kernels from /h/vllm\n"
    prebuilt = _slice_row("prebuilt", 120.0, _slice_log(35, 10, 20, jit, 12) + loaded, humming=212)
    warm = _slice_row("carried", 61.0, _slice_log(35, 10, 4, jit, 12), humming=0, after=3)
    runs = []
    for row in (empty, prebuilt, warm):
        (tmp_path / f"{row['arm']}.json").write_text(json.dumps(row))
        runs.append(tmp_path / f"{row['arm']}.json")
    summary = cold_start.write_summary(runs, "NVIDIA H200", "abc1234", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary
    assert summary["gpu"] == "NVIDIA H200" and summary["commit"] == "abc1234"
    states = summary["runs"]["rank-mxfp8-ep"]
    assert {state: run["ready_s"] for state, run in states.items()} == {
        "fresh_empty": 311.0,
        "fresh_prebuilt": 120.0,
        "warm": 61.0,
    }
    assert states["fresh_empty"]["phases_s"]["profile_run_s"] == 157.0
    assert states["fresh_prebuilt"]["vllm_cutedsl"] == {"loaded": True, "saved": False}
    assert states["fresh_empty"]["vllm_cutedsl"] == {"loaded": False, "saved": False}
    assert states["fresh_empty"]["phases_s"]["kv_to_jit_s"] == 2.0
    assert states["fresh_empty"]["phases_s"]["before_engine_s"] == 45.0
    fresh, carried, nothing_after = summary["targets"]
    assert (fresh["state"], fresh["met"]) == ("fresh_prebuilt", True)  # 120 s is the bound
    assert (carried["state"], carried["met"]) == ("warm", False)
    assert carried["held_by"] == "JIT warm-up 69 s (LLFp32WGemm, 64 keys: 55 s)"
    assert (
        states["fresh_empty"]["held_by"]
        == "profile run 157 s (this start wrote: humming 212 files)"
    )
    assert nothing_after["met"] is False
    assert nothing_after["built_after_ready"]["warm"] == [
        "humming cache: 3 files written after ready"
    ]
    report = (tmp_path / "out" / "report.md").read_text()
    lines = report.splitlines()
    assert lines[0] == "# Cold start on NVIDIA H200 (commit abc1234)"
    assert lines[4].startswith(
        "| MXFP8 EP slice ready, fresh machine with the image's caches <= 120 s"
    )
    assert lines[4].endswith("| 120.0 s (65.0 s without the slice's LLFp32WGemm) | met |")
    assert lines[5].endswith("| 61.0 s (6.0 s without the slice's LLFp32WGemm) | MISSED |")
    assert states["warm"]["slice_only_s"] == 55.0
    assert lines[6].endswith("| humming cache: 3 files written after ready | MISSED |")
    assert (
        "- MXFP8 EP slice ready, machine that started it once <= 60 s: held by JIT warm-up"
        in report
    )
    assert "| rank-mxfp8-ep | fresh_empty | abc1234 | 311.0 | 45.0 | 20.0 | 157.0 |" in report


def test_each_state_names_the_commit_it_ran_at(tmp_path):
    """A run's own commit (``run --commit``, or ``summary --commit-of`` for an older record)
    stays with its state; the others take the summary's."""
    jit = {"LLFp32WGemm": 1}
    rows = {
        "empty": _slice_row("empty", 300.0, _slice_log(40, 20, 100, jit, 12), humming=0),
        "prebuilt": _slice_row("prebuilt", 200.0, _slice_log(35, 10, 20, jit, 12), humming=0),
        "carried": _slice_row("carried", 100.0, _slice_log(35, 10, 4, jit, 12), humming=0),
    }
    rows["carried"]["commit"] = "new5678"
    runs = []
    for arm, row in rows.items():
        (tmp_path / f"{arm}.json").write_text(json.dumps(row))
        runs.append(tmp_path / f"{arm}.json")
    out = tmp_path / "out"
    named = f"{tmp_path / 'prebuilt.json'}=mid9999"
    common = ["--gpu", "G", "--commit", "old1234", "--out-dir", str(out)]
    code = cold_start.main(["summary", *map(str, runs), *common, "--commit-of", named])
    assert code == 0
    states = json.loads((out / "summary.json").read_text())["runs"]["rank-mxfp8-ep"]
    assert {state: run["commit"] for state, run in states.items()} == {
        "fresh_empty": "old1234",
        "fresh_prebuilt": "mid9999",
        "warm": "new5678",
    }
    assert "| rank-mxfp8-ep | warm | new5678 | 100.0 |" in (out / "report.md").read_text()
    with pytest.raises(SystemExit):
        cold_start.main(["summary", str(runs[0]), *common, "--commit-of", "no-sha"])


def test_summary_without_the_slice_says_not_measured(tmp_path):
    row = _slice_row("empty", 50.0, _slice_log(30, 2, 3, {"LLFp32WGemm": 5}, 1), humming=0)
    row["name"] = "tiny"
    summary = cold_start.summarize([row], "NVIDIA H100 80GB HBM3", "abc")
    assert [target["met"] for target in summary["targets"]] == [None, None, None]
    # The tiny model's own gate compiles LLFp32WGemm too: not a slice's artifact there.
    assert summary["runs"]["tiny"]["fresh_empty"]["ready_without_slice_only_s"] == 50.0
    assert "| not measured |" in cold_start.render_summary(summary, [row])


def test_cache_dirs_follow_each_owners_rule(tmp_path):
    home = tmp_path / "home"
    env = {"HOME": str(home), "TMPDIR": str(tmp_path / "tmp"), "USER": "u"}
    dirs = compile_caches.cache_dirs(env)
    assert dirs["humming"] == home / ".humming" / "cache"
    assert dirs["triton"] == home / ".triton" / "cache"
    assert dirs["vllm_torch_compile"] == home / ".cache" / "vllm" / "torch_compile_cache"
    assert dirs["flashinfer"] == home / ".cache" / "flashinfer"
    assert dirs["cute_dsl"] == tmp_path / "tmp" / "u" / "cutlass_python_cache"
    assert dirs["torchinductor"] == tmp_path / "tmp" / "torchinductor_u"
    moved = compile_caches.cache_dirs(
        env
        | {
            "HUMMING_CACHE_DIR": "/h",
            "TRITON_HOME": "/t",
            "XDG_CACHE_HOME": "/x",
            "FLASHINFER_WORKSPACE_BASE": "/f",
        }
    )
    assert moved["humming"] == Path("/h")
    assert moved["triton"] == Path("/t/.triton/cache")
    assert moved["vllm_startup_plan"] == Path("/x/vllm/startup_plan")
    assert moved["vllm_cutedsl"] == Path("/x/vllm/cutedsl")
    assert moved["flashinfer"] == Path("/f/.cache/flashinfer")
    assert compile_caches.cache_dirs(env | {"VLLM_CACHE_ROOT": "/v"})["vllm_torch_compile"] == Path(
        "/v/torch_compile_cache"
    )


def test_inventory_counts_files_and_those_written_since(tmp_path):
    root = tmp_path / "humming"
    (root / "a").mkdir(parents=True)
    old, new = root / "a" / "kernel.cubin", root / "b.cubin"
    old.write_bytes(b"12345")
    new.write_bytes(b"1")
    (root / "a" / "x.lock").write_text("")
    os.utime(old, (1000, 1000))
    os.utime(new, (3000, 3000))
    found = compile_caches.inventory({"humming": root, "triton": tmp_path / "none"}, since=2000)
    assert found["humming"] == {"dir": str(root), "files": 2, "bytes": 6, "since_files": 1}
    assert found["triton"] == {
        "dir": str(tmp_path / "none"),
        "files": 0,
        "bytes": 0,
        "since_files": 0,
    }


def test_every_arm_keeps_its_caches_in_its_own_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HUMMING_CACHE_DIR", "/shared/humming")
    monkeypatch.setenv("TRITON_HOME", "/shared")
    env = cold_start.prepare_home(tmp_path, "tiny", "empty", None)
    dirs = compile_caches.cache_dirs({**os.environ, **env})
    home = Path(env["HOME"])
    for name, path in dirs.items():
        assert home in path.parents, name


def test_a_fresh_empty_record_from_eval_ab(tmp_path):
    ab = {
        "config": "serve.yaml",
        "round_order": [["fp8-flashinfer", "stock"]],
        "arms": [
            {
                "name": "fp8-flashinfer",
                "rounds": [
                    {"round": 0, "startup_seconds": 311.04},
                    {"round": 1, "startup_seconds": 140.0},  # on the caches round 1 left
                ],
            },
            {"name": "stock", "rounds": [{"round": 0, "startup_seconds": 145.0}]},
        ],
    }
    (tmp_path / "ab.json").write_text(json.dumps(ab))
    log = tmp_path / "fp8-flashinfer" / "round-1" / "server.log"
    log.parent.mkdir(parents=True)
    jit = {"_IndexerFlashInferJit": 4, "LLFp32WGemm": 55}
    log.write_text(_slice_log(40, 20, 157, jit, 12))
    out = tmp_path / "rank-mxfp8-ep-empty.json"
    argv = ["from-ab", str(tmp_path / "ab.json"), "--arm", "fp8-flashinfer", "--name", SLICE]
    assert cold_start.main([*argv, "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert (row["state"], row["ready_s"]) == ("fresh_empty", 311.0)
    assert row["profile_run_s"] == 157.0 and "before_engine_s" not in row
    summary = cold_start.summarize([row], "NVIDIA H200", "abc")
    assert summary["runs"][SLICE]["fresh_empty"]["slice_only_s"] == 55.0
    # stock started second, on the caches the first arm filled
    with pytest.raises(SystemExit, match="started after fp8-flashinfer"):
        cold_start.run_from_ab(tmp_path / "ab.json", "stock", SLICE)
    with pytest.raises(SystemExit, match="has no arm 'bf16'"):
        cold_start.run_from_ab(tmp_path / "ab.json", "bf16", SLICE)
