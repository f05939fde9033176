"""`make-tiny-model --geometry m3-tpN-rank --weights ... --experts ...`: the rank slice in the
weight layouts Hopper users serve (MXFP8, BF16, today's online fp8) and with whole experts
(expert parallelism) beside today's TP-sharded ones; what vLLM 0.34.0 makes of each, read on
this CPU host by rank_weights_probe.py (the quantization config its ModelConfig resolves, and
the MXFP8 MoE backend its oracle picks on an SM90 device)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from patchset_helpers import run_json_probe

from vllm_minimax import cli
from vllm_minimax.m3_geometry import parameter_counts
from vllm_minimax.memory_budget import Parallelism, parameters_per_gpu
from vllm_minimax.tiny_model import MXFP8_QUANTIZATION_CONFIG

PROBE = Path(__file__).parent / "rank_weights_probe.py"
REPO = Path(__file__).resolve().parents[2]
SLICES = {
    "mxfp8-ep": ["--weights", "mxfp8", "--experts", "ep"],
    "bf16-ep": ["--weights", "bf16", "--experts", "ep"],
    "today": [],
}
GPU_SCRIPT = REPO / "scripts" / "gpu-rank-slice"
SLICE_SERVE_CONFIG = REPO / "evals" / "m3-tp8-rank-checkpoint-serve.yaml"


@pytest.fixture(scope="module")
def slices(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rank-layouts")
    for name, options in SLICES.items():
        argv = ["make-tiny-model", str(root / name), "--geometry", "m3-tp8-rank", *options]
        assert cli.main(argv) == 0
    return {name: root / name for name in SLICES}


@pytest.fixture(scope="module")
def probed(slices, vllm_probe_host) -> dict:
    paths = [str(path) for path in slices.values()]
    report = run_json_probe(PROBE, *paths, timeout=900, host=vllm_probe_host)
    return {name: report[str(path)] for name, path in slices.items()} | {
        "deployed": report["deployed-ep8-rank"]
    }


def _config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def test_mxfp8_slice_takes_the_mxfp8_checkpoints_path(slices, probed):
    """config.json's quantization config is what vLLM 0.34.0 reads from a MiniMax MXFP8
    checkpoint (quant_method mxfp8, ignored_layers); its ModelConfig resolves ``mxfp8`` to
    ModelOpt's MXFP8 config, with MXFP8 routed experts (e4m3, u8 scales per 32)."""
    assert _config(slices["mxfp8-ep"])["quantization_config"] == MXFP8_QUANTIZATION_CONFIG
    report = probed["mxfp8-ep"]
    assert report["quantization"] == "mxfp8"
    assert report["config_class"] == "ModelOptMxFp8Config"
    assert report["excluded"] == ["lm_head"]
    assert "f8e4m3fn" in report["routed_expert_weights"]
    assert "col=32" in report["routed_expert_weights"]


@pytest.mark.parametrize("name", ["bf16-ep", "today"])
def test_other_layouts_carry_no_quantization_config(slices, probed, name):
    """BF16 is served as is; online fp8 comes from the serve config (``quantization: fp8``)."""
    assert "quantization_config" not in _config(slices[name])
    assert probed[name]["quantization"] is None


def test_expert_parallel_slice_holds_16_whole_experts(slices):
    config = _config(slices["mxfp8-ep"])
    assert (config["num_local_experts"], config["intermediate_size"]) == (16, 3072)
    assert config["num_experts_per_tok"] == 1
    today = _config(slices["today"])
    assert (today["num_local_experts"], today["intermediate_size"]) == (128, 384)
    assert today["num_experts_per_tok"] == 4


def test_expert_parallel_slice_is_the_ep_rank_plus_a_full_width_shared_expert(slices):
    """The slice holds an EP-8 rank's parameters (memory_budget) except the shared expert,
    which vLLM builds from intermediate_size at full width (3072, not 3072 / 8)."""
    counts = parameter_counts(_config(slices["mxfp8-ep"]))
    rank = parameters_per_gpu(Parallelism(8, enable_expert_parallel=True))
    linear = sum(rank[part] for part in ("attention", "dense_mlp", "shared_expert"))
    linear += rank["routed_experts"]
    assert counts["linear"] - linear == 57 * 3 * 6144 * (3072 - 384)
    assert counts["router"] == 57 * (16 * 6144 + 16)


def test_sm90_mxfp8_moe_is_humming_then_marlin(probed):
    """On an SM90 device vLLM 0.34.0 skips FlashInfer TRT-LLM and DeepGEMM (SM100 only), puts
    Humming ahead of Marlin, and falls back to Marlin without the humming package."""
    for report in (probed["mxfp8-ep"]["sm90_mxfp8_moe"], probed["deployed"]["sm90_mxfp8_moe"]):
        order = [verdict["backend"] for verdict in report["verdicts"]]
        assert order[:4] == ["FLASHINFER_TRTLLM", "DEEPGEMM", "HUMMING", "MARLIN"]
        assert all(
            "current device" in reason
            for verdict in report["verdicts"][:2]
            for reason in verdict["rejected"]
        )
        assert report["picked"][0] == "HUMMING"
        assert report["picked_without_humming"] == ["MARLIN", "MarlinExperts"]


def test_the_slice_needs_the_grouped_humming_gemm_of_an_ep_rank(probed):
    """A deployed EP rank runs Humming's grouped GEMM (vLLM picks it under expert
    parallelism); the slice, one GPU without EP, gets the indexed one unless
    VLLM_HUMMING_MOE_GEMM_TYPE=grouped, which the GPU script sets."""
    deployed = probed["deployed"]["sm90_mxfp8_moe"]["picked"]
    assert deployed == ["HUMMING", "HummingGroupedExperts"]
    assert probed["mxfp8-ep"]["sm90_mxfp8_moe"]["picked"] == ["HUMMING", "HummingIndexedExperts"]
    assert probed["mxfp8-ep"]["sm90_mxfp8_moe_grouped"]["picked"] == deployed
    script = GPU_SCRIPT.read_text()
    assert "ep) export VLLM_HUMMING_MOE_GEMM_TYPE=grouped ;;" in script
    assert '--server-env "VLLM_HUMMING_MOE_GEMM_TYPE=$VLLM_HUMMING_MOE_GEMM_TYPE"' in script


def test_the_checkpoint_layouts_serve_config_sets_no_quantization():
    """An MXFP8 slice whose serve config also said ``quantization: fp8`` would not start
    (vLLM refuses a quantization that differs from the checkpoint's)."""
    import yaml

    keys = yaml.safe_load(SLICE_SERVE_CONFIG.read_text())
    assert "quantization" not in keys
    assert keys["load-format"] == "dummy"


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--weights", "fp8-online"], "random-weight MiniMax M3 geometries take bf16 or mxfp8"),
        (["--experts", "ep"], "rank geometries"),
    ],
    ids=["weights", "experts"],
)
def test_layout_options_are_refused_for_the_tiny_model(tmp_path, capsys, extra, says):
    """The tiny model's weights are drawn, so they are bf16 or MXFP8 (`--weights mxfp8`,
    tests/cpu/test_w8a8.py), never left to an online quantization; experts are the rank
    slices' option."""
    target = tmp_path / "tiny"
    assert cli.main(["make-tiny-model", str(target), *extra]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert extra[0] in line and says in line
    assert not target.exists()


def test_sm90_mxfp8_linear_layers_are_humming_then_marlin(probed):
    """The MXFP8 linear layers (attention, dense MLP, shared expert) take Humming on SM90
    too (Humming moved ahead of Marlin), Marlin without the package: one staged wheel
    decides both the MoE's and the linear layers' kernels."""
    linear = probed["mxfp8-ep"]["sm90_mxfp8_linear"]
    assert linear == {
        "picked": "HummingMxfp8LinearKernel",
        "picked_without_humming": "MarlinMxfp8LinearKernel",
    }


def test_humming_runs_mxfp8_with_bf16_activations_on_sm90(probed):
    """On SM90 Humming keeps MXFP8 activations for neither part: the linear layers ask for
    e4m3 activations with e8m0 scales per 32 and fall back to the 16-bit dtype (Humming
    prefers 16-bit activations for group-scaled weights below SM120); the MoE asks for none
    (VLLM_HUMMING_INPUT_QUANT_CONFIG unset). Both are fp8-weight, bf16-activation GEMMs."""
    activations = probed["mxfp8-ep"]["sm90_humming_activations"]
    assert activations["linear"] == {"asked": "float8e4m3", "asked_group": 32, "gets": None}
    assert activations["moe"] == {"asked": None, "asked_group": 0, "gets": None}
