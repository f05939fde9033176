"""Issue 53's lean A/B made ready without a GPU: scripts/gpu-rank-slice's arms, the lean
rounds' orders, points per card and the stock arm's environment, the stock arm's config
against stock vLLM 0.34.0's own fields and its unpatched copy, the H100 serve config,
step_profile's arms and benchmarks.fp8kv_targets' lean table."""

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
# Issue 53: (a), (c), (d) rotated by REP.
LEAN_ORDERS = {
    1: ["bf16", "fp8-flashinfer", "stock"],
    2: ["fp8-flashinfer", "stock", "bf16"],
    3: ["stock", "bf16", "fp8-flashinfer"],
}
SERIES_ONLY_KEYS = ("minimax_m3_indexer_backend", "minimax_m3_sparse_attention_backend")


def script_functions(*names: str) -> str:
    """Bash that defines the script's functions ``names`` (and its LEAN_ variables)."""
    picks = ";".join(f"/^{name}() {{/,/^}}/p" for name in names)
    # The script's shell options: pipefail changes what a pipeline's status says.
    return f"set -uo pipefail; source <(sed -n '{picks};/^LEAN_[A-Z0-9_]*=/p' {SCRIPT}); "


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
    done = run_bash(script_functions("fp8kv_arm", "lean_order", "lean_points") + code)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def arms() -> dict[str, ab.Arm]:
    lines = script_output("for a in bf16 fp8-triton fp8-flashinfer stock; do fp8kv_arm $a; done")
    parsed = [ab.parse_arm(line) for line in lines.splitlines()]
    return {arm.name: arm for arm in parsed}


def test_the_lean_rounds_rotate_a_c_d_so_each_arm_runs_in_each_place():
    orders = {rep: script_output(f"lean_order {rep}").split() for rep in (1, 2, 3, 4)}
    assert {rep: orders[rep] for rep in (1, 2, 3)} == LEAN_ORDERS
    assert orders[4] == orders[1]
    for arm in LEAN_ORDERS[1]:
        assert sorted(orders[rep].index(arm) for rep in (1, 2, 3)) == [0, 1, 2]


def test_the_lean_points_are_the_targets_points_and_the_capacity_point_on_the_h100_only():
    preset = [scenario.name for scenario in presets.load_throughput_preset("m3-rank").scenarios]
    h100 = script_output("lean_points h100").split()
    h200 = script_output("lean_points h200").split()
    assert h200 == ["prefill-128k-c1", "prefill-64k-c1", "decode-32k-c8", "mixed-c16"]
    # The capacity point fills every arm's cache on the H100: last, and only there.
    assert h100 == [*h200, "decode-32k-c64"]
    assert {"h100": tuple(h100), "h200": tuple(h200)} == fp8kv_targets.POINTS
    assert tuple(h200) == fp8kv_targets.LEAN_POINTS
    assert set(h100) <= set(preset)
    refused = run_bash(script_functions("lean_points") + "lean_points a100")
    assert refused.returncode == 2 and "no lean points for card a100" in refused.stderr


ROUND_FUNCTIONS = (
    "fp8kv_arm",
    "lean_order",
    "lean_points",
    "stock_env",
    "check_rep",
    "ab_command",
    "lean_round",
    "lean_fp8triton_round",
)


def round_command(call: str, card: str) -> tuple[str, list[str], list[ab.Arm]]:
    """The tag, the points and the arms (with their environments, as eval ab reads
    --arm-env) of the script's ``call`` on ``card``, the preset's writing stubbed."""
    code = (
        script_functions(*ROUND_FUNCTIONS)
        + 'select_scenarios() { shift; echo "points: $*"; }; '
        + f"model=/m serve_config=c.yaml routing=R=1 stock=/stock-copy card={card}; "
        + call
        + '; echo "tag: $tag"; printf "%s\\n" "${ab_cmd[@]}"'
    )
    done = run_bash(code, PYTHONPATH="/env-site")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("points: ") and lines[1].startswith("tag: ")
    argv = lines[2:]
    assert argv[:3] == ["python3", "-m", "vllm_minimax"]
    arms = [ab.parse_arm(argv[i + 1]) for i, word in enumerate(argv) if word == "--arm"]
    envs = [argv[i + 1] for i, word in enumerate(argv) if word == "--arm-env"]
    return lines[1][5:], lines[0][8:].split(), ab.parse_arm_env(envs, arms)


@pytest.mark.parametrize("card", ["h100", "h200"])
@pytest.mark.parametrize("rep", [1, 2, 3])
def test_a_lean_round_runs_a_c_d_rotated_and_only_stock_imports_the_unpatched_copy(rep, card):
    tag, points, arms = round_command(f"lean_round {rep}", card)
    assert tag == f"lean-rep{rep}"
    assert points == script_output(f"lean_points {card}").split()
    assert ("decode-32k-c64" in points) == (card == "h100")
    assert [arm.name for arm in arms] == LEAN_ORDERS[rep]
    for arm in arms:
        expected = {"PYTHONPATH": "/stock-copy:/env-site"} if arm.name == "stock" else {}
        assert dict(arm.env) == expected, arm.name


@pytest.mark.parametrize("card", ["h100", "h200"])
def test_the_fp8_triton_round_pairs_b_with_c_at_the_four_points_without_stock(card):
    orders = {1: ["fp8-triton", "fp8-flashinfer"], 2: ["fp8-flashinfer", "fp8-triton"]}
    for rep, order in orders.items():
        tag, points, arms = round_command(f"lean_fp8triton_round {rep}", card)
        assert tag == f"lean-fp8triton-rep{rep}"
        assert points == list(fp8kv_targets.LEAN_POINTS)
        assert [arm.name for arm in arms] == order
        assert all(not arm.env for arm in arms)


def test_the_stock_arm_is_checked_to_import_the_copy(tmp_path):
    copy = tmp_path / "stock"
    (copy / "vllm").mkdir(parents=True)
    (copy / "vllm" / "__init__.py").write_text("")
    check = script_functions("stock_imported") + f"stock={copy}; stock_imported"
    done = run_bash(check)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"stock arm imports {copy}/vllm/__init__.py"
    (copy / "vllm" / "__init__.py").unlink()
    (copy / "vllm").rmdir()
    done = run_bash(check)
    assert done.returncode == 4 and "the stock arm would import" in done.stderr
    # The phase makes the copy first, and checks the import before it starts the round.
    text = SCRIPT.read_text()
    assert (
        'if [ "$phase" = lean-start ] || [ "$phase" = served-start ]; then\n'
        '    stock_vllm "$site" "$stock"'
    ) in text
    phase = text[text.index("    lean-start)\n") : text.index("    lean-fp8triton-start)\n")]
    assert phase.index("lean_round") < phase.index("stock_imported || exit 4")
    assert phase.index("stock_imported") < phase.index("start_detached")


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


def lean_runs() -> list[dict]:
    """Three lean rounds of a, c, d on the H100. (c)/(d): TTFT 0.46 at 128k (met, <= 0.5),
    0.65 at 64k (missed, <= 0.6); mixed tok/s 1.6 (met, >= 1.5); ITL 0.96 at decode-32k-c8
    (met, <= 0.97); decode-32k-c64 tok/s 1.3 (missed, >= 1.4). (c)/(a): TTFT 0.767 and 0.929
    (met), mixed tok/s 0.970 (missed: lower), ITL 1.011 (missed: slower), capacity tok/s
    1.18 (met)."""
    points = {
        "prefill-128k-c1": {
            "bf16": three(SAME, (600.0, 600.0, 600.0), SAME),
            "fp8-flashinfer": three(SAME, (450.0, 460.0, 470.0), SAME),
            "stock": three(SAME, (1000.0, 1100.0, 900.0), SAME),
        },
        "prefill-64k-c1": {
            "bf16": three(SAME, (70.0, 70.0, 70.0), SAME),
            "fp8-flashinfer": three(SAME, (65.0, 65.0, 65.0), SAME),
            "stock": three(SAME, (100.0, 100.0, 100.0), SAME),
        },
        "mixed-c16": {
            "bf16": three((165.0, 165.0, 165.0), SAME, SAME),
            "fp8-flashinfer": three((160.0, 150.0, 170.0), SAME, SAME),
            "stock": three((100.0, 110.0, 90.0), SAME, SAME),
        },
        "decode-32k-c8": {
            "bf16": three(SAME, SAME, (9.5, 9.5, 9.5)),
            "fp8-flashinfer": three(SAME, SAME, (9.6, 9.6, 9.6)),
            "stock": three(SAME, SAME, (10.0, 10.0, 10.0)),
        },
        "decode-32k-c64": {
            "bf16": three((110.0, 110.0, 110.0), SAME, SAME, running=18),
            "fp8-flashinfer": three((130.0, 130.0, 130.0), SAME, SAME, running=30),
            "stock": three((100.0, 100.0, 100.0), SAME, SAME, running=16),
        },
    }
    return [run(points, kv={"bf16": 610112, "fp8-flashinfer": 1023744, "stock": 512000})]


def fp8_triton_runs() -> list[dict]:
    """The one round of (b) beside (c) at the four points. (c)/(b): TTFT 0.575 at 128k (met),
    66/60 = 1.1 at 64k (missed: slower), mixed tok/s 1.067 (met), ITL 1.0 at decode-32k-c8
    (met: equal is not slower). (c)'s 66 ms here must not move (c)/(d) at 64k."""
    points = {
        "prefill-128k-c1": {
            "fp8-triton": [level(0, 1.0, 800.0, 1.0)],
            "fp8-flashinfer": [level(0, 1.0, 460.0, 1.0)],
        },
        "prefill-64k-c1": {
            "fp8-triton": [level(0, 1.0, 60.0, 1.0)],
            "fp8-flashinfer": [level(0, 1.0, 66.0, 1.0)],
        },
        "mixed-c16": {
            "fp8-triton": [level(0, 150.0, 1.0, 1.0)],
            "fp8-flashinfer": [level(0, 160.0, 1.0, 1.0)],
        },
        "decode-32k-c8": {
            "fp8-triton": [level(0, 1.0, 1.0, 9.6)],
            "fp8-flashinfer": [level(0, 1.0, 1.0, 9.6)],
        },
    }
    return [run(points)]


def by_point(rows: list[dict]) -> dict[tuple[str, str, str], dict]:
    return {(row["letters"], row["metric"], row["point"]): row for row in rows}


def test_each_lean_target_is_c_over_stock_directly_in_its_direction():
    rows = by_point(fp8kv_targets.target_rows(lean_runs() + fp8_triton_runs(), "h100"))
    prefill = rows["(c)/(d)", "TTFT p50 ms", "prefill-128k-c1"]
    assert prefill["ratio"] == pytest.approx(460.0 / 1000.0)  # c over d, not d over c
    assert prefill["medians"] == {"fp8-flashinfer": 460.0, "stock": 1000.0}
    assert (prefill["status"], prefill["target"]) == ("met", "at most 0.5")
    assert prefill["paired"]["n"] == 3
    assert prefill["paired"]["max"] == pytest.approx(470.0 / 900.0)
    # 0.65 is above 0.6: missed (a flipped direction would call it met). The (b) round's
    # (c) at 66 ms is not pooled in: 65 / 100, not 65.5 / 100.
    ttft64 = rows["(c)/(d)", "TTFT p50 ms", "prefill-64k-c1"]
    assert (ttft64["ratio"], ttft64["status"]) == (pytest.approx(0.65), "missed")
    mixed = rows["(c)/(d)", "tok/s", "mixed-c16"]
    assert (mixed["ratio"], mixed["status"], mixed["target"]) == (
        pytest.approx(1.6),
        "met",
        "at least 1.5",
    )
    itl = rows["(c)/(d)", "ITL p50 ms", "decode-32k-c8"]
    assert (itl["ratio"], itl["status"], itl["target"]) == (
        pytest.approx(0.96),
        "met",
        "at most 0.97",
    )
    capacity = rows["(c)/(d)", "tok/s", "decode-32k-c64"]
    assert (capacity["ratio"], capacity["status"], capacity["target"]) == (
        pytest.approx(1.3),
        "missed",
        "at least 1.4",
    )
    assert capacity["detail"] == (
        "(c) ran 30 at once (median 15); (d) ran 16 at once (median 8);"
        " (a) ran 18 at once (median 9): different numbers at once, so capacity, not kernels"
    )
    # No chain: every (c)/(d) row is measured from runs holding both.
    assert not any(row["letters"] in ("(a)/(d)", "(c)/(a) x (a)/(d)") for row in rows.values())


def test_c_never_below_a_or_b_reads_each_points_metric_in_its_direction():
    rows = by_point(fp8kv_targets.target_rows(lean_runs() + fp8_triton_runs(), "h100"))
    versus_a = {point: row for (letters, _, point), row in rows.items() if letters == "(c)/(a)"}
    assert list(versus_a) == list(fp8kv_targets.POINTS["h100"])
    expected_a = {
        "prefill-128k-c1": ("TTFT p50 ms", 460.0 / 600.0, "at most 1", "met"),
        "prefill-64k-c1": ("TTFT p50 ms", 65.0 / 70.0, "at most 1", "met"),
        "decode-32k-c8": ("ITL p50 ms", 9.6 / 9.5, "at most 1", "missed"),  # slower
        "mixed-c16": ("tok/s", 160.0 / 165.0, "at least 1", "missed"),  # fewer tok/s
        "decode-32k-c64": ("tok/s", 130.0 / 110.0, "at least 1", "met"),
    }
    for point, (metric, ratio, target, status) in expected_a.items():
        row = versus_a[point]
        assert (row["metric"], row["target"], row["status"]) == (metric, target, status), point
        assert row["ratio"] == pytest.approx(ratio), point
    versus_b = {point: row for (letters, _, point), row in rows.items() if letters == "(c)/(b)"}
    assert list(versus_b) == list(fp8kv_targets.LEAN_POINTS)
    expected_b = {
        "prefill-128k-c1": (460.0 / 800.0, "met"),
        "prefill-64k-c1": (66.0 / 60.0, "missed"),
        "decode-32k-c8": (1.0, "met"),
        "mixed-c16": (160.0 / 150.0, "met"),
    }
    for point, (ratio, status) in expected_b.items():
        assert (versus_b[point]["ratio"], versus_b[point]["status"]) == (
            pytest.approx(ratio),
            status,
        ), point
        assert versus_b[point]["paired"]["n"] == 1


def test_a_zero_denominator_is_not_measured_rather_than_a_crash():
    """An arm whose every level served nothing (0 tok/s) gives no ratio."""
    mixed = {
        "stock": three((0.0, 0.0, 0.0), SAME, SAME),
        "fp8-flashinfer": three((140.0, 150.0, 130.0), SAME, SAME),
    }
    rows = by_point(fp8kv_targets.target_rows([run({"mixed-c16": mixed})], "h100"))
    assert rows["(c)/(d)", "tok/s", "mixed-c16"]["status"] == "not measured"
    assert rows["(c)/(d)", "tok/s", "mixed-c16"]["ratio"] is None


def test_rows_say_what_was_not_measured_and_what_is_not_a_target_on_the_h200():
    mixed = {
        "stock": three((100.0, 100.0, 100.0), SAME, SAME),
        "fp8-flashinfer": three((150.0, 150.0, 150.0), SAME, SAME),
    }
    only_mixed = [run({"mixed-c16": mixed})]
    rows = by_point(fp8kv_targets.target_rows(only_mixed, "h200"))
    assert rows["(c)/(d)", "TTFT p50 ms", "prefill-128k-c1"]["status"] == "not measured"
    assert rows["(c)/(d)", "ITL p50 ms", "decode-32k-c8"]["status"] == "not measured"
    assert rows["(c)/(d)", "tok/s", "mixed-c16"]["status"] == "met"
    capacity = rows["(c)/(d)", "tok/s", "decode-32k-c64"]
    assert capacity["status"] == "not a target here" and "detail" not in capacity
    # The H200's (c)/(a) rows are its four points; (b) never ran: not measured.
    assert [p for (letters, _, p) in rows if letters == "(c)/(a)"] == list(
        fp8kv_targets.LEAN_POINTS
    )
    assert {rows[k]["status"] for k in rows if k[0] in ("(c)/(a)", "(c)/(b)")} == {"not measured"}
    # On the H100, a capacity point no level recorded running counts for says so.
    h100 = by_point(fp8kv_targets.target_rows(only_mixed, "h100"))
    assert h100["(c)/(d)", "tok/s", "decode-32k-c64"]["status"] == "not measured"
    assert h100["(c)/(d)", "tok/s", "decode-32k-c64"]["detail"] == (
        "(c) running not recorded; (d) running not recorded; (a) running not recorded"
    )
    with pytest.raises(ValueError, match="gpu must be one of"):
        fp8kv_targets.target_rows(only_mixed, "a100")


def test_ab_repeats_writes_the_targets_into_both_files(tmp_path, capsys):
    for index, data in enumerate(lean_runs() + fp8_triton_runs()):
        (tmp_path / f"run{index}").mkdir()
        (tmp_path / f"run{index}" / "ab.json").write_text(json.dumps(data))
    out = tmp_path / "out"
    argv = [str(tmp_path), "--out", str(out), "--arms", "stock", "fp8-flashinfer", "bf16"]
    argv += ["fp8-triton"]
    assert ab_repeats.main([*argv, "--targets", "fp8kv"]) == 2
    assert "--targets needs --gpu" in capsys.readouterr().err
    assert ab_repeats.main([*argv, "--targets", "fp8kv", "--gpu", "h100"]) == 0
    summary = json.loads((out / "repeats.json").read_text())
    assert summary["targets"]["gpu"] == "h100"
    assert "stock_chain" not in summary["targets"]
    assert summary["kv_cache_tokens"]["stock"] == [512000]
    text = (out / "repeats.md").read_text()
    assert "## Issue 53's lean targets on the H100" in text
    assert "| TTFT p50 ms at most 0.5 | prefill-128k-c1 | (c)/(d) | 0.460 |" in text
    assert "| tok/s at least 1 | mixed-c16 | (c)/(a) | 0.970 |" in text
    assert "chain" not in text.lower()


def test_the_bytes_per_token_the_doc_and_the_h100_config_state_are_the_models():
    from vllm_minimax.memory_budget import Parallelism, kv_bytes_per_token

    rank = Parallelism(tensor_parallel_size=8)
    doc = (REPO_ROOT / "docs" / "fp8-kv-ab.md").read_text()
    config = SERVE_CONFIGS["h100"].read_text()
    for kv_dtype, index_dtype in (("auto", "fp8"), ("fp8", "fp8"), ("auto", "bf16")):
        figure = f"{kv_bytes_per_token(rank, kv_dtype, index_dtype):,}"
        assert figure in doc and f"{figure} bytes" in config, figure
