"""Gating, selection and page-table rules of the FlashInfer sparse attention.

Every selection case runs vLLM's own `select_main_backend_and_impl_cls` in the
patched tree on a simulated GPU; the expected outcome is written out below from
the issue's rules (SM90, fp8 e4m3 KV cache, head_dim 128, top-16, 8 or 16 query
heads per KV head), independently of the patch's code.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from types import SimpleNamespace

import pytest
import torch
from sparse_attention_helpers import registration_config

from vllm_minimax.probe import select_sparse_attention, sparse_attention_in_series

pytestmark = pytest.mark.skipif(
    not sparse_attention_in_series(), reason="this release's series has no FlashInfer attend"
)

FA_MODULE = "vllm.models.minimax_m3.nvidia.sparse_attention_flashinfer"
CAPABILITIES = [(8, 9), (9, 0), (10, 0), (12, 0)]
KV_DTYPES = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
GROUPS = [(8, 1), (16, 1), (32, 2), (4, 1), (2, 1)]  # (q heads, kv heads) per rank
FLASHINFER_STATES = {"present": None, "absent": "flashinfer-python is not installed"}
OVERRIDES = ["auto", "flashinfer", "triton"]


def expected(cap, kv, heads, fi_state, override) -> tuple[str, str]:
    """(kind, fragment): an impl class name or an exception name, and a
    fragment of its log line or message."""
    q_heads, kv_heads = heads
    if cap == (10, 0):
        # SM100 keeps its own MSA attend (bf16/fp8 e4m3), Triton for e5m2.
        if override == "flashinfer":
            return "ValueError", "cannot run here"
        if kv == "fp8_e5m2":
            return "MiniMaxM3SparseTritonImpl", "selected Triton"
        return "MiniMaxM3SparseMSAImpl", "selected MSA"
    if override == "triton":
        return "MiniMaxM3SparseTritonImpl", "backend='triton'" if cap == (9, 0) else "Triton"
    if cap != (9, 0):
        reason = "compute capability"
    elif kv not in ("fp8", "fp8_e4m3"):
        reason = "set --kv-cache-dtype fp8"
    elif q_heads // kv_heads not in (8, 16):
        reason = "groups of 8 or 16"
    elif FLASHINFER_STATES[fi_state] is not None:
        reason = FLASHINFER_STATES[fi_state]
    else:
        return "MiniMaxM3SparseFlashInferImpl", "selected FlashInfer"
    if override == "flashinfer":
        return "ValueError", reason
    return "MiniMaxM3SparseTritonImpl", reason if cap == (9, 0) else "selected Triton"


@pytest.mark.parametrize(
    ("cap", "kv", "heads", "fi_state", "override"),
    list(itertools.product(CAPABILITIES, KV_DTYPES, GROUPS, FLASHINFER_STATES, OVERRIDES)),
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_selection_matrix(monkeypatch, cap, kv, heads, fi_state, override):
    import importlib

    module = importlib.import_module(FA_MODULE)
    monkeypatch.setattr(
        module, "flashinfer_sparse_attention_unavailable", lambda: FLASHINFER_STATES[fi_state]
    )
    selection = select_sparse_attention(
        kv_cache_dtype=kv,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        sparse_attention_backend=override,
        capability=cap,
    )
    kind, fragment = expected(cap, kv, heads, fi_state, override)
    if kind.endswith("Error"):
        assert selection.error is not None and selection.error.startswith(kind), selection
        assert fragment in selection.error, selection.error
        assert "sparse_attention_backend='flashinfer' cannot run here" in selection.error
    else:
        assert selection.error is None, selection.error
        assert selection.impl == kind, selection
        assert selection.log is not None and fragment in selection.log, selection.log
        if cap != (9, 0):
            # FlashInfer's attend exists on 9.0 only: elsewhere the log (which doctor reads
            # as a fallback when it names FlashInfer) says nothing of it.
            assert "FlashInfer" not in selection.log, selection.log


@pytest.mark.parametrize(("heads", "kv_heads"), [(17, 2), (33, 2), (25, 3), (12, 1)])
@pytest.mark.parametrize("override", ["auto", "flashinfer"])
def test_heads_that_do_not_divide_into_groups_of_8_or_16_are_refused(heads, kv_heads, override):
    """A rank whose query heads are not a whole number of groups of 8 or 16 per KV head
    (17 over 2 is 8.5): no FlashInfer, whatever the integer quotient."""
    selection = select_sparse_attention(
        kv_cache_dtype="fp8",
        num_heads=heads,
        num_kv_heads=kv_heads,
        sparse_attention_backend=override,
        capability=(9, 0),
    )
    if override == "flashinfer":
        assert selection.error is not None and "groups of 8 or 16" in selection.error
    else:
        assert selection.impl == "MiniMaxM3SparseTritonImpl", selection
        assert selection.log is not None and "groups of 8 or 16" in selection.log


def _blocker(**overrides):
    import importlib

    module = importlib.import_module(FA_MODULE)
    kwargs = dict(
        capability=90,
        kv_cache_dtype="fp8",
        model_dtype=torch.bfloat16,
        head_size=128,
        sparse_block_size=128,
        topk_blocks=16,
        num_heads=8,
        num_kv_heads=1,
    )
    kwargs.update(overrides)
    return module.flashinfer_sparse_attention_blocker(**kwargs)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({}, None),
        ({"num_heads": 16}, None),
        ({"num_heads": 32, "num_kv_heads": 2}, None),
        ({"kv_cache_dtype": "fp8_e4m3"}, None),
        ({"capability": 120}, "compute capability 12.0"),
        ({"capability": None}, "compute capability unknown"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype=fp8_e5m2"),
        ({"model_dtype": torch.float16}, "bf16 queries"),
        ({"head_size": 64}, "head_dim 64"),
        ({"sparse_block_size": 64}, "sparse block 64"),
        ({"topk_blocks": 8}, "topk_blocks=8"),
        ({"num_heads": 4}, "4 query heads over 1 KV heads"),
        ({"num_heads": 12, "num_kv_heads": 8}, "groups of 8 or 16"),
        # Two failing conditions: the documented order names the first.
        ({"capability": 89, "kv_cache_dtype": "auto"}, "compute capability 8.9"),
        ({"kv_cache_dtype": "auto", "head_size": 64}, "kv_cache_dtype=auto"),
        ({"model_dtype": torch.float16, "head_size": 64}, "bf16 queries"),
        ({"head_size": 64, "topk_blocks": 8}, "head_dim 64"),
        ({"sparse_block_size": 64, "num_heads": 4}, "sparse block 64"),
        ({"topk_blocks": 8, "num_heads": 4}, "topk_blocks=8"),
    ],
)
def test_blocker_conditions_and_their_order(monkeypatch, overrides, fragment):
    import importlib

    module = importlib.import_module(FA_MODULE)
    monkeypatch.setattr(module, "flashinfer_sparse_attention_unavailable", lambda: "no build")
    reason = _blocker(**overrides)
    if fragment is None:
        # Every geometry condition passed, so the build probe is what answers.
        assert reason == "no build"
    else:
        assert reason is not None and fragment in reason, reason


def test_probe_of_this_machines_flashinfer_build():
    import importlib

    module = importlib.import_module(FA_MODULE)
    module.flashinfer_sparse_attention_unavailable.cache_clear()
    # The dev lock pins FlashInfer 0.7.4, whose msa_ops import on the CPU.
    assert module.flashinfer_sparse_attention_unavailable() is None


def test_probe_refuses_a_build_without_an_argument(monkeypatch):
    import importlib

    import flashinfer.msa_ops as msa_ops

    module = importlib.import_module(FA_MODULE)

    def no_out(q, k, v, q2k_indices, *, page_table=None, seqused_k=None, seqlen_q=1):
        raise AssertionError("never called")

    monkeypatch.setattr(msa_ops, "msa_sparse_decode_attention", no_out)
    module.flashinfer_sparse_attention_unavailable.cache_clear()
    try:
        reason = module.flashinfer_sparse_attention_unavailable()
    finally:
        monkeypatch.undo()
        module.flashinfer_sparse_attention_unavailable.cache_clear()
    assert reason is not None and "msa_sparse_decode_attention does not take" in reason
    assert "softmax_scale" in reason and "out" in reason


@pytest.mark.parametrize(
    ("width", "max_seq_len", "expected_width"),
    [
        (1, 128, 801),  # tiny tables are widened past the union schedule's bound
        (64, 8192, 801),
        (800, 102400, 801),
        (801, 102400, 801),  # already past it: passed as is
        (1024, 131072, 1024),
        (4096, 524288, 4096),
        (4097, 524288, 4096),  # cut to the programs' bound when the step fits
        (8192, 4096 * 128, 4096),
        (8192, 4096 * 128 + 1, None),  # a sequence beyond 4096 pages: Triton
        (8192, 1 << 20, None),
    ],
)
def test_prefill_page_table_width(width, max_seq_len, expected_width):
    import importlib

    module = importlib.import_module(FA_MODULE)
    got = module.prefill_page_table_width(width, max_seq_len)
    assert got == expected_width
    if got is not None:
        # Whatever is passed lands in FlashInfer 0.7.4's allocation-free programs.
        assert module.UNION_SCHEDULE_MAX_PAGES < got <= module.PREFILL_PROGRAM_MAX_PAGES
        assert -(-max_seq_len // 128) <= got


def _cache(pages: int, heads: int, layout: str) -> torch.Tensor:
    """A per-layer `[pages, heads, 128, 256]` view as vLLM's NHD or HND layout makes it."""
    if layout == "HND":
        return torch.zeros(pages, heads, 128, 256, dtype=torch.uint8)
    return torch.zeros(pages, 128, heads, 256, dtype=torch.uint8).transpose(1, 2)


@pytest.mark.parametrize(
    ("heads", "layout", "dense"),
    [(1, "NHD", True), (1, "HND", True), (2, "HND", True), (2, "NHD", False), (4, "NHD", False)],
)
def test_dense_interleaved_view(heads, layout, dense):
    import importlib

    module = importlib.import_module(FA_MODULE)
    cache = _cache(3, heads, layout)
    view = module.dense_interleaved_view(cache)
    if not dense:
        assert view is None
        return
    # The same bytes, with the strides FlashInfer's prefill programs admit.
    assert view is not None and view.data_ptr() == cache.data_ptr()
    assert view.stride() == (heads * 128 * 256, 128 * 256, 256, 1)
    cache.view(-1).copy_(torch.randint(0, 255, (cache.numel(),), dtype=torch.uint8))
    assert torch.equal(view, cache)
    # One layer of a pool whose pages hold two layers is not dense.
    pool = torch.zeros(3, 2, heads, 128, 256, dtype=torch.uint8)
    assert module.dense_interleaved_view(pool[:, 0]) is None


def test_warmup_covers_every_decode_batch_and_the_prefill_width():
    import importlib

    module = importlib.import_module(FA_MODULE)
    geometry = module.SparseAttentionWarmupGeometry(
        num_heads=8,
        num_kv_heads=1,
        scale=128**-0.5,
        max_decode_query_len=3,
        max_num_decodes=256,
        max_num_batched_tokens=512,
        block_table_width=1024,
    )
    launches = module.warmup_launches(geometry)
    decode = {(b, n) for kind, b, n in launches if kind == "decode"}
    # Every batch the scheduler can form: up to 256 requests, within 512 tokens.
    assert decode == {(b, n) for n in (1, 2, 3) for b in range(1, min(256, 512 // n) + 1)}
    assert [x for x in launches if x[0] == "prefill"] == [("prefill", 1, 1024)]
    narrow = module.warmup_launches(
        module.SparseAttentionWarmupGeometry(**{**vars(geometry), "block_table_width": 64})
    )
    assert [x for x in narrow if x[0] == "prefill"] == [("prefill", 1, 801)]


def test_failed_warmup_logs_and_lets_the_engine_start(monkeypatch, caplog):
    import importlib

    module = importlib.import_module(FA_MODULE)
    geometry = module.SparseAttentionWarmupGeometry(
        num_heads=8,
        num_kv_heads=1,
        scale=0.088,
        max_decode_query_len=1,
        max_num_decodes=2,
        max_num_batched_tokens=16,
        block_table_width=1024,
    )

    def broken(*args, **kwargs):
        raise AttributeError("module 'flashinfer.msa_ops' has no attribute 'renamed'")

    monkeypatch.setattr(module, "run_warmup_launch", broken)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    jit = module._SparseAttentionJit()
    with caplog.at_level(logging.WARNING):
        module.logger.propagate = True
        jit.compile(geometry)  # must not raise
    assert geometry in jit._compiled_cache
    assert "did not finish" in caplog.text and "AttributeError" in caplog.text


@pytest.fixture(autouse=True)
def cpu_device_memory(monkeypatch):
    """The device calls of the warm-up's reservation, on this CPU-only host: free memory
    (a list the test may change: the first call reads its first entry, later calls the
    last), device 0, no-op synchronize and empty_cache, the launches' buffers in host
    memory."""
    import importlib

    module = importlib.import_module(FA_MODULE)
    buffers = getattr(module, "WarmupBuffers", None)  # absent from a8fd942's series
    if buffers is not None:
        monkeypatch.setattr(
            module,
            "WarmupBuffers",
            lambda g, launches, d: buffers(g, launches, torch.device("cpu")),
        )
    free = [70 << 30]
    calls = []

    def memory_info():
        calls.append(1)
        return (free[0] if len(calls) == 1 else free[-1]), 80 << 30

    monkeypatch.setattr(torch.accelerator, "get_memory_info", memory_info)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    return free


def _layer_view(layout_name: str, heads: int) -> torch.Tensor:
    """Layer 0's `[pages, heads, 128, 256]` fp8 cache view, with the byte strides vLLM's
    `compute_layout_strides` gives a two-layer pool under `layout_name`."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layout_strides
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(
        block_size=128, num_kv_heads=heads, head_size=128, dtype=torch.float8_e4m3fn
    )
    pages, layers = 3, 2
    strides = compute_layout_strides(spec, pages, layers, KVCacheLayout[layout_name])
    pool = torch.zeros(layers * pages * heads * 128 * 256, dtype=torch.uint8)
    return pool.as_strided((pages, heads, 128, 256), strides[1:])


def test_the_backend_asks_for_the_layout_whose_pages_the_kernels_read():
    import importlib

    from vllm.v1.kv_cache_layout import KVCacheLayout

    module = importlib.import_module(FA_MODULE)
    layouts = module.MiniMaxM3SparseFlashInferBackend.supported_kv_cache_layouts()
    # Preferred first; every layout stays acceptable (Triton attends where pages are not dense).
    assert layouts[0] is KVCacheLayout.LBHNC
    assert sorted(layouts, key=lambda x: x.name) == sorted(KVCacheLayout, key=lambda x: x.name)
    # Under the preferred layout, several KV heads per rank still give dense pages.
    for heads in (1, 2, 4):
        assert module.dense_interleaved_view(_layer_view("LBHNC", heads)) is not None
    assert module.dense_interleaved_view(_layer_view("LBNHC", 1)) is not None
    assert module.dense_interleaved_view(_layer_view("LBNHC", 2)) is None
    assert module.dense_interleaved_view(_layer_view("BLHNC", 1)) is None


def _impl(heads: int, kv_heads: int):
    import importlib

    from vllm_minimax.testing import sparse_attention_cases as cases

    module = importlib.import_module(FA_MODULE)
    shape = cases.StepShape(num_heads=heads, num_kv_heads=kv_heads)
    return cases.make_impl(
        module.MiniMaxM3SparseFlashInferImpl, shape, scale=0.088, kv_cache_dtype="fp8"
    )


def test_the_cache_views_are_resolved_once_per_bound_cache(monkeypatch):
    import importlib

    module = importlib.import_module(FA_MODULE)
    resolved = []
    real = module.dense_interleaved_view
    monkeypatch.setattr(
        module, "dense_interleaved_view", lambda cache: resolved.append(1) or real(cache)
    )
    impl = _impl(16, 2)
    hnd, nhd = _cache(3, 2, "HND"), _cache(3, 2, "NHD")
    for _ in range(3):
        views = impl.cache_views(hnd)
    assert len(resolved) == 1
    assert views is not None
    kv, k, v = views
    assert kv.dtype == torch.float8_e4m3fn and kv.data_ptr() == hnd.data_ptr()
    assert (k.shape, v.shape) == ((3, 2, 128, 128), (3, 2, 128, 128))
    assert v.data_ptr() - k.data_ptr() == 128
    # A new bound cache is resolved again; one whose pages are not dense gets Triton.
    assert impl.cache_views(nhd) is None and impl.cache_views(nhd) is None
    assert len(resolved) == 2


class _Layer:
    def __init__(self, impl, kv_cache: torch.Tensor) -> None:
        self.impl = impl
        self.kv_cache = kv_cache


@pytest.mark.parametrize(("layout", "triton"), [("HND", False), ("NHD", True)])
def test_the_warmup_builds_the_triton_decode_of_layers_flashinfer_cannot_read(
    monkeypatch, layout, triton
):
    """The warm-up runs once the caches are bound: two KV heads under NHD send the layer
    to Triton, whose decode kernels then have to be built before the engine is ready."""
    import importlib

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    module = importlib.import_module(FA_MODULE)
    config = _registration_config()
    flashinfer_launches, triton_launches = [], []
    monkeypatch.setattr(module, "run_warmup_launch", lambda *a: flashinfer_launches.append(a))
    monkeypatch.setattr(module, "run_decode_launch", lambda *a: triton_launches.append(a))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        impl = _impl(16, 2)
        layer = _Layer(impl, _cache(3, 2, layout))
        jit = module._SparseAttentionJit()
        monkeypatch.setattr(module, "_JIT", jit)
        module.register_sparse_attention_warmup(layer, config)
        # The registration dedupes by geometry; every layer of it is checked.
        module.register_sparse_attention_warmup(_Layer(impl, _cache(3, 2, "HND")), config)
        (geometry,) = jit._layers
        jit.compile(geometry)
    assert flashinfer_launches
    expected = importlib.import_module(
        "vllm.models.minimax_m3.common.sparse_attn_decode_warmup"
    ).decode_warmup_launches(module.sparse_decode_geometry(impl._triton, config))
    assert [launch for _, launch, _ in triton_launches] == (expected if triton else [])


# --- the attend follows the bound cache ---------------------------------------------------


def _engine_config(backend: str, layout: str):
    """A CPU VllmConfig whose sparse attend is `backend` and whose resolved KV-cache layout
    (what the engine core records on the cache config before the caches bind) is `layout`."""
    from vllm.config import AttentionConfig, DeviceConfig, VllmConfig

    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        attention_config=AttentionConfig(minimax_m3_sparse_attention_backend=backend),
    )
    config.cache_config.kv_cache_layout = layout
    return config


def _bound_layer(impl, kv_cache: torch.Tensor):
    """The patched MiniMax M3 sparse attention layer, holding only `impl`, bound to `kv_cache`
    as vLLM's worker binds every layer (`bind_kv_cache`)."""
    from vllm.models.minimax_m3.nvidia import model as m3_model

    layer = m3_model.MiniMaxM3SparseAttention.__new__(m3_model.MiniMaxM3SparseAttention)
    torch.nn.Module.__init__(layer)
    layer.impl = impl
    layer.layer_name = "model.layers.1.self_attn.attn"
    layer.bind_kv_cache(kv_cache)
    return layer


def test_a_forced_flashinfer_attend_on_pages_it_cannot_read_stops_at_binding():
    """Two KV heads under LBNHC (VLLM_KV_CACHE_LAYOUT=NHD): the engine must not start, and
    the error names the option, the layer, the layout and the fix."""
    from vllm.config import set_current_vllm_config

    from vllm_minimax.testing.engine_runs import FORCED_FLASHINFER_NOT_DENSE

    with set_current_vllm_config(_engine_config("flashinfer", "LBNHC")):
        impl = _impl(16, 2)
    with pytest.raises(ValueError) as error:
        _bound_layer(impl, _cache(5, 2, "NHD"))
    message = str(error.value)
    for fragment in (*FORCED_FLASHINFER_NOT_DENSE, "model.layers.1.self_attn.attn"):
        assert fragment in message, message
    assert impl.attend is None
    # Dense pages bind, and the layer attends with FlashInfer.
    layer = _bound_layer(impl, _cache(5, 2, "HND"))
    assert impl.attend == "flashinfer" and layer.kv_cache.shape == (5, 2, 128, 256)


@pytest.mark.parametrize(
    ("layout", "name", "attend"), [("HND", "LBHNC", "flashinfer"), ("NHD", "LBNHC", "triton")]
)
def test_auto_on_pages_it_cannot_read_attends_with_triton_and_says_why(
    caplog, layout, name, attend
):
    import importlib

    from vllm.config import set_current_vllm_config

    from vllm_minimax.testing.engine_runs import attend_of

    module = importlib.import_module(FA_MODULE)
    with set_current_vllm_config(_engine_config("auto", name)):
        impl = _impl(32, 2)
    module.logger.propagate = True
    with caplog.at_level(logging.WARNING):
        _bound_layer(impl, _cache(7, 2, layout))  # a shape of its own: one warning per reason
        _bound_layer(impl, _cache(7, 2, layout).clone())  # another layer, same reason
    assert impl.attend == attend
    # What an engine run records for the layer (sparse_attention_engine.py).
    assert attend_of(impl) == attend
    assert attend_of(impl._triton) == "triton"
    warned = [r.getMessage() for r in caplog.records if r.name == module.logger.name]
    if attend == "flashinfer":
        assert warned == []
    else:
        (line,) = warned
        assert "Triton kernels attend" in line and "the LBNHC KV-cache layout" in line, line


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (None, "_MPG_UNION_MAX is missing, not an int"),
        ("800", "_MPG_UNION_MAX is a str, not an int"),
        (True, "_MPG_UNION_MAX is a bool, not an int"),
        (1000, "_MPG_UNION_MAX is 1000, not 800 as in flashinfer-python 0.7.4"),
    ],
)
def test_a_flashinfer_whose_page_bounds_moved_is_refused_with_the_reason(
    monkeypatch, value, fragment
):
    """FlashInfer's private page-table bounds (here `_sm90_dispatch._MPG_UNION_MAX`) moved,
    removed or changed: auto keeps Triton and logs why, a forced FlashInfer raises it."""
    import importlib

    from flashinfer.msa_ops import _sm90_dispatch

    module = importlib.import_module(FA_MODULE)
    if value is None:
        monkeypatch.delattr(_sm90_dispatch, "_MPG_UNION_MAX")
    else:
        monkeypatch.setattr(_sm90_dispatch, "_MPG_UNION_MAX", value)
    module.flashinfer_sparse_attention_unavailable.cache_clear()
    try:
        reason = module.flashinfer_sparse_attention_unavailable()
        auto, forced = (
            select_sparse_attention(
                kv_cache_dtype="fp8",
                num_heads=8,
                num_kv_heads=1,
                sparse_attention_backend=backend,
                capability=(9, 0),
            )
            for backend in ("auto", "flashinfer")
        )
    finally:
        monkeypatch.undo()
        module.flashinfer_sparse_attention_unavailable.cache_clear()
    assert reason is not None and fragment in reason, reason
    assert auto.impl == "MiniMaxM3SparseTritonImpl", auto
    assert auto.log is not None and fragment in auto.log, auto.log
    assert forced.error is not None and forced.error.startswith("ValueError"), forced
    assert fragment in forced.error, forced.error


def test_the_page_bounds_read_from_flashinfer_are_the_builders():
    """The installed FlashInfer (0.7.4, the dev lock) holds the bounds the builder follows,
    and the prefill-program bound is checked as well as the union one."""
    import importlib

    import flashinfer.msa_ops.cake_hopper_sm90 as cake
    from flashinfer.msa_ops import _sm90_dispatch

    module = importlib.import_module(FA_MODULE)
    assert module.flashinfer_page_bounds_mismatch() is None
    assert (_sm90_dispatch._MPG_UNION_MAX, cake._PF_MAX_BLOCKS) == (
        module.UNION_SCHEDULE_MAX_PAGES,
        module.PREFILL_PROGRAM_MAX_PAGES,
    )
    saved = cake._PF_MAX_BLOCKS
    cake._PF_MAX_BLOCKS = 8192
    try:
        reason = module.flashinfer_page_bounds_mismatch()
    finally:
        cake._PF_MAX_BLOCKS = saved
    assert reason is not None and "_PF_MAX_BLOCKS is 8192, not 4096" in reason, reason


def _registration_config(max_num_seqs: int = 48, num_speculative_tokens: int = 1):
    """This file's engine: a 40000-token context and 6144 batched tokens."""
    return registration_config(
        max_num_seqs=max_num_seqs,
        num_speculative_tokens=num_speculative_tokens,
        max_model_len=40000,
        max_num_batched_tokens=6144,
    )


def test_the_decode_scratch_exists_before_the_kv_cache_is_sized(monkeypatch):
    """FlashInfer keeps a decode scratch per launch geometry: the registration, at model
    construction (before vLLM's memory profiling), launches every warm-up launch once, so
    the profiler counts the scratch; the JIT warm-up after the KV cache is sized launches
    none again."""
    import importlib

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    module = importlib.import_module(FA_MODULE)
    config = _registration_config()
    launches = []
    monkeypatch.setattr(module, "run_warmup_launch", lambda *a: launches.append(a[1:4]))
    monkeypatch.setattr(module, "run_decode_launch", lambda *a: None)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        impl = _impl(16, 2)
        jit = module._SparseAttentionJit()
        monkeypatch.setattr(module, "_JIT", jit)
        module.register_sparse_attention_warmup(_Layer(impl, _cache(3, 2, "HND")), config)
        (geometry,) = jit._layers
        expected = module.warmup_launches(geometry)
        assert launches == expected
        # Every batch of up to 48 sequences at both query lengths (1 + 1 MTP token).
        assert {(b, n) for kind, b, n in launches if kind == "decode"} == {
            (b, n) for n in (1, 2) for b in range(1, 49)
        }
        module.register_sparse_attention_warmup(_Layer(impl, _cache(3, 2, "HND")), config)
        jit.compile(geometry)
    assert launches == expected


def test_out_of_memory_in_the_warmup_stops_the_engine_naming_the_settings(monkeypatch):
    import importlib

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    module = importlib.import_module(FA_MODULE)

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(module, "run_warmup_launch", out_of_memory)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        jit = module._SparseAttentionJit()
        monkeypatch.setattr(module, "_JIT", jit)
        with pytest.raises(RuntimeError) as raised:
            module.register_sparse_attention_warmup(
                _Layer(_impl(16, 2), _cache(3, 2, "HND")),
                _registration_config(max_num_seqs=1024, num_speculative_tokens=3),
            )
    message = str(raised.value)
    assert "--max-num-seqs" in message and "num_speculative_tokens" in message
    assert "1024 sequences" in message and "4 query tokens" in message
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)


@pytest.fixture(scope="module")
def m3_heads_model_config(tmp_path_factory):
    """vLLM's ModelConfig of MiniMax M3's attention geometry (64 query heads, 4 KV heads),
    parsed by the vLLM under test from a checkpoint written for it."""
    import vllm
    from vllm.config import ModelConfig

    from vllm_minimax import tiny_model

    directory = tmp_path_factory.mktemp("m3-heads-config")
    tiny_model.write_tiny_config_files(
        directory, config_layout=vllm.__version__, text_config=tiny_model.M3_HEADS_TEXT_CONFIG
    )
    return ModelConfig(model=str(directory), tokenizer=str(directory), dtype="bfloat16")


class _SelectionReached(Exception):
    pass


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_the_layer_asks_the_selection_for_its_ranks_query_and_kv_heads(
    monkeypatch, m3_heads_model_config, tp
):
    """MiniMax M3's sparse attention layer (`nvidia/model.py`), built up to its attend
    selection on a rank of TP `tp`: the selection gets that rank's query heads and KV heads
    (what the group rule of 8 or 16 query heads per KV head is about), the head dim, the
    sparse block and the model dtype. The projections, norms and rotary embedding the layer
    builds first are stand-ins (they need a distributed group); the selection records its
    arguments and stops the construction."""
    from torch import nn
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.models.minimax_m3.nvidia import model as m3_model

    asked: dict = {}

    def select(**kwargs):
        asked.update(kwargs)
        raise _SelectionReached

    def stand_in(*args, **kwargs):
        return nn.Identity()

    monkeypatch.setattr(m3_model, "select_main_backend_and_impl_cls", select)
    monkeypatch.setattr(m3_model, "get_tensor_model_parallel_world_size", lambda: tp)
    for name in ("MinimaxM3QKVParallelLinearWithIndexer", "RowParallelLinear", "get_rope"):
        monkeypatch.setattr(m3_model, name, stand_in)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    config.model_config = m3_heads_model_config
    with set_current_vllm_config(config), pytest.raises(_SelectionReached):
        m3_model.MiniMaxM3SparseAttention(
            m3_heads_model_config.hf_text_config,
            layer_id=1,
            prefix="model.layers.1.self_attn",
            cache_config=CacheConfig(cache_dtype="fp8"),
        )
    assert asked["num_heads"] == 64 // tp
    assert asked["num_kv_heads"] == max(1, 4 // tp)
    assert asked["head_size"] == 128
    assert asked["sparse_block_size"] == 128 and asked["topk_blocks"] == 16
    assert asked["kv_cache_dtype"] == "fp8"
    assert asked["model_dtype"] == torch.bfloat16


# --- issue 66: the reservation without the JIT warm-up, its buffers, its errors -----------


class _ConstructionReached(Exception):
    pass


@pytest.mark.parametrize("jit_warmup", [True, False], ids=["jit-warmup", "enforce-eager"])
def test_the_layer_checks_the_prebuild_and_reserves_the_scratch_with_the_jit_warmup_off(
    monkeypatch, m3_heads_model_config, jit_warmup
):
    """vLLM turns `kernel_config.enable_jit_warmup` off for `--enforce-eager`: the sparse
    layer built under it must still check a prebuild of FlashInfer's programs and launch the
    sparse attention's programs (the decode scratch the profiler must count); only the JIT
    registry's part depends on the setting. The layer (`nvidia/model.py`) is built for real
    up to the end of its registrations, with stand-ins for what needs a distributed group
    (projections, rotary embedding), for the indexer, and for the attend selection (which
    returns FlashInfer's impl, as on an SM90 with an fp8 cache)."""
    import importlib

    from torch import nn
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.models.minimax_m3.nvidia import indexer_flashinfer_warmup as iw
    from vllm.models.minimax_m3.nvidia import model as m3_model

    module = importlib.import_module(FA_MODULE)
    checked, launches = [], []
    monkeypatch.setattr(iw, "check_prebuilt_programs_once", lambda: checked.append(1))
    monkeypatch.setattr(module, "run_warmup_launch", lambda *a: launches.append(a[1:4]))
    jit = module._SparseAttentionJit()
    monkeypatch.setattr(module, "_JIT", jit)

    def stand_in(*args, **kwargs):
        return nn.Identity()

    def flashinfer_impl(*args, **kwargs):
        return _impl(16, 2)

    def select(**kwargs):
        return module.MiniMaxM3SparseFlashInferBackend, flashinfer_impl

    def stop(layer):
        raise _ConstructionReached

    monkeypatch.setattr(m3_model, "select_main_backend_and_impl_cls", select)
    monkeypatch.setattr(m3_model, "get_tensor_model_parallel_world_size", lambda: 4)
    monkeypatch.setattr(m3_model, "MiniMaxM3Indexer", lambda **kw: SimpleNamespace(impl=None))
    # 0.34.0's layer goes on to its fused QKV epilogue; 0.33.0's ends after the registrations.
    monkeypatch.setattr(m3_model, "_supports_qkv_fused_epilogue", stop, raising=False)
    for name in ("MinimaxM3QKVParallelLinearWithIndexer", "RowParallelLinear", "get_rope"):
        monkeypatch.setattr(m3_model, name, stand_in)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    config.model_config = m3_heads_model_config
    config.kernel_config.enable_jit_warmup = jit_warmup
    with set_current_vllm_config(config), contextlib.suppress(_ConstructionReached):
        m3_model.MiniMaxM3SparseAttention(
            m3_heads_model_config.hf_text_config,
            layer_id=1,
            prefix="model.layers.1.self_attn",
            cache_config=CacheConfig(cache_dtype="fp8"),
        )
    assert checked, "the prebuild was not checked"
    assert launches, "the decode scratch was not reserved"
    (geometry,) = jit._launched
    assert launches == module.warmup_launches(geometry)
    assert geometry.max_num_decodes == config.scheduler_config.max_num_seqs
    # The JIT registry holds the layer only where the JIT warm-up runs.
    assert bool(jit._layers) == jit_warmup


def test_the_warmup_allocates_its_buffers_once_and_slices_them(monkeypatch, cpu_device_memory):
    """Each launch takes leading slices of one set of buffers allocated before the first,
    at their largest, so nothing of the warm-up's own lies between FlashInfer's retained
    decode scratch allocations; each slice holds what the launch needs (the top-k selects
    page 0, sequence lengths of the query length, page tables of the engine's width). The
    log gives the free GPU memory the warm-up took beside the scratch it holds."""
    import importlib

    import flashinfer.msa_ops as msa_ops

    module = importlib.import_module(FA_MODULE)
    seen = []

    def decode(q, k, v, topk, *, page_table, seqused_k, seqlen_q, out, **kwargs):
        seen.append(
            (
                "decode",
                q,
                topk,
                page_table,
                seqused_k,
                out,
                seqlen_q,
                topk.clone(),
                seqused_k.clone(),
            )
        )

    def prefill(q, k, v, topk, cu_seqlens_q, *, page_table, seqused_k, out, **kwargs):
        seen.append(
            ("prefill", q, topk, page_table, seqused_k, out, 1, topk.clone(), seqused_k.clone())
        )

    monkeypatch.setattr(msa_ops, "msa_sparse_decode_attention", decode)
    monkeypatch.setattr(msa_ops, "msa_sparse_attention", prefill)
    geometry = module.SparseAttentionWarmupGeometry(
        num_heads=16,
        num_kv_heads=2,
        scale=0.088,
        max_decode_query_len=3,
        max_num_decodes=5,
        max_num_batched_tokens=12,
        block_table_width=40,
    )
    cpu_device_memory[:] = [70 << 30, (70 << 30) - (3 << 29)]  # 1.5 GiB taken
    jit = module._SparseAttentionJit()
    module.logger.propagate = True
    records = []
    monkeypatch.setattr(module.logger, "info", lambda *a: records.append(a[0] % a[1:]))
    jit.reserve(geometry, torch.device("cpu"))
    launches = module.warmup_launches(geometry)
    assert [(kind, q.shape[0]) for kind, q, *_ in seen] == [
        (kind, b * n if kind == "decode" else 1) for kind, b, n in launches
    ]
    for role in (1, 2, 3, 5):  # q, top-k, page table, out: one storage each
        storages = {entry[role].untyped_storage().data_ptr() for entry in seen}
        assert len(storages) == 1, f"argument {role} allocated per launch"
    # What each launch saw, recorded as it ran (the slices share their storage).
    for kind, q, topk, page_table, seq_lens, out, n, topk_then, lens_then in seen:
        assert q.is_contiguous() and topk.is_contiguous() and page_table.is_contiguous()
        assert topk.shape == (2, q.shape[0], 16) and out.shape == q.shape
        assert (topk_then[..., 0] == 0).all() and (topk_then[..., 1:] == -1).all()
        assert (lens_then == n).all() and len(seq_lens) == page_table.shape[0]
        assert page_table.shape[1] == (40 if kind == "decode" else launches[-1][2])
    (line,) = [r for r in records if "sparse attention warm-up" in r]
    assert "1.50 GiB less free GPU memory" in line, line


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("cuModuleLoadData failed: CUDA_ERROR_OUT_OF_MEMORY"),
        RuntimeError("CUDA error: out of memory"),
        RuntimeError("cudaErrorMemoryAllocation"),
    ],
    ids=["torch", "driver-module-load", "runtime", "runtime-name"],
)
def test_every_out_of_memory_form_stops_the_engine(monkeypatch, error):
    """A CuTe-DSL or driver module that cannot load for lack of memory raises no
    `torch.OutOfMemoryError`, but the scratch is just as uncounted: the engine must stop,
    whether the error is raised as it is or wrapped by the kernel's caller."""
    import importlib

    module = importlib.import_module(FA_MODULE)
    for raised in (error, _wrapped(error)):

        def out_of_memory(*args, raised=raised):
            raise raised

        monkeypatch.setattr(module, "run_warmup_launch", out_of_memory)
        jit = module._SparseAttentionJit()
        monkeypatch.setattr(module, "_JIT", jit)
        with pytest.raises(RuntimeError, match="--max-num-seqs") as stopped:
            module.register_sparse_attention_warmup(
                _Layer(_impl(16, 2), _cache(3, 2, "HND")), _registration_config()
            )
        assert stopped.value.__cause__ is raised


def _wrapped(error: BaseException) -> BaseException:
    try:
        raise RuntimeError("failed to compile the decode kernel") from error
    except RuntimeError as wrapper:
        return wrapper
