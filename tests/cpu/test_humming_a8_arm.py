"""evals/mxfp8-humming-a8-arm.yaml, issue 62's Humming fp8-input arm: its environment as the
served A/B hands it to that arm's server (benchmarks.served_ab fourth-arm, eval ab's --arm-env),
parsed by vLLM 0.34.0's own envs parser and followed through vLLM's and Humming's code with the
platform reporting an SM90 GPU (humming_a8_probe.py, forked from the session's probe host; no
kernel runs). The routed experts get e4m3 inputs with a dynamic scale per token; the MXFP8
linear layers keep bf16 inputs. Controls: the variable unset, with ``allow_fallback``, with
groups of 128, and with MXFP8-style groups of 32."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
from patchset_helpers import run_json_probe
from probe_host import ProbeHost

from benchmarks import served_ab
from vllm_minimax.evals import ab

REPO = Path(__file__).resolve().parents[2]
ARM = REPO / "evals" / "mxfp8-humming-a8-arm.yaml"
PROBE = Path(__file__).parent / "humming_a8_probe.py"
NAME = "humming-a8"
VARIABLE = "VLLM_HUMMING_INPUT_QUANT_CONFIG"
BASE = 'fp8-flashinfer={"kv-cache-dtype": "fp8"}'
CONTROLS = {
    "unset": "-",
    "fallback": '{"dtype": "float8e4m3", "quant_mode": "dynamic_token", "allow_fallback": true}',
    "group-128": '{"dtype": "float8e4m3", "group_size": 128}',
    "mxfp8-groups": '{"dtype": "float8e4m3", "group_size": 32, "scale_dtype": "float8e8m0"}',
}
PER_TOKEN_E4M3 = {"dtype": "float8e4m3", "group": 0, "scale_dtype": None, "mode": "dynamic_token"}
BF16 = {"dtype": None, "group": 0, "scale_dtype": None, "mode": None}


def arm_env() -> dict[str, str]:
    """The arm's server environment as eval ab sets it: fourth-arm's lines for the arm file,
    read back by eval ab's --arm-env parser."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = served_ab.main(["fourth-arm", str(ARM), "--base", BASE, "--name", NAME])
    assert status == 0
    arm_line, *env_lines = out.getvalue().splitlines()
    arm = ab.parse_arm(arm_line)
    [parsed] = ab.parse_arm_env(env_lines, [arm])
    return parsed.env


@pytest.fixture(scope="module")
def probed(vllm_probe_host: ProbeHost) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_HUMMING_")}
    report = run_json_probe(
        PROBE, *CONTROLS.values(), timeout=900, env=env | arm_env(), host=vllm_probe_host
    )
    controls = dict(zip(CONTROLS, report["values"], strict=True))
    return {"arm": report["as_set"], **controls, "checkpoint": report["humming_quantization"]}


def test_the_arm_sets_one_variable_and_no_serve_argument():
    """Only the environment differs from the arm it is merged over (fp8-flashinfer's)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert served_ab.main(["fourth-arm", str(ARM), "--base", BASE, "--name", NAME]) == 0
    arm_line, *env_lines = out.getvalue().splitlines()
    assert ab.parse_arm(arm_line).server_args == {"kv-cache-dtype": "fp8"}
    assert [line.partition("=")[0] for line in env_lines] == [f"{NAME}:{VARIABLE}"]


def test_vllms_parser_reads_the_value_into_keys_humming_reads(probed):
    """vLLM's envs parser gives a dict (JSON), every key of which vLLM or Humming's input
    schema reads (a misspelt key would be dropped and leave bf16 inputs)."""
    arm = probed["arm"]
    assert arm["value"] == arm_env()[VARIABLE]
    assert isinstance(arm["parsed"], dict)
    assert arm["parsed"] == json.loads(arm["value"])
    assert arm["moe"]["unread_keys"] == []


def test_the_routed_experts_get_e4m3_inputs_per_token_on_sm90(probed):
    """Both expert GEMMs of every MoE layer: the schema built from the variable allows no
    fallback, Humming keeps it for the MXFP8 weights on SM90 (vLLM reads it as fp8 dynamic
    per-token), and Humming's layer config runs it on WGMMA with float32 token scales beside
    the weights' groups of 32; the grouped GEMM the EP slice sets is still the one picked."""
    moe = probed["arm"]["moe"]
    assert moe["sublayers"] == ["w13", "w2"]
    assert moe["asked"] == moe["gets"] == PER_TOKEN_E4M3
    assert moe["allow_fallback"] is False
    assert moe["is_fp8_per_token"] is True
    assert moe["layer_config"] == {
        "a_dtype": "float8e4m3",
        "as_dtype": "float32",
        "mode": "dynamic_token",
        "mma": "WGMMA",
        "weight_group": 32,
    }
    assert probed["arm"]["grouped"] == ["HUMMING", "HummingGroupedExperts"]


def test_the_mxfp8_linear_layers_keep_bf16_inputs_with_the_arm_set(probed):
    """HummingMxfp8LinearKernel asks for MXFP8 inputs (e4m3, e8m0 per 32) whatever the
    variable says, with a fallback, and Humming gives group-scaled weights bf16 inputs below
    SM120: the same as with the variable unset."""
    linear = probed["arm"]["linear"]
    assert linear["kernel"] == "HummingMxfp8LinearKernel"
    assert linear["asked"] == {
        "dtype": "float8e4m3",
        "group": 32,
        "scale_dtype": "float8e8m0",
        "mode": "dynamic_group",
    }
    assert linear["allow_fallback"] is True
    assert linear["gets"] == BF16 and linear["layer_config"]["mode"] == "none"
    assert linear == probed["unset"]["linear"]


def test_the_controls_leave_bf16_inputs_or_refuse(probed):
    """Unset, the experts take bf16 inputs; ``allow_fallback: true`` hands them back to bf16
    (Humming's preference for group-scaled weights); groups of 128 are refused at load (they
    must equal the weights' 32); MXFP8-style groups of 32 pass the schema check (whether the
    SM90 kernel builds them is for a GPU to say)."""
    for name in ("unset", "fallback"):
        moe = probed[name]["moe"]
        assert moe["gets"] == BF16 and moe["layer_config"]["a_dtype"] == "bfloat16", name
        assert not moe["is_fp8_per_token"]
    assert probed["unset"]["parsed"] is None
    assert "No compatible Humming input schema" in probed["group-128"]["moe"]["refused"]
    groups = probed["mxfp8-groups"]["moe"]
    assert groups["gets"]["group"] == 32 and groups["layer_config"]["as_dtype"] == "float8e8m0"
    assert groups["layer_config"]["mode"] == "dynamic_group"


def test_humming_quantization_does_not_take_the_mxfp8_checkpoint(probed):
    """The other reader of the variable, ``--quantization humming`` (HummingConfig), which
    would pass it to the linear layers too, has no weight schema for the MiniMax checkpoint's
    ``quant_method: mxfp8``."""
    assert probed["checkpoint"]["refused"] == "unsupported weight quant_method: mxfp8"
