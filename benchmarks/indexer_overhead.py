"""What the patch's FlashInfer indexer forward costs on top of its two kernels.

    python -m benchmarks.indexer_overhead --out results/h200/indexer-kernels

For a few cases of `cases_for_bench()`:
- GPU time alone: the patched forward, the bare kernel pair and vLLM's Triton
  forward each captured in a CUDA graph and replayed (do_bench median), next to
  their eager do_bench medians and host issue times;
- host time split: msa_proxy_score alone, msa_topk_select alone, and the
  patch's own lines (forward minus the two calls);
- a cProfile of 200 patched forwards (top functions by own time);
Writes overhead.json and overhead.txt under --out.

The mixed-batch rows of results/h200/indexer-kernels/overhead.json also compare the patch's
former single whole-batch pair with a split into one pair per side; the patch
now makes that split itself (`md.calls`), so this script no longer carries the
comparison.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

from benchmarks.indexer_bench import bench, graph_ms, host_us, kernel_calls
from vllm_minimax.testing import patched_module as pm
from vllm_minimax.testing.indexer_cases import (
    cases_for_bench,
    make_batch,
    patched_run,
)
from vllm_minimax.testing.triton_indexer import load_index_topk, triton_build, triton_forward


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    module = pm.load_patched_module()
    ops = load_index_topk()
    names = (
        "decode B=1 8k h1 fp8",
        "decode B=32 32k h1 fp8",
        "decode B=128 32k h1 fp8",
        "decode B=32 32k h4 fp8",
        "mtp2 B=32 32k h1 fp8",
        "prefill 8k on 0 ctx h1 fp8",
        "prefill 4x4k h4 fp8",
        "mixed 32 dec (32k) + 2k chunk h1 fp8",
        "mixed 64 dec (64k) + 4k chunk h4 fp8",
    )
    cases = [c for c in cases_for_bench() if c.name in names]
    rows, text = [], io.StringIO()
    for case in cases:
        batch = make_batch(case, "cuda")
        run = patched_run(module, batch)
        pm.set_forward_context(run.attn_metadata())
        iq = batch.index_query

        def fwd(run=run, iq=iq):
            run.impl.forward(iq)

        kern = kernel_calls(run)
        tmd = triton_build(batch.common, reorder_batch_threshold=case.reorder_batch_threshold)

        def tri(tmd=tmd, batch=batch, case=case):
            triton_forward(
                ops,
                tmd,
                batch.index_query,
                batch.kv_cache,
                batch.topk_buffer,
                num_index_heads=case.heads,
                init_blocks=case.init_blocks,
                local_blocks=case.local_blocks,
            )

        for f in (fwd, kern, tri):
            f()
        torch.cuda.synchronize()
        row = {"case": case.name}
        row["eager_forward_ms"] = bench(fwd)
        row["eager_kernels_ms"] = bench(kern)
        row["eager_triton_ms"] = bench(tri)
        row["graph_forward_ms"] = graph_ms(fwd)
        row["graph_kernels_ms"] = graph_ms(kern)
        row["graph_triton_ms"] = graph_ms(tri)
        row["host_us_forward"] = host_us(fwd, 200)
        row["host_us_kernels"] = host_us(kern, 200)
        row["host_us_triton"] = host_us(tri, 200)
        # Host split of the pair.
        md, impl = run.metadata, run.impl
        if len(md.calls) == 1:  # the host split of a single pair
            (c,) = md.calls
            q = iq[: md.num_actual_tokens].view(-1, case.heads, 128)
            if c.prefill_regime:
                q = module._with_overread_slack(q, module._PREFILL_Q_OVERREAD_ROWS)
            kp = batch.kv_cache.view(batch.kv_cache.shape[0], 1, 128, 128)

            def proxy(q=q, kp=kp, c=c, md=md):
                return module.msa_proxy_score(
                    q,
                    kp,
                    c.cu_seqlens_q,
                    page_table=c.page_table,
                    seqused_k=c.seqused_k,
                    causal=True,
                    max_seqlen_q=c.max_seqlen_q,
                    max_k_tiles=md.max_k_tiles,
                )

            scores = proxy()
            row["host_us_proxy_only"] = host_us(proxy, 200)
            out = impl.topk_indices_buffer[: md.num_actual_tokens]
            row["host_us_topk_only"] = host_us(
                lambda s=scores, c=c, out=out: module.msa_topk_select(
                    s,
                    16,
                    num_valid_pages=c.num_valid_pages,
                    force_begin_blocks=0,
                    force_end_blocks=1,
                    output=out,
                ),
                200,
            )
        row["host_us_patch_own"] = row["host_us_forward"] - row["host_us_kernels"]
        # cProfile of 200 forwards.
        pr = cProfile.Profile()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pr.enable()
        for i in range(200):
            fwd()
            if i % 20 == 19:
                torch.cuda.synchronize()
        pr.disable()
        torch.cuda.synchronize()
        row["cprofile_wall_us_per_forward"] = (time.perf_counter() - t0) / 200 * 1e6
        st = io.StringIO()
        pstats.Stats(pr, stream=st).sort_stats("tottime").print_stats(25)
        text.write(f"=== {case.name}: cProfile of 200 patched forwards (tottime) ===\n")
        text.write(st.getvalue()[:9000] + "\n")
        rows.append(row)
        print(json.dumps(row), flush=True)
        pm.set_forward_context(None)
        torch.cuda.empty_cache()
    (args.out / "overhead.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "overhead.txt").write_text(text.getvalue())
    cols = list(rows[0].keys())
    for r in rows:
        print(" | ".join(f"{k}={r.get(k)}" for k in cols if k in r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
