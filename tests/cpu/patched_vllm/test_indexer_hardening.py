"""Issue 16: the patched FlashInfer indexer's regime-keyed q slack, the decode
side's max_seqlen_q, the profiled score workspace, the page-size check, the
one local window and the FULL-graph contract, on the CPU with vLLM's own code.

The regime is compared with FlashInfer 0.7.4's own SM90 dispatch
(`proxy_score_sm90`), run on CPU tensors with its kernels replaced by
recorders; selections are compared with the float32 reference computed from
the raw batch.
"""

from __future__ import annotations

import types

import pytest
import torch
from flashinfer.msa_ops import _sm90_dispatch, cake_hopper_sm90
from flashinfer.msa_ops.cute_dsl import proxy_score_decode_sm90, proxy_score_prefill_sm90
from indexer_helpers import (
    FP8,
    MAX_TOKENS,
    PAGE,
    bind_cache,
    expected_selection,
    make_batch,
    make_builder,
    make_impl,
    run_forward,
)
from vllm.config import DeviceConfig, VllmConfig
from vllm.models.minimax_m3.nvidia import indexer_flashinfer as fi_mod

from vllm_minimax.testing.patched_module import indexer_text_config

pytestmark = pytest.mark.usefixtures("single_rank")
# What the engine's config holds at profiling, for the impls that reserve the workspace.
MAX_MODEL_LEN = 65536


# ---------------------------------------------------------------------------
# 1. The q slack follows FlashInfer's regime.
# ---------------------------------------------------------------------------
def flashinfer_sm90_regime(monkeypatch, q_rows, max_seqlen_q, cu_seqlens_q, seqused_k) -> str:
    """The regime FlashInfer 0.7.4's `proxy_score_sm90` picks for these
    arguments ('decode' or 'prefill'), its kernels replaced by recorders."""
    taken = []
    decode = lambda *a, **k: taken.append("decode")  # noqa: E731
    prefill = lambda *a, **k: taken.append("prefill")  # noqa: E731
    monkeypatch.setattr(_sm90_dispatch, "_cute_proxy_decode_preferred", lambda *a: False)
    monkeypatch.setattr(cake_hopper_sm90, "proxy_decode_route_available", lambda **k: True)
    monkeypatch.setattr(cake_hopper_sm90, "proxy_prefill_route_available", lambda **k: True)
    monkeypatch.setattr(cake_hopper_sm90, "hopper_msa_proxy_score_decode", decode)
    monkeypatch.setattr(cake_hopper_sm90, "hopper_msa_proxy_score_prefill", prefill)
    monkeypatch.setattr(proxy_score_decode_sm90, "run", decode)
    monkeypatch.setattr(proxy_score_prefill_sm90, "run", prefill)
    batch = seqused_k.numel()
    _sm90_dispatch.proxy_score_sm90(
        torch.zeros(q_rows, 1, 128).to(FP8),
        torch.zeros(4, 1, PAGE, 128).to(FP8),
        cu_seqlens_q,
        torch.zeros(batch, 4, dtype=torch.int32),
        seqused_k,
        torch.empty(1, 4, q_rows),
        max_seqlen_q=max_seqlen_q,
        batch_size=batch,
        kv_fp8=True,
    )
    (regime,) = taken
    return regime


# (context_lens, query_lens, decode threshold = 1 + speculative tokens)
REGIME_BATCHES = {
    "decode": ([3000, 5, 127], [1, 1, 1], 1),
    "mtp-k3 (q 4)": ([2500, 129, 6000], [4, 4, 4], 4),
    "mtp-k4 (q 5)": ([2500, 129, 6000], [5, 5, 5], 5),
    "mtp-k4 beside a chunk": ([2500, 129, 0], [5, 5, 700], 5),
    "mtp-k1 beside a chunk": ([2500, 129, 0], [2, 2, 700], 2),
    "zero-length row among decodes": ([2500, 40, 129, 0], [2, 0, 2, 700], 2),
    "prefill": ([0, 0], [300, 2049]),
    "one short prefill": ([0], [3]),
}


@pytest.mark.parametrize("name", REGIME_BATCHES)
def test_each_call_is_in_the_regime_flashinfer_dispatches_it_to(monkeypatch, name):
    context_lens, query_lens, *threshold = REGIME_BATCHES[name]
    md = make_builder(threshold=threshold[0] if threshold else 1).build(
        0, make_batch(context_lens, query_lens).metadata
    )
    for call in md.calls:
        rows = call.token_end - call.token_start
        fi_regime = flashinfer_sm90_regime(
            monkeypatch, rows, call.max_seqlen_q, call.cu_seqlens_q, call.seqused_k
        )
        assert call.prefill_regime == (fi_regime == "prefill"), (name, call)


def test_mtp_k4_decode_query_gets_the_slack_and_k3_is_not_copied(monkeypatch, kernels):
    """Query length 5 is FlashInfer's prefill regime although vLLM calls it
    decode: its q needs the 127 rows of slack; query length 4 is not copied."""
    impl, _ = make_impl(max_model_len=MAX_MODEL_LEN)
    k4 = make_batch([2500, 129, 6000], [5, 5, 5])
    k3 = make_batch([2500, 129, 6000], [4, 4, 4])
    impl.index_cache.bind_kv_cache(
        torch.randn(max(k4.num_pages, k3.num_pages), 1, PAGE, 128).to(FP8)
    )
    q5 = torch.randn(15, 128).to(FP8)
    run_forward(monkeypatch, impl, make_builder(threshold=5).build(0, k4.metadata), q5)
    (call,) = kernels.proxy_calls
    assert call["max_seqlen_q"] == 5
    assert call["q_storage"] >= (15 + 127) * 128, "no room behind q for the over-read"
    q4 = torch.randn(12, 128).to(FP8)
    run_forward(monkeypatch, impl, make_builder(threshold=4).build(0, k3.metadata), q4)
    assert kernels.proxy_calls[-1]["q_ptr"] == q4.data_ptr(), "a decode-regime q was copied"


# ---------------------------------------------------------------------------
# 2. The decode side's max_seqlen_q.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("context_lens", "query_lens", "threshold", "decode_max"),
    [
        ([2500, 40, 129, 0], [2, 0, 2, 700], 2, 2),  # 4 // 3 would be 1
        ([900, 40, 41, 0], [1, 0, 0, 500], 1, 1),  # 1 // 3 would be 0
    ],
)
def test_decode_max_seqlen_q_counts_zero_length_rows_out(
    monkeypatch, kernels, context_lens, query_lens, threshold, decode_max
):
    batch = make_batch(context_lens, query_lens)
    md = make_builder(threshold=threshold).build(0, batch.metadata)
    assert md.num_prefills == 1 and md.num_decodes == len(query_lens) - 1
    decode_call = md.calls[0]
    assert decode_call.max_seqlen_q == decode_max
    impl, buffer = make_impl(max_model_len=MAX_MODEL_LEN)
    bind_cache(impl, batch)
    index_query = torch.randn(batch.num_tokens, 128).to(FP8)
    run_forward(monkeypatch, impl, md, index_query)
    assert kernels.proxy_calls[0]["max_seqlen_q"] == decode_max
    k_pages = impl.index_cache.kv_cache.view(-1, 1, PAGE, 128)
    want = expected_selection(batch, index_query, k_pages, 1, 0, 1)
    assert torch.equal(buffer[: batch.num_tokens], want)


# ---------------------------------------------------------------------------
# 3. The score buffer is a reserved, reused workspace.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("heads", "max_model_len", "max_tokens", "max_decode_tokens", "rows"),
    [
        (1, 131072, 8192, 256, 8192),  # TP8 (4 index heads / 8 ranks), 128k: 32 MiB
        # TP1, 1M, 16k tokens: prefills in chunks of 2048 rows, 256 MiB (not 2 GiB).
        (4, 1 << 20, 16384, 256, 2048),
        # 1024 decodes of MTP K=4 are scored whole: the decode side sets the size.
        (4, 1 << 20, 16384, 5120, 5120),
        (2, 1000, 64, 64, 64),  # a partial last page counts whole
    ],
)
def test_score_workspace_shape(heads, max_model_len, max_tokens, max_decode_tokens, rows):
    shape = fi_mod.score_workspace_shape(heads, max_model_len, max_tokens, max_decode_tokens)
    assert shape == (heads, -(-max_model_len // PAGE), rows)
    # Any prefill chunk of a shorter step fits the reserved scores.
    for tiles in sorted({1, 7, 100, 1000, shape[1]} & set(range(1, shape[1] + 1))):
        chunk = min(max_tokens, fi_mod.prefill_chunk_rows(tiles))
        assert tiles * chunk <= shape[1] * shape[2]


def test_profiling_reserves_the_workspace_and_every_call_reuses_it(
    monkeypatch, kernels, cpu_workspace
):
    max_model_len = 20000
    impl, buffer = make_impl(heads=2, max_model_len=max_model_len)
    # The profiling run: no metadata, nothing scored, the workspace reserved.
    monkeypatch.setattr(
        fi_mod, "get_forward_context", lambda: types.SimpleNamespace(attn_metadata=None)
    )
    assert impl(torch.randn(8, 256).to(FP8)) == (None, None)
    impl.reserve_workspace()
    reserved = cpu_workspace._current_workspaces[0]
    assert reserved is not None
    assert reserved.numel() == 2 * -(-max_model_len // PAGE) * MAX_TOKENS * 4
    # vLLM locks the workspace after capture: no step may grow it.
    cpu_workspace.lock()
    batches = [
        (make_batch([9000, 4096, 0], [1, 1, 700]), 1),
        (make_batch([19000 - 1, 77], [1, 1]), 1),
        (make_batch([0], [1000]), 1),
    ]
    for batch, threshold in batches:
        bind_cache(impl, batch)
        index_query = torch.randn(batch.num_tokens, 256).to(FP8)
        run_forward(
            monkeypatch,
            impl,
            make_builder(threshold=threshold).build(0, batch.metadata),
            index_query,
        )
        k_pages = impl.index_cache.kv_cache.view(-1, 1, PAGE, 128)
        want = expected_selection(batch, index_query, k_pages, 2, 0, 1)
        assert torch.equal(buffer[: batch.num_tokens], want)
    assert len(kernels.proxy_calls) == 4
    for call in kernels.proxy_calls:
        assert call["output"] is not None, "the score buffer was allocated per call"
        assert call["output"].data_ptr() == reserved.data_ptr()
    assert {t["score_ptr"] for t in kernels.topk_calls} == {reserved.data_ptr()}


def test_long_prefills_are_scored_in_query_chunks_within_the_reserved_buffer(
    monkeypatch, kernels, cpu_workspace
):
    """A prefill side whose scores would pass the per-head cap is scored in query
    chunks of whole 128-row tiles, cutting requests where it must; every row keeps
    its own causal extent (the selection equals the whole batch's reference), and no
    call's scores exceed what profiling reserved, with the workspace locked."""
    max_model_len = 12000  # 94 pages
    # A cap of 3 tiles of rows at this engine's longest context: 384-row chunks.
    monkeypatch.setattr(fi_mod, "_SCORE_CHUNK_ELEMENTS", 3 * PAGE * 94)
    impl, buffer = make_impl(heads=2, max_model_len=max_model_len)
    impl.reserve_workspace()
    reserved = cpu_workspace._current_workspaces[0]
    assert reserved.numel() == 2 * 94 * max(64, 3 * PAGE) * 4
    cpu_workspace.lock()
    # 2 decodes, then prefills of 700 rows on no context and 900 on 2000 tokens.
    batch = make_batch([9000, 11000, 0, 2000], [1, 1, 700, 900])
    md = make_builder().build(0, batch.metadata)
    k_pages = bind_cache(impl, batch)
    index_query = torch.randn(batch.num_tokens, 256).to(FP8)
    run_forward(monkeypatch, impl, md, index_query)

    want = expected_selection(batch, index_query, k_pages, 2, 0, 1)
    assert torch.equal(buffer[: batch.num_tokens], want)
    # The decode side whole, then 1600 prefill rows as 384 + 384 + 384 + 384 + 64.
    assert [c["q_rows"] for c in kernels.proxy_calls] == [2, 384, 384, 384, 384, 64]
    assert [(c.token_start, c.token_end) for c in md.calls] == [
        (0, 2),
        (2, 386),
        (386, 770),
        (770, 1154),
        (1154, 1538),
        (1538, 1602),
    ]
    # The chunk over rows [386, 770) cuts both prefills: 316 rows of the first (ending
    # at its position 699), 68 of the second (positions 2000 to 2067).
    assert md.calls[2].cu_seqlens_q.tolist() == [0, 316, 384]
    assert md.calls[2].seqused_k.tolist() == [700, 2068]
    for call in kernels.proxy_calls:
        assert call["output"].data_ptr() == reserved.data_ptr()


# ---------------------------------------------------------------------------
# 4. The index cache's real page size.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [64, 256])
def test_builder_refuses_an_index_cache_of_other_pages(block_size):
    impl, _ = make_impl(max_model_len=MAX_MODEL_LEN)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    config.cache_config.block_size = block_size
    spec = impl.index_cache.get_kv_cache_spec(config)
    assert spec.block_size == block_size
    with pytest.raises(ValueError, match=f"the index cache has {block_size}-token blocks"):
        fi_mod.MiniMaxM3IndexerFlashInferMetadataBuilder(
            kv_cache_spec=spec,
            layer_names=["l"],
            vllm_config=make_builder().vllm_config,
            device=torch.device("cpu"),
        )


def test_builder_takes_an_index_cache_of_128_token_pages():
    impl, _ = make_impl(max_model_len=MAX_MODEL_LEN)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    config.cache_config.block_size = PAGE
    builder = fi_mod.MiniMaxM3IndexerFlashInferMetadataBuilder(
        kv_cache_spec=impl.index_cache.get_kv_cache_spec(config),
        layer_names=["l"],
        vllm_config=make_builder().vllm_config,
        device=torch.device("cpu"),
    )
    assert builder.kv_cache_spec.block_size == PAGE


# ---------------------------------------------------------------------------
# 5. One local window: the layer's own.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text_config",
    [
        indexer_text_config(index_n_heads=1, index_local_blocks=1),  # the target's
        indexer_text_config(index_n_heads=1, index_local_blocks=None),  # no local window
    ],
    ids=["target-config-says-1", "config-says-nothing"],
)
def test_forward_forces_the_layers_own_local_window(monkeypatch, kernels, text_config):
    """An MTP draft layer whose local window (3) differs from the config the
    builder sees."""
    batch = make_batch([9000, 4096, 0], [1, 1, 700])
    md = make_builder(text_config=text_config).build(0, batch.metadata)
    impl, buffer = make_impl(local_blocks=3, max_model_len=MAX_MODEL_LEN)
    bind_cache(impl, batch)
    index_query = torch.randn(batch.num_tokens, 128).to(FP8)
    run_forward(monkeypatch, impl, md, index_query)
    assert [t["force_end"] for t in kernels.topk_calls] == [3, 3]
    k_pages = impl.index_cache.kv_cache.view(-1, 1, PAGE, 128)
    want = expected_selection(batch, index_query, k_pages, 1, 0, 3)
    assert torch.equal(buffer[: batch.num_tokens], want)


# ---------------------------------------------------------------------------
# 6. The FULL-graph contract.
# ---------------------------------------------------------------------------
def test_builder_docstring_states_the_full_graph_contract():
    doc = fi_mod.MiniMaxM3IndexerFlashInferMetadataBuilder.__doc__
    assert "eager cudagraph break" not in doc
    for claim in ("FULL CUDA graphs", "persistent buffer", "max_model_len / PAGE_SIZE"):
        assert claim in doc


def test_captured_decode_scores_into_the_same_buffer_on_replay(monkeypatch, kernels):
    """A captured decode call's score buffer is baked into the graph: the
    replay's must be the same storage."""
    impl, _ = make_impl(max_model_len=32768)
    impl.reserve_workspace()
    capture = make_batch([32768 - 2] * 4, [2] * 4)
    replay = make_batch([3000, 5, 127, 9000], [2] * 4)
    impl.index_cache.bind_kv_cache(
        torch.randn(max(capture.num_pages, replay.num_pages), 1, PAGE, 128).to(FP8)
    )
    builder = make_builder(threshold=2)
    for batch in (capture, replay):
        run_forward(
            monkeypatch, impl, builder.build(0, batch.metadata), torch.randn(8, 128).to(FP8)
        )
    captured, replayed = kernels.proxy_calls
    assert captured["output"] is not None and replayed["output"] is not None
    assert captured["output"].data_ptr() == replayed["output"].data_ptr()
