"""Check every selection the FlashInfer indexer makes inside a running engine.

`install()` wraps the patched vLLM's `MiniMaxM3IndexerFlashInferMetadataBuilder.build`
(to keep what the engine handed it: the step's `CommonAttentionMetadata` and the
model config) and `MiniMaxM3IndexerFlashInferImpl.forward`. After each real
forward (kernels, metadata and index cache exactly as the engine produced them),
each proxy-score + top-k call of the step is recomputed with the float32
reference from the engine's own inputs, not the builder's: the requests the
call's token range covers in the engine's `query_start_loc`, their rows of the
engine's block table and their `seq_lens`, each token's page count from the
engine's `positions`, and the forced regions from the model config, read as the
release's model reads it (`model_init_blocks`, `model_local_blocks`). The shared
top-k buffer is checked against it on every row: the selection invariants, and the selected blocks'
reference scores equal to the reference top-k scores (a multiset, so two
selections that pass differ only by tied scores). A builder that mis-slices the
page table or shifts the page counts, or an impl that forces other leading blocks or
another window than the model config's, fails the audit.

Kinds are `decode`, `prefill`, or `mixed-` either in a step with both; an MTP
draft's layers (`mtp_draft`) count as `draft-` kinds. Decode calls also count
their rows by query length (`decode_query_lens`): 1 + K for a target verifying K
speculated tokens.

`install_triton()` runs the same reference over vLLM's own
`MiniMaxM3IndexerTritonImpl` (`AUDIT.triton`). It asserts nothing about
Triton's choices; it counts the rows that are a reference top-k by value.

Both audits also record the rows at `RECORDED_POSITIONS` (the first 64
positions where blocks are dropped) whole: request, position, layer, head,
whether the selection is a reference top-k by value, the reference's gap at its
16th block (`boundary_gap`) and the selected blocks. Requests are numbered 0, 1,
... in the order their first token is scheduled (`RequestOrder`), which need not
be the order of submission. Two runs' records say at which row, if any, their
selections first differ.

Only while `AUDIT.enabled` (the driver turns it on around its own requests;
warm-up, profiling and capture batches run over uninitialised cache pages).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

import torch

from vllm_minimax.testing import mtp_draft, reference
from vllm_minimax.testing.reference import (
    boundary_gap,
    expected_topk_values,
    value_check,
    value_rows_ok,
    vector_invariants,
)

PAGE = 128


@dataclass
class AuditCounts:
    calls: int = 0
    rows: int = 0
    value_rows: int = 0
    problems: list[str] = field(default_factory=list)
    decode_query_lens: dict[int, int] = field(default_factory=dict)


@dataclass
class RequestOrder:
    """Numbers requests 0, 1, ... in the order their first token (position 0) is
    scheduled, and finds them again in later steps by their first KV block (which a
    request keeps while it runs, with prefix caching off). That need not be the order
    of submission. `extents[n]`: the positions request n has been seen at in audited
    steps (its last position + 1; full-graph decode steps run no audit)."""

    by_first_block: dict[int, int] = field(default_factory=dict)
    extents: list[int] = field(default_factory=list)

    def number(self, query_start_loc: list[int], first_blocks: list[int], positions) -> list[int]:
        """The number of each request of a step (-1: not seen starting)."""
        numbers = []
        for r, block in enumerate(first_blocks):
            start, end = query_start_loc[r], query_start_loc[r + 1]
            if end == start:
                numbers.append(-1)
                continue
            if int(positions[start]) == 0:
                self.by_first_block[block] = len(self.extents)
                self.extents.append(0)
            n = self.by_first_block.get(block, -1)
            if n >= 0:
                self.extents[n] = max(self.extents[n], int(positions[end - 1]) + 1)
            numbers.append(n)
        return numbers


# Where a FlashInfer-against-Triton pair may first part (test_engine.py's bound): the
# first 64 positions at which a request has more than 16 blocks.
RECORDED_POSITIONS = range(16 * PAGE, 16 * PAGE + 64)


@dataclass
class TritonCounts:
    """What `install_triton()` saw of vLLM's Triton indexer: its rows, and those
    whose selection is a reference top-k by value."""

    steps: int = 0
    rows: int = 0
    value_rows: int = 0
    problems: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "rows": self.rows,
            "value_rows": self.value_rows,
            "problems": self.problems[:10],
            "num_problems": len(self.problems),
        }


@dataclass
class Audit:
    enabled: bool = False
    steps: int = 0
    mixed_steps: int = 0
    by_kind: dict[str, AuditCounts] = field(default_factory=dict)
    triton: TritonCounts = field(default_factory=TritonCounts)
    requests: RequestOrder = field(default_factory=RequestOrder)
    # Per row at RECORDED_POSITIONS: [request, position, layer, head, exact, gap, *blocks].
    recorded: list[list] = field(default_factory=list)

    def counts(self, kind: str) -> AuditCounts:
        return self.by_kind.setdefault(kind, AuditCounts())

    def summary(self) -> dict:
        summary: dict = {"triton": self.triton.summary()} if self.triton.steps else {}
        return summary | {
            "request_extents": self.requests.extents,
            "recorded": self.recorded,
            "steps": self.steps,
            "mixed_steps": self.mixed_steps,
            "by_kind": {
                kind: {
                    "calls": c.calls,
                    "rows": c.rows,
                    "value_rows": c.value_rows,
                    "problems": c.problems[:10],
                    "num_problems": len(c.problems),
                    "decode_query_lens": {
                        str(q): rows for q, rows in sorted(c.decode_query_lens.items())
                    },
                }
                for kind, c in self.by_kind.items()
            },
        }


AUDIT = Audit()


@dataclass
class EngineStep:
    """What the engine handed the builder for one step (CPU copies)."""

    query_start_loc: list[int]
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    positions: torch.Tensor
    init_blocks: int
    local_blocks: int
    # Per request, its `RequestOrder` number: set by the step's first audited forward
    # of a target layer (`numbered`), so that an MTP draft's builds of the same step
    # number nothing.
    request_numbers: list[int] | None = None

    @classmethod
    def of(cls, common, vllm_config) -> EngineStep:
        import vllm

        hf_config = vllm_config.model_config.hf_config
        text_config = getattr(hf_config, "text_config", hf_config)
        n = common.num_reqs
        return cls(
            query_start_loc=common.query_start_loc_cpu[: n + 1].tolist(),
            seq_lens=common.seq_lens[:n].cpu().clone(),
            block_table=common.block_table_tensor[:n].clone(),
            positions=common.positions[: common.num_actual_tokens].cpu().clone(),
            init_blocks=model_init_blocks(text_config, vllm.__version__),
            local_blocks=model_local_blocks(text_config, vllm.__version__),
        )

    def numbered(self, requests: RequestOrder) -> list[int]:
        """The step's request numbers, numbering its requests on the first call."""
        if self.request_numbers is None:
            first_blocks = self.block_table[:, 0].tolist()
            self.request_numbers = requests.number(
                self.query_start_loc, first_blocks, self.positions
            )
        return self.request_numbers

    def requests_of(self, token_start: int, token_end: int) -> tuple[int, int] | None:
        """The requests whose query tokens are exactly [token_start, token_end)."""
        qsl = self.query_start_loc
        if token_start not in qsl or token_end not in qsl:
            return None
        return qsl.index(token_start), qsl.index(token_end)

    def requests_covering(self, token_start: int, token_end: int) -> tuple[int, int]:
        """The requests [first, last) holding any of the tokens [token_start, token_end)."""
        qsl = self.query_start_loc
        first = bisect.bisect_right(qsl, token_start) - 1
        return first, bisect.bisect_left(qsl, token_end)


def model_init_blocks(text_config, vllm_version: str) -> int:
    """The forced leading blocks, read from the model config the way that release's MiniMax
    M3 reads it: vLLM 0.33.0 from `sparse_attention_config`'s `sparse_init_block` (0 when
    absent); later releases' model passes none to the indexer (0)."""
    if vllm_version == "0.33.0":
        return int(text_config.sparse_attention_config.get("sparse_init_block", 0))
    return 0


def model_local_blocks(text_config, vllm_version: str) -> int:
    """The trailing local window, in blocks, read from the model config the way that
    release's MiniMax M3 reads it: vLLM 0.33.0 from `sparse_attention_config`'s
    `sparse_local_block` (0 when absent), later releases from the flat
    `index_local_blocks`."""
    if vllm_version == "0.33.0":
        return int(text_config.sparse_attention_config.get("sparse_local_block", 0))
    return int(text_config.index_local_blocks)


# Each step's engine inputs by the id of the metadata built from them (the last few).
_ENGINE_STEPS: dict[int, EngineStep] = {}
_KEPT_STEPS = 8


def _record_step(metadata, step: EngineStep) -> None:
    _ENGINE_STEPS[id(metadata)] = step
    while len(_ENGINE_STEPS) > _KEPT_STEPS:
        del _ENGINE_STEPS[next(iter(_ENGINE_STEPS))]


def _forced_regions(impl, step: EngineStep) -> tuple[int, int]:
    """The contract's forced leading and trailing block counts (the reference functions
    clamp them per token), from the model config."""
    force_begin = min(step.init_blocks, impl.topk_blocks)
    return force_begin, min(step.local_blocks, impl.topk_blocks - force_begin)


def _audit_step(impl, index_query: torch.Tensor) -> None:
    from vllm.models.minimax_m3.nvidia import indexer_flashinfer

    attn_metadata = indexer_flashinfer.get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return
    md = attn_metadata[impl.index_cache.prefix]
    step = _ENGINE_STEPS.get(id(md))
    AUDIT.steps += 1
    if step is None:
        AUDIT.counts("coverage").problems.append("metadata not built by the audited builder")
        return
    num_tokens = step.query_start_loc[-1]
    q_all = index_query[:num_tokens].view(-1, impl.num_index_heads, impl.index_head_dim)
    kv = impl.index_cache.kv_cache
    k_pages = kv.view(kv.shape[0], 1, PAGE, impl.index_head_dim)
    force_begin, force_end = _forced_regions(impl, step)
    # The decode side is the calls over the first num_decode_tokens rows.
    kinds = {call.token_start < md.num_decode_tokens for call in md.calls}
    mixed = len(kinds) == 2
    AUDIT.mixed_steps += int(mixed)
    layer = "draft-" if mtp_draft.is_draft_layer_name(impl.index_cache.prefix) else ""
    if not layer:
        step.numbered(AUDIT.requests)
    covered = 0
    for call in md.calls:
        is_prefill = call.token_start >= md.num_decode_tokens
        side = "prefill" if is_prefill else "decode"
        kind = layer + ("mixed-" if mixed else "") + side
        counts = AUDIT.counts(kind)
        counts.calls += 1
        if call.token_start != covered:
            counts.problems.append(f"calls leave a gap at token {covered}")
        covered = call.token_end
        requests = step.requests_of(call.token_start, call.token_end)
        if requests is None and not is_prefill:
            counts.problems.append(
                f"decode call tokens [{call.token_start}, {call.token_end}) split a request"
            )
            continue
        # A prefill chunk may cut requests: its rows are scored within theirs.
        first, last = requests or step.requests_covering(call.token_start, call.token_end)
        rows_start = step.query_start_loc[first]
        call_rows = slice(call.token_start - rows_start, call.token_end - rows_start)
        cu = torch.tensor(step.query_start_loc[first : last + 1]) - rows_start
        if not is_prefill:
            rows = call.token_end - call.token_start
            q_len = int((cu[1:] - cu[:-1]).max())
            counts.decode_query_lens[q_len] = counts.decode_query_lens.get(q_len, 0) + rows
        seq_lens = step.seq_lens[first:last]
        device = q_all.device
        nvp = (step.positions[call.token_start : call.token_end] // PAGE + 1).to(torch.int32)
        scores = reference.proxy_score(
            q_all[rows_start : step.query_start_loc[last]],
            k_pages,
            cu.to(device),
            page_table=step.block_table[first:last],
            seqused_k=seq_lens.to(device),
            max_k_tiles=-(-int(seq_lens.max()) // PAGE),
        )[:, :, call_rows].contiguous()
        nvp = nvp.to(device)
        got = impl.topk_indices_buffer[call.token_start : call.token_end]
        counts.problems += vector_invariants(got, nvp, fb=force_begin, fe=force_end)
        want = expected_topk_values(scores, nvp, fb=force_begin, fe=force_end)
        check = value_check(got, want, scores)
        counts.rows += check.rows
        counts.value_rows += check.value_rows
        if check.first_mismatch:
            counts.problems.append(check.first_mismatch)
        if not layer:
            _record_rows(impl, step, call.token_start, got, want, scores, nvp)
    if covered != num_tokens:
        AUDIT.counts("coverage").problems.append(f"calls end at {covered} of {num_tokens} tokens")


def _layer_number(prefix: str) -> int:
    """The decoder layer index in a layer prefix (`model.layers.12.self_attn...`), or -1."""
    parts = prefix.split(".")
    for name, value in pairwise(parts):
        if name == "layers" and value.isdigit():
            return int(value)
    return -1


def _record_rows(
    impl,
    step: EngineStep,
    token_start: int,
    got: torch.Tensor,
    want: torch.Tensor,
    scores: torch.Tensor,
    nvp: torch.Tensor,
) -> None:
    """Append to `AUDIT.recorded` the rows of tokens `token_start + i` (for row i of
    `got`) whose position is in `RECORDED_POSITIONS`, reading only those rows."""
    positions = step.positions[token_start : token_start + got.shape[0]]
    wanted = (positions >= RECORDED_POSITIONS.start) & (positions < RECORDED_POSITIONS.stop)
    rows = wanted.nonzero().flatten()
    if not rows.numel():
        return
    on_device = rows.to(got.device)
    got, scores = got[on_device], scores[..., on_device]
    exact = value_rows_ok(got, want[on_device], scores).tolist()
    force_begin, force_end = _forced_regions(impl, step)
    gap = boundary_gap(scores, nvp[on_device], fb=force_begin, fe=force_end).tolist()
    request_index = torch.bucketize(
        rows + token_start, torch.tensor(step.query_start_loc[1:]), right=True
    ).tolist()
    numbers = step.numbered(AUDIT.requests)
    layer = _layer_number(impl.index_cache.prefix)
    for i, (row, blocks_by_head) in enumerate(zip(rows.tolist(), got.tolist(), strict=True)):
        request, position = numbers[request_index[i]], int(positions[row])
        for head, blocks in enumerate(blocks_by_head):
            entry = [request, position, layer, head, int(exact[i][head]), gap[i][head]]
            AUDIT.recorded.append(entry + sorted(b for b in blocks if b >= 0))


def _audit_triton_step(impl, index_query: torch.Tensor) -> None:
    from vllm.models.minimax_m3.common import indexer as common_indexer

    attn_metadata = common_indexer.get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return
    counts = AUDIT.triton
    counts.steps += 1
    step = _ENGINE_STEPS.get(id(attn_metadata[impl.index_cache.prefix]))
    if step is None:
        counts.problems.append("metadata not built by the audited builder")
        return
    if impl.topk_indices_buffer is None:
        counts.problems.append("the impl has no shared top-k buffer")
        return
    step.numbered(AUDIT.requests)
    num_tokens = step.query_start_loc[-1]
    q_all = index_query[:num_tokens].view(-1, impl.num_index_heads, impl.index_head_dim)
    device = q_all.device
    kv = impl.index_cache.kv_cache
    force_begin, force_end = _forced_regions(impl, step)
    scores = reference.proxy_score(
        q_all,
        kv.view(kv.shape[0], 1, PAGE, impl.index_head_dim),
        torch.tensor(step.query_start_loc, device=device),
        page_table=step.block_table,
        seqused_k=step.seq_lens.to(device),
        max_k_tiles=-(-int(step.seq_lens.max()) // PAGE),
    )
    nvp = (step.positions // PAGE + 1).to(device=device, dtype=torch.int32)
    got = impl.topk_indices_buffer[:num_tokens]
    want = expected_topk_values(scores, nvp, fb=force_begin, fe=force_end)
    exact = value_rows_ok(got, want, scores)
    counts.rows += exact.numel()
    counts.value_rows += int(exact.sum())
    _record_rows(impl, step, 0, got, want, scores, nvp)


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _wrap(impl_cls, builder_cls, audit_forward) -> Callable[[], None]:
    """Wrap `builder_cls.build` (to keep each step's engine inputs) and
    `impl_cls.forward` (to run `audit_forward(impl, index_query)` after it), class-wide;
    returns a function that restores both."""
    original_forward = impl_cls.forward
    original_build = builder_cls.build

    def audited_build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        metadata = original_build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        if AUDIT.enabled and not _capturing(common_attn_metadata.seq_lens):
            _record_step(metadata, EngineStep.of(common_attn_metadata, self.vllm_config))
        return metadata

    def audited_forward(self, index_query, *args, **kwargs):
        result = original_forward(self, index_query, *args, **kwargs)
        if AUDIT.enabled and not _capturing(index_query):
            audit_forward(self, index_query)
        return result

    def restore() -> None:
        impl_cls.forward = original_forward
        builder_cls.build = original_build

    impl_cls.forward = audited_forward
    builder_cls.build = audited_build
    return restore


def install() -> Callable[[], None]:
    """Audit the patched vLLM's FlashInfer indexer (before or after the engine starts);
    returns a function that restores it."""
    from vllm.models.minimax_m3.nvidia.indexer_flashinfer import (
        MiniMaxM3IndexerFlashInferImpl,
        MiniMaxM3IndexerFlashInferMetadataBuilder,
    )

    return _wrap(
        MiniMaxM3IndexerFlashInferImpl, MiniMaxM3IndexerFlashInferMetadataBuilder, _audit_step
    )


def install_triton() -> Callable[[], None]:
    """Audit vLLM's own Triton indexer for `AUDIT.triton`; returns a function that
    restores it."""
    from vllm.models.minimax_m3.common.indexer import (
        MiniMaxM3IndexerTritonImpl,
        MiniMaxM3IndexerTritonMetadataBuilder,
    )

    return _wrap(
        MiniMaxM3IndexerTritonImpl, MiniMaxM3IndexerTritonMetadataBuilder, _audit_triton_step
    )
