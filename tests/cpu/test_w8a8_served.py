"""benchmarks/w8a8_served.py: issue 62's keys from a served A/B's summary, computed here from
repeats with known ratios through served_ab.summarise."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks import served_ab, w8a8_served


def repeats_with(scale: dict[str, dict[str, float]]) -> dict:
    """Three rounds of every H200 point per arm: stock's draw times the arm's scale."""
    rng = random.Random(62)
    base = {point: [rng.uniform(50, 500) for _ in range(3)] for point in served_ab.POINTS["h200"]}
    arms = {}
    for arm, factors in scale.items():
        points = {
            point: [
                {"round": r, "value": base[point][r] * factors.get(point, 1.0)} for r in range(3)
            ]
            for point in base
        }
        arms[arm] = {"points": points, "kv_cache_tokens": [int(1000 * factors.get("kv", 1))]}
    return {"arms": arms}


def summary_of(repeats: dict) -> dict:
    return served_ab.summarise(repeats, "h200", "mxfp8-ep", "abc123", 14.0)


def test_the_keys_are_the_w8a8_arms_ratios_against_stock():
    repeats = repeats_with({
        "stock": {},
        "fp8-flashinfer": {"kv": 1.7},
        "w8a8": {"prefill-128k-c1": 0.55, "prefill-32k-c4": 0.8, "decode-32k-c8": 0.85,
                 "kv": 1.7},
    })  # fmt: skip
    result = w8a8_served.w8a8_summary(summary_of(repeats), repeats)
    assert result["prefill_128k_ratio_vs_stock"] == pytest.approx(0.55)
    assert result["prefill_32k_ratio_vs_stock"] == pytest.approx(0.8)
    assert result["decode_ratio_vs_stock"] == pytest.approx(0.85)
    assert [row["status"] for row in result["targets"]] == ["met", "missed", "met"]
    assert result["kv_tokens_as_c"] is True and result["complete"]
    assert result["gpu"] == "h200" and result["rounds"] == 3 and result["commit"] == "abc123"


def test_w8a8_kv_tokens_unlike_c_are_reported_and_a_missing_arm_is_refused(tmp_path):
    repeats = repeats_with({"stock": {}, "fp8-flashinfer": {"kv": 1.7}, "w8a8": {"kv": 1.6}})
    assert w8a8_served.w8a8_summary(summary_of(repeats), repeats)["kv_tokens_as_c"] is False
    no_w8a8 = repeats_with({"stock": {}, "fp8-flashinfer": {}})
    with pytest.raises(ValueError, match="no w8a8 arm"):
        w8a8_served.w8a8_summary(summary_of(no_w8a8), no_w8a8)
    (tmp_path / "summary.json").write_text(json.dumps(summary_of(no_w8a8)))
    (tmp_path / "repeats.json").write_text(json.dumps(no_w8a8))
    assert w8a8_served.main([str(tmp_path), "--out", str(tmp_path / "o.json")]) == 2
    assert not (tmp_path / "o.json").exists()


def test_a_point_without_rounds_leaves_its_key_unmeasured(tmp_path):
    repeats = repeats_with({"stock": {}, "w8a8": {"decode-32k-c8": 0.5}})
    repeats["arms"]["w8a8"]["points"]["decode-32k-c8"] = []
    (tmp_path / "summary.json").write_text(json.dumps(summary_of(repeats)))
    (tmp_path / "repeats.json").write_text(json.dumps(repeats))
    assert w8a8_served.main([str(tmp_path), "--out", str(tmp_path / "o.json")]) == 1
    written = json.loads((tmp_path / "o.json").read_text())
    assert written["decode_ratio_vs_stock"] is None and written["kv_tokens_as_c"] is None
