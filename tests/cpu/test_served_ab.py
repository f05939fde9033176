"""Issue 67's served A/B made ready without a GPU: the summary's ratios and spreads against
hand-made rounds, the targets met or missed, the rotation, the time plan, the start phases from
a server log, the fourth arm's hook, the prefix-cached decode point, eval ab's rounds on one
server, and scripts/gpu-rank-slice's served round."""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import tarfile
import time
from pathlib import Path

import pytest
import yaml
from patchset_helpers import installed_vllm_site
from test_fp8kv_ab import SCRIPT, dataclass_fields, run_bash, script_output
from test_server_figures import STAND_IN_SERVER

from benchmarks import served_ab
from vllm_minimax.evals import ab, presets, throughput

POINTS = ("prefill-128k-c1", "prefill-32k-c4", "decode-32k-c8", "mixed-c16")


def level(point: str, value: float, round_index: int) -> dict:
    """An eval ab level whose point's metric is ``value`` and every other metric poisoned."""
    metric = served_ab.goal_of(point).metric
    poison = -1e9
    return {
        "concurrency": 1,
        "round": round_index,
        "completed": 1,
        "output_tokens_per_s": value if metric == served_ab.TOK_S else poison,
        "ttft_ms": {"p50": value if metric == served_ab.TTFT else poison, "mean": poison},
        "itl_ms": {"p50": value if metric == served_ab.ITL else poison, "mean": poison},
        "running_requests": {"max": 4, "waiting_max": 0},
    }


def ab_record(rounds: dict[str, dict[str, list[float]]], order: list[str]) -> dict:
    """eval ab's ab.json for arms whose rounds at each point are given (one server each)."""
    return {
        "round_order": [order],
        "arms": [
            {
                "name": name,
                "server_args": "{}",
                "rounds": [{"round": 0, "startup_seconds": 100.0 + i, "kv_cache_tokens": 1000}],
                "throughput": {
                    "scenarios": [
                        {"name": point, "levels": [level(point, v, r) for r, v in enumerate(vals)]}
                        for point, vals in points.items()
                    ]
                },
            }
            for i, (name, points) in enumerate(rounds.items())
        ],
    }


# Stock's rounds, and (c)'s chosen so that mean and median differ and the paired ratios differ
# from the ratio of medians.
STOCK_ROUNDS = {
    "prefill-128k-c1": [5000.0, 5200.0, 9000.0],
    "prefill-32k-c4": [1000.0, 1100.0, 1200.0],
    "decode-32k-c8": [20.0, 21.0, 40.0],
    "mixed-c16": [1000.0, 900.0, 1100.0],
}
C_ROUNDS = {
    "prefill-128k-c1": [2400.0, 2500.0, 8000.0],
    "prefill-32k-c4": [700.0, 600.0, 650.0],
    "decode-32k-c8": [19.0, 20.0, 19.5],
    "mixed-c16": [1600.0, 1500.0, 1300.0],
}


def summary_of(rounds: dict, gpu: str = "h200") -> dict:
    repeats = served_ab.collect(ab_record(rounds, list(rounds)), gpu)
    return served_ab.summarise(repeats, gpu, "mxfp8-ep", "abc123", 13.5)


def test_each_ratio_is_the_median_over_stocks_with_the_paired_rounds_as_its_spread():
    summary = summary_of({"stock": STOCK_ROUNDS, "fp8-flashinfer": C_ROUNDS})
    c = summary["arms"]["fp8-flashinfer"]
    # By hand: medians 2500/5200, 650/1100, 19.5/21, 1500/1000.
    assert c["ttft_128k_ratio"] == pytest.approx(2500 / 5200)
    assert c["ttft_32k_ratio"] == pytest.approx(650 / 1100)
    assert c["itl_decode_ratio"] == pytest.approx(19.5 / 21)
    assert c["mixed_tok_s_ratio"] == pytest.approx(1.5)
    # Paired: round by round; the spread is their min and max.
    assert c["spread"]["ttft_128k_ratio"] == pytest.approx([2400 / 5000, 8000 / 9000])
    assert c["spread"]["itl_decode_ratio"] == pytest.approx([19.5 / 40, 20 / 21])
    assert c["spread"]["mixed_tok_s_ratio"] == pytest.approx([1300 / 1100, 1500 / 900])
    assert "capacity_tok_s_ratio" not in c  # the H200 has no capacity point
    assert (summary["rounds"], summary["gpu"], summary["commit"]) == (3, "h200", "abc123")
    assert summary["device_minutes"] == 13.5 and summary["complete"]
    # The mean would give another figure: (2400 + 2500 + 8000) / 3 over (5000 + 5200 + 9000) / 3.
    mean_ratio = statistics.fmean(C_ROUNDS["prefill-128k-c1"]) / statistics.fmean(
        STOCK_ROUNDS["prefill-128k-c1"]
    )
    assert abs(c["ttft_128k_ratio"] - mean_ratio) > 0.1


def test_the_targets_are_met_or_missed_in_each_metrics_direction():
    summary = summary_of({"stock": STOCK_ROUNDS, "fp8-flashinfer": C_ROUNDS})
    status = {row["key"]: row["status"] for row in summary["targets"]}
    # 0.481 <= 0.5 met; 0.591 <= 0.6 met; 0.929 <= 0.97 met; 1.5 >= 1.5 met (the bound itself).
    assert status == dict.fromkeys(
        ("ttft_128k_ratio", "ttft_32k_ratio", "itl_decode_ratio", "mixed_tok_s_ratio"), "met"
    )
    slower = {**C_ROUNDS, "prefill-128k-c1": [2700.0, 2800.0, 2900.0]}
    fewer = {**C_ROUNDS, "mixed-c16": [1400.0, 1490.0, 1600.0]}
    for rounds, key in ((slower, "ttft_128k_ratio"), (fewer, "mixed_tok_s_ratio")):
        rows = summary_of({"stock": STOCK_ROUNDS, "fp8-flashinfer": rounds})["targets"]
        assert {row["key"]: row["status"] for row in rows}[key] == "missed"


def test_a_swapped_arm_does_not_pass_for_stock():
    """With the arms swapped, every ratio inverts: a summary that divided stock by the arm
    would report (c)'s figures as stock's."""
    right = summary_of({"stock": STOCK_ROUNDS, "fp8-flashinfer": C_ROUNDS})
    swapped = summary_of({"stock": C_ROUNDS, "fp8-flashinfer": STOCK_ROUNDS})
    for key in ("ttft_128k_ratio", "mixed_tok_s_ratio"):
        a, b = right["arms"]["fp8-flashinfer"][key], swapped["arms"]["fp8-flashinfer"][key]
        assert a * b == pytest.approx(1.0) and a != pytest.approx(b)
    assert right["arms"]["fp8-flashinfer"]["ttft_128k_ratio"] < 0.5


def test_a_missing_round_or_stock_arm_says_incomplete():
    short = {**C_ROUNDS, "mixed-c16": [1600.0, 1500.0]}
    summary = summary_of({"stock": STOCK_ROUNDS, "fp8-flashinfer": short})
    assert not summary["complete"]
    assert summary["missing"] == ["fp8-flashinfer mixed-c16: 2 of 3 rounds"]
    no_stock = summary_of({"fp8-flashinfer": C_ROUNDS})
    assert not no_stock["complete"] and no_stock["missing"][0] == "no stock arm: no ratio"
    assert all(row["status"] == "not measured" for row in no_stock["targets"])


def test_a_round_is_paired_with_stocks_round_of_the_same_number():
    record = ab_record({"stock": STOCK_ROUNDS, "fp8-flashinfer": C_ROUNDS}, ["stock"])
    [c_mixed] = [
        sc for sc in record["arms"][1]["throughput"]["scenarios"] if sc["name"] == "mixed-c16"
    ]
    del c_mixed["levels"][1]  # (c)'s round 2 at mixed-c16 failed: rounds 1 and 3 remain
    summary = served_ab.summarise(
        served_ab.collect(record, "h200"), "h200", "mxfp8-ep", "abc123", None
    )
    [row] = [r for r in summary["targets"] if r["point"] == "mixed-c16"]
    assert row["paired"] == pytest.approx([1600 / 1000, 1300 / 1100])
    assert row["ratio"] == pytest.approx(statistics.median([1600, 1300]) / 1000)
    assert not summary["complete"]


def test_the_h100_adds_the_capacity_ratio():
    capacity = {"decode-32k-c64": [800.0, 820.0, 810.0]}
    summary = summary_of(
        {
            "stock": {**STOCK_ROUNDS, **capacity},
            "fp8-flashinfer": {**C_ROUNDS, "decode-32k-c64": [1200.0, 1100.0, 1300.0]},
        },
        gpu="h100",
    )
    assert summary["arms"]["fp8-flashinfer"]["capacity_tok_s_ratio"] == pytest.approx(1200 / 810)


def test_the_report_opens_with_the_target_table():
    rounds = {"stock": STOCK_ROUNDS, "bf16": STOCK_ROUNDS, "fp8-flashinfer": C_ROUNDS}
    repeats = served_ab.collect(ab_record(rounds, list(rounds)), "h200")
    summary = served_ab.summarise(repeats, "h200", "mxfp8-ep", "abc123", 13.5)
    text = served_ab.markdown(summary, repeats, [])
    lines = text.splitlines()
    assert lines[0].startswith("# Served A/B against stock vLLM 0.34.0: mxfp8-ep slice on one H200")
    table = lines[lines.index("| goal | arm | ratio | rounds (paired) | |") :]
    assert table[2] == (
        "| TTFT p50 ms at `prefill-128k-c1` at most 0.5 of stock | (a) bf16 | 1.000 |"
        " 1.000-1.000 | missed |"
    )
    assert (
        "| TTFT p50 ms at `prefill-128k-c1` at most 0.5 of stock | (c) fp8-flashinfer | 0.481 |"
        " 0.480-0.889 | met |"
    ) in table
    assert "not a target here" in text
    # (a) missed every goal: the profile points for the four.
    assert "fp8kv-profile --points decode mixed prefill`" in text
    # The decode point's TTFT by round, which shows the prefix-cache hits (poisoned here).
    assert "| stock | 1,000 | prefill-128k-c1 4; prefill-32k-c4 4; decode-32k-c8 4;" in text
    assert "| (e) stock | 5200 [5000-9000] | 1100 [1000-1200] | 21.00 [20.00-40.00] |" in text


def test_the_rotation_puts_each_arm_in_each_place():
    arms = ["stock", "bf16", "fp8-flashinfer"]
    orders = [served_ab.rotation(arms, rep) for rep in (1, 2, 3, 4)]
    assert orders[0] == arms and orders[3] == arms
    assert orders[1] == ["bf16", "fp8-flashinfer", "stock"]
    for arm in arms:
        assert sorted(order.index(arm) for order in orders[:3]) == [0, 1, 2]
    with pytest.raises(ValueError):
        served_ab.rotation(arms, 0)
    # The script's rotation is the same.
    code = f"source <(sed -n '/^served_order() {{/,/^}}/p' {SCRIPT}); "
    for rep in (1, 2, 3, 4):
        done = run_bash(code + f"served_order {rep} stock bf16 fp8-flashinfer w8a8")
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == served_ab.rotation([*arms, "w8a8"], rep)


def test_the_plan_adds_starts_warm_ups_rounds_and_stops():
    table = served_ab.PLAN["mxfp8-ep"]
    estimate = served_ab.plan("h200", "mxfp8-ep", 3)
    per_arm = sum(w + 3 * r for p, (w, r) in table["points"].items() if p != "decode-32k-c64")
    assert estimate["points_s_per_arm"] == per_arm
    first_s, next_s = table["starts_s"]["h200"]
    assert estimate["starts_s"] == first_s + 2 * next_s
    assert estimate["total_s"] == estimate["starts_s"] + 3 * (per_arm + table["stop_s"])
    h100 = served_ab.plan("h100", "mxfp8-ep", 3)
    # Each card's own starts: the H100's later start builds FlashInfer's programs.
    first_s, next_s = table["starts_s"]["h100"]
    assert (h100["starts_s"], h100["starts_from"]) == (first_s + 2 * next_s, "h100")
    assert h100["starts_s"] > estimate["starts_s"]
    online = served_ab.plan("h100", "fp8-online", 2)
    assert online["starts_from"] == "h200"
    assert online["starts_s"] == sum(served_ab.PLAN["fp8-online"]["starts_s"]["h200"])
    assert (
        h100["points_s_per_arm"]
        == per_arm
        + table["points"]["decode-32k-c64"][0]
        + 3 * (table["points"]["decode-32k-c64"][1])
    )
    with pytest.raises(ValueError):
        served_ab.plan("h200", "mxfp8-ep", 1)
    over = served_ab.main(["plan", "--gpu", "h200", "--slice", "mxfp8-ep", "--budget-s", "60"])
    assert over == 1
    assert served_ab.main(["plan", "--gpu", "h200", "--slice", "mxfp8-ep", "--arms", "2"]) == 0
    three = ["prefill-128k-c1", "prefill-32k-c4", "decode-32k-c8"]
    some = served_ab.plan("h100", "mxfp8-ep", 2, points=three)
    assert some["points_s_per_arm"] == sum(
        table["points"][p][0] + 3 * table["points"][p][1] for p in three
    )
    with pytest.raises(ValueError, match="no point decode-32k-c64 on h200"):
        served_ab.plan("h200", "mxfp8-ep", 2, points=["decode-32k-c64"])
    argv = ["plan", "--gpu", "h100", "--slice", "mxfp8-ep", "--arms", "2", "--points", *three]
    assert served_ab.main(argv) == 0


# vLLM 0.34.0's start lines, as an MXFP8 EP server logs them (times made up).
START_LOG = "".join(
    f"(EngineCore pid=9) INFO 12-06 20:01:02 [x.py:1] {line}\n"
    for line in (
        "Model loading took 57.46 GiB memory and 21.30 seconds",
        "torch.compile took 61.20 s in total",
        "Initial profiling/warmup run took 96.50 s",
        "Available KV cache memory: 72.21 GiB",
        "JIT kernel warmup finished in 57.10s.",
        "Graph capturing finished in 31 secs, took 1.42 GiB",
        "init engine (profile, create kv cache, warmup model) took 190.20 s",
    )
)


def test_the_start_phases_are_read_as_vllm_logs_them():
    phases = served_ab.start_phases(START_LOG)
    assert phases == {
        "model_loading_s": 21.3,
        "profile_run_s": 96.5,
        "torch_compile_s": 61.2,
        "jit_warmup_s": 57.1,
        "graph_capture_s": 31.0,
        "init_engine_s": 190.2,
        "kv_cache_gib": 72.21,
        "weights_gib": 57.46,
    }
    assert served_ab.start_phases("") == {}


def test_starts_say_first_or_later_per_arm_on_the_machine(tmp_path):
    record = ab_record(
        {"stock": STOCK_ROUNDS, "fp8-flashinfer": C_ROUNDS}, ["fp8-flashinfer", "stock"]
    )
    (tmp_path / "stock" / "round-1").mkdir(parents=True)
    (tmp_path / "stock" / "round-1" / "server.log").write_text(START_LOG)
    starts = served_ab.starts(record, tmp_path, started_before=["fp8-flashinfer"])
    assert [(s["arm"], s["start"], s["machine_start"]) for s in starts] == [
        ("fp8-flashinfer", "later", 2),
        ("stock", "first", 3),
    ]
    assert starts[1]["ready_s"] == 100.0 and starts[1]["phases"]["jit_warmup_s"] == 57.1
    assert starts[0]["ready_s"] == 101.0 and starts[0]["phases"] == {}


def test_summarise_writes_the_compact_set_and_its_exit_says_complete(tmp_path, capsys):
    ab_dir = tmp_path / "ab"
    ab_dir.mkdir()
    record = ab_record(
        {"stock": STOCK_ROUNDS, "fp8-flashinfer": C_ROUNDS}, ["stock", "fp8-flashinfer"]
    )
    (ab_dir / "ab.json").write_text(json.dumps(record))
    ledger = tmp_path / "ledger"
    ledger.write_text("stock\n")
    argv = ["summarise", str(ab_dir), "--gpu", "h200", "--slice", "mxfp8-ep", "--commit", "c0"]
    argv += [
        "--device-minutes",
        "12.5",
        "--started-before",
        str(ledger),
        "--out",
        str(tmp_path / "o"),
    ]
    assert served_ab.main(argv) == 0
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [
        "repeats.json", "report.md", "starts.json", "summary.json",
    ]  # fmt: skip
    repeats = json.loads((tmp_path / "o" / "repeats.json").read_text())
    assert [e["value"] for e in repeats["arms"]["stock"]["points"]["mixed-c16"]] == [
        1000,
        900,
        1100,
    ]
    starts = json.loads((tmp_path / "o" / "starts.json").read_text())
    assert [s["start"] for s in starts] == ["later", "first"]
    record["arms"][1]["throughput"]["scenarios"][3]["levels"].pop()
    (ab_dir / "ab.json").write_text(json.dumps(record))
    assert served_ab.main(argv) == 1
    (ab_dir / "ab.json").write_text("[]")
    with pytest.raises(SystemExit, match="expected a JSON object"):
        served_ab.main(argv)


def test_the_fourth_arm_takes_its_arguments_over_c_and_its_environment(tmp_path, capsys):
    base = 'fp8-flashinfer={"kv-cache-dtype": "fp8", "attention-config": {"a": 1}}'
    extra = tmp_path / "w8a8.yaml"
    extra.write_text(
        "quantization-config: {mode: w8a8}\nattention-config: {b: 2}\n"
        "server-env: {VLLM_HUMMING_INPUT_QUANT_CONFIG: mxfp8}\n"
    )
    assert served_ab.main(["fourth-arm", str(extra), "--base", base]) == 0
    arm_line, env_line = capsys.readouterr().out.splitlines()
    arm = ab.parse_arm(arm_line)
    assert arm.name == "w8a8"
    assert arm.server_args == {
        "kv-cache-dtype": "fp8",
        "attention-config": {"a": 1, "b": 2},
        "quantization-config": {"mode": "w8a8"},
    }
    assert ab.parse_arm_env([env_line], [arm])[0].env == {
        "VLLM_HUMMING_INPUT_QUANT_CONFIG": "mxfp8"
    }
    for text, message in (("[1]", "expected a mapping"), ("server-env: [x]", "server-env")):
        extra.write_text(text)
        assert served_ab.main(["fourth-arm", str(extra), "--base", base]) == 2
        assert message in capsys.readouterr().err
    extra.write_text("{}")
    assert served_ab.main(["fourth-arm", str(extra), "--base", base]) == 2


def test_the_served_preset_has_the_points_and_the_decode_point_is_prefix_cached():
    preset = presets.load_throughput_preset("served-ab")
    by_name = {scenario.name: scenario for scenario in preset.scenarios}
    assert tuple(by_name) == (*POINTS, "decode-32k-c64")
    assert set(served_ab.POINTS["h100"]) == set(by_name)
    assert [s.name for s in preset.scenarios if s.prefix_cached] == ["decode-32k-c8"]
    for scenario in preset.scenarios:  # one wave each (one request at c1)
        assert scenario.num_requests == scenario.concurrency[0]
    # A prefix-cached scenario runs on this project's client: its warm-up sends its prompts.
    assert throughput.scenario_client(by_name["decode-32k-c8"], "vllm-bench") == "own"
    assert throughput.scenario_client(by_name["prefill-32k-c4"], "vllm-bench") == "vllm-bench"


def sent_prompts(monkeypatch) -> list[tuple[str, list]]:
    """Stub run_level: record each call's label and prompts, answer with made-up timings."""
    calls: list[tuple[str, list]] = []

    async def fake_level(base_url, model, prompts, concurrency, label, timeouts):
        calls.append((label, [tuple(p) for p, _ in prompts]))
        timing = throughput.RequestTiming(8, 4, 0.01, 0.05, [0.01, 0.01, 0.01])
        return [timing for _ in prompts], 0.05

    monkeypatch.setattr(throughput, "run_level", fake_level)
    return calls


def two_point_preset(tmp_path: Path) -> presets.ThroughputPreset:
    scenarios = [
        {"name": "decode", "shapes": [{"input_tokens": 8, "output_tokens": 4}],
         "concurrency": [2], "num_requests": 2, "prefix_cached": True},
        {"name": "prefill", "shapes": [{"input_tokens": 8, "output_tokens": 4}],
         "concurrency": [2], "num_requests": 2},
    ]  # fmt: skip
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"scenarios": scenarios}))
    return presets.load_throughput_preset(str(tmp_path / "p.yaml"))


def test_a_prefix_cached_level_resends_its_warm_up_prompts_every_round(tmp_path, monkeypatch):
    calls = sent_prompts(monkeypatch)
    monkeypatch.setattr(throughput, "check_server", lambda *a: None)
    monkeypatch.setattr(throughput, "check_fits", lambda *a: None)
    preset = two_point_preset(tmp_path)
    throughput.run_throughput(
        preset, "http://x", "m", tmp_path / "t.json", throughput.Vocabulary(100, frozenset()),
        repeat=3, client="own",
    )  # fmt: skip
    decode = [prompts for label, prompts in calls if "decode" in label]
    prefill = [prompts for label, prompts in calls if label.startswith("throughput prefill c")]
    assert len(decode) == 4  # the warm-up and three rounds
    assert all(prompts == decode[0] for prompts in decode)
    assert len(prefill) == 3 and len({tuple(p) for p in prefill}) == 3
    prefill_warmup = [p for label, p in calls if label == "throughput prefill warm-up"]
    assert prefill_warmup and prefill_warmup[0] not in prefill
    levels = json.loads((tmp_path / "t.json").read_text())["scenarios"][0]["levels"]
    assert [lv["round"] for lv in levels] == [0, 1, 2]


def test_eval_ab_runs_every_round_on_one_server_per_arm(tmp_path, monkeypatch):
    sent_prompts(monkeypatch)
    monkeypatch.setattr(throughput, "check_fits", lambda *a: None)
    monkeypatch.setattr(ab, "check_presets_fit", lambda *a: None)
    config = tmp_path / "serve.yaml"
    config.write_text("max-model-len: 1024\n")
    launch = ab.ServerLaunch(
        model="m",
        command=f"{shlex.quote(sys.executable)} -c {shlex.quote(STAND_IN_SERVER)}",
        env={"STAND_IN_KV": "9000"},
        startup_timeout=60,
    )
    monkeypatch.setattr(
        throughput.Vocabulary, "from_tokenizer", classmethod(lambda cls, n: cls(100, frozenset()))
    )
    arms = [ab.Arm("stock", {}), ab.Arm("fp8-flashinfer", {})]
    result = ab.run_ab(
        arms, launch, config, [], two_point_preset(tmp_path), tmp_path / "out",
        repeat=1, client="own", server_rounds=3,
    )  # fmt: skip
    assert result["server_rounds"] == 3 and result["round_order"] == [["stock", "fp8-flashinfer"]]
    for record in result["arms"]:
        assert len(record["rounds"]) == 1  # one start
        for scenario in record["throughput"]["scenarios"]:
            assert [lv["round"] for lv in scenario["levels"]] == [0, 1, 2]
    repeats = served_ab.collect(result, "h200")
    assert repeats["arms"]["stock"]["kv_cache_tokens"] == [9000]


# The script's functions that build one served round's `eval ab` command.
SERVED_ROUND_FUNCTIONS = ("fp8kv_arm", "served_points", "served_order", "served_arm",
                          "stock_env", "check_rep", "ab_command", "served_round")  # fmt: skip


def sed_picks(*functions: str) -> str:
    """A sed script printing each named shell function of the served-A/B script."""
    return ";".join(f"/^{name}() {{/,/^}}/p" for name in functions)


def sourced(*functions: str, settings: bool = False) -> str:
    """Bash that defines these functions of the script (with settings, its SERVED_* lines too)
    under ``set -uo pipefail``; a test appends what it runs."""
    picks = sed_picks(*functions) + (";/^SERVED_[A-Z0-9_]*=/p" if settings else "")
    return f"set -uo pipefail; source <(sed -n '{picks}' {SCRIPT}); "


def test_the_script_serves_the_rotated_arms_with_three_rounds_and_the_fourth_arm(tmp_path):
    extra = tmp_path / "w.yaml"
    extra.write_text("quantization-config: {w8a8: true}\nserver-env: {K: V}\n")
    code = (
        f"{sourced(*SERVED_ROUND_FUNCTIONS, settings=True)}"
        "model=/m serve_config=c.yaml routing=R=1 stock=/stock-copy card=h200; "
        'served_round 2; echo "tag: $tag"; printf "%s\\n" "${ab_cmd[@]}"'
    )
    done = run_bash(
        code, PYTHONPATH=f"{SCRIPT.parent.parent}", W8A8_ARGS=str(extra), TMPDIR=str(tmp_path)
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "tag: served-rep2"
    argv = lines[1:]
    arms = [ab.parse_arm(argv[i + 1]) for i, word in enumerate(argv) if word == "--arm"]
    # The default arms (c) (e) (a), then (w), rotated by one place at REP 2.
    assert [arm.name for arm in arms] == ["stock", "bf16", "w8a8", "fp8-flashinfer"]
    envs = [argv[i + 1] for i, word in enumerate(argv) if word == "--arm-env"]
    assert "w8a8:K=V" in envs and any(e.startswith("stock:PYTHONPATH=/stock-copy") for e in envs)
    assert argv[argv.index("--server-rounds") + 1] == "3"
    assert argv[argv.index("--client") + 1] == "own"
    assert argv[argv.index("--repeat") + 1] == "1"
    w8a8 = next(arm for arm in arms if arm.name == "w8a8")
    assert w8a8.server_args["kv-cache-dtype"] == "fp8"
    assert w8a8.server_args["quantization-config"] == {"w8a8": True}
    preset = yaml.safe_load((tmp_path / "m3-rank-served-served-rep2.yaml").read_text())
    assert [s["name"] for s in preset["scenarios"]] == list(POINTS)
    # Without W8A8_ARGS: three arms; an unknown arm is refused.
    done = run_bash(
        code,
        PYTHONPATH=f"{SCRIPT.parent.parent}",
        SERVED_ARMS="stock fp8-flashinfer",
        TMPDIR=str(tmp_path),
    )
    arms = [line for line in done.stdout.splitlines() if line.startswith(("stock=", "fp8-"))]
    assert [a.split("=")[0] for a in arms] == ["fp8-flashinfer", "stock"]
    refused = run_bash(
        code, PYTHONPATH=f"{SCRIPT.parent.parent}", SERVED_ARMS="stock nope", TMPDIR=str(tmp_path)
    )
    assert refused.returncode == 2 and "no arm nope" in refused.stderr
    # Named in SERVED_ARMS, (w) runs in its place there, once.
    done = run_bash(
        code,
        PYTHONPATH=f"{SCRIPT.parent.parent}",
        SERVED_ARMS="stock w8a8 fp8-flashinfer",
        W8A8_ARGS=str(extra),
        TMPDIR=str(tmp_path),
    )
    argv = done.stdout.splitlines()
    arms = [ab.parse_arm(argv[i + 1]) for i, word in enumerate(argv) if word == "--arm"]
    assert [arm.name for arm in arms] == ["w8a8", "fp8-flashinfer", "stock"]


HUMMING_A8_ARM = SCRIPT.parent.parent / "evals" / "mxfp8-humming-a8-arm.yaml"


def test_the_humming_a8_arm_runs_beside_w8a8_each_with_its_own_environment(tmp_path):
    """HUMMING_A8_ARGS=FILE adds the arm humming-a8 after w8a8 (both over (c)'s arguments),
    each arm's server-env on that arm alone; alone it adds humming-a8 only; named in
    SERVED_ARMS without its file it is refused."""
    extra = tmp_path / "w.yaml"
    extra.write_text("quantization-config: {w8a8: true}\nserver-env: {K: V}\n")
    code = (
        f"{sourced(*SERVED_ROUND_FUNCTIONS, settings=True)}"
        "model=/m serve_config=c.yaml routing=R=1 stock=/stock-copy card=h200; "
        'served_round 2; printf "%s\\n" "${ab_cmd[@]}"'
    )
    root = f"{SCRIPT.parent.parent}"
    done = run_bash(
        code,
        PYTHONPATH=root,
        W8A8_ARGS=str(extra),
        HUMMING_A8_ARGS=str(HUMMING_A8_ARM),
        TMPDIR=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    argv = done.stdout.splitlines()
    arms = [ab.parse_arm(argv[i + 1]) for i, word in enumerate(argv) if word == "--arm"]
    # (c) (e) (a) (w) (h), rotated by one place at REP 2.
    assert [arm.name for arm in arms] == ["stock", "bf16", "w8a8", "humming-a8", "fp8-flashinfer"]
    envs = [argv[i + 1] for i, word in enumerate(argv) if word == "--arm-env"]
    by_name = {arm.name: arm for arm in ab.parse_arm_env(envs, arms)}
    value = yaml.safe_load(HUMMING_A8_ARM.read_text())["server-env"]
    assert by_name["humming-a8"].env == value
    assert by_name["w8a8"].env == {"K": "V"}
    assert by_name["fp8-flashinfer"].env == {}
    assert by_name["humming-a8"].server_args == by_name["fp8-flashinfer"].server_args
    assert by_name["w8a8"].server_args["quantization-config"] == {"w8a8": True}
    done = run_bash(
        code, PYTHONPATH=root, HUMMING_A8_ARGS=str(HUMMING_A8_ARM), TMPDIR=str(tmp_path)
    )
    argv = done.stdout.splitlines()
    named = [ab.parse_arm(argv[i + 1]).name for i, word in enumerate(argv) if word == "--arm"]
    assert named == ["stock", "bf16", "humming-a8", "fp8-flashinfer"]
    refused = run_bash(code, PYTHONPATH=root, SERVED_ARMS="stock humming-a8", TMPDIR=str(tmp_path))
    assert refused.returncode == 2
    assert "the humming-a8 arm needs HUMMING_A8_ARGS=FILE" in refused.stderr


def test_the_fourth_arm_takes_the_name_of_the_extra_arm_it_makes(capsys):
    """``--name humming-a8`` names the arm and its environment lines; a name that is no extra
    arm is refused; the script's extra arms are these names, each with its own letter."""
    base = 'fp8-flashinfer={"kv-cache-dtype": "fp8"}'
    argv = ["fourth-arm", str(HUMMING_A8_ARM), "--base", base]
    assert served_ab.main([*argv, "--name", "humming-a8"]) == 0
    arm_line, env_line = capsys.readouterr().out.splitlines()
    arm = ab.parse_arm(arm_line)
    assert arm.name == "humming-a8" and arm.server_args == {"kv-cache-dtype": "fp8"}
    assert env_line.startswith("humming-a8:VLLM_HUMMING_INPUT_QUANT_CONFIG=")
    with pytest.raises(SystemExit):
        served_ab.main([*argv, "--name", "nope"])
    script = SCRIPT.read_text()
    [table] = [line for line in script.splitlines() if line.startswith("SERVED_EXTRA_ARMS=")]
    pairs = table.partition("=")[2].strip('"').split()
    assert tuple(pair.partition(":")[0] for pair in pairs) == served_ab.EXTRA_ARMS
    assert set(served_ab.EXTRA_ARMS) <= set(served_ab.ARM_LETTERS)
    assert len(set(served_ab.ARM_LETTERS.values())) == len(served_ab.ARM_LETTERS)


def test_served_point_names_keep_the_card_order_and_refuse_a_point_the_card_lacks(tmp_path):
    code = sourced("served_points", settings=True)
    kept = run_bash(code + "served_points h100", SERVED_POINT_NAMES="mixed-c16 prefill-128k-c1")
    assert kept.returncode == 0, kept.stderr
    assert kept.stdout.split() == ["prefill-128k-c1", "mixed-c16"]
    every = run_bash(code + "served_points h100")
    assert every.stdout.split() == [*POINTS, "decode-32k-c64"]
    refused = run_bash(code + "served_points h200", SERVED_POINT_NAMES="decode-32k-c64")
    assert refused.returncode == 2 and "no point decode-32k-c64 on h200" in refused.stderr


FAKE_EVAL = """
import json, pathlib, sys
out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1])
record = json.loads(pathlib.Path(sys.argv[1]).read_text())
for arm in record["arms"]:
    log = out / arm["name"] / "round-1" / "server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(sys.argv[2] + "Loading 50%|##   | 1/2 [00:01<00:01, 1.00it/s]\\n")
    (out / arm["name"] / "serve.yaml").write_text("max-model-len: 1024\\n")
(out / "ab.json").write_text(json.dumps(record))
print("eval ab: done")
"""


def test_the_detached_phase_summarises_and_collects_a_compact_set(tmp_path):
    """served_detached with a stand-in eval ab: run.sh's quoting, summarise with the minutes
    and the machine's ledger, exit-status, and served_collect's files (at most eight, two
    folders under $OUT) with the server logs' progress bars dropped."""
    record = ab_record(
        {"stock": STOCK_ROUNDS, "fp8-flashinfer": C_ROUNDS}, ["stock", "fp8-flashinfer"]
    )
    (tmp_path / "ab.json").write_text(json.dumps(record))
    (tmp_path / "fake_eval.py").write_text(FAKE_EVAL)
    picks = sed_picks("served_detached", "served_collect", "ab_wait")
    out = tmp_path / "OUT" / "served-ab" / "mxfp8-ep"
    root = tmp_path / "m3ab"
    root.mkdir()
    code = (
        f"set -uo pipefail; source <(sed -n '{picks}' {SCRIPT}); "
        "sample_gpu() { :; }; sample_host() { :; }; "
        f"tag=served-rep1 card=h200 slice=mxfp8-ep served_out={out} out={out}; "
        "arm_names=(stock fp8-flashinfer); "
        f"ab_cmd=(python3 {tmp_path / 'fake_eval.py'} {tmp_path / 'ab.json'}"
        f" {shlex.quote(START_LOG)}); "
        "served_detached"
    )
    env = {"M3AB_ROOT": str(root), "WAIT_S": "0", "PYTHONPATH": str(SCRIPT.parent.parent)}
    done = run_bash(code, **env)
    assert done.returncode == 0, done.stderr
    assert "starts 461 s" in done.stdout  # the plan of two arms, printed at the start
    status = root / "served-rep1" / "exit-status"
    for _ in range(300):
        if status.exists():
            break
        time.sleep(0.1)
    assert status.read_text().strip() == "0", (root / "served-rep1" / "summary.log").read_text()
    assert (root / "served-started-mxfp8-ep").read_text().split() == ["stock", "fp8-flashinfer"]
    again = run_bash(f"source <(sed -n '{picks}' {SCRIPT}); ab_wait 0", **env)
    assert again.returncode == 0, again.stderr
    assert "finished: exit status 0" in again.stdout
    files = sorted(p.name for p in out.iterdir())
    assert files == [
        "exit-status", "log.txt", "logs.tar.gz", "repeats.json", "report.md", "starts.json",
        "summary.json",
    ]  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device_minutes"] is not None and summary["device_minutes"] < 5
    assert summary["arms"]["fp8-flashinfer"]["ttft_128k_ratio"] == pytest.approx(2500 / 5200)
    starts = json.loads((out / "starts.json").read_text())
    assert [s["phases"]["jit_warmup_s"] for s in starts] == [57.1, 57.1]
    with tarfile.open(out / "logs.tar.gz") as tar:
        members = {m.name.removeprefix("./") for m in tar.getmembers() if m.isfile()}
        log = tar.extractfile("./stock/server.log").read().decode()
    assert {"ab.json", "stock/server.log", "stock/serve.yaml", "run.sh"} <= members
    assert "it/s]" not in log and "JIT kernel warmup finished" in log
    # A second round of the same tag on this machine is refused.
    assert run_bash(code, **env).returncode == 2
    # eval ab exits 0 but a round is missing: exit-status says so (summarise's 1).
    record["arms"][0]["throughput"]["scenarios"][0]["levels"].pop()
    (tmp_path / "ab.json").write_text(json.dumps(record))
    assert run_bash(code.replace("served-rep1", "served-rep2"), **env).returncode == 0
    status = root / "served-rep2" / "exit-status"
    for _ in range(300):
        if status.exists():
            break
        time.sleep(0.1)
    assert status.read_text().strip() == "1"
    # The ledger now says both arms started before: the second run's starts are later ones.
    again = run_bash(f"source <(sed -n '{picks}' {SCRIPT}); ab_wait 0", **env)
    assert "finished: exit status 1" in again.stdout
    starts = json.loads((out / "starts.json").read_text())
    assert [s["start"] for s in starts] == ["later", "later"]


def test_the_served_phase_makes_and_checks_the_stock_copy_before_it_starts():
    text = SCRIPT.read_text()
    phase = text[text.index("    served-start)\n") : text.index("    served-wait)\n")]
    assert phase.index("served_round") < phase.index("stock_imported || exit 4")
    assert phase.index("stock_imported") < phase.index("served_detached")
    assert 'if [ "$phase" = lean-start ] || [ "$phase" = served-start ]; then' in text


def test_the_stock_arm_on_the_mxfp8_slice_asks_stock_vllm_only_what_it_knows():
    """The MXFP8 slice's checkpoint config, with the stock arm merged in: only stock vLLM
    0.34.0's EngineArgs and AttentionConfig fields, the index cache left at stock's default."""
    site = installed_vllm_site() / "vllm"
    stock_attention = dataclass_fields(site / "config" / "attention.py", "AttentionConfig")
    engine = dataclass_fields(site / "engine" / "arg_utils.py", "EngineArgs")
    [line] = script_output("fp8kv_arm stock").splitlines()
    config = ab.load_serve_config(
        SCRIPT.parent.parent / "evals" / "m3-tp8-rank-checkpoint-serve.yaml"
    )
    stock = ab.merge_server_args(config, ab.parse_arm(line).server_args)
    assert {key.replace("-", "_") for key in stock} <= engine
    assert "indexer_kv_dtype" not in stock.get("attention-config", {})
    assert set(stock.get("attention-config", {})) <= stock_attention
    assert "kv-cache-dtype" not in stock and "quantization" not in stock


def test_server_rounds_reach_eval_ab_and_a_bad_count_is_refused(tmp_path, capsys, monkeypatch):
    from vllm_minimax.cli import main

    seen = {}

    def fake_run_ab(*args, **kwargs):
        seen.update(kwargs)
        (tmp_path / "o").mkdir()
        (tmp_path / "o" / "report.md").write_text("report\n")
        return {"accuracy_passed": True}

    monkeypatch.setattr(ab, "run_ab", fake_run_ab)
    argv = ["eval", "ab", "--model", "m", "--no-accuracy", "--throughput-preset", "none"]
    argv += ["--arm", "a={}", "--arm", "b={}", "--repeat", "1", "--out", str(tmp_path / "o")]
    assert main([*argv, "--server-rounds", "3"]) == 0
    assert seen["server_rounds"] == 3 and seen["repeat"] == 1
    monkeypatch.undo()
    assert main([*argv, "--server-rounds", "0"]) == 2
    assert "--server-rounds must be 1 or more, got 0" in capsys.readouterr().err


def test_the_detached_served_round_takes_over_the_restore_of_the_vllm_tree(tmp_path):
    """gpu-env.sh restores the vLLM tree when the calling shell exits; a detached served round
    outlives that shell, so it clears the caller's record and runs the restore itself when it
    ends (else the caller would revert the series under the round's servers)."""
    record = ab_record({"stock": STOCK_ROUNDS}, ["stock"])
    (tmp_path / "ab.json").write_text(json.dumps(record))
    (tmp_path / "fake_eval.py").write_text(FAKE_EVAL)
    picks = sed_picks("served_detached", "ab_wait")
    root = tmp_path / "m3ab"
    root.mkdir()
    restore = tmp_path / "gpu-env-restore.rec"
    restore.write_text("")
    code = (
        f"set -uo pipefail; source <(sed -n '{picks}' {SCRIPT}); "
        "sample_gpu() { :; }; sample_host() { :; }; served_collect() { :; }; "
        f"gpu_env_restore_file={restore}; "
        f"tag=served-rep1 card=h200 slice=mxfp8-ep served_out={tmp_path} out={tmp_path}; "
        "arm_names=(stock); "
        f"ab_cmd=(python3 {tmp_path / 'fake_eval.py'} {tmp_path / 'ab.json'} x); "
        'served_detached; echo "caller-record=[$gpu_env_restore_file]"'
    )
    env = {"M3AB_ROOT": str(root), "WAIT_S": "0", "PYTHONPATH": str(SCRIPT.parent.parent)}
    done = run_bash(code, **env)
    assert done.returncode == 0, done.stderr
    assert "caller-record=[]" in done.stdout
    status = root / "served-rep1" / "exit-status"
    for _ in range(300):
        if status.exists():
            break
        time.sleep(0.1)
    run_sh = (root / "served-rep1" / "run.sh").read_text()
    assert "gpu_site_restore.py restore" in run_sh
    assert not restore.exists()
