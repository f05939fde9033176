"""Does FlashInfer 0.7.4's SM90 prefill proxy score read past the end of q?

Run under compute-sanitizer with the caching allocator off, so that q is its own
cudaMalloc ending exactly at its last row:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --report-api-errors no \
        python -m benchmarks.overread_probe --control

Covers the uniform-batch (Cake) and padded-batch (CuTe) prefill routes, 1 and 4
heads, and ragged ends. The patch keeps 127 rows of slack behind prefill q
(`_with_overread_slack`) because 0.7.3 could over-read; no memcheck error here
means 0.7.4 does not on these shapes. `--control` adds a planted read past a
tensor's end last, which memcheck must report (it proves the probe can see one).
"""

from __future__ import annotations

import sys

import torch
from flashinfer.msa_ops import msa_proxy_score, msa_topk_select

from vllm_minimax.testing.indexer_cases import IndexerCase, make_batch

CASES = [
    IndexerCase("uniform 1x3000 h1", "prefill", ((3000, 3000),), 1),
    IndexerCase("uniform 4x1000 h4", "prefill", ((1000, 1000),) * 4, 4),
    IndexerCase("ragged 3 req h1", "prefill", ((1000, 1000), (2500, 12500), (700, 33700)), 1),
    IndexerCase("mixed 8 dec + 777 h2", "mixed", ((1, 5000),) * 8 + ((777, 9777),), 2),
    IndexerCase("uniform 1x129 h1", "prefill", ((129, 129),), 1),
]

for case in CASES:
    b = make_batch(case, "cuda", spare_pages=0)
    cm = b.common
    q = torch.empty((b.total_q, case.heads, 128), dtype=b.index_query.dtype, device="cuda")
    q.copy_(b.index_query.view(-1, case.heads, 128))
    k = b.kv_cache.view(b.kv_cache.shape[0], 1, 128, 128)
    tiles = -(-cm.max_seq_len // 128)
    s = msa_proxy_score(
        q,
        k,
        cm.query_start_loc,
        page_table=b.page_table,
        seqused_k=cm.seq_lens,
        causal=True,
        max_seqlen_q=cm.max_query_len,
        max_k_tiles=tiles,
    )
    msa_topk_select(
        s,
        16,
        num_valid_pages=b.num_valid_pages,
        force_end_blocks=1,
        output=b.topk_buffer[: b.total_q],
    )
    torch.cuda.synchronize()
    print(f"{case.name}: q {tuple(q.shape)} {q.dtype} ran, {q.untyped_storage().nbytes()} B")
print("probe done")

if "--control" in sys.argv:
    # A planted one-element read past the end of a torch tensor: memcheck must
    # report it, which shows that the probe above could see an over-read.
    import cupy

    t = torch.zeros(1024, dtype=torch.float32, device="cuda")
    out = torch.zeros(1, dtype=torch.float32, device="cuda")
    k = cupy.RawKernel(
        r'extern "C" __global__ void rd(const float* p, float* o, int n) { o[0] = p[n]; }', "rd"
    )
    k((1,), (1,), (cupy.asarray(t), cupy.asarray(out), cupy.int32(1024 + 64)))
    torch.cuda.synchronize()
    print("control ran")
