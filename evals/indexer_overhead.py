"""What the patch's FlashInfer indexer forward costs on top of its two kernels.

    python evals/indexer_overhead.py --out results/h200

For a few cases of `cases_for_bench()`:
- GPU time alone: the patched forward, the bare kernel pair and vLLM's Triton
  forward each captured in a CUDA graph and replayed (do_bench median), next to
  their eager do_bench medians and host issue times;
- host time split: msa_proxy_score alone, msa_topk_select alone, and the
  patch's own lines (forward minus the two calls);
- a cProfile of 200 patched forwards (top functions by own time);
- for mixed batches: the patch's single whole-batch proxy + top-k against a
  split (decode rows through the decode regime, prefill rows through the
  prefill regime, two proxy + two top-k calls), checked to select the same
  score values.
Writes overhead.json and overhead.txt under --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "evals"))

import torch  # noqa: E402
from indexer_bench import bench, graph_ms, host_us, kernel_calls  # noqa: E402

from vllm_minimax import patched_module as pm  # noqa: E402
from vllm_minimax.indexer_cases import (  # noqa: E402
    cases_for_bench,
    make_batch,
    patched_run,
    reference_scores,
    selection_values,
    value_check,
)
from vllm_minimax.triton_indexer import load_index_topk, triton_build, triton_forward  # noqa: E402


def split_calls(run):
    """Decode rows and prefill rows as two proxy + top-k pairs (same buffer)."""
    mod, md, impl, batch = run.module, run.metadata, run.impl, run.batch
    cm = batch.common
    nd_req, nd = md.num_decodes, md.num_decode_tokens
    H = impl.num_index_heads
    q = batch.index_query[: md.num_actual_tokens].view(-1, H, 128)
    qp = mod._with_overread_slack(q[nd:])
    qd = q[:nd]
    kv = impl.index_cache.kv_cache
    k_pages = kv.view(kv.shape[0], 1, 128, 128)
    buf = impl.topk_indices_buffer
    cu = md.proxy_cu_seqlens_q
    cu_d = cu[: nd_req + 1].contiguous()
    cu_p = (cu[nd_req:] - nd).to(torch.int32)
    pt_d, pt_p = md.proxy_page_table[:nd_req], md.proxy_page_table[nd_req:]
    sk_d, sk_p = md.proxy_seqused_k[:nd_req], md.proxy_seqused_k[nd_req:]
    sl = cm.seq_lens.tolist()
    tiles_d = -(-max(sl[:nd_req]) // 128)
    tiles_p = -(-max(sl[nd_req:]) // 128)
    qlens = (cm.query_start_loc_cpu[1:] - cm.query_start_loc_cpu[:-1]).tolist()
    dq, pq = max(qlens[:nd_req]), max(qlens[nd_req:])
    nvp = md.num_valid_pages
    nvp_d, nvp_p = nvp[:nd], nvp[nd:]
    out_d, out_p = buf[:nd], buf[nd : md.num_actual_tokens]
    fe = min(md.local_blocks, 16)
    P, T = mod.msa_proxy_score, mod.msa_topk_select

    def call():
        s = P(
            qd,
            k_pages,
            cu_d,
            page_table=pt_d,
            seqused_k=sk_d,
            causal=True,
            max_seqlen_q=dq,
            max_k_tiles=tiles_d,
        )
        T(s, 16, num_valid_pages=nvp_d, force_begin_blocks=0, force_end_blocks=fe, output=out_d)
        s = P(
            qp,
            k_pages,
            cu_p,
            page_table=pt_p,
            seqused_k=sk_p,
            causal=True,
            max_seqlen_q=pq,
            max_k_tiles=tiles_p,
        )
        T(s, 16, num_valid_pages=nvp_p, force_begin_blocks=0, force_end_blocks=fe, output=out_p)

    return call


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
        if len(getattr(md, "calls", ())) <= 1:  # one whole-batch pair
            q = iq[: md.num_actual_tokens].view(-1, case.heads, 128)
            if md.num_prefills:
                q = module._with_overread_slack(q)
            kp = batch.kv_cache.view(batch.kv_cache.shape[0], 1, 128, 128)
            scores = module.msa_proxy_score(
                q,
                kp,
                md.proxy_cu_seqlens_q,
                page_table=md.proxy_page_table,
                seqused_k=md.proxy_seqused_k,
                causal=True,
                max_seqlen_q=md.proxy_max_seqlen_q,
                max_k_tiles=md.max_k_tiles,
            )
            row["host_us_proxy_only"] = host_us(
                lambda q=q, kp=kp, md=md: module.msa_proxy_score(
                    q,
                    kp,
                    md.proxy_cu_seqlens_q,
                    page_table=md.proxy_page_table,
                    seqused_k=md.proxy_seqused_k,
                    causal=True,
                    max_seqlen_q=md.proxy_max_seqlen_q,
                    max_k_tiles=md.max_k_tiles,
                ),
                200,
            )
            out = impl.topk_indices_buffer[: md.num_actual_tokens]
            row["host_us_topk_only"] = host_us(
                lambda s=scores, md=md, out=out: module.msa_topk_select(
                    s,
                    16,
                    num_valid_pages=md.num_valid_pages,
                    force_begin_blocks=0,
                    force_end_blocks=1,
                    output=out,
                ),
                200,
            )
        row["host_us_patch_own"] = row["host_us_forward"] - row["host_us_kernels"]
        if md.num_prefills and md.num_decodes:
            whole = run.forward().clone()
            sc = split_calls(run)
            batch.poison()
            sc()
            split_sel = batch.topk_buffer[: batch.total_q].clone()
            ref = reference_scores(batch)
            vc = value_check(split_sel, selection_values(whole, ref), ref, want_sel=whole)
            row["split_value_match_vs_whole"] = vc.all_values_match
            row["split_exact_rate_vs_whole"] = vc.exact_rate
            row["eager_split_ms"] = bench(sc)
            row["graph_split_ms"] = graph_ms(sc)
            row["host_us_split"] = host_us(sc, 200)
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
