"""Per-GPU memory of MiniMax M3 served by vLLM 0.34.0: weights by checkpoint layout, KV cache
by token, and the budget a serving config states.

Weights come from the text model's geometry (:data:`vllm_minimax.m3_geometry.M3_TEXT_CONFIG`,
transformers' ``MiniMaxM3VLTextConfig`` widths with the published layer pattern: 3 dense
full-attention layers, then 57 MoE layers with sparse attention) and how vLLM 0.34.0 shards
and stores each part at tensor parallelism ``TP`` (with ``enable-expert-parallel``, the
routed experts go whole to the ``TP x DP`` ranks instead):

- attention: ``64 / TP`` query heads, ``max(1, 4 / TP)`` KV heads and index-q heads, the one
  index-k head on every rank, ``o_proj`` row-parallel;
- dense MLP (12288 wide) and the shared expert (vLLM builds it from ``intermediate_size``,
  3072) split ``TP`` ways;
- routed experts: 128 x (gate, up, down) of 3072 x 6144, split over ``TP`` ranks (TP) or
  whole experts over the expert-parallel ranks (EP): the same parameter count per rank
  when the EP group is the TP group;
- router (``gate`` and its score bias): fp32 on every rank (vLLM builds the gate without the
  quantization config);
- embedding and LM head: vocab padded to 64 and split ``TP`` ways, bf16;
- each MTP module: one sparse-attention MoE decoder layer plus ``eh_proj`` (6144 x 12288,
  replicated) and three norms; it shares the target's embedding and LM head.

A checkpoint layout says how the linear layers are stored (:data:`CHECKPOINTS`). The
MXFP8 checkpoint (``quant_method: mxfp8``, read by vLLM 0.34.0's ``ModelOptMxFp8Config``)
stores every linear layer vLLM builds with the quantization config (attention with the
indexer projections, dense MLP, shared and routed experts, ``eh_proj``) as e4m3 with one
e8m0 scale per 32 weights: 1 + 1/32 bytes a weight. Its ``ignored_layers`` is not known
here; this module assumes it lists ``lm_head`` (so the LM head stays bf16, like the
embedding, which the config never quantizes). With that assumption the text model is
~442 GB, and with the bf16 vision tower it matches the ~444 GB the checkpoint is published
at; quantized attention is what makes it match (bf16 attention would add ~6.6 GB).

A speculative draft served beside the target (:data:`DRAFTS`, the budget's ``draft`` field) adds
its own weights, bf16 (vLLM loads the draft with the draft's quantization, none for the EAGLE3
heads), split ``TP`` ways except ``fc`` (a ``ReplicatedLinear`` in vLLM's
``llama_eagle3.py``), and K and V of its decoder layer for every token, in the target's
KV-cache dtype (the draft inherits it unless ``speculative-config`` sets its own).

The KV cache costs, per token and rank, K and V of every attention layer's KV heads on that
rank in the KV-cache dtype, plus one index key per sparse layer in the index-cache dtype
(``MLAAttentionSpec``: one vector a token): 38016 bytes at TP 8 with a bf16 KV cache and an
fp8 index cache, which is what vLLM 0.34.0 allotted per token on the H200 rank slice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_minimax.m3_geometry import M3_TEXT_CONFIG, VLLM_VOCAB_PADDING
from vllm_minimax.serve_config import read_serve_options, serve_config_of

GIB = 2**30
MXFP8_BLOCK = 32
BYTES_PER_PARAMETER = {"bf16": 2.0, "fp32": 4.0, "fp8": 1.0, "mxfp8": 1.0 + 1.0 / MXFP8_BLOCK}
KV_CACHE_BYTES = {"auto": 2, "bf16": 2, "fp8": 1}
INDEX_CACHE_BYTES = {"bf16": 2, "fp8": 1}
# What vLLM 0.34.0 uses when a config leaves gpu-memory-utilization unset: the whole card,
# with the extensible KV cache (the default on CUDA) sized from measured memory
# (``CacheConfig.resolved_gpu_memory_utilization``).
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 1.0


@dataclass(frozen=True)
class Checkpoint:
    """A published MiniMax M3 checkpoint: how its linear layers are stored."""

    name: str
    linear_storage: str
    description: str


CHECKPOINTS: dict[str, Checkpoint] = {
    checkpoint.name: checkpoint
    for checkpoint in (
        Checkpoint("MiniMaxAI/MiniMax-M3", "bf16", "BF16, ~854 GB"),
        Checkpoint(
            "MiniMaxAI/MiniMax-M3-MXFP8",
            "mxfp8",
            "MXFP8 linear layers (e4m3, one e8m0 scale per 32), ~444 GB",
        ),
    )
}


@dataclass(frozen=True)
class Draft:
    """A published speculative draft: what it adds to each GPU beside the target.

    ``parameters``: all of its weights (model card), split over the TP ranks except
    ``replicated`` (held whole on every rank); ``kv_width``: the K (and V) width of each of
    its ``layers`` attention layers, all heads together."""

    name: str
    parameters: int
    replicated: int
    kv_width: int
    layers: int
    source: str


M3_HIDDEN = 6144
EAGLE3_AUX_STATES = 3
DRAFTS: dict[str, Draft] = {
    draft.name: draft
    for draft in (
        Draft(
            "Inferact/MiniMax-M3-EAGLE3",
            parameters=3_300_000_000,
            replicated=EAGLE3_AUX_STATES * M3_HIDDEN * M3_HIDDEN,
            kv_width=M3_HIDDEN,
            layers=1,
            source="model card: a 1-layer dense Llama (LlamaForCausalLMEagle3), ~3.3 B"
            " parameters, hidden 6144, MHA; its config.json is not read here, so the"
            " parameter count is the card's (an upper bound if it counts an embedding and LM"
            " head that vLLM replaces with the target's), fc is 3 x 6144 -> 6144, and the KV"
            " width assumes heads x head_dim = hidden",
        ),
    )
}
NO_DRAFT = "none"


def draft_bytes_per_gpu(draft: Draft | None, tensor_parallel_size: int) -> float:
    """The draft's bf16 weights on one GPU."""
    if draft is None:
        return 0.0
    sharded = (draft.parameters - draft.replicated) / tensor_parallel_size
    return (sharded + draft.replicated) * BYTES_PER_PARAMETER["bf16"]


def draft_kv_bytes_per_token(
    draft: Draft | None, tensor_parallel_size: int, kv_cache_dtype: str = "auto"
) -> int:
    """K and V of the draft's layers for one token on one GPU (its heads split TP ways)."""
    if draft is None:
        return 0
    width = _divide(draft.kv_width, tensor_parallel_size, f"{draft.name}'s KV width")
    return draft.layers * width * 2 * KV_CACHE_BYTES[kv_cache_dtype]


@dataclass(frozen=True)
class Card:
    """A GPU model and the total memory vLLM sees on it."""

    name: str
    total_gib: float
    source: str


CARDS: dict[str, Card] = {
    card.name: card
    for card in (
        Card("H100-80GB", 79.19, "torch's total memory of an H100 SXM 80 GB (not measured here)"),
        Card("H200-141GB", 139.8, "vLLM 0.34.0's log on the project's H200"),
        Card(
            "RTX-PRO-6000-96GB",
            round(96e9 / GIB, 2),
            "RTX PRO 6000 Blackwell's 96 GB read as 96 x 10^9 bytes, below what torch reports"
            " for it (not measured here)",
        ),
    )
}


@dataclass(frozen=True)
class Parallelism:
    """How one engine spreads the model: TP ranks, data-parallel engines, EP on or off."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False

    @property
    def expert_shards(self) -> int:
        """How many ways the routed experts are split: over TP x DP ranks with EP, else TP."""
        if self.enable_expert_parallel:
            return self.tensor_parallel_size * self.data_parallel_size
        return self.tensor_parallel_size


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) does not divide {parts} ways")
    return total // parts


def _kv_heads_per_rank(config: dict[str, Any], tensor_parallel_size: int) -> int:
    kv_heads = config["num_key_value_heads"]
    if kv_heads >= tensor_parallel_size:
        return _divide(kv_heads, tensor_parallel_size, "num_key_value_heads")
    _divide(tensor_parallel_size, kv_heads, "the tensor-parallel size over KV heads")
    return 1


def _attention_linear(config: dict[str, Any], tp: int, sparse: bool) -> int:
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    heads = _divide(config["num_attention_heads"], tp, "num_attention_heads")
    kv_heads = _kv_heads_per_rank(config, tp)
    width = (heads + 2 * kv_heads) * head_dim
    if sparse:  # index q sharded like the KV heads, the one index-k head everywhere
        width += kv_heads * config["index_head_dim"] + config["index_head_dim"]
    return width * hidden + heads * head_dim * hidden


def _moe_parts(config: dict[str, Any], parallelism: Parallelism) -> dict[str, int]:
    hidden, experts = config["hidden_size"], config["num_local_experts"]
    tp = parallelism.tensor_parallel_size
    expert_params = experts * 3 * config["intermediate_size"] * hidden
    return {
        "routed_experts": _divide(expert_params, parallelism.expert_shards, "the routed experts"),
        "shared_expert": _divide(3 * config["intermediate_size"] * hidden, tp, "shared expert"),
        "router": experts * hidden + experts,
    }


def parameters_per_gpu(
    parallelism: Parallelism, mtp_modules: int = 0, config: dict[str, Any] | None = None
) -> dict[str, int]:
    """Parameters one GPU holds, by part: ``attention``, ``dense_mlp``, ``shared_expert``,
    ``routed_experts``, ``mtp_linear`` (the MTP modules' linear layers), ``router`` (fp32),
    ``embedding`` (embedding and LM head), ``norm``."""
    config = M3_TEXT_CONFIG if config is None else config
    tp, hidden = parallelism.tensor_parallel_size, config["hidden_size"]
    head_dim, index_dim = config["head_dim"], config["index_head_dim"]
    padded_vocab = -(-config["vocab_size"] // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    parts = dict.fromkeys(
        ("attention", "dense_mlp", "shared_expert", "routed_experts", "mtp_linear", "router"),
        0,
    )
    parts["embedding"] = 2 * _divide(padded_vocab, tp, "the padded vocab") * hidden
    parts["norm"] = hidden
    layer_norm = 2 * hidden + 2 * head_dim
    for attention, mlp in zip(config["layer_types"], config["mlp_layer_types"], strict=True):
        sparse = attention == "minimax_m3_sparse"
        parts["attention"] += _attention_linear(config, tp, sparse)
        parts["norm"] += layer_norm + (2 * index_dim if sparse else 0)
        if mlp == "sparse":
            for name, count in _moe_parts(config, parallelism).items():
                parts[name] += count
        else:
            parts["dense_mlp"] += _divide(3 * config["dense_intermediate_size"] * hidden, tp, "MLP")
    for _ in range(mtp_modules):
        moe = _moe_parts(config, parallelism)
        parts["mtp_linear"] += (
            _attention_linear(config, tp, sparse=True)
            + moe["routed_experts"]
            + moe["shared_expert"]
            + hidden * 2 * hidden  # eh_proj, replicated
        )
        parts["router"] += moe["router"]
        parts["norm"] += layer_norm + 2 * index_dim + 3 * hidden
    return parts


def weight_bytes_per_gpu(
    checkpoint: Checkpoint,
    parallelism: Parallelism,
    mtp_modules: int = 0,
    config: dict[str, Any] | None = None,
    draft: Draft | None = None,
) -> dict[str, float]:
    """Bytes of each part of :func:`parameters_per_gpu` as ``checkpoint`` stores it, and the
    ``draft``'s weights (part ``draft``, 0 without one)."""
    linear = BYTES_PER_PARAMETER[checkpoint.linear_storage]
    storage = {"router": BYTES_PER_PARAMETER["fp32"], "embedding": 2.0, "norm": 2.0}
    parts = {
        part: count * storage.get(part, linear)
        for part, count in parameters_per_gpu(parallelism, mtp_modules, config).items()
    }
    parts["draft"] = draft_bytes_per_gpu(draft, parallelism.tensor_parallel_size)
    return parts


def kv_bytes_per_token(
    parallelism: Parallelism,
    kv_cache_dtype: str = "auto",
    indexer_kv_dtype: str = "bf16",
    mtp_modules: int = 0,
    config: dict[str, Any] | None = None,
    draft: Draft | None = None,
) -> int:
    """KV-cache bytes one token costs on one GPU: K and V of every attention layer (and MTP
    layer, and the draft's layers) for that rank's KV heads, plus one index key per sparse
    layer."""
    config = M3_TEXT_CONFIG if config is None else config
    kv_heads = _kv_heads_per_rank(config, parallelism.tensor_parallel_size)
    layers = config["num_hidden_layers"] + mtp_modules
    sparse_layers = config["layer_types"].count("minimax_m3_sparse") + mtp_modules
    kv = layers * kv_heads * config["head_dim"] * 2 * KV_CACHE_BYTES[kv_cache_dtype]
    index = sparse_layers * config["index_head_dim"] * INDEX_CACHE_BYTES[indexer_kv_dtype]
    drafted = draft_kv_bytes_per_token(draft, parallelism.tensor_parallel_size, kv_cache_dtype)
    return kv + index + drafted


# --- The budget a serving config states ------------------------------------------------------

BUDGET_MARKER = "# Memory budget per GPU"
BUDGET_FIELDS = ("checkpoint", "gpu", "mtp-modules", "draft", "weights", "kv-cache", "reserve")
_FIELD_LINE = re.compile(r"^#\s+(?P<key>[a-z-]+):\s+(?P<value>.+?)\s*$")
_GIB_VALUE = re.compile(r"^(?P<number>[0-9]+(?:\.[0-9]+)?) GiB\b")
_TOKENS_VALUE = re.compile(r"^(?P<number>[0-9][0-9,]*) tokens\b")


class BudgetError(ValueError):
    """A serving config's memory budget is missing, malformed or does not fit."""


@dataclass(frozen=True)
class StatedBudget:
    """The ``# Memory budget per GPU`` block of a serving config."""

    checkpoint: Checkpoint
    card: Card
    mtp_modules: int
    draft: Draft | None
    weights_gib: float
    kv_tokens: int
    reserve_gib: float


def read_stated_budget(text: str, source: str = "config") -> StatedBudget:
    """Parse the budget block: the marker line (its sentence may run over more comment
    lines), then one run of ``#   key: value`` lines, one for each of :data:`BUDGET_FIELDS`
    (``weights`` and ``reserve`` in GiB, ``kv-cache`` in tokens)."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith(BUDGET_MARKER))
    except StopIteration:
        raise BudgetError(f"{source}: no '{BUDGET_MARKER}' block") from None
    fields: dict[str, str] = {}
    for line in lines[start + 1 :]:
        if not line.startswith("#"):
            break
        match = _FIELD_LINE.match(line)
        if match and match["key"] in BUDGET_FIELDS:
            fields[match["key"]] = match["value"]
        elif fields:  # the fields are one run of lines
            break
    missing = [field for field in BUDGET_FIELDS if field not in fields]
    if missing:
        raise BudgetError(f"{source}: the budget block lacks {', '.join(missing)}")
    checkpoint = CHECKPOINTS.get(fields["checkpoint"].split()[0])
    if checkpoint is None:
        raise BudgetError(f"{source}: unknown checkpoint {fields['checkpoint']!r}")
    draft_name = fields["draft"].split()[0]
    if draft_name != NO_DRAFT and draft_name not in DRAFTS:
        known = ", ".join([NO_DRAFT, *DRAFTS])
        raise BudgetError(f"{source}: unknown draft {fields['draft']!r} (known: {known})")
    card = CARDS.get(fields["gpu"].split()[0])
    if card is None:
        raise BudgetError(f"{source}: unknown gpu {fields['gpu']!r} (known: {', '.join(CARDS)})")
    return StatedBudget(
        checkpoint=checkpoint,
        card=card,
        mtp_modules=int(fields["mtp-modules"].split()[0]),
        draft=DRAFTS.get(draft_name),
        weights_gib=_number(_GIB_VALUE, fields["weights"], source, "weights"),
        kv_tokens=int(_number(_TOKENS_VALUE, fields["kv-cache"], source, "kv-cache")),
        reserve_gib=_number(_GIB_VALUE, fields["reserve"], source, "reserve"),
    )


def _number(pattern: re.Pattern[str], value: str, source: str, field: str) -> float:
    match = pattern.match(value)
    if not match:
        raise BudgetError(f"{source}: {field} {value!r} does not start with {pattern.pattern}")
    return float(match["number"].replace(",", ""))


@dataclass(frozen=True)
class BudgetCheck:
    """A serving config's memory per GPU, computed from its keys and its stated budget."""

    config: Path
    budget: StatedBudget
    parallelism: Parallelism
    weights_gib: float
    kv_bytes_per_token: int
    kv_gib: float
    limit_gib: float
    gpu_memory_utilization: float

    @property
    def used_gib(self) -> float:
        return self.weights_gib + self.kv_gib + self.budget.reserve_gib

    @property
    def fits(self) -> bool:
        return self.used_gib <= self.limit_gib


def check_serving_config(path: Path) -> BudgetCheck:
    """Compute weights and KV cache per GPU from the config's keys (read as `vllm serve
    --config` reads them, :mod:`vllm_minimax.serve_config`) and its stated budget."""
    path = Path(path)
    keys = read_serve_options(path)
    serve = serve_config_of(keys, path)
    budget = read_stated_budget(path.read_text(), str(path))
    parallelism = Parallelism(
        tensor_parallel_size=serve.tensor_parallel_size,
        data_parallel_size=int(keys.get("data-parallel-size", 1)),
        enable_expert_parallel=bool(keys.get("enable-expert-parallel", False)),
    )
    per_token = kv_bytes_per_token(
        parallelism,
        kv_cache_dtype=serve.kv_cache_dtype,
        indexer_kv_dtype=serve.indexer_kv_dtype,
        mtp_modules=budget.mtp_modules,
        draft=budget.draft,
    )
    weights = weight_bytes_per_gpu(
        budget.checkpoint, parallelism, budget.mtp_modules, draft=budget.draft
    )
    utilization = float(keys.get("gpu-memory-utilization", VLLM_DEFAULT_GPU_MEMORY_UTILIZATION))
    return BudgetCheck(
        config=path,
        budget=budget,
        parallelism=parallelism,
        weights_gib=sum(weights.values()) / GIB,
        kv_bytes_per_token=per_token,
        kv_gib=budget.kv_tokens * per_token / GIB,
        limit_gib=utilization * budget.card.total_gib,
        gpu_memory_utilization=utilization,
    )
