"""FlashInfer's SM90 sparse attend through the patch's impl and builder (GPU only).

Each case builds one step (`vllm_minimax.testing.sparse_attention_cases`):
fresh random fp8 pages scattered over the cache, page-table entries past a
sequence's end pointing at live pages, an indexer-like selection, and a
NaN-poisoned output. The FlashInfer impl and vLLM's own Triton impl (on the same
fp8 cache) must each be within `BOUND` relative L2 of a float32 reference, on
the whole step and on every request; a control (the reference with one selected
block dropped per token) must be outside it by a factor of four, so the bound
can fail.

    vllm-minimax apply --target SITE
    python -m pytest -q tests/gpu_e2e/test_sparse_attention_kernels.py
"""

from __future__ import annotations

import importlib
import math
import zlib

import pytest
import torch

from vllm_minimax.testing import sparse_attention_cases as cases

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec(cases.FA_MODULE) is None,
        reason="the vLLM this Python imports has no FlashInfer sparse attention (apply the series)",
    ),
]

# FlashInfer's SM90 kernels feed fp8 WGMMAs (about 2e-3 relative L2 against
# float32 on random data); bf16 outputs round at 2^-8. Ten times the former.
BOUND = 2e-2
CONTROL_FACTOR = 4.0
SCALE = 1.0 / math.sqrt(cases.HEAD_DIM)


@pytest.fixture(scope="module")
def env():
    torch.cuda.set_device(0)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FlashInfer's sparse attend runs on SM90")
    from vllm.config import VllmConfig, set_current_vllm_config

    fa = importlib.import_module(cases.FA_MODULE)
    common = importlib.import_module(cases.COMMON_MODULE)
    config = VllmConfig()
    with set_current_vllm_config(config):
        yield fa, common, config


def _run(env, shape: cases.StepShape, seed: int, *, triton: bool = True) -> dict[str, float]:
    fa, common, config = env
    device = torch.device("cuda")
    batch = cases.make_batch(shape, seed=seed, device=device)
    ref = cases.reference_attention(batch, scale=SCALE)
    control = cases.reference_attention(batch, scale=SCALE, topk=cases.drop_last_block(batch.topk))
    md = cases.build_metadata(batch, fa.MiniMaxM3SparseFlashInferMetadataBuilder, config)
    layer = cases.make_layer(batch)
    results: dict[str, float] = {}
    impls = {"flashinfer": fa.MiniMaxM3SparseFlashInferImpl}
    if triton:
        impls["triton"] = common.MiniMaxM3SparseTritonImpl
    for name, impl_cls in impls.items():
        impl = cases.make_impl(impl_cls, shape, scale=SCALE, kv_cache_dtype="fp8")
        out = torch.full_like(batch.query, float("nan"))
        with cases.forward_context(md):
            impl.forward(layer, batch.query, batch.kv_fp8, out)
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"{name}: rows left unwritten"
        err = cases.rel_l2(out, ref)
        assert err <= BOUND, f"{name}: rel L2 {err:.2e} > {BOUND}"
        for r in range(len(shape.seq_lens)):
            rows = batch.token_req == r
            req_err = cases.rel_l2(out[rows], ref[rows])
            assert req_err <= BOUND, f"{name}: request {r} rel L2 {req_err:.2e}"
        ctrl = cases.rel_l2(out, control)
        assert ctrl > CONTROL_FACTOR * BOUND, f"{name}: control only {ctrl:.2e} away"
        results[name] = err
    return results


PREFIX_CASES = {
    f"prefill-{q}-at-{prefix}-g{hq}": cases.StepShape(
        num_heads=hq,
        prefills=((prefix, q),),
        block_table_width=max(1024, -(-(prefix + q) // 128)),
    )
    for hq in (8, 16)
    for prefix, q in ((0, 2048), (32768, 1024), (131072 + 37, 1024), (200000 + 5, 333))
}


@pytest.mark.parametrize("name", list(PREFIX_CASES))
def test_prefill_chunks_at_prefixes(env, name):
    print(name, _run(env, PREFIX_CASES[name], seed=zlib.crc32(name.encode()) % 1000))


@pytest.mark.parametrize("batch", [1, 32, 256])
@pytest.mark.parametrize("hq", [8, 16])
def test_uniform_decode(env, batch, hq):
    gen = torch.Generator().manual_seed(batch * hq)
    lens = tuple(int(x) for x in torch.randint(1, 40000, (batch,), generator=gen))
    shape = cases.StepShape(num_heads=hq, decode_seq_lens=lens, block_table_width=1024)
    print(batch, hq, _run(env, shape, seed=batch))


@pytest.mark.parametrize("query_len", [2, 3, 4])
def test_mtp_verification(env, query_len):
    gen = torch.Generator().manual_seed(query_len)
    lens = tuple(int(x) for x in torch.randint(query_len, 40000, (32,), generator=gen))
    shape = cases.StepShape(
        decode_seq_lens=lens, decode_query_len=query_len, block_table_width=1024
    )
    print(query_len, _run(env, shape, seed=query_len))


@pytest.mark.parametrize("hq", [8, 16])
def test_mixed_decodes_and_prefill_chunks(env, hq):
    gen = torch.Generator().manual_seed(hq)
    lens = tuple(int(x) for x in torch.randint(1, 60000, (16,), generator=gen))
    shape = cases.StepShape(
        num_heads=hq,
        decode_seq_lens=lens,
        prefills=((0, 700), (61440 + 11, 1500)),
        block_table_width=1024,
    )
    print(hq, _run(env, shape, seed=hq))


@pytest.mark.parametrize("width", [64, 800, 801, 1408, 2048, 4097])
@pytest.mark.parametrize("num_seqs", [1, 16, 17, 64])
def test_page_table_widths_and_sequence_counts(env, width, num_seqs):
    """Widths on both sides of FlashInfer 0.7.4's routing bounds (800 columns,
    4096 pages) and sequence counts on both sides of its 16-sequence schedule;
    the longest sequence fills the table, so at 4097 the step goes to Triton."""
    gen = torch.Generator().manual_seed(width + num_seqs)
    full = width * 128 - 3
    lens = [full] + [int(x) for x in torch.randint(9, full, (num_seqs - 1,), generator=gen)]
    shape = cases.StepShape(prefills=tuple((n - 8, 8) for n in lens), block_table_width=width)
    print(width, num_seqs, _run(env, shape, seed=width * num_seqs, triton=False))


def test_scales_other_than_one(env):
    shape = cases.StepShape(
        decode_seq_lens=(5000, 17, 30000),
        prefills=((4096, 512),),
        k_scale=0.37,
        v_scale=2.5,
    )
    print(_run(env, shape, seed=7))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_two_kv_heads_per_rank(env, layout):
    """TP 2's geometry: under HND (vLLM's LBHNC, which the backend asks for)
    FlashInfer attends in place; under NHD the pages are not dense, so the whole
    step attends with Triton."""
    fa, _, _ = env
    shape = cases.StepShape(
        num_heads=32,
        num_kv_heads=2,
        decode_seq_lens=(3000, 9000),
        prefills=((2048, 1024),),
        layout=layout,
    )
    batch = cases.make_batch(shape, seed=11, device=torch.device("cuda"))
    impl = cases.make_impl(
        fa.MiniMaxM3SparseFlashInferImpl, shape, scale=SCALE, kv_cache_dtype="fp8"
    )
    assert (impl.cache_views(batch.kv_fp8) is None) == (layout == "NHD")
    print(layout, _run(env, shape, seed=11))


def test_warmup_launches_run_through_the_public_ops(env):
    fa, _, _ = env
    geometry = fa.SparseAttentionWarmupGeometry(
        num_heads=8,
        num_kv_heads=1,
        scale=SCALE,
        max_decode_query_len=3,
        max_num_decodes=8,
        max_num_batched_tokens=64,
        block_table_width=1024,
    )
    for launch in fa.warmup_launches(geometry):
        fa.run_warmup_launch(geometry, *launch, torch.device("cuda"))
    torch.cuda.synchronize()
