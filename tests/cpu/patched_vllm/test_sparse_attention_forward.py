"""Patch 0007's builder and impl `forward` on the CPU, FlashInfer's two ops recorded.

Each step comes from `vllm_minimax.testing.sparse_attention_cases` (the GPU test's batches:
random fp8 pages scattered over the cache, page-table entries past a sequence's end naming
live pages, an indexer-like selection, a NaN-poisoned output), goes through the patch's own
metadata builder and `MiniMaxM3SparseFlashInferImpl.forward`, and reaches
`sparse_attention_helpers.RecordingMsaOps` in place of `flashinfer.msa_ops`. The tests check
what the impl passed (table width, scales, heads, query lengths, the output buffer) and the
result against the float32 reference of the batch, so a wrong scale, head count or table
fails here rather than only on an H100 (tests/gpu_e2e/test_sparse_attention_kernels.py).
"""

from __future__ import annotations

import importlib
import math
from types import SimpleNamespace

import pytest
import torch
from sparse_attention_helpers import RecordingMsaOps, flashinfer_prefill_width_bounds, install

from vllm_minimax.probe import sparse_attention_in_series
from vllm_minimax.testing import sparse_attention_cases as cases

pytestmark = pytest.mark.skipif(
    not sparse_attention_in_series(), reason="this release's series has no FlashInfer attend"
)

SCALE = 1.0 / math.sqrt(cases.HEAD_DIM)
# The stand-in computes in float32 and rounds to bf16 (2^-9 relative); ten times that.
BOUND = 2e-2
CPU = torch.device("cpu")


@pytest.fixture
def env(monkeypatch):
    """The patch's module and vLLM's common sparse-attention module under a CPU engine
    config, with FlashInfer's ops recorded (`ops`) and the Triton attend recorded instead
    of launched (`triton`: the impl's Triton forward and the prefill beyond FlashInfer's
    page bound)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    fa = importlib.import_module(cases.FA_MODULE)
    common = importlib.import_module(cases.COMMON_MODULE)
    ops = RecordingMsaOps()
    install(monkeypatch, ops, fa)
    triton: list[tuple[str, dict]] = []

    def triton_forward(self, layer, query, kv_cache, output):
        triton.append(("forward", {"cache": kv_cache}))
        return output

    def triton_prefill(*args, **kwargs):
        triton.append(("prefill", {"args": args, **kwargs}))

    monkeypatch.setattr(common.MiniMaxM3SparseTritonImpl, "forward", triton_forward)
    monkeypatch.setattr(fa, "minimax_m3_sparse_attn", triton_prefill)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        yield SimpleNamespace(fa=fa, config=config, ops=ops, triton=triton)


def _forward(env, batch: cases.SparseBatch, *, kv_cache: torch.Tensor | None = None, impl=None):
    """One step through the builder and the impl; the output (NaN where nothing wrote)."""
    md = cases.build_metadata(batch, env.fa.MiniMaxM3SparseFlashInferMetadataBuilder, env.config)
    impl = impl or cases.make_impl(
        env.fa.MiniMaxM3SparseFlashInferImpl, batch.shape, scale=SCALE, kv_cache_dtype="fp8"
    )
    out = torch.full_like(batch.query, float("nan"))
    with cases.forward_context(md):
        impl.forward(
            cases.make_layer(batch),
            batch.query,
            batch.kv_fp8 if kv_cache is None else kv_cache,
            out,
        )
    return out


def _check_result(batch: cases.SparseBatch, out: torch.Tensor) -> None:
    assert not out.isnan().any(), "rows left unwritten"
    ref = cases.reference_attention(batch, scale=SCALE)
    err = cases.rel_l2(out, ref)
    assert err <= BOUND, f"rel L2 {err:.2e} against the float32 reference"
    for request in range(len(batch.shape.seq_lens)):
        rows = batch.token_req == request
        assert cases.rel_l2(out[rows], ref[rows]) <= BOUND, f"request {request}"


def _check_common(call, batch: cases.SparseBatch, out: torch.Tensor, tokens: slice) -> None:
    """What either op must get for the tokens `tokens` of the step."""
    shape = batch.shape
    assert call.q.shape == (tokens.stop - tokens.start, shape.num_heads, cases.HEAD_DIM)
    assert torch.equal(call.q.reshape(call.q.shape[0], -1), batch.query[tokens])
    # K and V: the two halves of each row of the bound cache, read in place.
    assert call.k.shape[1] == call.v.shape[1] == shape.num_kv_heads
    assert call.k.data_ptr() == batch.kv_fp8.data_ptr()
    assert call.v.data_ptr() == batch.kv_fp8.data_ptr() + cases.HEAD_DIM
    # The indexer's selection, per KV head.
    assert torch.equal(call.q2k_indices, batch.topk[tokens].transpose(0, 1))
    assert call.softmax_scale == pytest.approx(SCALE * shape.k_scale, rel=1e-6)
    assert (call.v_global_scale or 1.0) == pytest.approx(shape.v_scale, rel=1e-6)
    # Written in place: the rows of the layer's output buffer.
    row_bytes = out.shape[1] * out.element_size()
    assert call.out.data_ptr() == out.data_ptr() + tokens.start * row_bytes


@pytest.mark.parametrize(
    ("heads", "kv_heads", "layout"), [(8, 1, "NHD"), (16, 1, "NHD"), (32, 2, "HND")]
)
@pytest.mark.parametrize("query_len", [1, 3])
def test_a_decode_step(env, heads, kv_heads, layout, query_len):
    """Uniform decode (query length 1) and MTP verification (3): one decode call with every
    request's query tokens, the layer's scale times k_scale, v_scale on the output."""
    shape = cases.StepShape(
        num_heads=heads,
        num_kv_heads=kv_heads,
        decode_seq_lens=(300, 2100, 129),
        decode_query_len=query_len,
        block_table_width=64,
        layout=layout,
        k_scale=0.37,
        v_scale=2.5,
    )
    batch = cases.make_batch(shape, seed=heads + query_len, device=CPU)
    out = _forward(env, batch)
    assert env.ops.of("prefill") == [] and env.triton == []
    (call,) = env.ops.of("decode")
    _check_common(call, batch, out, slice(0, batch.num_tokens))
    assert call.seqlen_q == query_len
    assert torch.equal(call.page_table, batch.block_table)
    assert call.seqused_k.tolist() == list(shape.decode_seq_lens)
    _check_result(batch, out)


def test_a_mixed_step(env):
    """Decodes, then two prefill chunks (one with context): the decode op gets the decode
    tokens, the prefill op the rest, each writing its rows of the output."""
    shape = cases.StepShape(
        num_heads=16,
        decode_seq_lens=(700, 3000),
        prefills=((0, 40), (2500, 24)),
        block_table_width=1024,
        k_scale=1.7,
        v_scale=0.6,
    )
    batch = cases.make_batch(shape, seed=5, device=CPU)
    out = _forward(env, batch)
    (decode,) = env.ops.of("decode")
    (prefill,) = env.ops.of("prefill")
    _check_common(decode, batch, out, slice(0, 2))
    _check_common(prefill, batch, out, slice(2, batch.num_tokens))
    assert prefill.cu_seqlens_q.tolist() == [0, 40, 64]
    assert prefill.seqused_k.tolist() == [40, 2524]
    # 1024 columns are within FlashInfer's allocation-free programs: passed as they are.
    assert torch.equal(prefill.page_table, batch.block_table[2:])
    assert env.triton == []
    _check_result(batch, out)


@pytest.mark.parametrize("width", [1, 64, 800, 801, 4096, 4097, 8192])
def test_the_prefill_page_table_is_one_flashinfers_programs_take(env, width):
    """Whatever vLLM's block table width, the prefill op gets a table FlashInfer 0.7.4's
    allocation-free programs take (the stand-in refuses others), holding each request's
    pages: a narrow one widened, a wide one cut where the step's sequences fit."""
    union_max, programs_max = flashinfer_prefill_width_bounds()
    shape = cases.StepShape(
        prefills=((min(width, 9) * 128 - 40, 30), (100, 20)), block_table_width=width
    )
    batch = cases.make_batch(shape, seed=width, device=CPU)
    out = _forward(env, batch)
    (call,) = env.ops.of("prefill")
    columns = call.page_table.shape[1]
    assert union_max < columns <= programs_max
    kept = min(columns, width)
    assert torch.equal(call.page_table[:, :kept], batch.block_table[:, :kept])
    _check_result(batch, out)


def test_a_prefill_beyond_flashinfers_page_bound_attends_with_triton(env):
    """A sequence of more pages than FlashInfer's programs take: no FlashInfer prefill, the
    Triton prefill with the layer's own scale and its scale tensors; decodes of the same step
    still go to FlashInfer."""
    _, programs_max = flashinfer_prefill_width_bounds()
    width = 2 * programs_max
    shape = cases.StepShape(
        decode_seq_lens=(500,),
        prefills=((programs_max * 128, 8),),
        block_table_width=width,
        k_scale=0.5,
        v_scale=3.0,
    )
    # make_batch would fill a cache of the whole sequence: the prefill's pages are never
    # read here (its attend is recorded), so a small cache and table entries within it do.
    pages = 8
    gen = torch.Generator().manual_seed(3)
    table = torch.randint(0, pages, (2, width), dtype=torch.int32, generator=gen)
    kv = torch.randn(pages, 1, 128, 256, generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)
    positions = torch.tensor([499] + [programs_max * 128 + i for i in range(8)])
    batch = cases.SparseBatch(
        shape=shape,
        query=torch.randn(9, 8 * 128, generator=gen).to(torch.bfloat16),
        kv_fp8=kv,
        block_table=table,
        topk=cases.select_blocks(positions.clamp(max=499), 1, gen),
        positions=positions,
        token_req=torch.tensor([0] + [1] * 8),
    )
    out = _forward(env, batch)
    assert env.ops.of("prefill") == []
    assert len(env.ops.of("decode")) == 1 and not out[0].isnan().any()
    (triton,) = env.triton
    kind, call = triton
    assert kind == "prefill"
    assert call["k_scale"].item() == 0.5 and call["v_scale"].item() == 3.0
    assert any(isinstance(arg, float) and arg == SCALE for arg in call["args"]), (
        "the Triton prefill dequantizes with the layer's own scale"
    )
    assert any(
        isinstance(arg, torch.Tensor) and arg.shape == (1, width) and torch.equal(arg, table[1:])
        for arg in call["args"]
    ), "the Triton prefill reads vLLM's whole block table"


def _same_storage_views(pages: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two `[pages, heads, 128, 256]` views of one allocation: HND (dense pages) and NHD
    (not dense with several heads): same data pointer, same shape, other strides."""
    storage = torch.zeros(pages * heads * 128 * 256, dtype=torch.uint8)
    hnd = storage.view(pages, heads, 128, 256)
    nhd = storage.view(pages, 128, heads, 256).transpose(1, 2)
    assert hnd.data_ptr() == nhd.data_ptr() and hnd.shape == nhd.shape
    return hnd, nhd


def test_a_cache_flashinfer_cannot_read_in_place_goes_to_triton_per_bound_cache(env):
    """Two KV heads under NHD: the pages are not dense, so the Triton attend runs and
    FlashInfer is not called. The decision follows the bound cache, strides included: a
    cache of the same memory and shape but dense strides goes back to FlashInfer."""
    shape = cases.StepShape(num_heads=16, num_kv_heads=2, decode_seq_lens=(300, 900), layout="HND")
    batch = cases.make_batch(shape, seed=9, device=CPU)
    impl = cases.make_impl(
        env.fa.MiniMaxM3SparseFlashInferImpl, shape, scale=SCALE, kv_cache_dtype="fp8"
    )
    hnd, nhd = _same_storage_views(batch.kv_fp8.shape[0], 2)
    hnd.copy_(batch.kv_fp8)
    batch.kv_fp8 = hnd
    for cache, flashinfer in ((hnd, True), (nhd, False), (hnd, True), (nhd, False)):
        env.ops.calls.clear()
        env.triton.clear()
        _forward(env, batch, kv_cache=cache, impl=impl)
        if flashinfer:
            assert len(env.ops.calls) == 1 and env.triton == []
        else:
            assert env.ops.calls == [], "FlashInfer read a cache whose pages are not dense"
            assert [kind for kind, _ in env.triton] == ["forward"]
            assert env.triton[0][1]["cache"] is cache


class _BoundLayer:
    """What the warm-up keeps of a sparse layer (weakly): its impl and bound cache."""

    def __init__(self, impl, kv_cache: torch.Tensor) -> None:
        self.impl = impl
        self.kv_cache = kv_cache


@pytest.mark.parametrize("num_speculative_tokens", [0, 2])
def test_the_warmup_launches_every_decode_query_length_the_engine_runs(
    monkeypatch, caplog, num_speculative_tokens
):
    """vLLM's JIT warm-up registry, fed by the layer's registration, launches FlashInfer's
    decode op once per decode query length a step can have (1, and 1 + k under MTP with k
    speculative tokens), each with whole requests of that length, and the prefill op with a
    table its allocation-free programs take. Its launches run on the CPU here (their buffers'
    device replaced), against the recorded ops."""
    import logging

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    fa = importlib.import_module(cases.FA_MODULE)
    ops = RecordingMsaOps(compute=False)
    install(monkeypatch, ops, fa)
    real_buffers = fa.WarmupBuffers
    monkeypatch.setattr(
        fa, "WarmupBuffers", lambda g, launches, device: real_buffers(g, launches, CPU)
    )
    monkeypatch.setattr(fa, "_JIT", fa._SparseAttentionJit())
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda: (70 << 30, 80 << 30))
    # What the registration reads of an engine's config (a CPU VllmConfig has no model).
    config = SimpleNamespace(
        kernel_config=SimpleNamespace(enable_jit_warmup=True),
        speculative_config=SimpleNamespace(num_speculative_tokens=num_speculative_tokens),
        model_config=SimpleNamespace(dtype=torch.bfloat16, max_model_len=40000),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )
    shape = cases.StepShape(num_heads=16)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        impl = cases.make_impl(
            fa.MiniMaxM3SparseFlashInferImpl, shape, scale=SCALE, kv_cache_dtype="fp8"
        )
        layer = _BoundLayer(impl, torch.zeros(3, 1, 128, 256, dtype=torch.uint8))
        registry = JitWarmupRegistry(vllm_config=config)
        with registry.activate():
            fa.register_sparse_attention_warmup(layer, config)
        assert len(registry) == 1
        with caplog.at_level(logging.WARNING):
            fa.logger.propagate = True
            registry.warmup()
    assert "did not finish" not in caplog.text, caplog.text
    decode = ops.of("decode")
    assert {call.seqlen_q for call in decode} == set(range(1, 2 + num_speculative_tokens))
    for call in decode:
        assert call.q.shape[1] == 16 and call.softmax_scale == pytest.approx(SCALE)
    assert ops.of("prefill"), "no prefill program was launched"
