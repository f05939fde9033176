"""The patched vLLM's FlashInfer indexer builder and impl, on the CPU.

The builder runs on `CommonAttentionMetadata` batches of every shape the
scheduler produces. The impl's `forward` runs with FlashInfer's two kernels
replaced by the float32 reference (behind the same argument checks FlashInfer
makes), and its output buffer is compared with a selection computed from the
raw batch, not from the metadata.
"""

from __future__ import annotations

import types

import pytest
import torch
from indexer_helpers import (
    PAGE,
    POISON,
    Batch,
    expected_selection,
    make_batch,
    make_builder,
    make_impl,
    run_forward,
)
from vllm.models.minimax_m3.nvidia import indexer_flashinfer as fi_mod

from vllm_minimax.testing import reference

pytestmark = pytest.mark.usefixtures("single_rank")


BATCHES = {
    "decode": ([3000, 5, 127, 128, 40000], [1, 1, 1, 1, 1]),
    "prefill": ([0, 0], [300, 2049]),
    "decode+prefill": ([9000, 4096, 0], [1, 1, 700]),
    "chunked-prefill-on-context": ([1, 4000], [1, 1500]),
    "mtp-2": ([2500, 129, 6000], [2, 2, 2]),
    "mtp-4": ([2500, 129, 6000, 70], [4, 4, 4, 4]),
    "ragged-mid-page": ([0, 255, 1000], [129, 2, 383]),
    # MTP with 2 speculative tokens (the serving configs'): decodes of 3 tokens beside a
    # chunk on cached context, the decode side's 15 rows not a multiple of 4.
    "mtp-3-beside-chunk": ([2500, 129, 6000, 70, 300, 7000], [3, 3, 3, 3, 3, 2000]),
    # Decodes of unequal length: only the leading run of equal ones is the decode side.
    "mtp-3-uneven": ([4000, 900, 128, 1500], [3, 3, 2, 2]),
}
DECODE_THRESHOLD = {"mtp-2": 2, "mtp-4": 4, "mtp-3-beside-chunk": 3, "mtp-3-uneven": 3}


def expected_split(batch: Batch, threshold: int) -> tuple[int, int, int, int]:
    """Leading requests with the same short query length are decodes."""
    first = batch.query_lens[0]
    num_decodes = 0
    if first <= threshold:
        while num_decodes < len(batch.query_lens) and batch.query_lens[num_decodes] == first:
            num_decodes += 1
    decode_tokens = sum(batch.query_lens[:num_decodes])
    return (
        num_decodes,
        len(batch.query_lens) - num_decodes,
        decode_tokens,
        sum(batch.query_lens) - decode_tokens,
    )


@pytest.mark.parametrize("name", BATCHES)
def test_builder_fields(name):
    batch = make_batch(*BATCHES[name])
    threshold = DECODE_THRESHOLD.get(name, 1)
    builder = make_builder(local_blocks=1, threshold=threshold)
    builder.num_valid_pages_buffer.fill_(POISON)
    md = builder.build(0, batch.metadata)
    assert isinstance(md, fi_mod.MiniMaxM3IndexerFlashInferMetadata)

    num_tokens = sum(batch.query_lens)
    assert md.num_actual_tokens == num_tokens
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens, md.num_prefill_tokens) == (
        expected_split(batch, threshold)
    )
    assert md.prefill is None and md.decode is None
    assert md.max_k_tiles == -(-max(batch.seq_lens) // PAGE)
    assert md.max_seq_len == max(batch.seq_lens)
    # The calls' page counts are views of the builder's shared buffer, and only the
    # step's tokens are written.
    assert md.calls[0].num_valid_pages.data_ptr() == builder.num_valid_pages_buffer.data_ptr()
    assert torch.all(builder.num_valid_pages_buffer[num_tokens:] == POISON)
    check_calls(md, batch, expected_split(batch, threshold))


def check_calls(md, batch, split) -> None:
    """One pair over a pure batch; a decode pair and a prefill pair over a mixed
    one, each covering whole requests with their own rebased inputs."""
    num_decodes, num_prefills, decode_tokens, _ = split
    num_tokens = sum(batch.query_lens)
    if num_decodes and num_prefills:
        sides = [(0, num_decodes, False), (num_decodes, len(batch.query_lens), True)]
    else:
        sides = [(0, len(batch.query_lens), num_prefills > 0)]
    assert len(md.calls) == len(sides)
    token_start = 0
    for call, (first, last, is_prefill) in zip(md.calls, sides, strict=True):
        query_lens = batch.query_lens[first:last]
        token_end = token_start + sum(query_lens)
        assert (call.token_start, call.token_end) == (token_start, token_end)
        assert call.cu_seqlens_q.dtype == torch.int32
        assert call.cu_seqlens_q.tolist() == [0, *torch.tensor(query_lens).cumsum(0).tolist()]
        assert call.seqused_k.tolist() == batch.seq_lens[first:last]
        assert torch.equal(call.page_table, batch.metadata.block_table_tensor[first:last])
        if is_prefill and num_decodes:
            # The step's longest query: a bound on this side's own, equal to it unless the
            # decodes are longer than every prefill (mtp-3-uneven).
            assert call.max_seqlen_q == max(batch.query_lens)
        else:
            assert call.max_seqlen_q == max(query_lens)
        assert call.num_valid_pages.tolist() == [
            p // PAGE + 1 for p in batch.positions[token_start:token_end]
        ]
        token_start = token_end
    assert token_start == num_tokens
    if num_decodes and num_prefills:
        assert md.calls[0].token_end == decode_tokens


@pytest.mark.parametrize("query_len", [1, 2, 3])
def test_full_graph_decode_reads_only_stable_buffers(query_len):
    """Uniform decode batches are captured in full CUDA graphs with the indexer
    inside (the base builder's UNIFORM_BATCH support; seen on the H200). vLLM
    captures with max_seq_len = max_model_len, so what the graph bakes in is
    the capture's ints and tensor addresses: every tensor the decode call reads
    must alias the runner's persistent buffers or the builder's own, and the
    baked ints must not depend on the replay's context lengths."""
    max_model_len = 32768
    capture = make_batch([max_model_len - query_len] * 4, [query_len] * 4)
    replay = make_batch([3000, 5, 127, 9000], [query_len] * 4)
    # The runner's persistent buffers: the replay batch refills them in place.
    for name in ("query_start_loc", "seq_lens", "block_table_tensor", "positions"):
        buffer = getattr(capture.metadata, name)
        width = getattr(replay.metadata, name).shape[-1]
        buffer[..., :width].copy_(getattr(replay.metadata, name))
        setattr(replay.metadata, name, buffer[..., :width] if buffer.ndim > 1 else buffer)
    builder = make_builder(threshold=query_len)
    at_capture = builder.build(0, capture.metadata)
    (graph_call,) = at_capture.calls
    at_replay = builder.build(0, replay.metadata)
    (replay_call,) = at_replay.calls
    assert at_capture.num_prefills == at_replay.num_prefills == 0
    assert at_capture.max_k_tiles == max_model_len // PAGE >= at_replay.max_k_tiles
    assert graph_call.max_seqlen_q == replay_call.max_seqlen_q == query_len
    for field in ("cu_seqlens_q", "seqused_k", "page_table", "num_valid_pages"):
        captured, replayed = getattr(graph_call, field), getattr(replay_call, field)
        assert captured.data_ptr() == replayed.data_ptr(), f"{field} is a per-step copy"
    # The captured views now hold the replay's values.
    assert graph_call.num_valid_pages.tolist() == [p // PAGE + 1 for p in replay.positions]
    assert graph_call.seqused_k.tolist() == replay.seq_lens


CASES = [
    ("decode", 1, "fp8", 0, 1),
    ("decode", 4, "bf16", 0, 1),
    ("prefill", 1, "fp8", 0, 1),
    ("decode+prefill", 2, "fp8", 1, 1),
    ("chunked-prefill-on-context", 1, "fp8", 2, 2),
    ("mtp-2", 4, "fp8", 0, 1),
    ("mtp-4", 1, "bf16", 0, 1),
    ("ragged-mid-page", 2, "fp8", 1, 0),
    ("mtp-3-beside-chunk", 1, "fp8", 0, 1),
    ("mtp-3-uneven", 2, "fp8", 0, 1),
]


@pytest.mark.parametrize(("name", "heads", "dtype", "init_blocks", "local_blocks"), CASES)
def test_forward_writes_the_reference_selection(
    monkeypatch, kernels, name, heads, dtype, init_blocks, local_blocks
):
    torch.manual_seed(hash(name) % 1000)
    batch = make_batch(*BATCHES[name])
    num_tokens = sum(batch.query_lens)
    impl, buffer = make_impl(
        heads=heads, dtype=dtype, init_blocks=init_blocks, local_blocks=local_blocks
    )
    cache_dtype = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
    assert impl.index_cache.dtype == cache_dtype
    impl.index_cache.bind_kv_cache(torch.randn(batch.num_pages, 1, PAGE, 128).to(cache_dtype))
    # The model's index query may carry padding rows past the step's tokens.
    index_query = torch.randn(num_tokens + 5, heads * 128).to(cache_dtype)
    md = make_builder(
        index_heads=heads, local_blocks=local_blocks, threshold=DECODE_THRESHOLD.get(name, 1)
    ).build(0, batch.metadata)

    assert run_forward(monkeypatch, impl, md, index_query) == (None, None)

    k_pages = impl.index_cache.kv_cache.view(-1, 1, PAGE, 128)
    want = expected_selection(
        batch, index_query[:num_tokens], k_pages, heads, init_blocks, local_blocks
    )
    assert torch.equal(buffer[:num_tokens], want)
    assert torch.all(buffer[num_tokens:] == POISON), "rows past num_tokens were written"
    num_decodes, num_prefills, _, _ = expected_split(batch, DECODE_THRESHOLD.get(name, 1))
    pairs = 2 if num_decodes and num_prefills else 1
    assert len(kernels.proxy_calls) == pairs
    for proxy, call in zip(kernels.proxy_calls, md.calls, strict=True):
        assert proxy["q"].dtype == cache_dtype, "the index query must reach the kernel as is"
        assert proxy["max_seqlen_q"] == call.max_seqlen_q
        assert proxy["max_k_tiles"] == md.max_k_tiles
    if pairs == 2:
        # The decode rows stay in FlashInfer's decode regime (max_seqlen_q <= 4).
        assert kernels.proxy_calls[0]["max_seqlen_q"] <= 4
    forced = [(call["force_begin"], call["force_end"]) for call in kernels.topk_calls]
    assert forced == [(init_blocks, local_blocks)] * pairs
    problems = reference.check_selection_invariants(
        buffer[:num_tokens],
        batch.step.valid_pages(),
        topk=16,
        force_begin_blocks=init_blocks,
        force_end_blocks=local_blocks,
    )
    assert problems == []


def test_prefill_query_gets_overread_slack_and_decode_is_not_copied(monkeypatch, kernels):
    impl, _ = make_impl(heads=1, dtype="fp8")
    prefill = make_batch(*BATCHES["decode+prefill"])
    decode = make_batch(*BATCHES["decode"])
    pages = max(prefill.num_pages, decode.num_pages)
    impl.index_cache.bind_kv_cache(torch.randn(pages, 1, PAGE, 128).to(torch.float8_e4m3fn))
    rows = sum(prefill.query_lens)
    index_query = torch.randn(rows, 128).to(torch.float8_e4m3fn)
    run_forward(monkeypatch, impl, make_builder().build(0, prefill.metadata), index_query)
    decode_side, prefill_side = kernels.proxy_calls
    decode_rows = decode_side["q"].shape[0]
    assert decode_side["q"].data_ptr() == index_query.data_ptr(), "decode rows were copied"
    prefill_rows = rows - decode_rows
    assert prefill_side["q_storage"] >= (prefill_rows + 127) * 128, "no room for the over-read"
    assert torch.equal(
        prefill_side["q"].view(torch.uint8).view(prefill_rows, 128),
        index_query[decode_rows:].view(torch.uint8),
    )

    index_query = torch.randn(sum(decode.query_lens), 128).to(torch.float8_e4m3fn)
    run_forward(monkeypatch, impl, make_builder().build(0, decode.metadata), index_query)
    assert kernels.proxy_calls[-1]["q"].data_ptr() == index_query.data_ptr()


def test_short_contexts_force_clamped_regions(monkeypatch, kernels):
    """init + local blocks larger than a context: no raise, every page selected."""
    impl, buffer = make_impl(heads=1, dtype="fp8", init_blocks=20, local_blocks=4)
    batch = make_batch([100, 600], [1, 1])
    impl.index_cache.bind_kv_cache(
        torch.randn(batch.num_pages, 1, PAGE, 128).to(torch.float8_e4m3fn)
    )
    md = make_builder(local_blocks=4).build(0, batch.metadata)
    run_forward(monkeypatch, impl, md, torch.randn(2, 128).to(torch.float8_e4m3fn))
    [call] = kernels.topk_calls
    assert (call["force_begin"], call["force_end"]) == (5, 4)  # max_k_tiles == 5
    assert buffer[0, 0].tolist() == [0] + [-1] * 15
    assert buffer[1, 0].tolist() == [0, 1, 2, 3, 4] + [-1] * 11


def test_profiling_run_returns_early_and_writes_nothing(monkeypatch, kernels):
    impl, buffer = make_impl(heads=1, dtype="fp8")
    monkeypatch.setattr(
        fi_mod, "get_forward_context", lambda: types.SimpleNamespace(attn_metadata=None)
    )
    assert impl(torch.randn(8, 128).to(torch.float8_e4m3fn)) == (None, None)
    assert kernels.proxy_calls == [] and kernels.topk_calls == []
    assert torch.all(buffer == POISON)


def test_backend_reports_the_flashinfer_builder():
    impl, _ = make_impl(heads=1, dtype="fp8")
    backend = impl.index_cache.get_attn_backend()
    assert backend is fi_mod.MiniMaxM3IndexerFlashInferBackend
    assert backend.get_builder_cls() is fi_mod.MiniMaxM3IndexerFlashInferMetadataBuilder
