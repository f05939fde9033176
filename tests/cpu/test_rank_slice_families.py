"""scripts/gpu-rank-slice's families phase (issue 62) without a GPU: its arms, and a shape
that benchmarks/step_profile accepts."""

from __future__ import annotations

import re
import shlex

import yaml
from test_fp8kv_ab import SCRIPT, run_bash

from benchmarks import step_profile
from vllm_minimax.evals import ab

REPO_ROOT = SCRIPT.parent.parent


def families_arms(*args: str):
    picks = "/^fp8kv_arm() {/,/^}/p;/^families_arms() {/,/^}/p"
    code = (
        f"set -uo pipefail; source <(sed -n '{picks}' {SCRIPT}); families_arms {shlex.join(args)}"
    )
    return run_bash(code)


def test_the_default_arms_are_the_w8a16_series_and_w8a8_named_by_slice():
    done = families_arms("mxfp8", "mxfp8-ep")
    assert done.returncode == 0, done.stderr
    arms = [ab.parse_arm(line) for line in done.stdout.splitlines()]
    assert [arm.name for arm in arms] == ["mxfp8-ep.fp8-flashinfer", "mxfp8-ep.w8a8"]
    series, w8a8 = (arm.server_args for arm in arms)
    assert series["kv-cache-dtype"] == "fp8"
    assert series["attention-config"] == {
        "minimax_m3_indexer_backend": "flashinfer",
        "minimax_m3_sparse_attention_backend": "flashinfer",
    }
    extra = yaml.safe_load((REPO_ROOT / "evals/mxfp8-w8a8-arm.yaml").read_text())
    assert w8a8 == {**series, **extra}
    assert "quantization-config" not in series


def test_an_arm_named_alone_and_a_tp_slice():
    done = families_arms("mxfp8", "mxfp8-tp", "fp8-flashinfer")
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    assert line.startswith("mxfp8-tp.fp8-flashinfer={")


def test_w8a8_on_fp8_online_weights_and_unknown_arms_are_refused():
    refused = families_arms("fp8-online", "fp8-online", "w8a8")
    assert refused.returncode == 2 and refused.stdout == ""
    assert "overrides an MXFP8 checkpoint's quantization" in refused.stderr
    unknown = families_arms("mxfp8", "mxfp8-ep", "fp8-flashinfer", "bogus")
    assert unknown.returncode == 2 and "no arm bogus" in unknown.stderr


def test_the_phases_shape_is_one_step_profile_accepts(tmp_path):
    """The shape array of the phase, as step_profile's --from-traces re-report parses it:
    an 8k chunk after a 32k prefix (one chunk a prompt) and 8 decodes of 32k."""
    text = SCRIPT.read_text()
    found = re.search(r"shape=\(([^)]*)\)", text)
    assert found is not None
    shape = shlex.split(found.group(1))
    traces = tmp_path / "traces"
    traces.mkdir()
    args = step_profile.parse_args(
        ["--from-traces", str(traces), "--out", str(tmp_path / "out"), "--sparse-layers", "57",
         "--arms", "mxfp8-ep.w8a8", *shape]
    )  # fmt: skip
    assert args.points == ["prefill", "decode"]
    assert (args.prefill_prefix, args.prefill_context) == (32768, 8192)
    assert (args.decode_batch, args.decode_context) == (8, 32768)
    assert step_profile.prompt_chunks(args, args.prefill_context) == 1
