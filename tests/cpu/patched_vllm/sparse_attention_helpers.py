"""FlashInfer's two SM90 sparse-attention ops as the CPU tests of patch 0007 replace them.

`RecordingMsaOps.msa_sparse_attention` and `.msa_sparse_decode_attention` take the
arguments FlashInfer 0.7.4's ops take, check them against what those ops state for SM90
(bf16 `q` of `(tokens, q_heads, 128)`; fp8 e4m3 paged K and V of `(pages, kv_heads, 128,
128)`; a contiguous int32 `q2k_indices` of `(kv_heads, tokens, 16)`; int32 page table and
`seqused_k`; a prefill page table wider than the union schedule's bound and at most as wide
as the allocation-free programs take, both read from the installed FlashInfer; a contiguous
bf16 `out` shaped like `q`; no per-tensor scale tensors), record them, and then compute the
attention in float32 into `out`: token `i` of a request of `L` query tokens sits at position
`seqused_k - L + i` and attends the keys of its selected blocks (through the request's row of
the page table) up to its own position, scaled by `softmax_scale`, the output multiplied by
`v_global_scale`. A wrong scale, head count, table or query length then gives a wrong result
on the CPU, and `vllm_minimax.testing.sparse_attention_cases.reference_attention` (float32
over the batch itself, not over these arguments) tells.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from vllm_minimax.testing.sparse_attention_cases import selected_block_attention

PAGE = 128
HEAD_DIM = 128
TOPK = 16
FP8 = torch.float8_e4m3fn


def flashinfer_prefill_width_bounds() -> tuple[int, int]:
    """(exclusive lower, inclusive upper) page-table widths of FlashInfer's SM90 prefill
    programs that allocate nothing per call, as the installed FlashInfer sets them."""
    from flashinfer.msa_ops import _sm90_dispatch, cake_hopper_sm90

    return int(_sm90_dispatch._MPG_UNION_MAX), int(cake_hopper_sm90._PF_MAX_BLOCKS)


@dataclass
class MsaCall:
    """One call of either op, as the impl made it."""

    op: str  # "prefill" or "decode"
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q2k_indices: torch.Tensor
    page_table: torch.Tensor
    seqused_k: torch.Tensor
    query_lens: list[int]
    softmax_scale: float | None
    v_global_scale: float | None
    out: torch.Tensor | None
    cu_seqlens_q: torch.Tensor | None = None
    seqlen_q: int | None = None


class RecordingMsaOps:
    """The two ops, checked, recorded and computed in float32 (see the module's doc).
    With `compute=False` they only check and record (the warm-up's launches)."""

    def __init__(self, *, compute: bool = True) -> None:
        self.compute = compute
        self.calls: list[MsaCall] = []
        # The installed FlashInfer's parameters of each op (`install` reads them).
        self.parameters: dict[str, set[str]] = {}

    def of(self, op: str) -> list[MsaCall]:
        return [call for call in self.calls if call.op == op]

    def _unsupported(self, op: str, rest: dict[str, Any]) -> None:
        unknown = sorted(set(rest) - self.parameters[op])
        assert not unknown, f"{op} takes no {unknown}"
        # Per-tensor scales, an LSE, a workspace: none has an SM90 path for this cache.
        passed = [name for name, value in rest.items() if value is not None and value is not False]
        assert not passed, f"{op}: SM90 rejects {sorted(passed)}"

    def msa_sparse_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q2k_indices: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor | None = None,
        causal: bool = False,
        softmax_scale: float | None = None,
        page_table: torch.Tensor | None = None,
        seqused_k: torch.Tensor | None = None,
        v_global_scale: float | None = None,
        out: torch.Tensor | None = None,
        **rest: Any,
    ) -> torch.Tensor:
        self._unsupported("msa_sparse_attention", {"cu_seqlens_k": cu_seqlens_k, **rest})
        assert causal is True, "every SM90 prefill schedule is causal"
        assert page_table is not None and seqused_k is not None, "SM90 prefill is paged only"
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.dim() == 1
        starts = cu_seqlens_q.tolist()
        assert starts[0] == 0 and starts[-1] == q.shape[0], starts
        union_max, programs_max = flashinfer_prefill_width_bounds()
        width = page_table.shape[1]
        assert union_max < width <= programs_max, (
            f"a prefill page table of {width} columns: FlashInfer's allocation-free SM90"
            f" programs take more than {union_max} and at most {programs_max}"
        )
        call = MsaCall(
            op="prefill",
            q=q,
            k=k,
            v=v,
            q2k_indices=q2k_indices,
            page_table=page_table,
            seqused_k=seqused_k,
            query_lens=[b - a for a, b in itertools.pairwise(starts)],
            softmax_scale=softmax_scale,
            v_global_scale=v_global_scale,
            out=out,
            cu_seqlens_q=cu_seqlens_q.clone(),
        )
        return self._record_and_attend(call)

    def msa_sparse_decode_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q2k_indices: torch.Tensor,
        *,
        page_table: torch.Tensor | None = None,
        seqused_k: torch.Tensor | None = None,
        seqlen_q: int = 1,
        causal: bool = True,
        softmax_scale: float | None = None,
        v_global_scale: float | None = None,
        out: torch.Tensor | None = None,
        **rest: Any,
    ) -> torch.Tensor:
        self._unsupported("msa_sparse_decode_attention", rest)
        assert causal is True
        assert page_table is not None and seqused_k is not None
        assert isinstance(seqlen_q, int) and seqlen_q >= 1, seqlen_q
        batch = page_table.shape[0]
        assert q.shape[0] == batch * seqlen_q, (
            f"decode of {batch} requests x {seqlen_q} query tokens got {q.shape[0]} tokens"
        )
        call = MsaCall(
            op="decode",
            q=q,
            k=k,
            v=v,
            q2k_indices=q2k_indices,
            page_table=page_table,
            seqused_k=seqused_k,
            query_lens=[seqlen_q] * batch,
            softmax_scale=softmax_scale,
            v_global_scale=v_global_scale,
            out=out,
            seqlen_q=seqlen_q,
        )
        return self._record_and_attend(call)

    def _record_and_attend(self, call: MsaCall) -> torch.Tensor:
        q, k, v, out = call.q, call.k, call.v, call.out
        assert q.dtype == torch.bfloat16 and q.dim() == 3 and q.shape[2] == HEAD_DIM, (
            q.dtype,
            q.shape,
        )
        tokens, q_heads, _ = q.shape
        assert k.dtype == FP8 and v.dtype == FP8, (k.dtype, v.dtype)
        assert k.dim() == 4 and k.shape == v.shape, (k.shape, v.shape)
        assert k.shape[2:] == (PAGE, HEAD_DIM), k.shape
        kv_heads = k.shape[1]
        assert q_heads % kv_heads == 0, f"{q_heads} query heads over {kv_heads} KV heads"
        q2k = call.q2k_indices
        assert q2k.dtype == torch.int32 and q2k.is_contiguous(), (q2k.dtype, q2k.stride())
        assert q2k.shape == (kv_heads, tokens, TOPK), (
            f"q2k_indices {tuple(q2k.shape)}; want (kv_heads, tokens, 16) ="
            f" {(kv_heads, tokens, TOPK)}"
        )
        batch = len(call.query_lens)
        assert call.page_table.dtype == torch.int32 and call.page_table.dim() == 2
        assert call.page_table.shape[0] == batch, (call.page_table.shape, batch)
        assert call.seqused_k.dtype == torch.int32 and call.seqused_k.shape == (batch,)
        assert isinstance(call.softmax_scale, float), f"softmax_scale {call.softmax_scale!r}"
        assert call.v_global_scale is None or isinstance(call.v_global_scale, float)
        assert out is not None, "the SM90 ops write into the caller's out"
        assert out.dtype == torch.bfloat16 and out.is_contiguous() and out.shape == q.shape, (
            out.dtype,
            out.shape,
            out.stride(),
        )
        assert out.device == q.device
        # What the impl passed, as it was at the call.
        call.q2k_indices = q2k.clone()
        call.page_table = call.page_table.clone()
        call.seqused_k = call.seqused_k.clone()
        self.calls.append(call)
        if self.compute:
            out.copy_(msa_reference(call).to(torch.bfloat16))
        return out


def msa_reference(call: MsaCall) -> torch.Tensor:
    """float32 `(tokens, q_heads, 128)`: what the op computes from `call`'s arguments."""
    q = call.q.float()
    tokens, q_heads, _ = q.shape
    kv_heads = call.k.shape[1]
    group = q_heads // kv_heads
    width = call.page_table.shape[1]
    out = torch.empty(tokens, q_heads, HEAD_DIM)
    start = 0
    for request, length in enumerate(call.query_lens):
        used = int(call.seqused_k[request])
        assert length <= used, f"request {request}: {length} query tokens, {used} keys"
        positions = torch.arange(used - length, used)
        for head in range(kv_heads):
            sel = call.q2k_indices[head, start : start + length].long()  # (L, 16)
            assert int(sel.max()) < width, f"a selected block past the page table's {width} columns"
            pages = call.page_table[request][sel.clamp(min=0)].long()  # (L, 16)
            assert int(pages.max()) < call.k.shape[0]
            keys = call.k[pages, head].float().reshape(length, 1, TOPK * PAGE, HEAD_DIM)
            values = call.v[pages, head].float().reshape(length, 1, TOPK * PAGE, HEAD_DIM)
            heads = slice(head * group, (head + 1) * group)
            attended = selected_block_attention(
                q[start : start + length, None, heads],
                keys,
                values,
                sel[:, None],
                positions,
                call.softmax_scale,
            )
            out[start : start + length, heads] = attended[:, 0]
        start += length
    assert start == tokens, (start, tokens)
    if call.v_global_scale is not None:
        out *= call.v_global_scale
    return out


def install(monkeypatch, ops: RecordingMsaOps, *modules: Any) -> None:
    """Replace FlashInfer's two ops by `ops` where the impl looks them up: in
    `flashinfer.msa_ops`, and in any of `modules` that bound the names itself."""
    import flashinfer.msa_ops as msa_ops

    for name in ("msa_sparse_attention", "msa_sparse_decode_attention"):
        real = getattr(msa_ops, name)
        ops.parameters.setdefault(name, set(inspect.signature(real).parameters))
        monkeypatch.setattr(msa_ops, name, getattr(ops, name))
        for module in modules:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(ops, name))


def registration_config(
    *,
    max_num_seqs: int,
    num_speculative_tokens: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    jit_warmup: bool = True,
) -> SimpleNamespace:
    """What patch 0007's registration reads of an engine's config (a CPU VllmConfig has no
    model): the JIT warm-up switch, the draft length, the dtype and context, the scheduler's
    limits and no decode context parallelism."""
    return SimpleNamespace(
        kernel_config=SimpleNamespace(enable_jit_warmup=jit_warmup),
        speculative_config=SimpleNamespace(num_speculative_tokens=num_speculative_tokens),
        model_config=SimpleNamespace(dtype=torch.bfloat16, max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        ),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )
