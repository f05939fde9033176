"""Issue 41's A/B made ready without a GPU: scripts/gpu-rank-slice's arms, groups and round
orders, the stock arm's config against stock vLLM 0.34.0's own fields and its unpatched
copy, the H100 serve config, step_profile's arms and benchmarks.fp8kv_targets' table."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from patchset_helpers import REPO_ROOT, installed_vllm_site, real_series_paths

from benchmarks import ab_repeats, fp8kv_targets, step_profile
from vllm_minimax.evals import ab, presets

SCRIPT = REPO_ROOT / "scripts" / "gpu-rank-slice"
SERVE_CONFIGS = {
    card: REPO_ROOT / "evals" / f"{card}-m3-tp8-rank-serve.yaml" for card in ("h100", "h200")
}
KV_ARMS = ("bf16", "fp8-triton", "fp8-flashinfer")
SERIES_ONLY_KEYS = ("minimax_m3_indexer_backend", "minimax_m3_sparse_attention_backend")


def script_functions(*names: str) -> str:
    """Bash that defines the script's functions ``names`` (and its FP8KV_ variables)."""
    picks = ";".join(f"/^{name}() {{/,/^}}/p" for name in names)
    # The script's shell options: pipefail changes what a pipeline's status says.
    return f"set -uo pipefail; source <(sed -n '{picks};/^FP8KV_[A-Z_]*=/p' {SCRIPT}); "


def run_bash(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    return subprocess.run(
        ["bash", "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PATH": path, "PYTHONPATH": str(REPO_ROOT), **env},
        timeout=120,
    )


def script_output(code: str) -> str:
    done = run_bash(script_functions("fp8kv_arm", "fp8kv_order", "fp8kv_group") + code)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def arms() -> dict[str, ab.Arm]:
    lines = script_output("for a in bf16 fp8-triton fp8-flashinfer stock; do fp8kv_arm $a; done")
    parsed = [ab.parse_arm(line) for line in lines.splitlines()]
    return {arm.name: arm for arm in parsed}


def test_three_rounds_put_each_kv_arm_in_each_place():
    orders = [script_output(f"fp8kv_order {rep}").split() for rep in (1, 2, 3, 4)]
    assert orders[0] == list(KV_ARMS)
    assert orders[3] == orders[0]
    for arm in KV_ARMS:
        assert sorted(order.index(arm) for order in orders[:3]) == [0, 1, 2]
    assert all(sorted(order) == sorted(KV_ARMS) for order in orders)


def test_the_groups_cover_the_preset_once_with_the_targets_first():
    names = ("targets", "capacity", "decode", "long")
    groups = {name: script_output(f"fp8kv_group {name}").split() for name in names}
    preset = [scenario.name for scenario in presets.load_throughput_preset("m3-rank").scenarios]
    together = [point for points in groups.values() for point in points]
    assert sorted(together) == sorted(preset), "every point of m3-rank.yaml in one group"
    assert {"prefill-128k-c1", "prefill-64k-c1", "mixed-c16"} <= set(groups["targets"])
    # The capacity point fills the H100's KV cache: last in its group.
    assert groups["capacity"][-1] == "decode-32k-c64"
    assert run_bash(script_functions("fp8kv_group") + "fp8kv_group nope").returncode == 1
    stock = script_output("echo ${FP8KV_STOCK_POINTS[@]}").split()
    assert stock == list(fp8kv_targets.STOCK_POINTS)
    assert set(stock) <= set(preset)


def test_the_128k_prefill_fits_the_model_length_with_its_output():
    [scenario] = [
        s
        for s in presets.load_throughput_preset("m3-rank").scenarios
        if s.name == "prefill-128k-c1"
    ]
    [shape] = scenario.shapes
    assert shape.input_tokens >= 128 * 1024 and scenario.concurrency == [1]
    for path in SERVE_CONFIGS.values():
        limit = yaml.safe_load(path.read_text())["max-model-len"]
        assert shape.input_tokens + shape.output_tokens <= limit


def dataclass_fields(path: Path, class_name: str) -> set[str]:
    """The annotated fields of ``class_name`` in ``path``'s source (never imported)."""
    tree = ast.parse(path.read_text())
    [node] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    return {
        item.target.id
        for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    }


def series_attention_fields() -> set[str]:
    """The AttentionConfig fields the series adds (its diffs of vllm/config/attention.py)."""
    added = set()
    for patch in sorted((REPO_ROOT / "patches" / "vllm-0.34.0").glob("*.patch")):
        for diff in patch.read_text().split("diff --git ")[1:]:
            if diff.startswith("a/vllm/config/attention.py "):
                added |= set(re.findall(r"^\+    (\w+): ", diff, re.M))
    return added


@pytest.mark.parametrize("card", sorted(SERVE_CONFIGS))
def test_the_stock_arm_asks_stock_vllm_only_what_it_knows(arms, card):
    """Stock vLLM 0.34.0 (the installed, unpatched tree) refuses unknown attention keys: the
    stock arm's merged config must hold only its fields, and leave the index cache at its
    default; the KV-cache arms need the series' keys, pinned as issue 41 defines them."""
    site = installed_vllm_site() / "vllm"
    stock_attention = dataclass_fields(site / "config" / "attention.py", "AttentionConfig")
    engine = dataclass_fields(site / "engine" / "arg_utils.py", "EngineArgs")
    assert "indexer_kv_dtype" in stock_attention  # stock has it: bf16 for MiniMax M3 by default
    assert not set(SERIES_ONLY_KEYS) & stock_attention
    assert set(SERIES_ONLY_KEYS) <= series_attention_fields()
    config = ab.load_serve_config(SERVE_CONFIGS[card])
    merged = {name: ab.merge_server_args(config, arm.server_args) for name, arm in arms.items()}
    stock = merged["stock"]
    assert {key.replace("-", "_") for key in stock} <= engine
    assert "indexer_kv_dtype" not in stock.get("attention-config", {})
    assert set(stock.get("attention-config", {})) <= stock_attention
    assert "kv-cache-dtype" not in stock
    expected = {
        "bf16": ("auto", "triton"),
        "fp8-triton": ("fp8", "triton"),
        "fp8-flashinfer": ("fp8", "flashinfer"),
    }
    for name, (kv_dtype, attend) in expected.items():
        attention = merged[name]["attention-config"]
        assert merged[name].get("kv-cache-dtype", "auto") == kv_dtype, name
        assert attention["minimax_m3_sparse_attention_backend"] == attend, name
        assert attention["minimax_m3_indexer_backend"] == "flashinfer", name
        assert attention["indexer_kv_dtype"] == "fp8", name
        assert set(attention) <= stock_attention | series_attention_fields(), name


def test_the_h100_config_serves_what_the_h200_config_serves():
    h100, h200 = (yaml.safe_load(SERVE_CONFIGS[card].read_text()) for card in ("h100", "h200"))
    assert h100 == h200


def fake_site(root: Path) -> Path:
    """A site with the installed vLLM's files the series touches and its version file."""
    installed = installed_vllm_site()
    for relative in [*real_series_paths(), "vllm/_version.py"]:
        source = installed / relative
        if source.is_file():
            target = root / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    return root


def test_the_stock_copy_of_a_pristine_site_leaves_the_site_alone(tmp_path):
    """A fresh machine: the site has no series yet; it is copied as it is."""
    site = fake_site(tmp_path / "site")
    before = {path: path.read_bytes() for path in site.rglob("*") if path.is_file()}
    copy = tmp_path / "stock"
    done = run_bash(script_functions("stock_vllm") + f"stock_vllm {site} {copy}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("(series not applied, its files pristine)")
    assert {path: path.read_bytes() for path in site.rglob("*") if path.is_file()} == before
    assert (copy / "vllm" / "config" / "attention.py").read_bytes() == (
        site / "vllm" / "config" / "attention.py"
    ).read_bytes()


def test_the_stock_copy_is_unpatched_even_from_an_applied_site(tmp_path):
    """The script's stock_vllm on a site with the series applied (a warm machine): it reverts
    the site, copies it and checks the copy; a copy that is not pristine is refused."""
    site = fake_site(tmp_path / "site")
    applied = subprocess.run(
        [sys.executable, "-m", "vllm_minimax", "apply", "--target", str(site)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert applied.returncode == 0, applied.stderr
    copy = tmp_path / "stock"
    done = run_bash(script_functions("stock_vllm") + f"stock_vllm {site} {copy}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(f"{copy}/vllm (series not applied, its files pristine)")
    assert not (
        copy / "vllm" / "models" / "minimax_m3" / "nvidia" / "indexer_flashinfer.py"
    ).exists()
    # Edited after the copy was made: refused, with the status that says why.
    attention = copy / "vllm" / "config" / "attention.py"
    attention.write_text(attention.read_text() + "# edited\n")
    done = run_bash(script_functions("stock_vllm") + f"stock_vllm {site} {copy}")
    assert done.returncode == 4
    assert f"{copy} is not an unpatched vLLM" in done.stderr
    assert "edited      vllm/config/attention.py" in done.stderr


def test_step_profile_runs_the_arms_eval_ab_defines(tmp_path, monkeypatch, arms):
    """--arm NAME=JSON: merged into the serve config as eval ab merges it, each arm's
    definition passed to its engine's process; --arms defaults to the --arm names."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    texts = [f"{name}={json.dumps(arms[name].server_args)}" for name in ("bf16", "fp8-flashinfer")]
    argv = ["--model", str(model), "--out", str(tmp_path / "out"), "--points", "mixed"]
    argv += [f"--arm={text}" for text in texts]
    parsed = step_profile.parse_args(argv)
    assert parsed.arms == ["bf16", "fp8-flashinfer"]
    kwargs = step_profile.engine_kwargs(
        SERVE_CONFIGS["h100"],
        step_profile.arm_server_args("fp8-flashinfer", parsed.defined_arms),
        8192,
    )
    assert kwargs["kv_cache_dtype"] == "fp8"
    assert kwargs["attention_config"] == {
        "indexer_kv_dtype": "fp8",
        "minimax_m3_indexer_backend": "flashinfer",
        "minimax_m3_sparse_attention_backend": "flashinfer",
    }
    commands = []

    def fake_run(command, check):
        commands.append(command)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(step_profile.subprocess, "run", fake_run)
    assert step_profile.run_arms(parsed) == 0
    for (name, text), command in zip(
        (("bf16", texts[0]), ("fp8-flashinfer", texts[1])), commands, strict=True
    ):
        assert command[command.index("--run-arm") + 1] == name
        child = step_profile.parse_args(command[3:])
        assert child.run_arm == name
        assert step_profile.arm_server_args(name, child.defined_arms) == json.loads(
            text.split("=", 1)[1]
        )
    # An undefined name is refused before any engine; saved traces take any name.
    with pytest.raises(step_profile.UsageError, match="--arms takes distinct values"):
        step_profile.parse_args([*argv, "--arms", "bf16", "fp8-triton"])
    (tmp_path / "traces").mkdir()
    traces = ["--from-traces", str(tmp_path / "traces"), "--out", str(tmp_path / "o")]
    named = step_profile.parse_args([*traces, "--sparse-layers", "57", "--arms", "bf16", "x"])
    assert named.arms == ["bf16", "x"]


# --- benchmarks.fp8kv_targets ---------------------------------------------------------------


def level(round_index: int, tok_s: float, ttft: float, itl: float, running: float = 0) -> dict:
    record = {
        "concurrency": 1,
        "round": round_index,
        "output_tokens_per_s": tok_s,
        "ttft_ms": {"p50": ttft, "p99": ttft},
        "tpot_ms": {"p50": itl, "p99": itl},
        "itl_ms": {"p50": itl, "p99": itl},
        "prompt_seed": round_index,
    }
    if running:
        # The median below the max, as a level that ramps up has it: the row reads the max.
        record["running_requests"] = {"max": running, "median": running / 2, "waiting_max": 0}
    return record


def run(points: dict[str, dict[str, list[dict]]], kv: dict[str, int] | None = None) -> dict:
    """An ab.json: point -> arm -> levels."""
    arms: dict[str, dict] = {}
    for point, by_arm in points.items():
        for name, levels in by_arm.items():
            record = arms.setdefault(
                name,
                {"name": name, "rounds": [{"kv_cache_tokens": (kv or {}).get(name)}],
                 "throughput": {"scenarios": []}},
            )  # fmt: skip
            record["throughput"]["scenarios"].append({"name": point, "levels": levels})
    return {"arms": list(arms.values())}


def three(tok_s: tuple, ttft: tuple, itl: tuple, running: float = 0) -> list[dict]:
    return [level(r, tok_s[r], ttft[r], itl[r], running) for r in range(3)]


SAME = (1.0, 1.0, 1.0)


def main_runs() -> list[dict]:
    """Three rounds of a, b, c: c's TTFT at 128k is 0.52 of a's (met, <= 0.55), at 64k 0.70
    (missed, <= 0.65); mixed tok/s 1.40 (met, >= 1.3); ITL 0.98 at decode-32k-c8 (met) and
    1.02 at decode-8k-c1 (missed); decode-32k-c64 tok/s 1.20 (missed on the H100, >= 1.3);
    c/b tok/s 0.97 at mixed-c16 (missed)."""
    points = {
        "prefill-128k-c1": {
            "bf16": three(SAME, (1000.0, 1100.0, 900.0), SAME),
            "fp8-triton": three(SAME, (990.0, 990.0, 990.0), SAME),
            "fp8-flashinfer": three(SAME, (500.0, 520.0, 560.0), SAME),
        },
        "prefill-64k-c1": {
            "bf16": three(SAME, (100.0, 100.0, 100.0), SAME),
            "fp8-triton": three(SAME, (100.0, 100.0, 100.0), SAME),
            "fp8-flashinfer": three(SAME, (70.0, 70.0, 70.0), SAME),
        },
        "mixed-c16": {
            "bf16": three((100.0, 110.0, 90.0), SAME, SAME),
            "fp8-triton": three((144.3, 144.3, 144.3), SAME, SAME),
            "fp8-flashinfer": three((140.0, 150.0, 130.0), SAME, SAME),
        },
        "decode-32k-c8": {
            "bf16": three(SAME, SAME, (10.0, 10.0, 10.0)),
            "fp8-triton": three(SAME, SAME, (10.0, 10.0, 10.0)),
            "fp8-flashinfer": three(SAME, SAME, (9.8, 9.8, 9.8)),
        },
        "decode-8k-c1": {
            "bf16": three(SAME, SAME, (5.0, 5.0, 5.0)),
            "fp8-triton": three(SAME, SAME, (5.0, 5.0, 5.0)),
            "fp8-flashinfer": three(SAME, SAME, (5.1, 5.1, 5.1)),
        },
        "decode-32k-c64": {
            "bf16": three((100.0, 100.0, 100.0), SAME, SAME, running=18),
            "fp8-triton": three((100.0, 100.0, 100.0), SAME, SAME, running=30),
            "fp8-flashinfer": three((120.0, 120.0, 120.0), SAME, SAME, running=30),
        },
    }
    return [run(points, kv={"bf16": 610112, "fp8-flashinfer": 1023744})]


def stock_runs() -> list[dict]:
    """bf16 against stock at the stock points: bf16's TTFT here (200 ms) must not move
    (c)/(a) at prefill-64k-c1, which only the runs holding c give; (a)/(d) tok/s 1.1."""
    return [
        run(
            {
                "prefill-64k-c1": {
                    "bf16": three((11.0, 11.0, 11.0), (200.0, 200.0, 200.0), SAME),
                    "stock": three((10.0, 10.0, 10.0), (250.0, 250.0, 250.0), SAME),
                },
                "decode-32k-c8": {
                    "bf16": three((11.0, 11.0, 11.0), SAME, SAME),
                    "stock": three((10.0, 10.0, 10.0), SAME, SAME),
                },
            }
        )
    ]


def by_point(rows: list[dict]) -> dict[tuple[str, str], dict]:
    return {(row["metric"], row["point"]): row for row in rows}


def test_each_target_is_the_ratio_of_medians_in_its_direction():
    rows = by_point(fp8kv_targets.target_rows(main_runs() + stock_runs(), "h100"))
    prefill = rows["TTFT p50 ms", "prefill-128k-c1"]
    assert prefill["ratio"] == pytest.approx(520.0 / 1000.0)  # c over a, not a over c
    assert prefill["medians"] == {"fp8-flashinfer": 520.0, "bf16": 1000.0}
    assert (prefill["status"], prefill["target"], prefill["letters"]) == (
        "met",
        "at most 0.55",
        "(c)/(a)",
    )
    assert prefill["paired"]["n"] == 3
    assert prefill["paired"]["max"] == pytest.approx(560.0 / 900.0)
    # 0.70 is above 0.65: missed (a flipped direction would call it met). The stock run's
    # bf16 TTFT (200 ms) is not pooled in: the ratio is 70 / 100.
    assert rows["TTFT p50 ms", "prefill-64k-c1"]["ratio"] == pytest.approx(0.70)
    assert rows["TTFT p50 ms", "prefill-64k-c1"]["status"] == "missed"
    assert rows["tok/s", "mixed-c16"]["ratio"] == pytest.approx(1.40)
    assert rows["tok/s", "mixed-c16"]["status"] == "met"
    assert rows["ITL p50 ms", "decode-32k-c8"]["status"] == "met"
    assert rows["ITL p50 ms", "decode-8k-c1"]["ratio"] == pytest.approx(1.02)
    assert rows["ITL p50 ms", "decode-8k-c1"]["status"] == "missed"
    capacity = rows["tok/s", "decode-32k-c64"]
    assert (capacity["ratio"], capacity["status"]) == (pytest.approx(1.2), "missed")
    assert capacity["detail"] == "bf16 ran 18 at once; fp8-flashinfer ran 30 at once"
    never = rows["tok/s", "every point"]
    assert never["status"] == "missed" and never["letters"] == "(c)/(b)"
    assert never["ratio"] == pytest.approx(140.0 / 144.3)
    assert "below 1 at mixed-c16" in never["detail"]


def test_a_zero_denominator_is_not_measured_rather_than_a_crash():
    """An arm whose every level served nothing (0 tok/s) gives no ratio."""
    mixed = {
        "bf16": three((0.0, 0.0, 0.0), SAME, SAME),
        "fp8-flashinfer": three((140.0, 150.0, 130.0), SAME, SAME),
    }
    rows = by_point(fp8kv_targets.target_rows([run({"mixed-c16": mixed})], "h100"))
    assert rows["tok/s", "mixed-c16"]["status"] == "not measured"
    assert rows["tok/s", "mixed-c16"]["ratio"] is None


def test_rows_say_what_was_not_measured_and_what_is_not_a_target_on_the_h200():
    mixed = {
        "bf16": three((100.0, 100.0, 100.0), SAME, SAME),
        "fp8-flashinfer": three((140.0, 140.0, 140.0), SAME, SAME),
    }
    only_mixed = [run({"mixed-c16": mixed})]
    rows = by_point(fp8kv_targets.target_rows(only_mixed, "h200"))
    assert rows["TTFT p50 ms", "prefill-128k-c1"]["status"] == "not measured"
    assert rows["ITL p50 ms", "decode-*"]["status"] == "not measured"
    assert rows["tok/s", "decode-32k-c64"]["status"] == "not a target here"
    assert rows["tok/s", "every point"]["status"] == "not measured"
    assert rows["tok/s", "mixed-c16"]["status"] == "met"
    with pytest.raises(ValueError, match="gpu must be one of"):
        fp8kv_targets.target_rows(only_mixed, "a100")


def test_the_chain_to_stock_multiplies_the_two_measured_ratios():
    chain = {
        (row["point"], row["metric"]): row
        for row in fp8kv_targets.stock_chain(main_runs() + stock_runs())
    }
    tok = chain["decode-32k-c8", "tok/s"]
    assert tok["a/d"] == pytest.approx(1.1)
    assert tok["c/a"] == pytest.approx(1.0)
    ttft = chain["prefill-64k-c1", "TTFT p50 ms"]
    assert ttft["a/d"] == pytest.approx(200.0 / 250.0)
    assert ttft["c/a"] == pytest.approx(0.70)
    assert ttft["c/d"] == pytest.approx(0.8 * 0.7)
    assert chain["decode-32k-c8", "ITL p50 ms"]["c/d"] == pytest.approx(0.98)


def test_ab_repeats_writes_the_targets_into_both_files(tmp_path, capsys):
    for index, data in enumerate(main_runs() + stock_runs()):
        (tmp_path / f"run{index}").mkdir()
        (tmp_path / f"run{index}" / "ab.json").write_text(json.dumps(data))
    out = tmp_path / "out"
    argv = [str(tmp_path), "--out", str(out), "--arms", *KV_ARMS, "stock"]
    assert ab_repeats.main([*argv, "--targets", "fp8kv"]) == 2
    assert "--targets needs --gpu" in capsys.readouterr().err
    assert ab_repeats.main([*argv, "--targets", "fp8kv", "--gpu", "h100"]) == 0
    summary = json.loads((out / "repeats.json").read_text())
    assert summary["targets"]["gpu"] == "h100"
    assert summary["kv_cache_tokens"]["bf16"] == [610112]
    text = (out / "repeats.md").read_text()
    assert "## Issue 41's targets on the H100" in text
    assert "| TTFT p50 ms at most 0.55 | prefill-128k-c1 | (c)/(a) | 0.520 |" in text
    assert "| prefill-64k-c1 | TTFT p50 ms | 0.800 | 0.700 | 0.560 |" in text
    assert "KV cache per server (tokens, the server log's `KV cache size`): bf16 610,112" in text


def test_the_bytes_per_token_the_doc_and_the_h100_config_state_are_the_models():
    from vllm_minimax.memory_budget import Parallelism, kv_bytes_per_token

    rank = Parallelism(tensor_parallel_size=8)
    doc = (REPO_ROOT / "docs" / "fp8-kv-ab.md").read_text()
    config = SERVE_CONFIGS["h100"].read_text()
    for kv_dtype, index_dtype in (("auto", "fp8"), ("fp8", "fp8"), ("auto", "bf16")):
        figure = f"{kv_bytes_per_token(rank, kv_dtype, index_dtype):,}"
        assert figure in doc and f"{figure} bytes" in config, figure
