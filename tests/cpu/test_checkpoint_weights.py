"""doctor --model: the checkpoint row says whether the config's speculative draft has its
weights in the checkpoint, from an index written here (with and without the tensors), and
the exit status follows it. No vLLM, torch or FlashInfer is imported."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest

from vllm_minimax import checkpoint_weights, cli, doctor, patchset
from vllm_minimax.checkpoint_weights import Outcome, check

# A few of the published checkpoint's language-model names (the VL wrapper's prefix).
TARGET_NAMES = [
    "language_model.model.embed_tokens.weight",
    "language_model.lm_head.weight",
    "language_model.model.norm.weight",
    "language_model.model.layers.0.self_attn.q_proj.weight",
    "language_model.model.layers.3.block_sparse_moe.experts.7.w1.weight",
    "language_model.model.layers.3.self_attn.index_k_proj.weight",
]
MTP_SUFFIXES = [
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "final_layernorm.weight",
    "transformer_layer.self_attn.q_proj.weight",
    "transformer_layer.block_sparse_moe.experts.0.w1.weight",
]
EAGLE3_NAMES = [
    *(f"midlayer.{weight}" for weight in checkpoint_weights.EAGLE3_LAYER_WEIGHTS),
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    *checkpoint_weights.EAGLE3_HEAD_WEIGHTS,
]


def mtp_names(modules: int, prefix: str = "language_model.") -> list[str]:
    return [
        f"{prefix}model.mtp.layers.{module}.{suffix}"
        for module in range(modules)
        for suffix in MTP_SUFFIXES
    ]


def write_checkpoint(
    directory: Path, names: list[str], config: dict | None = None, shards: int = 3
) -> Path:
    """An index over ``names`` (shuffled, spread over ``shards`` files) and a config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    names = list(names)
    random.Random(len(names)).shuffle(names)
    weight_map = {
        name: f"model-{i % shards + 1:05d}-of-{shards:05d}.safetensors"
        for i, name in enumerate(names)
    }
    index = {"metadata": {"total_size": 1234}, "weight_map": weight_map}
    (directory / checkpoint_weights.INDEX_FILE).write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(config or {}))
    return directory


def m3_config(mtp_modules: int = 1, quantized: bool = False) -> dict:
    text = {"model_type": "minimax_m3_vl_text", "num_mtp_modules": mtp_modules}
    config = {"model_type": "minimax_m3_vl", "text_config": text}
    if quantized:
        config["quantization_config"] = {"quant_method": "mxfp8"}
    return config


MTP = {"method": "mtp", "num_speculative_tokens": 2}


def test_mtp_tensors_present_pass(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m", TARGET_NAMES + mtp_names(2), m3_config(2))
    row = check(MTP, str(model))
    assert row.outcome is Outcome.PRESENT and not row.stops_serve
    assert f"{2 * len(MTP_SUFFIXES)} model.mtp.layers" in row.text


def test_no_mtp_tensors_stops_serve(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m", TARGET_NAMES, m3_config(1))
    row = check(MTP, str(model))
    assert row.outcome is Outcome.ABSENT and row.stops_serve
    assert "Following weights were not initialized" in row.text


def test_a_quantized_checkpoint_says_it_starts_with_unloaded_modules(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m", TARGET_NAMES, m3_config(1, quantized=True))
    row = check(MTP, str(model))
    assert row.outcome is Outcome.ABSENT
    assert "quantized" in row.text and "never written" in row.text


def test_each_declared_module_must_be_there(tmp_path: Path) -> None:
    """config.json declares 3 modules, the index carries module 0 only."""
    model = write_checkpoint(tmp_path / "m", TARGET_NAMES + mtp_names(1), m3_config(3))
    row = check(MTP, str(model))
    assert row.outcome is Outcome.ABSENT and "model.mtp.layers.{1,2}" in row.text


def test_names_that_only_contain_mtp_elsewhere_do_not_count(tmp_path: Path) -> None:
    """vLLM keeps model.mtp.layers.* (less language_model.); other names with 'mtp' in them
    load nothing into the MTP modules."""
    decoys = ["vision_tower.model.mtp.layers.0.eh_proj.weight", "mtp.layers.0.eh_proj.weight"]
    model = write_checkpoint(tmp_path / "m", TARGET_NAMES + decoys, m3_config(1))
    assert check(MTP, str(model)).outcome is Outcome.ABSENT


def test_a_standalone_mtp_draft_is_read_from_its_model(tmp_path: Path) -> None:
    target = write_checkpoint(tmp_path / "target", TARGET_NAMES, m3_config(1))
    draft = write_checkpoint(
        tmp_path / "draft",
        [*mtp_names(1, prefix=""), "model.embed_tokens.weight", "lm_head.weight"],
        {"model_type": "minimax_m3_mtp", "num_mtp_modules": 1},
    )
    assert check(MTP, str(target)).outcome is Outcome.ABSENT
    assert check({**MTP, "model": str(draft)}, str(target)).outcome is Outcome.PRESENT


def test_a_single_safetensors_file_is_read_from_its_header(tmp_path: Path) -> None:
    """The tiny models have one model.safetensors and no index."""
    directory = tmp_path / "tiny"
    directory.mkdir()
    for names, expected in ((TARGET_NAMES, Outcome.ABSENT), (mtp_names(1), Outcome.PRESENT)):
        header = {name: {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]} for name in names}
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header).encode()
        (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0\0")
        assert check(MTP, str(directory)).outcome is expected


def test_no_index_is_cannot_check_not_a_pass(tmp_path: Path) -> None:
    directory = tmp_path / "empty"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(m3_config()))
    row = check(MTP, str(directory))
    assert row.outcome is Outcome.CANNOT_CHECK and not row.stops_serve


def test_a_hub_id_is_found_in_the_local_cache(tmp_path, monkeypatch) -> None:
    """HF_HUB_CACHE's models--ORG--NAME/refs/main names the snapshot; HF_HOME/hub also."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "nothing"))
    hub = tmp_path / "home" / "hub"
    repo = hub / "models--MiniMaxAI--MiniMax-M3-MXFP8"
    write_checkpoint(repo / "snapshots" / "abc123", TARGET_NAMES, m3_config(1, quantized=True))
    write_checkpoint(repo / "snapshots" / "old999", TARGET_NAMES + mtp_names(1), m3_config(1))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    model = "MiniMaxAI/MiniMax-M3-MXFP8"
    assert check(MTP, model).outcome is Outcome.CANNOT_CHECK
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    row = check(MTP, model)
    assert row.outcome is Outcome.ABSENT and "abc123" in row.text
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert check(MTP, model).outcome is Outcome.ABSENT
    (repo / "refs" / "main").write_text("old999")
    assert check(MTP, model).outcome is Outcome.PRESENT


def test_eagle3_draft_checked_in_its_own_index(tmp_path: Path) -> None:
    target = write_checkpoint(tmp_path / "target", TARGET_NAMES, m3_config(1))
    draft = write_checkpoint(tmp_path / "draft", EAGLE3_NAMES, {"model_type": "llama"})
    speculative = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    assert check(speculative, str(target)).outcome is Outcome.PRESENT
    broken = write_checkpoint(
        tmp_path / "broken", [n for n in EAGLE3_NAMES if n != "fc.weight"], {}
    )
    row = check({**speculative, "model": str(broken)}, str(target))
    assert row.outcome is Outcome.ABSENT and row.stops_serve and "fc.weight" in row.text
    assert "starts with these never written" in row.text  # vLLM does not check EAGLE3 drafts
    remote = {**speculative, "model": "Inferact/NoSuchDraftHere"}
    assert check(remote, str(target)).outcome is Outcome.CANNOT_CHECK


def test_no_speculative_config_has_nothing_to_check(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m", TARGET_NAMES, m3_config(1))
    assert check(None, str(model)).outcome is Outcome.NOTHING_TO_CHECK


@pytest.fixture
def cpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU, an applied series (doctor then exits 4 before any vLLM selection)."""
    files = [("vllm/config/attention.py", "as-applied")]
    state = patchset.SeriesState(Path("/x"), "0.34.0", Path("/s"), True, files)
    monkeypatch.setattr(patchset, "series_state", lambda target=None: state)
    monkeypatch.setattr(patchset, "format_status", lambda state: "state:        (test)")
    monkeypatch.setattr(doctor, "gpu_line", lambda: ("none", None))
    monkeypatch.setattr(doctor, "flashinfer_line", lambda: "0.7.4 (test)")


def serve_config(tmp_path: Path, speculative: dict) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(
        f"tensor-parallel-size: 8\nblock-size: 128\nspeculative-config: {json.dumps(speculative)}\n"
    )
    return path


def test_doctor_exits_5_without_the_mtp_tensors(tmp_path, cpu_machine, capsys) -> None:
    config = serve_config(tmp_path, MTP)
    without = write_checkpoint(tmp_path / "without", TARGET_NAMES, m3_config(1))
    code = cli.main(["doctor", "--config", str(config), "--model", str(without)])
    out = capsys.readouterr().out
    assert code == doctor.EXIT_FAILS == 5, out
    assert "checkpoint:   absent" in out
    with_mtp = write_checkpoint(tmp_path / "with", TARGET_NAMES + mtp_names(1), m3_config(1))
    code = cli.main(["doctor", "--config", str(config), "--model", str(with_mtp)])
    out = capsys.readouterr().out
    assert code == doctor.EXIT_CANNOT_CHECK, out  # no GPU here: the selection is unchecked
    assert "checkpoint:   present" in out


def test_an_unchecked_checkpoint_turns_ready_into_4() -> None:
    row = checkpoint_weights.CheckpointRow(Outcome.CANNOT_CHECK, "not here")
    assert doctor.with_checkpoint(doctor.EXIT_READY, "ok", row)[0] == doctor.EXIT_CANNOT_CHECK
    present = checkpoint_weights.CheckpointRow(Outcome.PRESENT, "here")
    assert doctor.with_checkpoint(doctor.EXIT_READY, "ok", present)[0] == doctor.EXIT_READY
    absent = checkpoint_weights.CheckpointRow(Outcome.ABSENT, "gone")
    assert doctor.with_checkpoint(doctor.EXIT_FALLBACK, "x", absent)[0] == doctor.EXIT_FAILS


def test_shipped_configs_checked_against_the_published_layout(tmp_path, cpu_machine, capsys):
    """Each shipped config with a speculative block, against a local copy of the published
    checkpoint's index (no mtp.* tensors) and the draft it names made local."""
    from vllm_minimax.serve_config import read_serve_options, shipped_config_groups

    serving, _ = shipped_config_groups()
    checked = 0
    for name, path in serving.items():
        speculative = checkpoint_weights.speculative_options(read_serve_options(path))
        if speculative is None:
            continue
        checked += 1
        target = write_checkpoint(tmp_path / name / "target", TARGET_NAMES, m3_config(1))
        row = check(speculative, str(target))
        assert not row.stops_serve or speculative.get("method") != "eagle3", (name, row)
        assert speculative.get("method") != "mtp", f"{name} still asks for method mtp"
    assert checked >= 2
