"""The W8A8 opt-in for MXFP8 checkpoints on Hopper, and the bound its tiny-model check applies.

vLLM 0.34.0 runs an MXFP8 checkpoint's linear layers and routed experts on SM90 with 16-bit
activations (Humming, W8A16). Patch 0008 of the series makes vLLM's own override of a
checkpoint's quantization, ``quantization_config`` (``--quantization-config`` /
``quantization-config:`` in a serve config / ``LLM(quantization_config=...)``) with
``fp8_per_channel`` for ``linear`` and ``moe``, requantize MXFP8 weights at load to per-channel
FP8 with power-of-two scales, run with per-token FP8 activations (W8A8). The serve-config keys
are in ``evals/mxfp8-w8a8-arm.yaml``; ``python -m vllm_minimax.w8a8 arm`` prints them as
``vllm-minimax eval ab``'s ``--arm NAME=JSON``.

The tiny-model check (``scripts/gpu-e2e w8a8``) serves the tiny MiniMax M3 in MXFP8 W8A16
(stock) and W8A8, and a control: W8A8 on the same checkpoint with each MoE layer's experts
rotated by one (a layout fault). :func:`verdict` compares their prompt logprobs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

ARM_NAME = "w8a8"
ARM_FILE = "mxfp8-w8a8-arm.yaml"
# vLLM's quantization_config as LLM(...) takes it (the arm file's, in Python).
W8A8_QUANTIZATION_CONFIG: dict[str, str] = {"linear": "fp8_per_channel", "moe": "fp8_per_channel"}
# Mean |prompt logprob difference| (nats, over every scored prompt token) that W8A8 may
# differ from W8A16 by on the tiny MXFP8 model, and that the control must exceed. Set from
# the CPU simulation of the three runs (python -m benchmarks.w8a8_tiny_sim, float32): W8A8
# 0.222 (the per-token e4m3 rounding of every projection's input, about what MXFP8's weight
# rounding costs: bf16 against W8A16 0.254), the rotated-experts control 1.468. 0.5 leaves
# W8A8 2.3x for the GPU's bf16 arithmetic and kernels and sits 2.9x below the control. Only
# gross faults (layout, scales applied wrongly, the wrong kernel) can fail it; a wrong
# rounding of the weights is the CPU tests' to catch.
MEAN_ABS_BOUND = 0.5


def arm_file() -> Path:
    from vllm_minimax.evals.presets import eval_configs_root

    return eval_configs_root() / ARM_FILE


def arm_settings(path: Path | None = None) -> dict[str, Any]:
    """The arm file's serve-config keys."""
    import yaml

    settings = yaml.safe_load((path or arm_file()).read_text())
    if not isinstance(settings, dict) or "quantization-config" not in settings:
        raise ValueError(f"{path or arm_file()}: no quantization-config mapping")
    return settings


def arm_argument(name: str = ARM_NAME, path: Path | None = None) -> str:
    """``NAME=JSON`` for ``vllm-minimax eval ab --arm``."""
    return f"{name}={json.dumps(arm_settings(path), sort_keys=True)}"


def logprob_differences(a: dict[str, Any], b: dict[str, Any]) -> list[float]:
    """|a - b| over every prompt token both runs scored (the first of each prompt has none)."""
    left, right = a["prompt_logprobs"], b["prompt_logprobs"]
    if len(left) != len(right):
        raise ValueError(f"{len(left)} prompts against {len(right)}")
    diffs: list[float] = []
    for index, (x, y) in enumerate(zip(left, right, strict=True)):
        if len(x) != len(y):
            raise ValueError(f"prompt {index}: {len(x)} tokens against {len(y)}")
        for p, q in zip(x, y, strict=True):
            if (p is None) != (q is None):
                raise ValueError(f"prompt {index}: one run scored a token the other did not")
            if p is None:
                continue
            if not (math.isfinite(p) and math.isfinite(q)):
                diffs.append(math.inf)
            else:
                diffs.append(abs(p - q))
    if not diffs:
        raise ValueError("no scored prompt tokens")
    return diffs


def pair_figures(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    diffs = sorted(logprob_differences(a, b))
    return {
        "tokens": len(diffs),
        "mean_abs": sum(diffs) / len(diffs),
        "p99_abs": diffs[min(len(diffs) - 1, int(0.99 * len(diffs)))],
        "max_abs": diffs[-1],
    }


def verdict(runs: dict[str, dict[str, Any]], bound: float = MEAN_ABS_BOUND) -> dict[str, Any]:
    """Pass when W8A8 is within ``bound`` of W8A16 and the control is not; figures of each
    pair (and of ``bf16`` against W8A16, for scale, when that run is there)."""
    for name in ("w8a16", "w8a8", "control"):
        if name not in runs:
            raise ValueError(f"no {name} run")
        if "error" in runs[name]:
            return {"passed": False, "reason": f"{name} run failed: {runs[name]['error']}"}
    pairs = {
        "w8a8_vs_w8a16": pair_figures(runs["w8a8"], runs["w8a16"]),
        "control_vs_w8a16": pair_figures(runs["control"], runs["w8a16"]),
    }
    if "bf16" in runs and "error" not in runs["bf16"]:
        pairs["bf16_vs_w8a16"] = pair_figures(runs["bf16"], runs["w8a16"])
    within = pairs["w8a8_vs_w8a16"]["mean_abs"] <= bound
    control_fails = pairs["control_vs_w8a16"]["mean_abs"] > bound
    reasons = []
    if not within:
        reasons.append("W8A8 differs from W8A16 by more than the bound")
    if not control_fails:
        reasons.append("the control stays within the bound, so the bound tells nothing")
    return {
        "passed": within and control_fails,
        "bound_mean_abs": bound,
        "pairs": pairs,
        "reason": "; ".join(reasons) or "W8A8 within the bound, the control outside it",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_minimax.w8a8", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    arm = sub.add_parser("arm", help="print the W8A8 arm as eval ab's --arm NAME=JSON")
    arm.add_argument("--name", default=ARM_NAME)
    check = sub.add_parser("verdict", help="compare the tiny-model runs (JSON files)")
    for name in ("w8a16", "w8a8", "control"):
        check.add_argument(f"--{name}", type=Path, required=True)
    check.add_argument("--bf16", type=Path)
    check.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "arm":
        print(arm_argument(args.name))
        return 0
    runs = {
        name: json.loads(getattr(args, name).read_text())
        for name in ("w8a16", "w8a8", "control", "bf16")
        if getattr(args, name) is not None
    }
    result = verdict(runs)
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    print(("PASS: " if result["passed"] else "FAIL: ") + result["reason"])
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
