"""Does FlashInfer 0.7.4's proxy score read past the end of q, in either regime?

Run under compute-sanitizer with the caching allocator off, so that every tensor
is its own cudaMalloc ending exactly at its last element:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --report-api-errors no \
        --print-limit 40 python -m benchmarks.overread_probe --control

Every case goes through the patch's own builder (`patched_run`), so the calls are the
ones the patch makes: one per side of a mixed batch, with the patch's `max_seqlen_q`
and `max_k_tiles`. Each call's q, cu_seqlens_q, seqused_k and page table are copied
into allocations of exactly their size and passed as they are, with no slack, then
its scores go through msa_topk_select. The cases cover both of FlashInfer's regimes
(`runs_prefill_regime`, printed per call): decode (1 to 4 uniform rows per request),
and prefill: MTP with 4 speculative tokens (query length 5) alone and beside a chunk,
a zero-length row among decodes, uniform, tiny (5 and 65 rows) and ragged prefills,
decodes beside a chunk, 1, 2 and 4 heads; bf16 for the decode regime (SM90's prefill
regime takes only fp8).

No memcheck error means 0.7.4 reads nothing past these allocations on these shapes,
which is what dropping `_with_overread_slack` would need. `--control` adds a planted
read past a tensor's end last, which memcheck must report (it proves the probe can
see one).
"""

from __future__ import annotations

import sys

import torch

from vllm_minimax.testing.indexer_cases import IndexerCase, decode, make_batch, patched_run
from vllm_minimax.testing.patched_module import load_patched_module

MTP = ("mtp",)
CASES = [
    # FlashInfer's decode regime.
    decode("decode B=1 h1", 1, 9000, ragged=False),
    decode("decode B=32 h4", 32, 20000, heads=4),
    decode("mtp K=1 B=16 h2", 16, 20000, heads=2, q=2),
    decode("mtp K=2 B=8 h1", 8, 20000, q=3),
    decode("mtp K=3 B=8 h4", 8, 20000, heads=4, q=4),
    decode("decode B=8 h1 bf16", 8, 20000, dtype="bf16"),
    decode("mtp K=3 B=4 h4 bf16", 4, 20000, heads=4, q=4, dtype="bf16"),
    IndexerCase("prefill 1x3 h1 (decode regime)", "prefill", ((3, 3),), 1),
    # FlashInfer's prefill regime.
    decode("mtp K=4 B=1 h1", 1, 9000, q=5, ragged=False),
    decode("mtp K=4 B=8 h4", 8, 20000, heads=4, q=5),
    IndexerCase(
        "mtp K=4 x4 + 300 chunk h2",
        "mixed",
        ((5, None),) * 4 + ((300, 4300),),
        2,
        kv_min=5,
        kv_max=20000,
        tags=MTP,
    ),
    IndexerCase(
        "zero-length row among mtp K=1 + 700 chunk h1",
        "mixed",
        ((2, 3000), (0, 500), (2, 9000), (700, 1700)),
        1,
        tags=MTP,
    ),
    IndexerCase("prefill 1x5 h1", "prefill", ((5, 5),), 1),
    IndexerCase("prefill 1x65 h4", "prefill", ((65, 8065),), 4),
    IndexerCase("prefill 1x129 h1", "prefill", ((129, 129),), 1),
    IndexerCase("prefill 1x3000 h1", "prefill", ((3000, 3000),), 1),
    IndexerCase("prefill 4x1000 h4", "prefill", ((1000, 1000),) * 4, 4),
    IndexerCase("prefill ragged 3 req", "prefill", ((1000, 1000), (2500, 12500), (700, 33700)), 1),
    IndexerCase("mixed 8 dec + 777 h2", "mixed", ((1, 5000),) * 8 + ((777, 9777),), 2),
    IndexerCase("mixed 3 dec + 6 chunk h1", "mixed", ((1, 5000),) * 3 + ((6, 6),), 1),
]


def exact(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into an allocation of exactly its size."""
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def probe(module) -> None:
    for case in CASES:
        batch = make_batch(case, "cuda", spare_pages=0)
        run = patched_run(module, batch)
        md = run.metadata
        q_all = batch.index_query[: batch.total_q].view(-1, case.heads, 128)
        k_pages = batch.kv_cache.view(batch.kv_cache.shape[0], 1, 128, 128)
        for call in md.calls:
            q = exact(q_all[call.token_start : call.token_end])
            scores = module.msa_proxy_score(
                q,
                k_pages,
                exact(call.cu_seqlens_q),
                page_table=exact(call.page_table),
                seqused_k=exact(call.seqused_k),
                causal=True,
                max_seqlen_q=call.max_seqlen_q,
                max_k_tiles=md.max_k_tiles,
            )
            module.msa_topk_select(
                scores,
                16,
                num_valid_pages=exact(call.num_valid_pages),
                force_end_blocks=1,
                output=batch.topk_buffer[call.token_start : call.token_end],
            )
            torch.cuda.synchronize()
            regime = "prefill" if call.prefill_regime else "decode"
            side = "prefill" if call.token_start >= md.num_decode_tokens else "decode"
            print(
                f"{case.name}: {side} side, {regime} regime, q {tuple(q.shape)} {q.dtype} "
                f"({q.untyped_storage().nbytes()} B), reqs {call.seqused_k.numel()}, "
                f"max_seqlen_q {call.max_seqlen_q}, max_k_tiles {md.max_k_tiles}: ran"
            )
    print("probe done")


def control() -> None:
    """A planted one-element read past the end of a torch tensor: memcheck must
    report it, which shows that the probe above could see an over-read."""
    import cupy

    t = torch.zeros(1024, dtype=torch.float32, device="cuda")
    out = torch.zeros(1, dtype=torch.float32, device="cuda")
    kernel = cupy.RawKernel(
        r'extern "C" __global__ void rd(const float* p, float* o, int n) { o[0] = p[n]; }', "rd"
    )
    kernel((1,), (1,), (cupy.asarray(t), cupy.asarray(out), cupy.int32(1024 + 64)))
    torch.cuda.synchronize()
    print("control ran")


if __name__ == "__main__":
    probe(load_patched_module())
    if "--control" in sys.argv:
        control()
