"""Per-layer time of MiniMax M3's dense full-attention layer on vLLM's FLASH_ATTN path under
the KV-cache layouts LBNHC (vLLM's default, "NHD") and LBHNC ("HND").

    python3 -m benchmarks.dense_layout_bench --out $OUT/dense-layout

The KV-cache layout is one for the whole model: asking for LBHNC (what FlashInfer's MSA
sparse attention reads) also lays out the caches of M3's dense full-attention layers (the
first 3 of 60), which run vLLM 0.34.0's FLASH_ATTN backend (FA3 on SM90; it declares no
layout, so it reads whatever it is given through the strides of the layer's view). This
times that backend's call on both layouts.

Each layer cache is built as vLLM builds it: an int8 buffer viewed through
``compute_layout_strides`` of a ``FullAttentionSpec`` (128-token pages, head_dim 128, K and V
side by side in a page's content), viewed as the spec's dtype (bf16, or uint8 for an fp8
cache). The call is ``FlashAttentionImpl.forward``'s: the view transposed to
``[blocks, tokens, heads, 2 * head_dim]`` and split into K and V, singleton strides
canonicalised, an fp8 cache viewed as ``float8_e4m3fn`` with the query quantized to fp8 (the
attention layer does that before the call), per-tensor descales of 1.0 expanded to
``(sequences, kv_heads)``, ``causal=True``, ``fa_version`` 3, and ``num_splits`` as vLLM's
builder sets it (32, ``flash_attn_max_num_splits_for_cuda_graph``, for a decode batch that
CUDA graphs cover; 0, FA3's own heuristic, for the prefill chunk). The builder's
ahead-of-time ``scheduler_metadata`` is not passed: FA3 then runs the same split planning
inside the call.

Geometry: one rank of M3 at TP 1 (64 query heads, 4 KV heads), TP 2 (32 / 2) and TP 8
(8 / 1; with one KV head per rank the two layouts have the same bytes in the same places).
Workloads: decode 32 x 32k and 64 x 8k, and an 8k-token prefill chunk at a 32k prefix; pages
are scattered (a random permutation of the cache's blocks), the block table 1024 pages wide
(max_model_len 131072). Each case draws fresh random inputs; both layouts hold the same
logical K and V. Times are CUDA-graph replays of one captured call, timed with CUDA events;
rounds alternate which layout runs first, and the report gives the median of the round
medians (ms per layer call) with min..max (timing through `benchmarks.timing`; the outputs are
poisoned before the timed replays, and a row whose output any element of was left unwritten
fails).

Checks, each of which fails the run (exit 1, after the JSON is written): on every case the
two layouts' outputs agree (max abs difference at most ``LAYOUT_ATOL``); on a small mixed
case per geometry and cache dtype each layout's output is within ``REFERENCE_REL_L2`` (relative
L2) of a float32 torch reference computed from the same (dequantized) cache.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks import timing
from vllm_minimax.m3_geometry import M3_TEXT_CONFIG

HEAD_DIM: int = M3_TEXT_CONFIG["head_dim"]
QUERY_HEADS: int = M3_TEXT_CONFIG["num_attention_heads"]
KV_HEADS: int = M3_TEXT_CONFIG["num_key_value_heads"]
BLOCK_SIZE = 128
TABLE_WIDTH = 1024  # pages: max_model_len 131072, as the serving configs set it
LAYOUTS = ("LBNHC", "LBHNC")
TP_SIZES = (1, 2, 8)
KV_DTYPES = ("bf16", "fp8")
# vLLM 0.34.0's AttentionConfig.flash_attn_max_num_splits_for_cuda_graph: the bound the
# builder passes while a batch fits the CUDA graphs (decode); 0 lets FA3 choose (prefill).
GRAPH_NUM_SPLITS = 32
# Two layouts hold the same values and FA3 reduces them in the same order.
LAYOUT_ATOL = 1e-2
# Against float32 on the same (dequantized) cache: FA3's bf16 and fp8 (P rounded to e4m3)
# paths; a misread layout gives a relative L2 near 1.
REFERENCE_REL_L2 = {"bf16": 2e-2, "fp8": 1e-1}
FP8_MAX = 448.0


@dataclass(frozen=True)
class Workload:
    """One step's requests: new query tokens and KV length (new tokens included) of each."""

    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.query_lens) != len(self.seq_lens) or not self.query_lens:
            raise ValueError(f"{self.name}: one query length per sequence length")
        if any(q < 1 or q > s for q, s in zip(self.query_lens, self.seq_lens, strict=True)):
            raise ValueError(f"{self.name}: each query length must be in 1..its seq length")

    @property
    def is_decode(self) -> bool:
        return max(self.query_lens) == 1

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def pages(self) -> tuple[int, ...]:
        return tuple(math.ceil(s / BLOCK_SIZE) for s in self.seq_lens)

    @property
    def attended_pairs(self) -> int:
        """(query token, key) pairs under the causal mask aligned to the sequence's end."""
        return sum(
            q * (s - q) + q * (q + 1) // 2
            for q, s in zip(self.query_lens, self.seq_lens, strict=True)
        )

    @property
    def num_splits(self) -> int:
        return GRAPH_NUM_SPLITS if self.is_decode else 0


WORKLOADS = (
    Workload("decode-32x32k", (1,) * 32, (32768,) * 32),
    Workload("decode-64x8k", (1,) * 64, (8192,) * 64),
    Workload("prefill-8k-at-32k", (8192,), (32768 + 8192,)),
)
# Small enough for a float32 reference: three decodes (one a page plus a token) and a
# 300-token chunk at a 700-token prefix, in one varlen batch.
CHECK_WORKLOAD = Workload("check-mixed", (1, 1, 1, 300), (1000, 129, 4096, 1000))


def rank_heads(tp: int) -> tuple[int, int]:
    """(query heads, KV heads) of one rank: KV heads split while they last, then replicated."""
    if QUERY_HEADS % tp:
        raise ValueError(f"{QUERY_HEADS} query heads do not split {tp} ways")
    if tp <= KV_HEADS:
        if KV_HEADS % tp:
            raise ValueError(f"{KV_HEADS} KV heads do not split {tp} ways")
        return QUERY_HEADS // tp, KV_HEADS // tp
    if tp % KV_HEADS:
        raise ValueError(f"TP {tp} does not replicate {KV_HEADS} KV heads evenly")
    return QUERY_HEADS // tp, 1


@dataclass(frozen=True)
class Case:
    tp: int
    kv_dtype: str
    workload: Workload

    @property
    def heads(self) -> tuple[int, int]:
        return rank_heads(self.tp)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token on this rank."""
        return self.heads[1] * 2 * HEAD_DIM * (1 if self.kv_dtype == "fp8" else 2)

    @property
    def kv_bytes_read(self) -> int:
        return sum(self.workload.seq_lens) * self.kv_bytes_per_token

    @property
    def flops(self) -> int:
        """QK^T and PV multiply-adds of every attended pair, every query head."""
        return 4 * self.heads[0] * HEAD_DIM * self.workload.attended_pairs


def all_cases(
    tp_sizes: tuple[int, ...] = TP_SIZES,
    kv_dtypes: tuple[str, ...] = KV_DTYPES,
    workloads: tuple[Workload, ...] = WORKLOADS,
) -> list[Case]:
    for dtype in kv_dtypes:
        if dtype not in KV_DTYPES:
            raise ValueError(f"unknown KV cache dtype {dtype!r}; choose from {KV_DTYPES}")
    return [Case(tp, d, w) for tp in tp_sizes for d in kv_dtypes for w in workloads]


def _spec(num_kv_heads: int, kv_dtype: str) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    if kv_dtype == "fp8":  # vLLM's STR_DTYPE_TO_TORCH_DTYPE["fp8"]
        return FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=num_kv_heads,
            head_size=HEAD_DIM,
            dtype=torch.uint8,
            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        )
    return FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=num_kv_heads, head_size=HEAD_DIM, dtype=torch.bfloat16
    )


def layer_view_strides(
    layout: str, num_blocks: int, num_kv_heads: int, kv_dtype: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, element strides) of one layer's ``[blocks, kv_heads, tokens, 2 * head_dim]``
    cache view, from vLLM's own ``compute_layout_strides`` for one layer."""
    from vllm.v1.kv_cache_interface import KVCacheLayout, compute_layout_strides

    if layout not in KVCacheLayout.__members__:
        raise ValueError(f"unknown KV cache layout {layout!r}")
    spec = _spec(num_kv_heads, kv_dtype)
    byte_strides = compute_layout_strides(spec, num_blocks, 1, KVCacheLayout[layout])[1:]
    elem = 1 if kv_dtype == "fp8" else 2
    if any(s % elem for s in byte_strides[:-1]) or byte_strides[-1] != 1:
        raise ValueError(f"{layout}: strides {byte_strides} do not view as {kv_dtype}")
    shape = (num_blocks, num_kv_heads, BLOCK_SIZE, 2 * HEAD_DIM)
    return shape, (*(s // elem for s in byte_strides[:-1]), 1)


# --- GPU ----------------------------------------------------------------------------------


class LayerCache:
    """One layer's paged cache in one layout, holding given logical K and V."""

    def __init__(self, layout: str, logical: Any, kv_dtype: str) -> None:
        import torch

        num_blocks, num_kv_heads = logical.shape[:2]
        shape, strides = layer_view_strides(layout, num_blocks, num_kv_heads, kv_dtype)
        elem = logical.element_size()
        self.raw = torch.zeros(logical.numel() * elem, dtype=torch.int8, device=logical.device)
        byte_view = torch.as_strided(
            self.raw,
            size=(*shape[:-1], shape[-1] * elem),
            stride=(*(s * elem for s in strides[:-1]), 1),
        )
        self.view = byte_view.view(logical.dtype)
        if self.view.stride() != strides:
            raise AssertionError(f"{layout}: view strides {self.view.stride()} != {strides}")
        self.view.view(torch.uint8).copy_(logical.view(torch.uint8))


class Step:
    """Query, metadata and output of one workload, shared by the layouts."""

    def __init__(self, case: Case, seed: int, device: Any) -> None:
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        w = case.workload
        heads_q, heads_kv = case.heads
        self.case = case
        num_blocks = sum(w.pages)
        if max(w.pages) > TABLE_WIDTH:
            raise ValueError(f"{w.name}: more than {TABLE_WIDTH} pages per sequence")
        kv = torch.randn(
            (num_blocks, heads_kv, BLOCK_SIZE, 2 * HEAD_DIM),
            generator=gen,
            device=device,
            dtype=torch.bfloat16,
        )
        query = torch.randn(
            (w.num_tokens, heads_q, HEAD_DIM), generator=gen, device=device, dtype=torch.bfloat16
        )
        if case.kv_dtype == "fp8":
            self.logical = kv.to(torch.float8_e4m3fn).view(torch.uint8)
            self.query = query.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        else:
            self.logical = kv
            self.query = query
        del kv
        perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
        self.block_table = torch.zeros(
            (len(w.pages), TABLE_WIDTH), dtype=torch.int32, device=device
        )
        start = 0
        for i, n in enumerate(w.pages):
            self.block_table[i, :n] = perm[start : start + n]
            start += n
        self.cu_seqlens_q = torch.tensor(
            [0, *_cumsum(w.query_lens)], dtype=torch.int32, device=device
        )
        self.seqused_k = torch.tensor(w.seq_lens, dtype=torch.int32, device=device)
        scale = torch.ones(1, dtype=torch.float32, device=device)
        self.scales = scale  # layer._q_scale / _k_scale / _v_scale of an uncalibrated cache
        self.out = {
            layout: torch.empty(
                (w.num_tokens, heads_q, HEAD_DIM), dtype=torch.bfloat16, device=device
            )
            for layout in LAYOUTS
        }

    def kernel_kv(self, cache: LayerCache) -> tuple[Any, Any]:
        """K and V as FlashAttentionImpl.forward hands them to the kernel: the layer view
        transposed to ``[blocks, tokens, kv_heads, 2 * head_dim]`` and split, singleton
        strides canonicalised, an fp8 cache viewed as ``float8_e4m3fn``."""
        import torch
        from vllm.utils.torch_utils import canonicalize_singleton_dim_strides

        key_cache, value_cache = cache.view.transpose(1, 2).split(HEAD_DIM, dim=-1)
        key_cache = canonicalize_singleton_dim_strides(key_cache)
        value_cache = canonicalize_singleton_dim_strides(value_cache)
        if self.case.kv_dtype == "fp8":
            key_cache = key_cache.view(torch.float8_e4m3fn)
            value_cache = value_cache.view(torch.float8_e4m3fn)
        return key_cache, value_cache

    def attend(self, cache: LayerCache, out: Any) -> None:
        """FlashAttentionImpl.forward's call, for a layer cache in any layout."""
        from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        w = self.case.workload
        key_cache, value_cache = self.kernel_kv(cache)
        descale_shape = (len(w.seq_lens), self.case.heads[1])
        descale = canonicalize_singleton_dim_strides(self.scales.expand(descale_shape))
        flash_attn_varlen_func(
            q=self.query,
            k=key_cache,
            v=value_cache,
            out=out,
            cu_seqlens_q=self.cu_seqlens_q,
            max_seqlen_q=max(w.query_lens),
            seqused_k=self.seqused_k,
            max_seqlen_k=max(w.seq_lens),
            softmax_scale=HEAD_DIM**-0.5,
            causal=True,
            alibi_slopes=None,
            window_size=None,
            block_table=self.block_table,
            softcap=0.0,
            scheduler_metadata=None,
            fa_version=3,
            q_descale=descale,
            k_descale=descale,
            v_descale=descale,
            num_splits=w.num_splits,
            s_aux=None,
        )

    def reference(self) -> Any:
        """Float32 attention over the logical cache, gathered through the block table."""
        import torch

        w = self.case.workload
        heads_q, heads_kv = self.case.heads
        if self.case.kv_dtype == "fp8":
            kv = self.logical.view(torch.float8_e4m3fn).float()
        else:
            kv = self.logical.float()
        query = self.query.float()
        table = self.block_table.cpu()
        outs = []
        for i, (q_len, s_len) in enumerate(zip(w.query_lens, w.seq_lens, strict=True)):
            pages = table[i, : w.pages[i]].to(kv.device).long()
            seq = kv[pages].permute(0, 2, 1, 3).reshape(-1, heads_kv, 2 * HEAD_DIM)[:s_len]
            k, v = seq[..., :HEAD_DIM], seq[..., HEAD_DIM:]
            k = k.repeat_interleave(heads_q // heads_kv, dim=1)
            v = v.repeat_interleave(heads_q // heads_kv, dim=1)
            start = int(self.cu_seqlens_q[i])
            q = query[start : start + q_len]
            scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
            positions = torch.arange(s_len, device=kv.device)
            last = s_len - q_len + torch.arange(q_len, device=kv.device)
            scores.masked_fill_(positions[None, None, :] > last[None, :, None], float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v))
        return torch.cat(outs)


def _cumsum(values: tuple[int, ...]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


def rel_l2(got: Any, want: Any) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def run_case(case: Case, seed: int, rounds: int, iters: int, device: Any) -> dict[str, Any]:
    """Both layouts' times and outputs for one case. Times are CUDA-graph replays; where
    capture fails (it should not), back-to-back eager calls, and the row says so."""
    import torch

    step = Step(case, seed, device)
    caches = {layout: LayerCache(layout, step.logical, case.kv_dtype) for layout in LAYOUTS}
    calls = {layout: partial(step.attend, caches[layout], step.out[layout]) for layout in LAYOUTS}
    mode = "graph"
    graphs: dict[str, Any] = {}
    try:
        for layout in LAYOUTS:
            graphs[layout] = timing.capture_graph(calls[layout])
        runners = {layout: graphs[layout].replay for layout in LAYOUTS}
    except RuntimeError as exc:
        print(f"{case.workload.name}: CUDA-graph capture failed ({exc}); timing eager calls")
        mode = "eager"
        runners = calls
    # What the timed calls leave unwritten stays NaN, and fails the row.
    timing.poison(*step.out.values())
    samples = timing.alternated_rounds(
        {layout: partial(timing.per_call_ms, runners[layout], iters) for layout in LAYOUTS},
        rounds,
    )
    torch.cuda.synchronize()
    a, b = (step.out[layout].float() for layout in LAYOUTS)
    diff = float((a - b).abs().max())
    finite = bool(torch.isfinite(a).all() and torch.isfinite(b).all())
    unwritten = {layout: timing.unwritten(step.out[layout]) for layout in LAYOUTS}
    row: dict[str, Any] = {
        "tp": case.tp,
        "heads": list(case.heads),
        "kv_dtype": case.kv_dtype,
        "case": case.workload.name,
        "num_splits": case.workload.num_splits,
        "timing": mode,
        "samples_ms": samples,
        "layout_max_abs_diff": diff,
        "unwritten": unwritten,
        "kv_bytes_read": case.kv_bytes_read,
        "flops": case.flops,
        "ok": finite and diff <= LAYOUT_ATOL and not any(unwritten.values()),
    }
    del graphs, runners, calls, caches, step
    torch.cuda.empty_cache()
    return row


def check_reference(tp: int, kv_dtype: str, seed: int, device: Any) -> dict[str, Any]:
    import torch

    case = Case(tp, kv_dtype, CHECK_WORKLOAD)
    step = Step(case, seed, device)
    ref = step.reference()
    errors = {}
    for layout in LAYOUTS:
        cache = LayerCache(layout, step.logical, kv_dtype)
        timing.poison(step.out[layout])
        step.attend(cache, step.out[layout])
        torch.cuda.synchronize()
        errors[layout] = rel_l2(step.out[layout], ref)
    bound = REFERENCE_REL_L2[kv_dtype]
    return {
        "tp": tp,
        "heads": list(case.heads),
        "kv_dtype": kv_dtype,
        "case": CHECK_WORKLOAD.name,
        "rel_l2": errors,
        "bound": bound,
        "ok": all(math.isfinite(e) and e <= bound for e in errors.values()),
    }


def error_row(case: Case, exc: BaseException) -> dict[str, Any]:
    """A case or check that raised: recorded, and the run fails at its end."""
    return {
        "tp": case.tp,
        "heads": list(case.heads),
        "kv_dtype": case.kv_dtype,
        "case": case.workload.name,
        "error": f"{type(exc).__name__}: {exc}",
        "ok": False,
    }


# --- report -------------------------------------------------------------------------------


def summary(row: dict[str, Any]) -> dict[str, float]:
    """Median of round medians per layout, and LBHNC over LBNHC."""
    med = {layout: timing.Spread.of(row["samples_ms"][layout]).median for layout in LAYOUTS}
    return {**med, "ratio": med["LBHNC"] / med["LBNHC"]}


def _rate(row: dict[str, Any], ms: float) -> str:
    if row["case"].startswith("decode"):
        return f"{row['kv_bytes_read'] / ms / 1e6:.0f} GB/s"
    return f"{row['flops'] / ms / 1e9:.0f} TFLOP/s"


def render(rows: list[dict[str, Any]], checks: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"MiniMax M3 dense layer, FLASH_ATTN (FA3), by KV-cache layout: {meta['device']}, "
        f"vLLM {meta['vllm']}, torch {meta['torch']}",
        f"ms per layer call: median of {meta['rounds']} round medians of {meta['iters']} "
        "CUDA-graph replays; spread = (max - min) / median of the round medians, worse layout",
        "",
        "| TP | q/kv | KV | case | NHD ms | HND ms | HND/NHD | NHD rate | HND rate | spread "
        "| max diff | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        head = f"| {row['tp']} | {row['heads'][0]}/{row['heads'][1]} | {row['kv_dtype']} | "
        if "error" in row:
            lines.append(f"{head}{row['case']} | error: {row['error'][:160]} |||||||| NO |")
            continue
        s = summary(row)
        spread = max(timing.Spread.of(row["samples_ms"][layout]).relative for layout in LAYOUTS)
        eager_note = "" if row.get("timing", "graph") == "graph" else " (eager)"
        lines.append(
            f"{head}{row['case']}{eager_note} | {s['LBNHC']:.4f} | {s['LBHNC']:.4f} | "
            f"{s['ratio']:.3f}x | "
            f"{_rate(row, s['LBNHC'])} | {_rate(row, s['LBHNC'])} | {spread:.1%} | "
            f"{row['layout_max_abs_diff']:.1e} | {'yes' if row['ok'] else 'NO'} |"
        )
    lines += [
        "",
        f"float32 reference ({CHECK_WORKLOAD.name}), relative L2:",
        "",
        "| TP | KV | NHD | HND | bound | ok |",
        "|---|---|---|---|---|---|",
    ]
    for c in checks:
        if "error" in c:
            lines.append(f"| {c['tp']} | {c['kv_dtype']} | error: {c['error'][:160]} ||| NO |")
            continue
        lines.append(
            f"| {c['tp']} | {c['kv_dtype']} | {c['rel_l2']['LBNHC']:.1e} | "
            f"{c['rel_l2']['LBHNC']:.1e} | {c['bound']:.0e} | {'yes' if c['ok'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tp", type=int, nargs="+", default=list(TP_SIZES))
    parser.add_argument("--kv-dtype", nargs="+", default=list(KV_DTYPES), choices=KV_DTYPES)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.iters < 1:
        parser.error("--rounds and --iters must be at least 1")
    for tp in args.tp:
        try:
            rank_heads(tp)
        except ValueError as exc:
            parser.error(f"--tp {tp}: {exc}")

    import torch
    import vllm

    if not torch.cuda.is_available():
        print("dense_layout_bench: needs a CUDA GPU (SM90: FA3)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    checks = []
    for i, (tp, dtype) in enumerate((tp, d) for tp in args.tp for d in args.kv_dtype):
        try:
            check = check_reference(tp, dtype, seed=1000 + i, device=device)
        except Exception as exc:
            check = error_row(Case(tp, dtype, CHECK_WORKLOAD), exc)
        print(f"check tp{tp} {dtype}: {check.get('rel_l2', check.get('error'))}", flush=True)
        checks.append(check)
    rows = []
    for i, case in enumerate(all_cases(tuple(args.tp), tuple(args.kv_dtype))):
        try:
            row = run_case(case, seed=i, rounds=args.rounds, iters=args.iters, device=device)
        except Exception as exc:
            row = error_row(case, exc)
        name = f"tp{case.tp} {case.kv_dtype} {case.workload.name:18s}"
        if "error" in row:
            print(f"{name} {row['error']}", flush=True)
        else:
            s = summary(row)
            print(
                f"{name} NHD {s['LBNHC']:.4f} ms  HND {s['LBHNC']:.4f} ms  "
                f"{s['ratio']:.3f}x  ok={row['ok']}",
                flush=True,
            )
        rows.append(row)
    meta = {
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "command": "python3 -m benchmarks.dense_layout_bench " + " ".join(argv or sys.argv[1:]),
        "rounds": args.rounds,
        "iters": args.iters,
        "block_size": BLOCK_SIZE,
        "table_width": TABLE_WIDTH,
    }
    ok = all(r["ok"] for r in rows) and all(c["ok"] for c in checks)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"meta": meta, "ok": ok, "checks": checks, "rows": rows}
    (args.out / "bench.json").write_text(json.dumps(report, indent=1))
    table = render(rows, checks, meta)
    (args.out / "table.md").write_text(table)
    print(table)
    if not ok:
        print("dense_layout_bench: a check failed (see ok columns)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
