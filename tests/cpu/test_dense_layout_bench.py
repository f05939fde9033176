"""benchmarks.dense_layout_bench without a GPU: its cases and M3's rank heads, the layer-cache
strides it takes from vLLM, the K and V views it hands FlashAttention in each layout, its
float32 reference, its argument checks and its table."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from benchmarks import dense_layout_bench as bench


def test_cases_cover_three_ranks_two_dtypes_three_workloads() -> None:
    cases = bench.all_cases()
    assert len(cases) == 3 * 2 * 3
    assert {c.tp: c.heads for c in cases} == {1: (64, 4), 2: (32, 2), 8: (8, 1)}
    assert {c.workload.name for c in cases} == {
        "decode-32x32k",
        "decode-64x8k",
        "prefill-8k-at-32k",
    }
    by_name = {w.name: w for w in bench.WORKLOADS}
    decode, prefill = by_name["decode-32x32k"], by_name["prefill-8k-at-32k"]
    assert decode.is_decode and decode.num_splits == bench.GRAPH_NUM_SPLITS
    assert decode.attended_pairs == 32 * 32768 and decode.pages == (256,) * 32
    assert not prefill.is_decode and prefill.num_splits == 0
    assert prefill.attended_pairs == 8192 * 32768 + 8192 * 8193 // 2
    assert max(prefill.pages) <= bench.TABLE_WIDTH
    tp1_fp8 = bench.Case(1, "fp8", decode)
    assert tp1_fp8.kv_bytes_read == 32 * 32768 * 4 * 2 * 128
    assert bench.Case(1, "bf16", decode).kv_bytes_read == 2 * tp1_fp8.kv_bytes_read


@pytest.mark.parametrize("tp", [3, 6, 128])
def test_a_tp_that_does_not_split_m3_is_refused(tp: int) -> None:
    with pytest.raises(ValueError, match=r"do not split|does not replicate"):
        bench.rank_heads(tp)


def test_workload_and_dtype_validation() -> None:
    with pytest.raises(ValueError, match="one query length per sequence length"):
        bench.Workload("bad", (1, 1), (10,))
    with pytest.raises(ValueError, match=r"1\.\.its seq length"):
        bench.Workload("bad", (11,), (10,))
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        bench.all_cases(kv_dtypes=("fp16",))


# Element strides of the [blocks, kv_heads, tokens, 2 * head_dim] layer view, by hand: LBHNC
# keeps that order; LBNHC stores a page token-major, each token's heads side by side.
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_layer_view_strides_are_vllms(kv_dtype: str) -> None:
    heads, content = 4, 2 * bench.HEAD_DIM
    page = heads * bench.BLOCK_SIZE * content
    shape, lbhnc = bench.layer_view_strides("LBHNC", 10, heads, kv_dtype)
    assert shape == (10, heads, bench.BLOCK_SIZE, content)
    assert lbhnc == (page, bench.BLOCK_SIZE * content, content, 1)
    _, lbnhc = bench.layer_view_strides("LBNHC", 10, heads, kv_dtype)
    assert lbnhc == (page, content, heads * content, 1)
    with pytest.raises(ValueError, match="unknown KV cache layout"):
        bench.layer_view_strides("NHD", 10, heads, kv_dtype)


def _step(tp: int, kv_dtype: str) -> bench.Step:
    return bench.Step(bench.Case(tp, kv_dtype, bench.CHECK_WORKLOAD), 0, torch.device("cpu"))


def _gathered(kv: Any, step: bench.Step, seq: int) -> Any:
    """One sequence's ``[tokens, kv_heads, head_dim]`` through the block table, as the kernel
    reads a paged cache ``[blocks, tokens, kv_heads, head_dim]``."""
    w = step.case.workload
    pages = step.block_table[seq, : w.pages[seq]].long()
    return kv[pages].flatten(0, 1)[: w.seq_lens[seq]]


@pytest.mark.parametrize(("tp", "kv_dtype"), [(1, "bf16"), (2, "fp8"), (8, "bf16")])
def test_both_layouts_hand_the_kernel_the_same_k_and_v(tp: int, kv_dtype: str) -> None:
    step = _step(tp, kv_dtype)
    caches = {layout: bench.LayerCache(layout, step.logical, kv_dtype) for layout in bench.LAYOUTS}
    heads = step.case.heads[1]
    if heads > 1:  # the layouts put the same bytes in different places
        assert not torch.equal(caches["LBHNC"].raw, caches["LBNHC"].raw)
    else:
        assert torch.equal(caches["LBHNC"].raw, caches["LBNHC"].raw)
    logical = step.logical
    if kv_dtype == "fp8":
        logical = logical.view(torch.float8_e4m3fn)
    want_k = logical[..., : bench.HEAD_DIM].transpose(1, 2)
    want_v = logical[..., bench.HEAD_DIM :].transpose(1, 2)
    for layout, cache in caches.items():
        k, v = step.kernel_kv(cache)
        assert k.shape == v.shape == (logical.shape[0], bench.BLOCK_SIZE, heads, bench.HEAD_DIM)
        assert k.stride(-1) == v.stride(-1) == 1, layout
        if kv_dtype == "fp8":
            assert k.dtype == v.dtype == torch.float8_e4m3fn
        for seq in range(len(step.case.workload.seq_lens)):
            for got, want in ((k, want_k), (v, want_v)):
                assert torch.equal(
                    _gathered(got, step, seq).view(torch.uint8),
                    _gathered(want, step, seq).view(torch.uint8),
                ), (layout, seq)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_the_reference_is_causal_gqa_attention_aligned_to_each_sequences_end(
    kv_dtype: str,
) -> None:
    step = _step(2, kv_dtype)
    got = step.reference()
    w = step.case.workload
    heads_q, heads_kv = step.case.heads
    kv = step.logical.view(torch.float8_e4m3fn) if kv_dtype == "fp8" else step.logical
    kv = kv.float().transpose(1, 2)
    query = step.query.float()
    want = []
    for seq, (q_len, s_len) in enumerate(zip(w.query_lens, w.seq_lens, strict=True)):
        keys = _gathered(kv, step, seq)
        start = int(step.cu_seqlens_q[seq])
        q = query[start : start + q_len].transpose(0, 1)
        k = keys[..., : bench.HEAD_DIM].transpose(0, 1)
        v = keys[..., bench.HEAD_DIM :].transpose(0, 1)
        mask = torch.ones(q_len, s_len, dtype=torch.bool).tril(diagonal=s_len - q_len)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        want.append(out.transpose(0, 1))
    assert heads_q // heads_kv == 16
    assert got.shape == (w.num_tokens, heads_q, bench.HEAD_DIM)
    assert bench.rel_l2(got, torch.cat(want)) < 1e-5


def test_rel_l2() -> None:
    a = torch.tensor([3.0, 4.0])
    assert bench.rel_l2(a, a) == 0
    assert math.isclose(bench.rel_l2(torch.zeros(2), a), 1.0)


def _row(case: str, nhd: list[float], hnd: list[float], ok: bool = True) -> dict[str, Any]:
    return {
        "tp": 1,
        "heads": [64, 4],
        "kv_dtype": "bf16",
        "case": case,
        "timing": "graph",
        "samples_ms": {"LBNHC": nhd, "LBHNC": hnd},
        "layout_max_abs_diff": 0.0,
        "kv_bytes_read": 2_000_000_000,
        "flops": 10**13,
        "ok": ok,
    }


def test_table_gives_each_case_its_times_ratio_and_rate() -> None:
    rows = [
        _row("decode-32x32k", [1.0, 1.1, 0.9], [1.2, 1.2, 1.3]),
        _row("prefill-8k-at-32k", [20.0, 20.0, 20.0], [19.0, 19.0, 19.0], ok=False),
    ]
    checks = [
        {
            "tp": 1,
            "kv_dtype": "fp8",
            "rel_l2": {"LBNHC": 0.02, "LBHNC": 0.02},
            "bound": 0.1,
            "ok": True,
        }
    ]
    meta = {"device": "H100", "vllm": "0.34.0", "torch": "2.14", "rounds": 3, "iters": 20}
    assert bench.summary(rows[0]) == {"LBNHC": 1.0, "LBHNC": 1.2, "ratio": 1.2}
    table = bench.render(rows, checks, meta).splitlines()
    decode = next(line for line in table if "decode-32x32k" in line)
    assert "| 1.0000 | 1.2000 | 1.200x | 2000 GB/s | 1667 GB/s | 20.0% |" in decode
    assert decode.endswith("| yes |")
    prefill = next(line for line in table if "prefill" in line)
    assert "500 TFLOP/s | 526 TFLOP/s" in prefill and prefill.endswith("| NO |")
    assert table[-1] == "| 1 | fp8 | 2.0e-02 | 2.0e-02 | 1e-01 | yes |"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "3"], "--tp 3: 64 query heads do not split 3 ways"),
        (["--kv-dtype", "fp16"], "invalid choice: 'fp16'"),
        (["--iters", "0"], "--rounds and --iters must be at least 1"),
    ],
)
def test_bad_arguments_stop_before_any_gpu_work(
    argv: list[str], message: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--out", str(tmp_path), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_main_records_a_case_that_raises_writes_the_json_and_fails_at_the_end(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    def run_case(case: bench.Case, **_: Any) -> dict[str, Any]:
        if case.workload.name.startswith("prefill"):
            raise RuntimeError("the kernel refused the strides")
        return {**_row(case.workload.name, [1.0], [1.0]), "tp": case.tp, "kv_dtype": "fp8"}

    def check_reference(tp: int, kv_dtype: str, **_: Any) -> dict[str, Any]:
        rel = {"LBNHC": 0.01, "LBHNC": 0.01}
        return {"tp": tp, "kv_dtype": kv_dtype, "rel_l2": rel, "bound": 0.1, "ok": True}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stand-in")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(bench, "run_case", run_case)
    monkeypatch.setattr(bench, "check_reference", check_reference)
    assert bench.main(["--out", str(tmp_path), "--tp", "8", "--kv-dtype", "fp8"]) == 1
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["ok"] is False
    assert [r["case"] for r in report["rows"]] == [w.name for w in bench.WORKLOADS]
    failed = report["rows"][-1]
    assert failed["error"] == "RuntimeError: the kernel refused the strides"
    assert failed["heads"] == [8, 1] and failed["ok"] is False
    out = capsys.readouterr()
    assert "a check failed" in out.err
    table = out.out.rstrip("\n").splitlines()
    assert table[-1] == "| 8 | fp8 | 1.0e-02 | 1.0e-02 | 1e-01 | yes |"
    assert any("prefill-8k-at-32k | error: RuntimeError" in line for line in table)
    assert (tmp_path / "table.md").read_text().splitlines()[-1] == table[-1]


class _HalfWritingStep:
    """A stand-in Step whose attend writes only the first half of the output's tokens: the
    other half keeps whatever was there (zeros, as an earlier call's right answer would)."""

    def __init__(self, case: bench.Case, seed: int, device: Any) -> None:
        self.logical = None
        self.out = {layout: torch.zeros(4, 2, 8) for layout in bench.LAYOUTS}
        self.calls = 0

    def attend(self, cache: Any, out: torch.Tensor) -> None:
        self.calls += 1
        out[:2] = 0.0


@pytest.mark.parametrize("capture_fails", [False, True])
def test_run_case_fails_a_row_whose_timed_calls_left_output_unwritten(
    monkeypatch: pytest.MonkeyPatch, capture_fails: bool
) -> None:
    """The outputs are poisoned before the timed calls (graph replays, or eager calls where
    capture fails), so a kernel that skips part of its output fails the row even where the
    stale values would have matched."""

    class Graph:
        def __init__(self, fn: Any) -> None:
            self.replay = fn

    def capture(fn: Any) -> Graph:
        if capture_fails:
            raise RuntimeError("capture refused")
        fn()
        return Graph(fn)

    timed: list[Any] = []

    def per_call_ms(fn: Any, iters: int) -> float:
        timed.append(fn)
        fn()
        return 1.0

    monkeypatch.setattr(bench, "Step", _HalfWritingStep)
    monkeypatch.setattr(bench, "LayerCache", lambda layout, logical, kv_dtype: layout)
    monkeypatch.setattr(bench.timing, "capture_graph", capture)
    monkeypatch.setattr(bench.timing, "per_call_ms", per_call_ms)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    case = bench.Case(8, "bf16", bench.WORKLOADS[0])
    row = bench.run_case(case, seed=0, rounds=3, iters=5, device="cpu")
    assert len(timed) == 3 * len(bench.LAYOUTS)
    assert row["timing"] == ("eager" if capture_fails else "graph")
    assert row["unwritten"] == dict.fromkeys(bench.LAYOUTS, 2 * 2 * 8)
    assert row["samples_ms"] == {layout: [1.0, 1.0, 1.0] for layout in bench.LAYOUTS}
    assert row["ok"] is False
