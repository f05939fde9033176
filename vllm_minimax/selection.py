"""What a `vllm serve` configuration selects for MiniMax M3, one row per component.

`select_rows` takes a parsed serve config and a GPU capability and returns the rows doctor
prints: the indexer and the sparse attention, each from vLLM's own selection
(`select_indexer_impl_cls`, `select_main_backend_and_impl_cls`) through
`vllm_minimax.probe`. Each row says the backend, why, whether the engine runs as
configured, and for a fallback or a failure the config key (or doctor flag) that changes it.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from vllm_minimax import cuda_bindings, probe
from vllm_minimax.serve_config import (
    M3_HEAD_DIM,
    M3_SPARSE_BLOCK,
    M3_TOPK_BLOCKS,
    ServeConfig,
)

INSTALL_HINT = (
    "install FlashInfer from requirements/user-flashinfer.txt as README's 'Install' does"
    " (cuda-python and cuda-bindings uninstalled first)"
)


def install_hint() -> str:
    """What makes FlashInfer's msa_ops importable: the CUDA bindings repaired when they are
    not whole (installing the recipe again would find it satisfied), else the recipe."""
    if cuda_bindings.pair_problem() is not None:
        return f"repair the CUDA bindings: {cuda_bindings.repair_command()}"
    return INSTALL_HINT


class Outcome(enum.Enum):
    """How a row bears on `vllm serve` with this config (ordered by how bad it is)."""

    READY = "ready"  # the backend the config asks for, FlashInfer wherever `auto` can pick it
    INFO = "info"  # nothing this series selects
    FALLBACK = "fallback"  # `auto` keeps Triton
    FAILS = "fails"  # vLLM refuses the config or a forced backend at start-up


@dataclass(frozen=True)
class Row:
    component: str
    backend: str
    reason: str
    outcome: Outcome
    hint: str | None = None


def rows_to_json(rows: list[Row]) -> list[dict[str, str | None]]:
    return [{**dataclasses.asdict(row), "outcome": row.outcome.value} for row in rows]


def rows_from_json(stored: object) -> list[Row] | None:
    """Rows `rows_to_json` wrote, or None for anything else (a stored answer of another
    shape is no answer)."""
    if not isinstance(stored, list) or not stored:
        return None
    try:
        return [Row(**{**item, "outcome": Outcome(item["outcome"])}) for item in stored]
    except (TypeError, ValueError, KeyError):
        return None


def select_rows(
    config: ServeConfig, capability: tuple[int, int], *, simulated: bool = True
) -> list[Row]:
    """The indexer and the sparse attention that `vllm serve` with `config` would select on a
    GPU of `capability`: a simulated one, or (`simulated=False`) this machine's, which has
    that capability."""
    problems = config.problems()
    if problems:
        return [Row("config", "-", "; ".join(problems), Outcome.FAILS, "tensor-parallel-size")]
    platform = capability if simulated else None
    return [
        indexer_row(config, platform),
        sparse_attention_row(config, capability, simulated=simulated),
    ]


def indexer_row(config: ServeConfig, capability: tuple[int, int] | None) -> Row:
    """vLLM's indexer selection on a simulated GPU of `capability` (None: this machine's)."""
    backend_key = config.indexer_backend
    attention_options = {
        key: value
        for key, value in config.attention_config.items()
        if key != "minimax_m3_indexer_backend"
    }
    selection = probe.select_indexer(
        indexer_kv_dtype=None,
        topk_blocks=M3_TOPK_BLOCKS,
        num_index_heads=config.index_heads_per_rank,
        indexer_backend=backend_key,
        capability=capability,
        attention_options=attention_options,
    )
    if selection.error is not None:
        return Row(
            "indexer", "-", selection.error, Outcome.FAILS, indexer_hint(selection.error, True)
        )
    impl = selection.impl or "?"
    log = selection.log or ""
    backend = impl.removeprefix("MiniMaxM3Indexer").removesuffix("Impl")
    if "Triton" in backend and backend_key == "auto":
        return Row("indexer", backend, log, Outcome.FALLBACK, indexer_hint(log, False))
    return Row("indexer", backend, log, Outcome.READY)


def indexer_hint(reason: str, forced: bool) -> str:
    """The key (or install step) that changes the indexer's outcome, from vLLM's reason."""
    if "flashinfer" in reason.lower() and any(
        word in reason for word in ("import", "install", "older than", "has no", "does not take")
    ):
        return install_hint()
    if "set indexer_kv_dtype" in reason or "index cache is" in reason:
        return (
            "set attention-config.indexer_kv_dtype: fp8 in the config (doctor: --indexer-kv-dtype)"
        )
    if "requires CUDA fp8 support" in reason:
        return "attention-config.indexer_kv_dtype: bf16 (this GPU has no fp8 for the index cache)"
    if "index heads per rank" in reason:
        return "tensor-parallel-size (index heads per rank: max(1, 4 // TP))"
    if "compute capability" in reason:
        return "none in the config: this GPU has no FlashInfer MSA indexer (9.0, 12.0, 12.1 have)"
    if "Unexpected keyword argument" in reason or "validation error" in reason:
        return "the attention-config key the error names (this series' vLLM does not take it)"
    if forced:
        return "attention-config.minimax_m3_indexer_backend: auto"
    return "attention-config.minimax_m3_indexer_backend"


def sparse_attention_rule(
    *,
    capability: tuple[int, int] | None,
    kv_cache_dtype: str,
    head_dim: int,
    block_size: int,
    topk_blocks: int,
    num_queries_per_kv: int,
) -> tuple[bool, str | None]:
    """Whether FlashInfer's sparse attention can serve MiniMax M3 here, else the first unmet
    condition: SM90, an fp8 e4m3 KV cache, head dim 128, 128-token pages, top-16 blocks, and
    8 or 16 query heads per KV head on a rank: what a series without the FlashInfer attend
    would select once it has one."""
    if capability != (9, 0):
        found = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        return False, f"compute capability {found}; FlashInfer's sparse attention runs on 9.0"
    if kv_cache_dtype not in ("fp8", "fp8_e4m3"):
        return False, (
            f"KV cache is {kv_cache_dtype}; FlashInfer's SM90 sparse attention reads fp8 e4m3:"
            " set kv-cache-dtype: fp8"
        )
    if head_dim != 128:
        return False, f"head dim {head_dim}; FlashInfer's sparse attention takes 128"
    if block_size != 128:
        return False, (
            f"block-size {block_size}; FlashInfer's sparse attention takes 128-token pages"
        )
    if topk_blocks != 16:
        return False, f"topk_blocks={topk_blocks}; FlashInfer's sparse attention takes 16"
    if num_queries_per_kv not in (8, 16):
        return False, (
            f"{num_queries_per_kv} query heads per KV head on a rank; FlashInfer's sparse"
            " attention takes 8 or 16"
        )
    return True, None


NO_SPARSE_ATTENTION_HERE = "none in the config: FlashInfer's sparse attention runs on 9.0 only"


def sparse_attention_hint(reason: str) -> str:
    """The key that changes the sparse attention's outcome, from vLLM's reason."""
    if "kv-cache-dtype" in reason or "KV cache is" in reason:
        return "kv-cache-dtype: fp8 in the config"
    if "query heads per KV head" in reason or "KV heads per rank" in reason:
        return "tensor-parallel-size (query heads per KV head at a rank: 8 at TP 8, 16 at TP 1-4)"
    if "compute capability" in reason:
        return NO_SPARSE_ATTENTION_HERE
    return f"attention-config.{probe.SPARSE_ATTENTION_KEY}"


def sparse_attention_row(
    config: ServeConfig, capability: tuple[int, int], *, simulated: bool = True
) -> Row:
    """vLLM's sparse-attention selection (`select_main_backend_and_impl_cls`, through
    `vllm_minimax.probe`) on a simulated GPU of `capability` (`simulated=False`: this
    machine's). A series without the FlashInfer attend selects nothing of its own, and the
    row says what `sparse_attention_rule` expects once it does."""
    if not probe.sparse_attention_in_series():
        usable, reason = sparse_attention_rule(
            capability=capability,
            kv_cache_dtype=config.kv_cache_dtype_resolved,
            head_dim=M3_HEAD_DIM,
            block_size=config.block_size or M3_SPARSE_BLOCK,
            topk_blocks=M3_TOPK_BLOCKS,
            num_queries_per_kv=config.queries_per_kv_head,
        )
        expected = "FlashInfer" if usable else f"Triton ({reason})"
        return Row(
            "sparse attention",
            "not in this series",
            f"vLLM's own sparse attention runs; with the sparse-attention selection this"
            f" config would get {expected}",
            Outcome.INFO,
        )
    key = config.sparse_attention_backend
    selection = probe.select_sparse_attention(
        kv_cache_dtype=config.kv_cache_dtype_resolved,
        num_heads=config.query_heads_per_rank,
        num_kv_heads=config.kv_heads_per_rank,
        topk_blocks=M3_TOPK_BLOCKS,
        head_size=M3_HEAD_DIM,
        sparse_attention_backend=key,
        capability=capability if simulated else None,
    )
    if selection.error is not None:
        return Row(
            "sparse attention",
            "-",
            selection.error,
            Outcome.FAILS,
            sparse_attention_hint(selection.error),
        )
    backend = (selection.impl or "?").removeprefix("MiniMaxM3Sparse").removesuffix("Impl")
    log = selection.log or ""
    if backend != "Triton" or key == "triton":
        return Row("sparse attention", backend, log, Outcome.READY)
    if config.kv_cache_dtype_resolved not in ("fp8", "fp8_e4m3"):
        # A bf16 (or e5m2) KV cache is the config's choice, and Triton its attend: nothing
        # falls back. The hint says what would change it: on 9.0 the KV cache's dtype, and
        # elsewhere nothing in the config.
        hint = sparse_attention_hint(log) if capability == (9, 0) else NO_SPARSE_ATTENTION_HERE
        return Row("sparse attention", backend, f"as configured: {log}", Outcome.READY, hint)
    if "FlashInfer not used" not in log:
        # No FlashInfer attend exists for this GPU: Triton is vLLM's own choice.
        return Row("sparse attention", backend, log, Outcome.READY)
    return Row("sparse attention", backend, log, Outcome.FALLBACK, sparse_attention_hint(log))
