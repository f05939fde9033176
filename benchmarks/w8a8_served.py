"""Issue 62's served figures from a served A/B of the MXFP8 EP slice (benchmarks/served_ab.py):
the W8A8 arm against stock, under the issue's own keys and targets.

    python -m benchmarks.w8a8_served SUMMARY_DIR --out results/h200/mxfp8-w8a8/summary.json

SUMMARY_DIR holds ``summarise``'s ``summary.json`` and ``repeats.json`` for slice
``mxfp8-ep``. The keys: ``prefill_128k_ratio_vs_stock`` (TTFT p50 at ``prefill-128k-c1``),
``prefill_32k_ratio_vs_stock`` (``prefill-32k-c4``), ``decode_ratio_vs_stock`` (ITL p50 at
``decode-32k-c8``), each the median of the W8A8 arm's rounds over stock's, with the paired
spread; the KV-cache tokens of each arm, and whether W8A8's equal (c)'s where (c) ran. Exits 0
when every key has a figure, 1 when one is missing, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

W8A8 = "w8a8"
C_ARM = "fp8-flashinfer"
SLICE = "mxfp8-ep"


@dataclass(frozen=True)
class Target:
    """Issue 62's ``key``: served_ab's ``source`` ratio, met at or below ``bound``."""

    key: str
    source: str
    bound: float


TARGETS = (
    Target("prefill_128k_ratio_vs_stock", "ttft_128k_ratio", 0.6),
    Target("prefill_32k_ratio_vs_stock", "ttft_32k_ratio", 0.7),
    Target("decode_ratio_vs_stock", "itl_decode_ratio", 0.9),
)


def kv_tokens(repeats: Mapping[str, Any]) -> dict[str, int | None]:
    """Each arm's logged KV-cache tokens (the first start's; None where none was logged)."""
    return {
        arm: (record.get("kv_cache_tokens") or [None])[0]
        for arm, record in repeats.get("arms", {}).items()
    }


def w8a8_summary(summary: Mapping[str, Any], repeats: Mapping[str, Any]) -> dict[str, Any]:
    """Issue 62's summary of one served A/B that ran the W8A8 arm beside stock."""
    if summary.get("slice") != SLICE:
        raise ValueError(f"the A/B ran slice {summary.get('slice')!r}, not {SLICE}")
    arm = summary.get("arms", {}).get(W8A8)
    if arm is None:
        raise ValueError(f"the A/B has no {W8A8} arm (arms: {sorted(summary.get('arms', {}))})")
    out: dict[str, Any] = {
        "gpu": summary["gpu"],
        "commit": summary["commit"],
        "rounds": summary["rounds"],
        "device_minutes": summary.get("device_minutes"),
        "reference": summary.get("reference"),
        "targets": [],
        "spread": {},
    }
    for target in TARGETS:
        ratio = arm.get(target.source)
        out[target.key] = ratio
        out["spread"][target.key] = arm.get("spread", {}).get(target.source)
        status = "not measured" if ratio is None else ("met" if ratio <= target.bound else "missed")
        out["targets"].append({"key": target.key, "goal": f"at most {target.bound}",
                               "ratio": ratio, "status": status})  # fmt: skip
    tokens = kv_tokens(repeats)
    out["kv_cache_tokens"] = tokens
    out["kv_tokens_as_c"] = (
        None if tokens.get(C_ARM) is None else tokens.get(W8A8) == tokens.get(C_ARM)
    )
    out["complete"] = all(out[t.key] is not None for t in TARGETS)
    return out


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        result = w8a8_summary(
            _read(args.summary_dir / "summary.json"), _read(args.summary_dir / "repeats.json")
        )
    except ValueError as error:
        print(f"w8a8_served: {error}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for row in result["targets"]:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        print(f"{row['key']}: {ratio} ({row['goal']}: {row['status']})")
    return 0 if result["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
