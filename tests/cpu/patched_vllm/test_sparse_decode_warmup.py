"""Patch 0005's warm-up compiles every variant of the sparse decode kernels an engine can reach.

The reference is Triton itself: `minimax_m3_sparse_attn_decode` runs on CPU tensors with its two
kernels' launches intercepted, and each launch's compile key is what Triton 3.8's own argument
binder (`create_function_from_signature` over the kernel's signature, after its heuristics) makes
of the arguments: the constexprs, each integer's type and 1 / divisible-by-16 class, each
pointer's dtype and 16-byte alignment. The runtime side builds its tensors the way the sparse
impl slices a step's buffers (decodes first in a mixed batch, views of a token-major query and
output, the `[tokens, heads, topk]` top-k buffer, vLLM's own block-table width) for every decode
composition an engine config allows and mixed batches with random prefills behind; the warm-up
side runs only the launches `decode_warmup_launches` chose. The two key sets must be equal.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.autotuner import Heuristics
from triton.runtime.jit import create_function_from_signature
from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
from vllm.models.minimax_m3.common import sparse_attn_decode_warmup as warmup
from vllm.models.minimax_m3.common.ops import sparse_attn
from vllm.models.minimax_m3.common.sparse_attention import MiniMaxM3SparseTritonImpl
from vllm.v1.kv_cache_interface import FullAttentionSpec

try:
    from vllm.v1.kv_cache_interface import get_block_table_width
except ImportError:  # vLLM 0.33.0 keeps it beside the V1 runner's block table
    from vllm.v1.worker.block_table import get_block_table_width

CPU = torch.device("cpu")
HEAD_DIM = 128
PAGE = 128
TOPK = 16
KERNELS = ("_gqa_sparse_decode_kernel", "_merge_topk_attn_out_kernel")


def _compile_key(kernel: Heuristics, args: tuple, kwargs: dict) -> str:
    """Triton's compile key of one launch: its heuristics, then its binder."""
    jit_fn = kernel.fn
    named = dict(zip(jit_fn.arg_names[: len(args)], args, strict=True)) | kwargs
    kwargs = dict(kwargs)
    for name, heuristic in kernel.values.items():
        kwargs[name] = heuristic(named)
    binder = create_function_from_signature(jit_fn.signature, jit_fn.params, BaseBackend)
    _, specialization, options = binder(*args, **kwargs)
    return repr((jit_fn.__name__, specialization, sorted(options.items())))


@functools.cache
def _triton_kernels() -> dict[str, Heuristics]:
    """The two kernels as real Triton objects. vLLM gives a CPU-only host a placeholder
    ``triton``, so the module's own source runs again with Triton's decorators."""
    source = Path(inspect.getsourcefile(sparse_attn)).read_text()
    stock_import = "from vllm.triton_utils import tl, triton\n"
    assert stock_import in source
    # One line for one, so Triton finds each kernel's source at its line in the file.
    source = source.replace(stock_import, "import triton; import triton.language as tl\n")
    namespace: dict = {"__name__": "sparse_attn_with_triton"}
    exec(compile(source, inspect.getsourcefile(sparse_attn), "exec"), namespace)
    kernels = {name: namespace[name] for name in KERNELS}
    assert all(isinstance(kernel, Heuristics) for kernel in kernels.values())
    return kernels


@contextmanager
def _recorded_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    keys: set[str] = set()

    class Recorder:
        def __init__(self, kernel: Heuristics) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                keys.add(_compile_key(self.kernel, args, kwargs))

            return launch

    with monkeypatch.context() as patch:
        for name in KERNELS:
            patch.setattr(sparse_attn, name, Recorder(_triton_kernels()[name]))
        yield keys


def _geometry(
    *,
    heads: int,
    kv_heads: int,
    spec_tokens: int,
    max_num_seqs: int,
    max_tokens: int,
    max_model_len: int,
    fp8: bool,
) -> warmup.SparseDecodeGeometry:
    return warmup.SparseDecodeGeometry(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        topk_blocks=TOPK,
        dtype=torch.bfloat16,
        kv_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
        kv_scales=fp8,
        max_decode_query_len=1 + spec_tokens,
        max_num_decodes=max_num_seqs,
        max_num_batched_tokens=max_tokens,
        block_table_width=math.ceil(max_model_len / PAGE),
        scale=HEAD_DIM**-0.5,
    )


# (heads, KV heads) per rank: the tiny model; MiniMax M3 at TP 8, 4 and 2 (one replicated KV
# head from TP 4 on). Budgets below max_num_seqs * query_len cut the decode batch short.
GEOMETRIES = {
    "tiny-32k": dict(heads=4, kv_heads=4, spec_tokens=0, max_num_seqs=64, max_tokens=8192,
                     max_model_len=32768, fp8=False),
    "tiny-mtp1-1000": dict(heads=4, kv_heads=4, spec_tokens=1, max_num_seqs=64,
                           max_tokens=8192, max_model_len=1000, fp8=True),
    "m3-tp8-h200": dict(heads=8, kv_heads=1, spec_tokens=2, max_num_seqs=256, max_tokens=16384,
                        max_model_len=131072, fp8=False),
    "m3-tp4-fp8-budget": dict(heads=16, kv_heads=1, spec_tokens=3, max_num_seqs=96,
                              max_tokens=200, max_model_len=8192, fp8=True),
    "m3-tp2-one-page": dict(heads=32, kv_heads=2, spec_tokens=0, max_num_seqs=40,
                            max_tokens=2048, max_model_len=128, fp8=False),
    # The budget is a batch's exact token count, whose variant no smaller batch has: 16
    # single-token decodes start a top-k chunk count of their own (8 heads, 1 KV head).
    "m3-tp8-budget-at-16": dict(heads=8, kv_heads=1, spec_tokens=0, max_num_seqs=64,
                                max_tokens=16, max_model_len=8192, fp8=False),
}  # fmt: skip


class _RuntimeBuffers:
    """A step's buffers as the engine keeps them: a token-major query and output, the
    shared top-k buffer, a persistent block table of vLLM's width, the layer's KV cache and
    its scalar scales."""

    def __init__(self, geometry: warmup.SparseDecodeGeometry, max_model_len: int) -> None:
        g = geometry
        tokens = (g.max_num_batched_tokens + 3) // 4 * 4
        self.geometry = g
        self.query = torch.zeros(tokens, g.num_heads * g.head_dim, dtype=g.dtype)
        self.output = torch.zeros_like(self.query)
        self.topk = torch.zeros(tokens, g.num_kv_heads, g.topk_blocks, dtype=torch.int32)
        spec = FullAttentionSpec(
            block_size=PAGE, num_kv_heads=g.num_kv_heads, head_size=g.head_dim, dtype=g.dtype
        )
        width = get_block_table_width(
            spec.max_num_blocks_per_req(_engine_config(jit_warmup=True), max_model_len),
            PAGE,
            token_alignment=spec.block_table_token_alignment,
        )
        self.block_table = torch.zeros(g.max_num_decodes + 1, width, dtype=torch.int32)
        self.seq_lens = torch.ones(g.max_num_decodes + 1, dtype=torch.int32)
        cache = torch.zeros(3, g.num_kv_heads, PAGE, 2 * g.head_dim, dtype=torch.bfloat16)
        self.kv_cache = cache.view(torch.uint8).view(g.kv_dtype) if g.kv_scales else cache
        self.scale = torch.tensor(1.0, dtype=torch.float32) if g.kv_scales else None

    def step(self, num_decodes: int, query_len: int, prefill_tokens: int) -> None:
        """The decode half of one step, sliced as ``MiniMaxM3SparseTritonImpl.forward`` and
        the metadata builder slice it."""
        g = self.geometry
        nd = num_decodes * query_len
        num_tokens = nd + prefill_tokens
        num_reqs = num_decodes + (1 if prefill_tokens else 0)
        q = self.query[:num_tokens].view(-1, g.num_heads, g.head_dim)
        out = self.output[:num_tokens].view(-1, g.num_heads, g.head_dim)
        topk = self.topk[:num_tokens].transpose(0, 1)
        sparse_attn.minimax_m3_sparse_attn_decode(
            q[:nd],
            self.kv_cache,
            topk[:, :nd, :],
            self.block_table[:num_reqs][:num_decodes],
            self.seq_lens[:num_reqs][:num_decodes],
            g.num_kv_heads,
            g.scale,
            out[:nd],
            query_len,
            k_scale=self.scale,
            v_scale=self.scale,
        )


@pytest.mark.parametrize("name", GEOMETRIES)
def test_warmup_launches_cover_every_decode_variant(name, monkeypatch):
    params = GEOMETRIES[name]
    geometry = _geometry(**params)
    runtime = _RuntimeBuffers(geometry, params["max_model_len"])
    rng = random.Random()
    with _recorded_launches(monkeypatch) as reachable:
        for query_len in range(1, geometry.max_decode_query_len + 1):
            for num_decodes in range(1, geometry.max_num_decodes + 1):
                nd = num_decodes * query_len
                if nd > geometry.max_num_batched_tokens:
                    break
                runtime.step(num_decodes, query_len, prefill_tokens=0)
                # A mixed step: a prompt chunk behind the decodes.
                room = geometry.max_num_batched_tokens - nd
                if room:
                    runtime.step(num_decodes, query_len, rng.randint(1, room))
    launches = warmup.decode_warmup_launches(geometry)
    with _recorded_launches(monkeypatch) as warmed:
        for launch in launches:
            warmup.run_decode_launch(geometry, launch, CPU)
    assert reachable - warmed == set(), f"{name}: variants the warm-up misses"
    assert warmed - reachable == set(), f"{name}: the warm-up compiles unreachable variants"
    decode_keys = {key for key in warmed if KERNELS[0] in key}
    assert len(decode_keys) == len(launches), "a warm-up launch repeats another's variant"


def test_classes_split_where_triton_specializes():
    geometry = _geometry(**GEOMETRIES["m3-tp8-h200"])
    totals = {launch.total_q: launch for launch in warmup.decode_warmup_launches(geometry)}
    # 8 heads, 1 KV head: chunk counts 16/8/4/2/1 split at 16/32/64/128 decode tokens; in each,
    # total_q % 16 == 0 and odd/even (total_q * 8 heads % 16) split, 1 stands alone.
    assert sorted(totals) == [1, 2, 3, 16, 17, 18, 32, 33, 34, 48, 65, 66, 80, 129, 130, 144]
    assert all(launch.query_len == 1 for launch in totals.values())
    # A budget below max_num_seqs requests cuts the reachable counts, and MTP's query lengths
    # reach what single-token decodes cannot.
    small = replace(geometry, max_num_decodes=8, max_decode_query_len=3, max_num_batched_tokens=20)
    launches = warmup.decode_warmup_launches(small)
    assert max(launch.total_q for launch in launches) <= 20
    assert {(launch.num_decodes, launch.query_len) for launch in launches if launch.total_q > 8}
    assert 16 in {launch.total_q for launch in launches}  # 8 requests x 2 tokens


def test_the_batch_exactly_at_the_token_budget_is_warmed():
    """A step may hold exactly `max_num_batched_tokens` decode tokens: that batch is
    reachable and its variant warmed, one token over is not reachable."""
    geometry = _geometry(**GEOMETRIES["m3-tp8-budget-at-16"])
    reachable = {
        (launch.num_decodes, launch.query_len)
        for launch in warmup.reachable_decode_launches(geometry)
    }
    assert (16, 1) in reachable and (17, 1) not in reachable
    mtp = replace(geometry, max_decode_query_len=3, max_num_batched_tokens=18)
    reachable = {
        (launch.num_decodes, launch.query_len) for launch in warmup.reachable_decode_launches(mtp)
    }
    assert (6, 3) in reachable and (9, 2) in reachable and (7, 3) not in reachable
    classes = {
        warmup.decode_launch_class(geometry, launch.total_q)
        for launch in warmup.decode_warmup_launches(geometry)
    }
    assert warmup.decode_launch_class(geometry, 16) in classes
    assert warmup.decode_launch_class(geometry, 16) not in {
        warmup.decode_launch_class(geometry, total) for total in range(1, 16)
    }  # the edge is a variant of its own: a `<` in the filter would leave it cold


def _engine_config(
    *, jit_warmup: bool, spec_tokens: int | None = 2, dcp: int = 1
) -> SimpleNamespace:
    return SimpleNamespace(
        kernel_config=SimpleNamespace(enable_jit_warmup=jit_warmup),
        speculative_config=None
        if spec_tokens is None
        else SimpleNamespace(num_speculative_tokens=spec_tokens),
        model_config=SimpleNamespace(dtype=torch.bfloat16, max_model_len=40000),
        scheduler_config=SimpleNamespace(max_num_seqs=48, max_num_batched_tokens=6144),
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp),
    )


def _triton_impl(kv_cache_dtype: str) -> MiniMaxM3SparseTritonImpl:
    return MiniMaxM3SparseTritonImpl(
        8,
        HEAD_DIM,
        HEAD_DIM**-0.5,
        1,
        kv_cache_dtype=kv_cache_dtype,
        topk_blocks=TOPK,
        sparse_block_size=PAGE,
    )


def test_geometry_follows_the_engine_config():
    geometry = warmup.sparse_decode_geometry(_triton_impl("fp8"), _engine_config(jit_warmup=True))
    assert (geometry.num_heads, geometry.num_kv_heads, geometry.head_dim) == (8, 1, HEAD_DIM)
    assert geometry.max_decode_query_len == 3
    assert (geometry.max_num_decodes, geometry.max_num_batched_tokens) == (48, 6144)
    assert geometry.block_table_width == 313  # ceil(40000 / 128)
    assert geometry.kv_scales and geometry.kv_dtype == torch.float8_e4m3fn
    bf16 = warmup.sparse_decode_geometry(
        _triton_impl("auto"), _engine_config(jit_warmup=True, spec_tokens=None)
    )
    assert bf16.max_decode_query_len == 1
    assert not bf16.kv_scales and bf16.kv_dtype == torch.bfloat16
    # Decode context parallelism: a rank's block table holds its share of the pages.
    dcp2 = warmup.sparse_decode_geometry(
        _triton_impl("fp8"), _engine_config(jit_warmup=True, dcp=2)
    )
    assert dcp2.block_table_width == 157  # ceil(40000 / 256)


@pytest.mark.parametrize("jit_warmup", [True, False])
def test_registration_follows_enable_jit_warmup(jit_warmup, monkeypatch):
    compiled = []
    monkeypatch.setattr(warmup._JIT, "compile", compiled.append)
    registry = JitWarmupRegistry(vllm_config=None)
    config = _engine_config(jit_warmup=jit_warmup)
    with registry.activate():
        for _layer in range(3):  # every sparse layer registers the same geometry
            warmup.register_sparse_decode_warmup(_triton_impl("fp8"), config)
        # Not a Triton-decode impl: nothing to warm.
        warmup.register_sparse_decode_warmup(object(), config)
    assert len(registry) == (1 if jit_warmup else 0)
    registry.warmup()
    expected = [warmup.sparse_decode_geometry(_triton_impl("fp8"), config)]
    assert compiled == (expected if jit_warmup else [])


def _sm100_msa_impl(kv_cache_dtype: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The SM100 MSA impl that serves ``kv_cache_dtype``, built by its own constructor as on
    an SM100 whose CUTLASS decode plans this shape. vLLM 0.33.0 runs an NVFP4 cache in
    ``MiniMaxM3SparseMSAImpl`` too; 0.34.0 has a class of its own for it, whose constructor
    needs the GPU, so that one is an instance left unconstructed (its type is what counts)."""
    msa = importlib.import_module(warmup._MSA_MODULE)
    nvfp4_cls = getattr(msa, "MiniMaxM3SparseMSANvfp4Impl", None)
    if kv_cache_dtype == "nvfp4" and nvfp4_cls is not None:
        return nvfp4_cls.__new__(nvfp4_cls)
    monkeypatch.setattr(msa, "supports_cutlass_sparse_decode", lambda **_: True)
    return msa.MiniMaxM3SparseMSAImpl(
        8,
        HEAD_DIM,
        HEAD_DIM**-0.5,
        1,
        kv_cache_dtype=kv_cache_dtype,
        topk_blocks=TOPK,
        sparse_block_size=PAGE,
    )


# The MSA impl runs the Triton decode for shapes its CUTLASS decode has no plan for, except
# over an NVFP4 cache, which has no Triton fallback: warming Triton there would compile
# variants no step runs.
@pytest.mark.parametrize(("kv_cache_dtype", "registers"), [("auto", True), ("fp8", True),
                                                            ("nvfp4", False)])  # fmt: skip
def test_msa_impl_registers_where_it_can_fall_back_to_triton(
    kv_cache_dtype, registers, monkeypatch
):
    impl = _sm100_msa_impl(kv_cache_dtype, monkeypatch)
    registry = JitWarmupRegistry(vllm_config=None)
    with registry.activate():
        warmup.register_sparse_decode_warmup(impl, _engine_config(jit_warmup=True))
    assert len(registry) == (1 if registers else 0)
