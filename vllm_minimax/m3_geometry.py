"""MiniMax M3's published text geometry, one tensor-parallel rank's share of it, and what its
weights count and weigh, as vLLM 0.34.0 builds them (plain data, no files written).

``make-tiny-model --geometry m3-tpN-rank`` writes :func:`rank_text_config` as a config-only
model (``tiny_model``); the memory budget, the prebuild and the tests read the geometry here.
"""

from __future__ import annotations

from typing import Any

# MiniMax M3's text model as published (``text_config`` of MiniMaxAI/MiniMax-M3's
# ``config.json``, as reproduced in public test fixtures and model ports): 60 layers, the
# first three dense (``moe_layer_freq`` 0, 0, 0, then 1) with full attention, the other 57
# MoE layers with MiniMax sparse attention (``sparse_attention_freq`` follows the same
# pattern); the widths are transformers 5.22's ``MiniMaxM3VLTextConfig`` defaults, which
# equal the published ones. vLLM builds the routed experts and the shared expert from
# ``intermediate_size`` (3072 for both in the checkpoint).
M3_FIRST_DENSE_LAYERS = 3
M3_LAYERS = 60
M3_TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 6144,
    "num_hidden_layers": M3_LAYERS,
    "layer_types": ["full_attention"] * M3_FIRST_DENSE_LAYERS
    + ["minimax_m3_sparse"] * (M3_LAYERS - M3_FIRST_DENSE_LAYERS),
    "mlp_layer_types": ["dense"] * M3_FIRST_DENSE_LAYERS
    + ["sparse"] * (M3_LAYERS - M3_FIRST_DENSE_LAYERS),
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rotary_dim": 64,
    "intermediate_size": 3072,
    "shared_intermediate_size": 3072,
    "dense_intermediate_size": 12288,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "routed_scaling_factor": 2.0,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_block_size": 128,
    "index_topk_blocks": 16,
    "index_local_blocks": 1,
    "vocab_size": 200064,
    "max_position_embeddings": 1048576,
    "tie_word_embeddings": False,
}
# --experts: how the rank holds the routed experts. ``tp``: all 128, each 3072 / N wide (vLLM
# without expert parallelism); ``ep``: 128 / N whole experts of 3072 (``enable-expert-parallel``
# with the EP group the TP group, as the serving configs deploy).
EXPERT_LAYOUTS = ("tp", "ep")
DEFAULT_EXPERT_LAYOUT = "tp"
# vLLM pads a vocab-parallel embedding to a multiple of this before sharding it
# (DEFAULT_VOCAB_PADDING_SIZE in vllm/model_executor/layers/vocab_parallel_embedding.py).
VLLM_VOCAB_PADDING = 64


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) does not divide {parts} ways")
    return total // parts


def rank_text_config(
    tensor_parallel_size: int,
    full: dict[str, Any] | None = None,
    experts: str = DEFAULT_EXPERT_LAYOUT,
) -> dict:
    """The text config whose TP=1 model is one rank of ``full`` served with TP-N.

    ``experts="ep"``: the rank holds ``num_local_experts / N`` whole experts instead (expert
    parallelism over the TP group), see :func:`expert_parallel_rank_config`.

    As vLLM 0.34.0's MiniMax M3 shards under TP without expert parallelism: attention heads
    split N ways (column-parallel q, row-parallel o); KV heads split while there are at
    least N of them, else each rank holds one (replicated); the index-q heads shard exactly
    like the KV heads (``MinimaxM3QKVParallelLinearWithIndexer``) and the one index-k head
    is on every rank; every rank holds all experts, each expert's and the shared expert's
    width split N ways (FusedMoE's ``intermediate_size_per_partition``, a merged
    column-parallel gate/up and a row-parallel down), the dense MLP likewise; the embedding
    and LM head are vocab-parallel (vocab padded to 64, then split)."""
    config = dict(M3_TEXT_CONFIG if full is None else full)
    n = tensor_parallel_size
    kv_heads = config["num_key_value_heads"]
    if kv_heads >= n:
        rank_kv_heads = _divide(kv_heads, n, "num_key_value_heads")
    else:
        _divide(n, kv_heads, "the tensor-parallel size over num_key_value_heads")
        rank_kv_heads = 1
    if config["index_n_heads"] != kv_heads:
        raise ValueError("vLLM's fused indexer projection needs index_n_heads == KV heads")
    padded_vocab = -(-config["vocab_size"] // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    config.update(
        num_attention_heads=_divide(config["num_attention_heads"], n, "num_attention_heads"),
        num_key_value_heads=rank_kv_heads,
        index_n_heads=rank_kv_heads,
        intermediate_size=_divide(config["intermediate_size"], n, "intermediate_size"),
        shared_intermediate_size=_divide(
            config["shared_intermediate_size"], n, "shared_intermediate_size"
        ),
        dense_intermediate_size=_divide(
            config["dense_intermediate_size"], n, "dense_intermediate_size"
        ),
        vocab_size=_divide(padded_vocab, n, "the padded vocab"),
    )
    if experts == "ep":
        return expert_parallel_rank_config(
            config, full_config=M3_TEXT_CONFIG if full is None else full, size=n
        )
    if experts != "tp":
        raise ValueError(f"experts {experts!r}: one of {', '.join(EXPERT_LAYOUTS)}")
    return config


def expert_parallel_rank_config(
    config: dict[str, Any], full_config: dict[str, Any], size: int
) -> dict[str, Any]:
    """``config`` (a TP-N rank's) with the routed experts of an EP-N rank: ``num_local_experts
    / N`` experts at the full ``intermediate_size``.

    Two things a TP=1 model cannot reproduce exactly. vLLM builds the shared expert from
    ``intermediate_size`` too, so the slice's is full width (3072), where an EP rank holds it
    TP-sharded (3072 / N). And an EP-N rank receives, per token, the (token, expert) pairs
    that land on its experts: ``top_k / N`` on average under balanced routing (0.5 at
    top-4, N = 8), which a model's integer top-k cannot be; the slice routes each token to
    ``max(1, top_k // N)`` of its experts, the fewest it can."""
    experts = _divide(full_config["num_local_experts"], size, "num_local_experts")
    return {
        **config,
        "num_local_experts": experts,
        "num_experts_per_tok": max(1, full_config["num_experts_per_tok"] // size),
        "intermediate_size": full_config["intermediate_size"],
        "shared_intermediate_size": full_config["intermediate_size"],
    }


def parameter_counts(config: dict[str, Any]) -> dict[str, int]:
    """Parameters of vLLM's MiniMax M3 at TP=1 for ``config``, by how a serving run stores
    them: ``linear`` (the projections and experts, what ``quantization: fp8`` makes fp8),
    ``embedding`` (embedding and LM head), ``router`` (fp32 gate and score bias),
    ``norm``."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    index_dim, experts = config["index_head_dim"], config["num_local_experts"]
    expert_width = config["intermediate_size"]
    padded_vocab = -(-config["vocab_size"] // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    counts = {"linear": 0, "embedding": 2 * padded_vocab * hidden, "router": 0, "norm": hidden}
    for attention, mlp in zip(config["layer_types"], config["mlp_layer_types"], strict=True):
        qkv_width = (heads + 2 * kv_heads) * head_dim
        counts["norm"] += 2 * hidden + 2 * head_dim  # input/post-attention, q/k norm
        if attention == "minimax_m3_sparse":
            qkv_width += kv_heads * index_dim + index_dim  # index q (KV-sharded) + index k
            counts["norm"] += 2 * index_dim
        counts["linear"] += qkv_width * hidden + heads * head_dim * hidden
        if mlp == "sparse":
            counts["linear"] += (experts + 1) * 3 * expert_width * hidden  # experts + shared
            counts["router"] += experts * hidden + experts
        else:
            counts["linear"] += 3 * config["dense_intermediate_size"] * hidden
    return counts


def weight_bytes(counts: dict[str, int]) -> dict[str, int]:
    """Bytes of the weights in bf16, with fp8 projections and experts (per-tensor scales
    left out) and with MXFP8 ones (one e8m0 scale byte per 32 weights); the router stays
    fp32, embedding, LM head and norms bf16."""
    kept = 2 * (counts["embedding"] + counts["norm"]) + 4 * counts["router"]
    return {
        "bf16": 2 * counts["linear"] + kept,
        "fp8": counts["linear"] + kept,
        "mxfp8": counts["linear"] + counts["linear"] // 32 + kept,
    }
