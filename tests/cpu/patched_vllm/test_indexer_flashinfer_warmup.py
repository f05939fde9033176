"""Patch 0004's warm-up builds exactly the FlashInfer programs an engine can reach.

The reference runs FlashInfer 0.7.4's own SM90 dispatch (`_sm90_dispatch`'s
`proxy_score_sm90` and `topk_select_sm90`) on meta tensors for every shape an
engine of the config can produce (top-k: every score width and token count;
proxy score: every regime over batches of 1 to 3 requests), with the step that
builds a program stubbed to record the program's name (the Cake program, or the
CuTe-DSL kernel's `module/kernel` name as FlashInfer's JIT cache names it). The
warm-up's own calls go through the same stubbed dispatch: both sets must match.
"""

from __future__ import annotations

import itertools
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("flashinfer.msa_ops.cake_hopper_sm90")

from flashinfer.jit.cake_hopper_msa import ROUTES
from flashinfer.msa_ops import _sm90_dispatch, cake_hopper_sm90
from flashinfer.msa_ops.cute_dsl import (
    proxy_score_decode_sm90,
    proxy_score_prefill_sm90,
    topk_select_sm90,
)
from vllm.models.minimax_m3.nvidia import indexer_flashinfer_warmup as warmup

from vllm_minimax.testing.patched_module import indexer_text_config

# The planning tests below call only the warm-up's planning functions (and the gate's
# constants), FlashInfer's own planners and the installed FlashInfer's dispatch: against
# another release they run only where these files differ from the installed release's.
PLANNING_ONLY = pytest.mark.same_code_in_every_release(
    "vllm/models/minimax_m3/nvidia/indexer_flashinfer_warmup.py",
    "vllm/models/minimax_m3/nvidia/indexer_flashinfer_gate.py",
)

H200_SMS = 132
META = torch.device("meta")
HEAD_DIM = 128


class _Recorder:
    """Stubs FlashInfer's build steps; ``programs`` collects what would be built."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.programs: set[str] = set()
        noop = lambda *args, **kwargs: None  # noqa: E731

        def cute_build(module_name, kernel_name, compile_fn, extra_key_files=()):
            self.programs.add(f"cute:{module_name}/{kernel_name}")
            return noop

        def cake_topk(max_score, topk, output, *, num_valid_pages=None, **forced):
            hq, tiles, total_q = max_score.shape
            _, name = cake_hopper_sm90._topk_resolution(
                num_heads=hq,
                tiles=tiles,
                total_q=total_q,
                num_sms=H200_SMS,
                masked=True,
                nvp=num_valid_pages is not None,
            )
            self.programs.add(f"cake:{name}")

        def cake_proxy_prefill(q, k, cu, *, per_head, max_seqlen_q, batch_size, **kw):
            plan = cake_hopper_sm90.plan_proxy_score_prefill(
                hq=q.shape[1],
                batch=batch_size,
                max_k_tiles=per_head.shape[1],
                max_seqlen_q=max_seqlen_q,
                use_fp32_acc=kw.get("use_fp32_acc", True),
                num_sms=H200_SMS,
            )
            self.programs.add(f"cake:{ROUTES[plan.route]}")

        def cake_proxy_decode(q, k, *, max_seqlen_q, **kw):
            route = cake_hopper_sm90.proxy_route(
                q_dtype=q.dtype, num_q_heads=q.shape[1], max_seqlen_q=max_seqlen_q
            )
            self.programs.add(f"cake:{ROUTES[route]}")

        monkeypatch.setattr(_sm90_dispatch, "_sm_count", lambda device: H200_SMS)
        monkeypatch.setattr(cake_hopper_sm90, "hopper_msa_topk_select", cake_topk)
        monkeypatch.setattr(cake_hopper_sm90, "hopper_msa_proxy_score_prefill", cake_proxy_prefill)
        monkeypatch.setattr(cake_hopper_sm90, "hopper_msa_proxy_score_decode", cake_proxy_decode)
        for module in (topk_select_sm90, proxy_score_decode_sm90, proxy_score_prefill_sm90):
            monkeypatch.setattr(module, "build_and_load_cute_dsl_kernel", cute_build)
            monkeypatch.setattr(module, "_kf_stream", noop)
        monkeypatch.setattr(topk_select_sm90, "_cache", {})
        monkeypatch.setattr(topk_select_sm90, "_dyn", lambda tensor, leading_dim: tensor)
        for module in (proxy_score_decode_sm90, proxy_score_prefill_sm90):
            monkeypatch.setattr(module, "_CACHE", {})
            monkeypatch.setattr(
                module,
                "from_dlpack",
                lambda *a, **k: SimpleNamespace(mark_layout_dynamic=lambda **kw: None),
            )
        monkeypatch.setattr(proxy_score_decode_sm90, "_nsplit", lambda b, n, d: 1)
        monkeypatch.setattr(proxy_score_prefill_sm90, "MsaProxyScore", lambda **kw: None)

    def topk(self, num_heads: int, tiles: int, total_q: int) -> None:
        scores = torch.empty((num_heads, tiles, total_q), dtype=torch.float32, device=META)
        output = torch.empty((total_q, num_heads, 16), dtype=torch.int32, device=META)
        nvp = torch.empty((total_q,), dtype=torch.int32, device=META)
        _sm90_dispatch.topk_select_sm90(
            scores, 16, output, num_valid_pages=nvp, force_end_blocks=min(1, tiles)
        )

    def proxy(self, num_heads: int, call: warmup.ProxyScoreCall, kv_fp8: bool = True) -> None:
        """One proxy-score call, with q and the index cache in the dtype the warm-up's own
        call gives them for ``kv_fp8``."""
        total_q, batch = sum(call.query_lens), len(call.query_lens)
        dtype = torch.float8_e4m3fn if kv_fp8 else torch.bfloat16
        _sm90_dispatch.proxy_score_sm90(
            torch.empty((total_q, num_heads, HEAD_DIM), dtype=dtype, device=META),
            torch.empty((call.num_pages, 1, 128, HEAD_DIM), dtype=dtype, device=META),
            torch.empty((batch + 1,), dtype=torch.int32, device=META),
            torch.empty((batch, call.max_k_tiles), dtype=torch.int32, device=META),
            torch.empty((batch,), dtype=torch.int32, device=META),
            torch.empty((num_heads, call.max_k_tiles, total_q), device=META),
            max_seqlen_q=max(call.query_lens),
            batch_size=batch,
            kv_fp8=kv_fp8,
        )

    def warmup_calls(self, geometry: warmup.IndexerFlashInferGeometry) -> set[str]:
        """What the warm-up's own calls build."""
        for program in warmup.indexer_flashinfer_programs(geometry):
            if isinstance(program.call, warmup.ProxyScoreCall):
                self.proxy(geometry.num_index_heads, program.call)
            else:
                self.topk(geometry.num_index_heads, program.call.max_k_tiles, program.call.total_q)
        return self.programs


def _geometry(heads: int, max_model_len: int, max_tokens: int, mtp: int = 0):
    return warmup.IndexerFlashInferGeometry(
        arch="sm90",
        num_index_heads=heads,
        kv_fp8=True,
        max_query_len=1 + mtp,
        max_num_batched_tokens=max_tokens,
        max_model_len=max_model_len,
        num_sms=H200_SMS,
    )


# TP 1 / 2 / 8 of MiniMax M3's 4 KV (= index) heads: 4, 2 and 1 per rank.
TOPK_GEOMETRIES = {
    "tp1-4k-256": _geometry(4, 4096, 256),
    "tp2-12k-96": _geometry(2, 12288, 96, mtp=2),
    "tp8-3k-512": _geometry(1, 3072, 512, mtp=4),
}


@pytest.mark.slow
@PLANNING_ONLY
@pytest.mark.parametrize("name", TOPK_GEOMETRIES)
def test_topk_programs_match_every_shape(name, monkeypatch):
    geometry = TOPK_GEOMETRIES[name]
    reference = _Recorder(monkeypatch)
    for tiles in range(1, geometry.max_k_tiles + 1):
        for total_q in range(1, geometry.max_num_batched_tokens + 1):
            reference.topk(geometry.num_index_heads, tiles, total_q)
    warm = _Recorder(monkeypatch)
    for program in warmup.topk_programs(geometry):
        warm.topk(geometry.num_index_heads, program.call.max_k_tiles, program.call.total_q)
    names = {program.name for program in warmup.topk_programs(geometry)}
    print(f"\n{name}: {len(reference.programs)} top-k programs")
    assert warm.programs == reference.programs
    # The names the warm-up logs are the programs its calls build.
    assert names == reference.programs


def _proxy_shapes(max_model_len: int, max_tokens: int):
    """Batches of 1 to 3 requests over query lengths and widths an engine can
    produce, with an index cache small and large against the batch's pages."""
    max_tiles = -(-max_model_len // 128)
    query_lens = [1, 2, 3, 4, 5, 8, 127, 128, 129, 300, 1024]
    tiles_set = sorted({1, 2, 3, 16, 17, 18, 64, max_tiles})
    for batch in (1, 2, 3):
        for lens in itertools.product(query_lens, repeat=batch):
            if sum(lens) > max_tokens:
                continue
            for tiles in tiles_set:
                if tiles > max_tiles or tiles * 128 < max(lens):
                    continue
                for num_pages in (1, batch * tiles):
                    yield warmup.ProxyScoreCall(tuple(lens), tiles, num_pages)


@PLANNING_ONLY
@pytest.mark.parametrize(
    "heads,max_model_len,max_tokens", [(4, 32768, 8192), (1, 131072, 16384), (2, 2048, 2048)]
)
def test_proxy_programs_match_every_regime(heads, max_model_len, max_tokens, monkeypatch):
    geometry = _geometry(heads, max_model_len, max_tokens)
    reference = _Recorder(monkeypatch)
    for call in _proxy_shapes(max_model_len, max_tokens):
        reference.proxy(heads, call)
    warm = _Recorder(monkeypatch)
    for program in warmup.proxy_score_calls(geometry):
        warm.proxy(heads, program.call)
    assert warm.programs == reference.programs
    # One call per program: the count the engine logs is the count built.
    assert len(warmup.proxy_score_calls(geometry)) == len(reference.programs)


def test_geometry_follows_the_engine_config():
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=3),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=6144),
        model_config=SimpleNamespace(max_model_len=40000),
    )
    geometry = warmup.geometry_from_config(
        config, num_index_heads=2, kv_fp8=True, arch="sm90", num_sms=H200_SMS
    )
    assert geometry.max_query_len == 4
    assert geometry.max_num_batched_tokens == 6144
    assert geometry.max_k_tiles == 313  # ceil(40000 / 128)
    config.speculative_config = None
    assert (
        warmup.geometry_from_config(
            config, num_index_heads=2, kv_fp8=True, arch="sm90", num_sms=H200_SMS
        ).max_query_len
        == 1
    )


def _engine_config(indexer_kv_dtype: str) -> SimpleNamespace:
    """A TP-8 MiniMax M3 engine's config, as far as the warm-up reads it."""
    from vllm.config import AttentionConfig

    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=indexer_text_config(index_n_heads=4), max_model_len=4096
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=8),
        attention_config=AttentionConfig(indexer_kv_dtype=indexer_kv_dtype),
        speculative_config=SimpleNamespace(num_speculative_tokens=2),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=2048),
        kernel_config=SimpleNamespace(enable_jit_warmup=True),
    )


def test_with_the_jit_warmup_off_the_prebuild_is_checked_and_nothing_registered(monkeypatch):
    """`--enforce-eager` turns vLLM's JIT warm-up off: the indexer's programs then build at
    first use, as in stock vLLM, but the engine may still load prebuilt ones, so the layer's
    call checks the prebuild all the same."""
    from vllm.models.minimax_m3.nvidia import indexer_flashinfer

    checked, registered = [], []
    monkeypatch.setattr(warmup, "check_prebuilt_programs_once", lambda: checked.append(1))
    monkeypatch.setattr(warmup, "current_device_facts", lambda: ("sm90", H200_SMS))
    monkeypatch.setattr(warmup._JIT, "register_warmup", lambda **fields: registered.append(fields))
    impl = object.__new__(indexer_flashinfer.MiniMaxM3IndexerFlashInferImpl)
    impl.num_index_heads, impl.indexer_kv_dtype = 1, "fp8"
    eager = _engine_config("fp8")
    eager.kernel_config.enable_jit_warmup = False
    warmup.register_indexer_flashinfer_warmup(impl, eager)
    assert checked == [1] and registered == []
    warmup.register_indexer_flashinfer_warmup(impl, _engine_config("fp8"))
    assert checked == [1, 1] and len(registered) == 1


@pytest.mark.parametrize("spelling", ["fp8", "fp8_e4m3"])
def test_either_fp8_spelling_warms_the_fp8_programs(spelling, monkeypatch):
    """vLLM's index cache is fp8 e4m3 under both spellings, and the SM90 gate lets
    both through. An engine's registration and the `vllm-minimax warmup` geometry must
    then plan fp8 programs: FlashInfer's SM90 dispatch refuses a bf16 prefill-regime
    proxy score, which would fail the engine's start."""
    import vllm.models.minimax_m3.nvidia.indexer_flashinfer_gate as gate
    from vllm.models.minimax_m3.nvidia import indexer_flashinfer

    from vllm_minimax import warmup as cli_warmup
    from vllm_minimax.probe import platform_override, simulated_cuda_platform

    config = _engine_config(spelling)
    monkeypatch.setattr(warmup, "current_device_facts", lambda: ("sm90", H200_SMS))
    monkeypatch.setattr(gate, "flashinfer_msa_indexer_unavailable", lambda: None)
    with platform_override(simulated_cuda_platform((9, 0))):
        cli_geometry, reason = cli_warmup.engine_indexer_flashinfer_geometry(config)
    assert reason is None
    registered: list[dict] = []
    monkeypatch.setattr(warmup._JIT, "register_warmup", lambda **fields: registered.append(fields))
    impl = object.__new__(indexer_flashinfer.MiniMaxM3IndexerFlashInferImpl)
    impl.num_index_heads, impl.indexer_kv_dtype = 1, spelling
    warmup.register_indexer_flashinfer_warmup(impl, config)
    engine_geometry = warmup.IndexerFlashInferGeometry(**registered[0])

    assert cli_geometry == engine_geometry
    recorder = _Recorder(monkeypatch)
    calls = warmup.proxy_score_calls(engine_geometry)
    assert any(max(program.call.query_lens) > 4 for program in calls)  # a prefill regime
    for program in calls:
        recorder.proxy(1, program.call, kv_fp8=engine_geometry.kv_fp8)
    assert engine_geometry.kv_fp8


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_the_warmup_commands_geometry_is_a_rank_of_the_configs_tensor_parallel_size(
    tp, monkeypatch
):
    """`vllm-minimax warmup` builds the engine config for one GPU (TP 1) and prepares the
    programs of a rank of the config's TP: the geometry it computes with that TP as the
    override is the one each rank's model registers (its index heads per rank)."""
    import vllm.models.minimax_m3.nvidia.indexer_flashinfer_gate as gate
    from vllm.models.minimax_m3.nvidia import indexer_flashinfer

    from vllm_minimax import warmup as cli_warmup
    from vllm_minimax.probe import platform_override, simulated_cuda_platform

    monkeypatch.setattr(warmup, "current_device_facts", lambda: ("sm90", H200_SMS))
    monkeypatch.setattr(gate, "flashinfer_msa_indexer_unavailable", lambda: None)
    one_gpu = _engine_config("fp8")
    one_gpu.parallel_config.tensor_parallel_size = 1
    with platform_override(simulated_cuda_platform((9, 0))):
        geometry, reason = cli_warmup.engine_indexer_flashinfer_geometry(
            one_gpu, tensor_parallel_size=tp
        )
    assert reason is None and geometry is not None
    rank = _engine_config("fp8")
    rank.parallel_config.tensor_parallel_size = tp
    registered: list[dict] = []
    monkeypatch.setattr(warmup._JIT, "register_warmup", lambda **fields: registered.append(fields))
    impl = object.__new__(indexer_flashinfer.MiniMaxM3IndexerFlashInferImpl)
    # MiniMax M3's 4 index heads over the ranks, as the indexer divides them.
    impl.num_index_heads, impl.indexer_kv_dtype = max(1, 4 // tp), "fp8"
    warmup.register_indexer_flashinfer_warmup(impl, rank)
    assert geometry == warmup.IndexerFlashInferGeometry(**registered[0])


@pytest.mark.parametrize(("name", "tp"), [("h200-8x", 8), ("rtx-pro-6000-4x", 4)])
def test_the_warmup_command_passes_the_configs_tensor_parallel_size_on(
    name, tp, tmp_path, monkeypatch, capsys
):
    """`vllm-minimax warmup --config NAME` on one GPU: vLLM's engine config is built for one
    rank (TP, PP and DP 1, which one GPU can hold), and the geometry is asked for a rank of
    the config's own tensor parallelism (a shipped config, parsed by vLLM's parser)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from vllm_minimax import cli
    from vllm_minimax import warmup as cli_warmup

    monkeypatch.setattr(current_platform, "device_type", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(cli_warmup.WORKSPACE_ENV, str(tmp_path))
    built: list[tuple[int, int, int]] = []

    def create_engine_config(self, *args, **kwargs):
        built.append(
            (self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size)
        )
        return SimpleNamespace()

    asked: list[int | None] = []

    def geometry(vllm_config, tensor_parallel_size=None):
        asked.append(tensor_parallel_size)
        return None, "stopped by the test"

    monkeypatch.setattr(EngineArgs, "create_engine_config", create_engine_config)
    monkeypatch.setattr(cli_warmup, "engine_indexer_flashinfer_geometry", geometry)
    code = cli.main(["warmup", "--config", name, "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "stopped by the test" in err, err
    assert built == [(1, 1, 1)]
    assert asked == [tp]


def test_program_list_is_kept_beside_the_jit_cache(tmp_path, monkeypatch):
    from flashinfer.jit import env as jit_env

    monkeypatch.setattr(jit_env, "FLASHINFER_WORKSPACE_DIR", tmp_path)
    geometry = _geometry(2, 4096, 300)
    first = warmup.cached_indexer_flashinfer_programs(geometry)
    assert first == warmup.indexer_flashinfer_programs(geometry)

    def no_sweep(geometry):
        raise AssertionError("swept again although the list was kept")

    monkeypatch.setattr(warmup, "indexer_flashinfer_programs", no_sweep)
    assert warmup.cached_indexer_flashinfer_programs(geometry) == first
    # Another geometry is not served from that list.
    with pytest.raises(AssertionError, match="swept again"):
        warmup.cached_indexer_flashinfer_programs(_geometry(2, 4096, 301))


def test_the_warmup_counts_rebuilt_artifacts_as_built(tmp_path, monkeypatch):
    """An artifact ninja rebuilds in place (its source is newer, as on a machine
    whose FlashInfer was installed after the cache was built) counts as built,
    as a new one does; an artifact left alone does not."""
    from flashinfer.jit import env as jit_env

    monkeypatch.setattr(jit_env, "FLASHINFER_JIT_DIR", tmp_path)
    kept, rebuilt, new = (
        tmp_path / "cake_kept" / "kept.so",
        tmp_path / "cake_rebuilt" / "kernel.cuda.o",
        tmp_path / "topk_cute_dsl" / "kernel.o",
    )
    for path in (kept, rebuilt):
        path.parent.mkdir()
        path.write_bytes(b"old")
        os.utime(path, ns=(10**18, 10**18))
    (tmp_path / "cake_rebuilt" / "build.ninja").write_text("not an artifact")
    programs = [
        warmup.FlashInferProgram("cake:rebuilt", warmup.ProxyScoreCall((1,), 4, 4)),
        warmup.FlashInferProgram("cute:topk", warmup.TopkSelectCall(4, 1)),
    ]
    monkeypatch.setattr(warmup, "cached_indexer_flashinfer_programs", lambda g: programs)
    monkeypatch.setattr(warmup, "_prebuild_cake_programs", lambda programs: None)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)

    def rebuild(*args):
        rebuilt.write_bytes(b"rebuilt")
        os.utime(rebuilt, ns=(10**18 + 10**9, 10**18 + 10**9))

    def build_new(*args):
        new.parent.mkdir()
        new.write_bytes(b"new")

    monkeypatch.setattr(warmup, "_run_proxy_score", rebuild)
    monkeypatch.setattr(warmup, "_run_topk_select", build_new)
    ready, built, _ = warmup.build_indexer_flashinfer_programs(_geometry(1, 8192, 1024))
    assert ready == programs
    assert built == 2


def test_vllm_warmup_registry_builds_each_geometry_once(monkeypatch):
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    built = []
    monkeypatch.setattr(
        warmup,
        "build_indexer_flashinfer_programs",
        lambda geometry: (built.append(geometry) or [], 0, 0.0),
    )
    monkeypatch.setattr(warmup._JIT, "_compiled_cache", {})
    registry = JitWarmupRegistry(vllm_config=None)
    geometry = _geometry(1, 8192, 1024)
    with registry.activate():
        for _layer in range(3):  # every sparse layer registers the same geometry
            warmup._JIT.register_warmup(**vars(geometry))
        # Not the FlashInfer indexer: nothing to warm.
        warmup.register_indexer_flashinfer_warmup(object(), vllm_config=None)
    assert len(registry) == 1
    registry.warmup()
    assert built == [geometry]


# ---------------------------------------------------------------------------
# The warm-up never stops the engine.
# ---------------------------------------------------------------------------
# Each FlashInfer internal the warm-up reads, and the geometry that reaches it.
PRIVATE_NAMES = {
    "plan_topk_select": ("flashinfer.msa_ops.cake_hopper_sm90", "plan_topk_select", "sm90"),
    "ROUTES": ("flashinfer.jit.cake_hopper_msa", "ROUTES", "sm90"),
    "_select_plan": ("flashinfer.msa_ops.cute_dsl.topk_select_sm90", "_select_plan", "sm90"),
    "TOPK": ("flashinfer.msa_ops.cute_dsl.topk_select_sm90", "TOPK", "sm90"),
    "_MAX_BLOCKS": (
        "flashinfer.msa_ops.cute_dsl.topk_select_countrank_sm12x",
        "_MAX_BLOCKS",
        "sm120",
    ),
    "FLASHINFER_WORKSPACE_DIR": ("flashinfer.jit.env", "FLASHINFER_WORKSPACE_DIR", "sm90"),
    "FLASHINFER_JIT_DIR": ("flashinfer.jit.env", "FLASHINFER_JIT_DIR", "sm90"),
    "load_hopper_msa_module": ("flashinfer.jit.cake_hopper_msa", "load_hopper_msa_module", "sm90"),
}


def _flashinfer_impl(heads: int = 1, dtype: str = "fp8"):
    from vllm.models.minimax_m3.nvidia import indexer_flashinfer

    impl = object.__new__(indexer_flashinfer.MiniMaxM3IndexerFlashInferImpl)
    impl.num_index_heads, impl.indexer_kv_dtype = heads, dtype
    return impl


@pytest.mark.parametrize("name", [*PRIVATE_NAMES, "plan_topk_select.__wrapped__"])
def test_a_changed_flashinfer_internal_is_logged_and_the_engine_goes_on(
    name, monkeypatch, tmp_path, caplog
):
    """A FlashInfer release that renames what the warm-up reads must not stop the
    engine: vLLM's registry runs the warm-up, which logs why it could not run and
    names the FlashInfer release it was validated on; the start goes on."""
    import importlib
    import logging

    from flashinfer.jit import env as jit_env
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    if name == "plan_topk_select.__wrapped__":
        module_name, attribute, arch = PRIVATE_NAMES["plan_topk_select"]
        module = importlib.import_module(module_name)
        real = module.plan_topk_select
        monkeypatch.setattr(module, attribute, lambda **kw: real(**kw))  # no __wrapped__
        missing = "__wrapped__"
    else:
        module_name, attribute, arch = PRIVATE_NAMES[name]
        monkeypatch.setattr(jit_env, "FLASHINFER_WORKSPACE_DIR", tmp_path / "ws")
        monkeypatch.setattr(jit_env, "FLASHINFER_JIT_DIR", tmp_path / "jit")
        monkeypatch.delattr(importlib.import_module(module_name), attribute)
        missing = attribute
    monkeypatch.setattr(warmup, "current_device_facts", lambda: (arch, H200_SMS))
    monkeypatch.setattr(warmup._JIT, "_compiled_cache", {})
    config = _engine_config("fp8")
    config.model_config.max_model_len = 40000  # wider than the fill-only top-k
    registry = JitWarmupRegistry(vllm_config=config)
    with registry.activate(), caplog.at_level(logging.WARNING):
        warmup.register_indexer_flashinfer_warmup(_flashinfer_impl(), config)
        assert len(registry) == 1
        registry.warmup()  # raises nothing
    (record,) = [r for r in caplog.records if "warm-up skipped" in r.getMessage()]
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    assert missing in message, message
    assert "validated on FlashInfer 0.7.4" in message
    assert "builds each program on first use" in message
    assert list(warmup._JIT._compiled_cache.values()) == [[]]


def test_a_warmup_that_cannot_be_planned_is_logged_at_registration(monkeypatch, caplog):
    """On a device without FlashInfer MSA kernels (here: the CPU) the geometry cannot
    be read: model construction logs it and registers nothing."""
    import logging

    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    registry = JitWarmupRegistry(vllm_config=None)
    with registry.activate(), caplog.at_level(logging.WARNING):
        warmup.register_indexer_flashinfer_warmup(_flashinfer_impl(), _engine_config("fp8"))
    assert len(registry) == 0
    assert any("could not register" in r.getMessage() for r in caplog.records), caplog.text


class _UnforeseenError(Exception):
    """An error of a type no handler names (what a FlashInfer or CUDA release may raise)."""


# One of each kind a warm-up meets or could: a full disk, a lock timeout, a CUDA error
# (a RuntimeError), a changed signature, a missing key, a failed check, and a new type.
WARMUP_ERRORS = {
    "OSError": OSError(28, "No space left on device"),
    "TimeoutError": TimeoutError("the JIT cache lock"),
    "RuntimeError": RuntimeError("CUDA error: out of memory"),
    "TypeError": TypeError("plan_topk_select() got an unexpected keyword argument"),
    "KeyError": KeyError("sm90"),
    "AssertionError": AssertionError("unexpected tile count"),
    "_UnforeseenError": _UnforeseenError("something new"),
}


@pytest.mark.parametrize("step", ["register", "build"])
@pytest.mark.parametrize("kind", list(WARMUP_ERRORS))
def test_whatever_the_warmup_raises_is_logged_and_the_engine_goes_on(
    monkeypatch, caplog, step, kind
):
    """At registration (model construction) and at the build (vLLM's warm-up before the
    engine is ready), an error of any type is logged with its type and the start goes on:
    the warm-up is an optimisation, never a reason for the engine not to start."""
    import logging

    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    # The message carries the test's parameters: warning_once logs each message once.
    error = type(WARMUP_ERRORS[kind])(*WARMUP_ERRORS[kind].args, f"[{step}-{kind}]")

    def raises(*args, **kwargs):
        raise error

    if step == "register":
        monkeypatch.setattr(warmup, "current_device_facts", raises)
    else:
        monkeypatch.setattr(warmup, "current_device_facts", lambda: ("sm90", H200_SMS))
        monkeypatch.setattr(warmup, "build_indexer_flashinfer_programs", raises)
    monkeypatch.setattr(warmup._JIT, "_compiled_cache", {})
    config = _engine_config("fp8")
    registry = JitWarmupRegistry(vllm_config=config)
    with registry.activate(), caplog.at_level(logging.WARNING):
        warmup.register_indexer_flashinfer_warmup(_flashinfer_impl(), config)
        assert len(registry) == (0 if step == "register" else 1)
        registry.warmup()
    (record,) = [r for r in caplog.records if "warm-up skipped" in r.getMessage()]
    message = record.getMessage()
    assert f"could not {step}" in message and f"({kind}: " in message, message
    assert f"[{step}-{kind}]" in message, message
    if step == "build":
        assert list(warmup._JIT._compiled_cache.values()) == [[]]


# ---------------------------------------------------------------------------
# A kept program list is used only when it is one the warm-up wrote.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "null",
        '"a string"',
        "{}",
        "[]",
        "[1]",
        '[{"name": "x"}]',
        '[{"name": 1, "op": "topk_select", "max_k_tiles": 1, "total_q": 1}]',
        '[{"name": "x", "op": "topk_select", "max_k_tiles": "3", "total_q": 1}]',
        '[{"name": "x", "op": "topk_select", "max_k_tiles": 0, "total_q": 1}]',
        '[{"name": "x", "op": "proxy_score", "query_lens": 5, "max_k_tiles": 1, "num_pages": 1}]',
        '[{"name": "x", "op": "proxy_score", "query_lens": [], "max_k_tiles": 1, "num_pages": 1}]',
        '[{"name": "x", "op": "build", "max_k_tiles": 1, "total_q": 1}]',
    ],
)
def test_a_malformed_program_list_is_recomputed(text, tmp_path, monkeypatch):
    from flashinfer.jit import env as jit_env

    monkeypatch.setattr(jit_env, "FLASHINFER_WORKSPACE_DIR", tmp_path)
    geometry = _geometry(2, 2048, 64)
    path = warmup._program_list_path(geometry)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    programs = warmup.cached_indexer_flashinfer_programs(geometry)
    assert programs == warmup.indexer_flashinfer_programs(geometry)
    # Written again, whole: the next start reads it.
    assert warmup._load_program_list(path) == programs


# ---------------------------------------------------------------------------
# One process per host builds; the others wait for its cache.
# ---------------------------------------------------------------------------
def test_one_process_per_host_builds_and_the_others_wait(tmp_path, monkeypatch):
    """Two ranks warming the same geometry at once: the first to take the lock
    builds the artifacts, the second waits for it and then builds nothing. Each
    rank's FileLock opens the lock file itself, as separate processes do."""
    import threading
    import time as time_mod

    from flashinfer.jit import env as jit_env

    monkeypatch.setattr(jit_env, "FLASHINFER_WORKSPACE_DIR", tmp_path / "ws")
    monkeypatch.setattr(jit_env, "FLASHINFER_JIT_DIR", tmp_path / "jit")
    artifact = tmp_path / "jit" / "cake_topk" / "topk.so"
    programs = [warmup.FlashInferProgram("cake:topk", warmup.TopkSelectCall(4, 1))]
    monkeypatch.setattr(warmup, "cached_indexer_flashinfer_programs", lambda g: programs)
    monkeypatch.setattr(warmup, "_prebuild_cake_programs", lambda programs: None)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)
    builds: list[str] = []

    def build_or_load(call, num_heads):  # FlashInfer's own check, then a slow build
        if not artifact.exists():
            time_mod.sleep(0.3)
            artifact.parent.mkdir(parents=True, exist_ok=True)
            artifact.write_bytes(b"so")
            builds.append(threading.current_thread().name)

    monkeypatch.setattr(warmup, "_run_topk_select", build_or_load)
    results: dict[str, int] = {}

    def rank(name: str) -> None:
        results[name] = warmup.build_indexer_flashinfer_programs(_geometry(1, 8192, 1024))[1]

    threads = [threading.Thread(target=rank, args=(f"rank{i}",), name=f"rank{i}") for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1, builds
    assert sorted(results.values()) == [0, 1]


# ---------------------------------------------------------------------------
# The sampled top-k plan covers an engine at production sizes.
# ---------------------------------------------------------------------------
def _random_points(geometry, rng, count: int):
    """Half of the points inside random cells of the warm-up's own sampling grid (where a
    program the grid misses must lie), half log-uniform over the whole plane."""
    widths = warmup._sample(geometry.max_k_tiles)
    tokens = warmup._sample(geometry.max_num_batched_tokens)
    for i in range(count):
        if i % 2:
            yield (
                max(1, int(geometry.max_k_tiles ** rng.random())),
                max(1, int(geometry.max_num_batched_tokens ** rng.random())),
            )
        else:
            w, t = rng.randrange(len(widths) - 1), rng.randrange(len(tokens) - 1)
            yield rng.randint(widths[w], widths[w + 1]), rng.randint(tokens[t], tokens[t + 1])


@PLANNING_ONLY
def test_topk_sampling_covers_random_points_at_production_sizes():
    """MiniMax M3 at TP1 (4 index heads) with 192k-token contexts and 16k batched
    tokens: every top-k program FlashInfer picks at 20000 seeded random (width, token
    count) points is among the warm-up's. A grid spaced by 1.2 or 1.3 instead of 1.05
    leaves 2 or 3 of the 50 programs unbuilt here."""
    import random

    geometry = _geometry(4, 196608, 16384)
    names = {program.name for program in warmup.topk_programs(geometry)}
    unbuilt = set()
    for tiles, total_q in _random_points(geometry, random.Random(45), 20000):
        program = warmup.sm90_topk_program(4, tiles, total_q, H200_SMS)
        if program not in names:
            unbuilt.add((program, tiles, total_q))
    assert not unbuilt, sorted(unbuilt)[:5]
