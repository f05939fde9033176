"""doctor's W8A8 row: a config whose quantization-config asks for the fp8_per_channel
requantization (patch 0008) gets one row, from the GPU's compute capability, the applied
series and (--model) the checkpoint's config.json, and doctor's exit status follows it.

The checkpoints are made here (`make-tiny-model --weights mxfp8` and its bf16 twin, and one
without config.json); the series state is the real series applied to a copy of the installed
vLLM, or a SeriesState of the test's choosing. vLLM's selection is stubbed as ready, so no
vLLM is imported; tests/cpu/patched_vllm/test_doctor_w8a8.py checks the MXFP8 reading
against vLLM's own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from patchset_helpers import REAL_PATCHES_ROOT, REAL_SERIES_DIR

from vllm_minimax import cli, doctor, patchset, selection, w8a8_doctor
from vllm_minimax.w8a8_doctor import REQUANTIZATION_FILE, Outcome

REPO = Path(__file__).resolve().parents[2]
W8A8_KEYS = "quantization-config:\n  linear: fp8_per_channel\n  moe: fp8_per_channel\n"
BASE_KEYS = (
    "tensor-parallel-size: 8\nblock-size: 128\n"
    "attention-config:\n  indexer_kv_dtype: fp8\n  minimax_m3_indexer_backend: auto\n"
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The tiny MiniMax M3 in MXFP8 and in bf16 (same draw), and the bf16 one less its
    config.json."""
    root = tmp_path_factory.mktemp("w8a8-checkpoints")
    for name in ("mxfp8", "bf16"):
        assert cli.main(["make-tiny-model", str(root / name), "--weights", name]) == 0
    shutil.copytree(root / "bf16", root / "no-config")
    (root / "no-config" / "config.json").unlink()
    return {name: root / name for name in ("mxfp8", "bf16", "no-config")}


def applied_state(series_dir: Path = REAL_SERIES_DIR) -> patchset.SeriesState:
    """A clean state of the series in ``series_dir``: every file it touches as applied."""
    files = [
        (path, "as-applied") for path in patchset.touched_paths(patchset.read_series(series_dir))
    ]
    return patchset.SeriesState(
        Path("/x"), "0.34.0", series_dir, True, files, recorded_series="vllm-0.34.0"
    )


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch):
    """No GPU, a working FlashInfer, vLLM's selection stubbed as ready (FlashInfer on both
    rows), and a series state of the test's choosing (the real series' files, as applied,
    unless told)."""
    ready = [
        selection.Row("indexer", "FlashInfer", "stub", selection.Outcome.READY),
        selection.Row("sparse attention", "Triton", "stub", selection.Outcome.READY),
    ]
    monkeypatch.setattr(doctor, "gpu_line", lambda: ("none", None))
    monkeypatch.setattr(doctor, "flashinfer_line", lambda: "0.7.4; " + doctor.HEALTHY_FLASHINFER)
    monkeypatch.setattr(doctor, "select", lambda *args: ready)
    monkeypatch.setattr(patchset, "format_status", lambda state: "state:        (test)")

    def set_state(state: patchset.SeriesState) -> None:
        monkeypatch.setattr(patchset, "series_state", lambda target=None: state)

    set_state(applied_state())
    return set_state


def serve_config(tmp_path: Path, extra: str = W8A8_KEYS, name: str = "serve.yaml") -> Path:
    path = tmp_path / name
    path.write_text(BASE_KEYS + extra)
    return path


def run_doctor(capsys, *argv: str) -> tuple[int, str, list[str]]:
    code = cli.main(["doctor", *argv])
    out = capsys.readouterr().out
    return code, out, [line for line in out.splitlines() if line.startswith("W8A8:")]


def test_mxfp8_checkpoint_on_sm90_runs(machine, checkpoints, tmp_path, capsys) -> None:
    config = serve_config(tmp_path)
    argv = ("--config", str(config), "--capability", "9.0", "--model", str(checkpoints["mxfp8"]))
    code, out, rows = run_doctor(capsys, *argv)
    assert code == doctor.EXIT_READY, out
    [row] = rows
    assert row.startswith("W8A8:         runs: quantization-config linear=fp8_per_channel,")
    assert "(SM 9.0) has FP8 tensor cores" in row
    assert "carries patch 0008" in row
    assert f"{checkpoints['mxfp8']} declares MXFP8" in row


def test_bf16_checkpoint_with_the_key_exits_3(machine, checkpoints, tmp_path, capsys) -> None:
    """vLLM builds no quantization method for a bf16 checkpoint: the key is never read, and
    the engine starts serving bf16, a fall-back, not a stop."""
    config = serve_config(tmp_path)
    argv = ("--config", str(config), "--capability", "9.0", "--model", str(checkpoints["bf16"]))
    code, out, [row] = run_doctor(capsys, *argv)
    assert code == doctor.EXIT_FALLBACK == 3, out
    assert row.startswith("W8A8:         has no effect:")
    assert "declares no quantization (bf16)" in row and "the key is ignored" in row
    assert "serves without the W8A8 requantization" in out


def test_no_config_json_is_cannot_check_not_a_pass(machine, checkpoints, tmp_path, capsys) -> None:
    config = serve_config(tmp_path)
    model = checkpoints["no-config"]
    argv = ("--config", str(config), "--capability", "9.0", "--model", str(model))
    code, out, [row] = run_doctor(capsys, *argv)
    assert code == doctor.EXIT_CANNOT_CHECK == 4, out
    assert row.startswith("W8A8:         cannot check:")
    assert f"{model / 'config.json'} does not exist" in row
    # Nor is a checkpoint that is not here.
    gone = ("--config", str(config), "--capability", "9.0", "--model", "NoOrg/NoSuchModel")
    code, out, [row] = run_doctor(capsys, *gone)
    assert code == doctor.EXIT_CANNOT_CHECK and "nothing is downloaded" in row


@pytest.mark.parametrize(
    ("capability", "runs"),
    [("7.5", False), ("8.0", False), ("8.6", False), ("8.9", True), ("9.0", True), ("12.0", True)],
)
def test_fp8_tensor_cores_from_sm89(
    machine, checkpoints, tmp_path, capsys, capability: str, runs: bool
) -> None:
    config = serve_config(tmp_path)
    argv = ("--config", str(config), "--capability", capability)
    code, out, [row] = run_doctor(capsys, *argv, "--model", str(checkpoints["mxfp8"]))
    if runs:
        assert code == doctor.EXIT_READY, out
        assert f"(SM {capability}) has FP8 tensor cores" in row
    else:
        assert code == doctor.EXIT_FAILS, out
        assert f"SM {capability}, without FP8 tensor cores" in row


def test_the_gpu_doctor_found_is_the_one_checked(
    machine, checkpoints, tmp_path, capsys, monkeypatch
) -> None:
    """Without --capability, the row reads the capability of doctor's own GPU line."""
    config = serve_config(tmp_path)
    model = ("--model", str(checkpoints["mxfp8"]))
    for capability, expected in (((8, 0), doctor.EXIT_FAILS), ((9, 0), doctor.EXIT_READY)):
        monkeypatch.setattr(doctor, "gpu_line", lambda c=capability: ("a GPU (test)", c))
        code, out, [row] = run_doctor(capsys, "--config", str(config), *model)
        assert code == expected, out
        assert "this GPU" in row


def test_no_gpu_and_no_capability_still_names_the_checkpoint(
    machine, checkpoints, tmp_path, capsys
) -> None:
    config = serve_config(tmp_path)
    for model, expected in (("mxfp8", doctor.EXIT_CANNOT_CHECK), ("bf16", doctor.EXIT_FALLBACK)):
        argv = ("--config", str(config), "--model", str(checkpoints[model]))
        code, out, [row] = run_doctor(capsys, *argv)
        assert code == expected, out
        assert "no GPU here and no --capability" in row


def test_without_model_the_row_says_how_to_check_the_checkpoint(machine, tmp_path, capsys):
    code, out, [row] = run_doctor(
        capsys, "--config", str(serve_config(tmp_path)), "--capability", "9.0"
    )
    assert code == doctor.EXIT_READY, out
    assert row.startswith("W8A8:         runs:") and row.endswith("to check that it is MXFP8")


def test_a_config_without_the_key_has_no_row(machine, checkpoints, tmp_path, capsys) -> None:
    """As the checkpoint row is absent without --model: nothing asked, nothing said."""
    config = serve_config(tmp_path, extra="")
    argv = ("--config", str(config), "--capability", "9.0", "--model", str(checkpoints["bf16"]))
    code, out, rows = run_doctor(capsys, *argv)
    assert code == doctor.EXIT_READY and rows == [], out
    # No --config: the shipped settings, which set no quantization-config.
    code, out, rows = run_doctor(capsys, "--capability", "9.0", "--model", str(checkpoints["bf16"]))
    assert code == doctor.EXIT_READY and rows == [], out


def test_another_quantization_config_is_not_checked(machine, tmp_path, capsys) -> None:
    config = serve_config(tmp_path, extra="quantization-config:\n  linear: fp8_per_tensor\n")
    code, out, [row] = run_doctor(capsys, "--config", str(config), "--capability", "9.0")
    assert code == doctor.EXIT_READY, out
    assert "not the W8A8 requantization" in row and "linear=fp8_per_tensor" in row


def test_the_key_as_json_text_and_a_bad_value(machine, checkpoints, tmp_path, capsys) -> None:
    """vllm serve takes the mapping as JSON text too; text that is no JSON is bad usage."""
    text = json.dumps({"moe": "fp8_per_channel"})
    config = serve_config(tmp_path, extra=f"quantization-config: '{text}'\n")
    argv = ("--config", str(config), "--capability", "9.0", "--model", str(checkpoints["mxfp8"]))
    code, out, [row] = run_doctor(capsys, *argv)
    assert code == doctor.EXIT_READY and "quantization-config moe=fp8_per_channel:" in row, out
    bad = serve_config(tmp_path, extra="quantization-config: '{linear'\n", name="bad.yaml")
    assert cli.main(["doctor", "--config", str(bad), "--capability", "9.0"]) == doctor.EXIT_USAGE
    assert "quantization-config is not JSON" in capsys.readouterr().err


def test_moe_backend_humming_is_refused(machine, checkpoints, tmp_path, capsys) -> None:
    config = serve_config(tmp_path, extra=W8A8_KEYS + "moe-backend: humming\n")
    argv = ("--config", str(config), "--capability", "9.0", "--model", str(checkpoints["mxfp8"]))
    code, out, [row] = run_doctor(capsys, *argv)
    assert code == doctor.EXIT_FAILS and "moe-backend humming" in row, out
    linear_only = serve_config(
        tmp_path, extra="quantization-config:\n  linear: fp8_per_channel\nmoe-backend: humming\n"
    )
    code, out, _ = run_doctor(capsys, "--config", str(linear_only), "--capability", "9.0")
    assert code == doctor.EXIT_READY, out  # the MoE is not requantized: its backend is its own


def test_a_series_without_the_requantization_is_refused(
    machine, checkpoints, tmp_path, capsys
) -> None:
    """A clean series (VLLM_MINIMAX_PATCHES, say) whose patches create no pow2_requant.py."""
    series = tmp_path / "vllm-0.34.0"
    series.mkdir()
    kept = [path for path in sorted(REAL_SERIES_DIR.glob("000[1-7]-*.patch"))]
    for path in kept:
        shutil.copy2(path, series / path.name)
    (series / "series").write_text("".join(f"{path.name}\n" for path in kept))
    machine(applied_state(series))
    config = serve_config(tmp_path)
    argv = ("--config", str(config), "--capability", "9.0", "--model", str(checkpoints["mxfp8"]))
    code, out, [row] = run_doctor(capsys, *argv)
    assert code == doctor.EXIT_FAILS, out
    assert f"has no patch creating {REQUANTIZATION_FILE}" in row


def test_the_real_series_applied_carries_the_requantization(small_target: Path) -> None:
    """The series state doctor reads from a copy of the installed vLLM, before and after
    `vllm-minimax apply`."""
    before = patchset.series_state(small_target)
    assert w8a8_doctor.series_finding(before)[0] is Outcome.CANNOT_CHECK
    assert cli.main(["apply", "--target", str(small_target)]) == 0
    after = patchset.series_state(small_target)
    outcome, text = w8a8_doctor.series_finding(after)
    assert outcome is Outcome.RUNS and "carries patch 0008" in text, text
    (small_target / REQUANTIZATION_FILE).write_text("# edited\n")
    edited = patchset.series_state(small_target)
    assert w8a8_doctor.series_finding(edited)[0] is Outcome.CANNOT_CHECK


@pytest.mark.parametrize("version", ["0.34.0", "0.33.0"])
def test_each_release_series_carries_the_requantization(version: str) -> None:
    state = applied_state(REAL_PATCHES_ROOT / f"vllm-{version}")
    assert (w8a8_doctor.requantization_patch(state) or "").startswith("0008-")
    assert w8a8_doctor.series_finding(state)[0] is Outcome.RUNS


def uncommented_w8a8_block(path: Path) -> str:
    """The commented `quantization-config:` block at the end of a shipped config, as YAML."""
    lines = path.read_text().splitlines()
    start = lines.index("# quantization-config:")
    block = [lines[start]]
    block += [line for line in lines[start + 1 :] if line.startswith("#   ")]
    return "\n".join(line.removeprefix("# ") for line in block) + "\n"


@pytest.mark.parametrize("name", ["h100-8x", "h200-8x"])
def test_the_shipped_configs_w8a8_block_is_the_row(
    machine, checkpoints, tmp_path, capsys, name: str
) -> None:
    shipped = REPO / "configs" / "serve" / f"{name}.yaml"
    code, out, rows = run_doctor(capsys, "--config", str(shipped), "--capability", "9.0")
    assert rows == [], out  # commented out: off by default
    config = tmp_path / f"{name}-w8a8.yaml"
    config.write_text(shipped.read_text() + uncommented_w8a8_block(shipped))
    argv = ("--config", str(config), "--capability", "9.0", "--model", str(checkpoints["mxfp8"]))
    code, out, [row] = run_doctor(capsys, *argv)
    assert row.startswith(
        "W8A8:         runs: quantization-config linear=fp8_per_channel, moe=fp8_per_channel:"
    ), out
    # The config's EAGLE3 draft is not here to be checked: exit 4, as without the block.
    assert code == doctor.EXIT_CANNOT_CHECK and "checkpoint:   cannot check" in out, out


@pytest.mark.parametrize(
    ("quantization", "mxfp8"),
    [
        ({"quant_method": "mxfp8", "ignored_layers": ["lm_head"]}, True),
        ({"quant_method": "MXFP8"}, True),
        ({"quant_method": "modelopt", "quantization": {"quant_algo": "MXFP8"}}, True),
        ({"quant_method": "modelopt", "quant_algo": "mxfp8"}, True),
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, False),
        ({"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}}, False),
        # vLLM reads quant_algo under `quantization` when that key is there, only.
        ({"quant_method": "modelopt", "quantization": [], "quant_algo": "MXFP8"}, False),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, False),
        ({"quant_method": "compressed-tensors", "format": "mxfp8-quantized"}, False),
        ({"quant_algo": "MXFP8"}, False),  # no modelopt method: vLLM does not read the algo
        (None, False),
    ],
)
def test_mxfp8_is_read_as_vllm_reads_it(quantization, mxfp8: bool) -> None:
    assert w8a8_doctor.is_mxfp8(quantization) is mxfp8


def test_the_quantization_config_is_found_where_vllm_looks(tmp_path: Path) -> None:
    """config.json's own, else hf_quant_config.json (older ModelOpt exports), else the text
    config's."""
    mxfp8 = {"quant_method": "modelopt", "quantization": {"quant_algo": "MXFP8"}}
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "minimax_m3"}))
    assert w8a8_doctor.declared_quantization(directory) is None
    (directory / "hf_quant_config.json").write_text(json.dumps(mxfp8))
    assert w8a8_doctor.declared_quantization(directory) == mxfp8
    (directory / "hf_quant_config.json").unlink()
    nested = {"model_type": "minimax_m3_vl", "text_config": {"quantization_config": mxfp8}}
    (directory / "config.json").write_text(json.dumps(nested))
    assert w8a8_doctor.declared_quantization(directory) == mxfp8
    own = {**nested, "quantization_config": {"quant_method": "fp8"}}
    (directory / "config.json").write_text(json.dumps(own))
    assert w8a8_doctor.declared_quantization(directory) == {"quant_method": "fp8"}
    assert w8a8_doctor.checkpoint_finding(str(directory))[0] is Outcome.REFUSED


def test_an_unreadable_config_json_is_cannot_check(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    outcome, text = w8a8_doctor.checkpoint_finding(str(tmp_path))
    assert outcome is Outcome.CANNOT_CHECK and "is no readable model config" in text
