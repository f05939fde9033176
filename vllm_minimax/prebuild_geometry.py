"""The warm-up geometries of an engine on one GPU, as the patched vLLM would register them.

The lengths and batch bounds come from the engine settings, the model's geometry and, for what
the config leaves unset, vLLM's own batch defaults for the target GPU's memory (asked of
``EngineArgs`` on a simulated GPU). Which backends run is asked of the patched vLLM's own
selection on a simulated SM90 GPU (``probe``); the geometries are the warm-ups' own types
(patch 0004's indexer, patch 0007's sparse attention).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_minimax.prebuild_inputs import EngineSettings, GpuTarget, ModelGeometry, PrebuildError

INDEXER_WARMUP_MODULE = "vllm.models.minimax_m3.nvidia.indexer_flashinfer_warmup"
SPARSE_ATTENTION_MODULE = "vllm.models.minimax_m3.nvidia.sparse_attention_flashinfer"
INDEXER_FLASHINFER_IMPL = "MiniMaxM3IndexerFlashInferImpl"
SPARSE_ATTENTION_FLASHINFER_IMPL = "MiniMaxM3SparseFlashInferImpl"


@dataclass(frozen=True)
class EngineShape:
    """The numbers the warm-ups read on one GPU, and where each came from."""

    gpu: GpuTarget
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    sources: dict[str, str]


@dataclass
class Plan:
    """The warm-up geometries of an engine on one GPU, the programs they reach, and the
    configs (with the KV-cache dtype given) whose engines have these geometries."""

    gpu: GpuTarget
    indexer: Any | None = None
    indexer_reason: str | None = None
    sparse_attention: Any | None = None
    sparse_attention_reason: str | None = None
    nvcc: list[str] = field(default_factory=list)
    cute_dsl: list[str] = field(default_factory=list)
    configs: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[int, str, str]:
        return (self.gpu.sm_count, repr(self.indexer), repr(self.sparse_attention))


def simulated_gpu_platform(target: GpuTarget) -> Any:
    """vLLM's platform answering as ``target`` (capability 9.0, its memory and name)."""
    from vllm_minimax.probe import simulated_cuda_platform

    base = type(simulated_cuda_platform((9, 0)))
    memory = int(target.memory_gib * 2**30)

    class SimulatedGpu(base):  # type: ignore[misc, valid-type]
        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return memory

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return target.device_name

    return SimulatedGpu()


def vllm_batch_defaults(target: GpuTarget, world_size: int) -> tuple[int, int]:
    """vLLM's own defaults of ``max_num_batched_tokens`` and ``max_num_seqs`` for `vllm
    serve` on ``target`` (``EngineArgs.get_batch_defaults``, on a simulated GPU)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from vllm_minimax.probe import platform_override

    with platform_override(simulated_gpu_platform(target), ("vllm.engine.arg_utils",)):
        tokens, seqs = EngineArgs.get_batch_defaults(world_size)
    context = UsageContext.OPENAI_API_SERVER
    return tokens[context], seqs[context]


def engine_shape(settings: EngineSettings, model: ModelGeometry, target: GpuTarget) -> EngineShape:
    """The lengths and batch bounds the warm-ups see on ``target``."""
    sources: dict[str, str] = {}
    max_model_len = settings.max_model_len
    sources["max_model_len"] = "config"
    if max_model_len is None:
        if model.max_position_embeddings is None:
            raise PrebuildError(
                f"{settings.config} sets no max-model-len and {model.source} states no"
                " max_position_embeddings"
            )
        max_model_len = model.max_position_embeddings
        sources["max_model_len"] = f"max_position_embeddings of {model.source}"
    tokens, seqs = settings.max_num_batched_tokens, settings.max_num_seqs
    sources["max_num_batched_tokens"] = sources["max_num_seqs"] = "config"
    if tokens is None or seqs is None:
        default_tokens, default_seqs = vllm_batch_defaults(target, settings.tensor_parallel_size)
        throughput = 2 if settings.performance_mode == "throughput" else 1
        how = f"vLLM's default for {target.device_name}"
        if tokens is None:
            tokens = default_tokens * throughput
            if not settings.enable_chunked_prefill:
                tokens = max(tokens, max_model_len)
            sources["max_num_batched_tokens"] = how
        if seqs is None:
            seqs = default_seqs * throughput
            sources["max_num_seqs"] = how
    return EngineShape(target, max_model_len, seqs, tokens, sources)


def _per_rank(total: int, tensor_parallel_size: int) -> int:
    """Heads a rank holds; KV and index heads are replicated once TP exceeds them."""
    return max(1, total // tensor_parallel_size)


def indexer_geometry(
    settings: EngineSettings, model: ModelGeometry, shape: EngineShape
) -> tuple[Any | None, str | None]:
    """Patch 0004's warm-up geometry for this engine, or ``(None, why it registers none)``."""
    import importlib

    from vllm_minimax.probe import select_indexer

    iw = importlib.import_module(INDEXER_WARMUP_MODULE)
    from vllm.models.minimax_m3.nvidia.indexer_flashinfer_gate import index_cache_is_fp8

    heads = _per_rank(model.index_heads, settings.tensor_parallel_size)
    options = {
        key: value
        for key, value in settings.attention.items()
        if key != "minimax_m3_indexer_backend"
    }
    selection = select_indexer(
        indexer_kv_dtype=None,
        topk_blocks=model.topk_blocks,
        num_index_heads=heads,
        indexer_backend=str(settings.attention.get("minimax_m3_indexer_backend", "auto")),
        capability=(9, 0),
        attention_options=options,
    )
    if selection.impl != INDEXER_FLASHINFER_IMPL:
        return None, selection.describe()
    from vllm.config import AttentionConfig

    dtype = AttentionConfig(**options).resolve_indexer_kv_dtype("bf16")
    return (
        iw.IndexerFlashInferGeometry(
            arch="sm90",
            num_index_heads=heads,
            kv_fp8=index_cache_is_fp8(dtype),
            max_query_len=1 + settings.num_speculative_tokens,
            max_num_batched_tokens=shape.max_num_batched_tokens,
            max_model_len=shape.max_model_len,
            num_sms=shape.gpu.sm_count,
        ),
        None,
    )


def sparse_attention_geometry(
    settings: EngineSettings, model: ModelGeometry, shape: EngineShape
) -> tuple[Any | None, str | None]:
    """Patch 0007's warm-up geometry for this engine, or ``(None, why it registers none)``."""
    import importlib
    import importlib.util

    from vllm_minimax.probe import select_sparse_attention

    if importlib.util.find_spec(SPARSE_ATTENTION_MODULE) is None:
        return None, "this vLLM's series has no FlashInfer sparse attention"
    if settings.dtype not in ("auto", "bfloat16", "bf16"):
        return None, f"dtype {settings.dtype}: FlashInfer's SM90 sparse attention takes bf16"
    tp = settings.tensor_parallel_size
    num_heads = model.num_attention_heads // tp
    num_kv_heads = _per_rank(model.num_key_value_heads, tp)
    selection = select_sparse_attention(
        kv_cache_dtype=settings.kv_cache_dtype,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        topk_blocks=model.topk_blocks,
        head_size=model.head_dim,
        sparse_attention_backend=str(
            settings.attention.get("minimax_m3_sparse_attention_backend", "auto")
        ),
        capability=(9, 0),
    )
    if selection.impl != SPARSE_ATTENTION_FLASHINFER_IMPL:
        return None, selection.describe()
    sa = importlib.import_module(SPARSE_ATTENTION_MODULE)
    derive = getattr(sa, "sparse_attention_warmup_geometry", None)
    if derive is None:
        raise PrebuildError(
            "the series' sparse attention has no sparse_attention_warmup_geometry: apply"
            " this checkout's series (`vllm-minimax apply`)"
        )
    geometry = derive(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        scale=model.head_dim**-0.5,
        num_speculative_tokens=settings.num_speculative_tokens,
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        max_model_len=shape.max_model_len,
        decode_context_parallel_size=settings.decode_context_parallel_size,
    )
    return geometry, None
