"""Benchmark: the patch's FlashInfer indexer forward against vLLM 0.34.0's
Triton indexer, case by case (`vllm_minimax.testing.indexer_cases.cases_for_bench`).

    python -m benchmarks.indexer_bench --out results/h200/indexer-kernels

For each case: medians of `triton.testing.do_bench(..., return_mode="median")`
for the patch's `MiniMaxM3IndexerFlashInferImpl.forward` (one msa_proxy_score
+ one msa_topk_select, as the impl calls them), for the two bare kernel calls
with the same arguments, and for vLLM's Triton indexer forward; the speed-up;
index-K bytes read per time against a device-to-device copy measured in the
same run; the first-call (JIT) cost of each; host-side issue times (forward,
bare kernels, builder.build, Triton) and the per-call wall time of eager
back-to-back calls; and whether both selections match the float32 reference
by value on every token. Writes indexer_bench.json (a list of objects),
indexer_bench.md, indexer_bench.png and profile.txt under --out.

The FlashInfer side always runs the patch's own file (extracted from
patches/vllm-0.34.0/0003-*.patch and loaded under the vLLM shim of
`vllm_minimax.testing.patched_module`); where a patched vLLM is installed the
benchmark also reports whether its indexer_flashinfer.py equals the patch's.
The Triton side imports the installed vLLM's index_topk when it imports, else
loads the unmodified file (see `vllm_minimax.testing.triton_indexer`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import timing
from vllm_minimax.testing import patched_module as pm
from vllm_minimax.testing.indexer_cases import (
    cases_for_bench,
    forced_counts,
    make_batch,
    normalize_selection,
    patched_run,
    reference_scores,
)
from vllm_minimax.testing.reference import (
    expected_topk_values,
    value_check,
)
from vllm_minimax.testing.triton_indexer import (
    load_index_topk,
    triton_build,
    triton_forward,
)

REPO = Path(__file__).resolve().parent.parent


def bench(fn, warmup=25, rep=100) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def first_call_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def host_us(fn, n=50) -> float:
    """Median host time to issue one call (no synchronization inside)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) % 10 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2] * 1e6


def loop_ms(fn, n=100) -> float:
    """Wall time per call of n eager back-to-back calls (max of host and GPU)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def graph_ms(fn) -> float | None:
    """do_bench median of a CUDA-graph replay of fn: its GPU time with almost
    no host cost (None where capture fails)."""
    try:
        return bench(timing.capture_graph(fn).replay)
    except Exception as exc:
        print(f"graph capture failed: {exc!r}")
        return None


def copy_bandwidth_gbps(nbytes=2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src.random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6  # read + write, GB/s


def gpu_slug() -> str:
    name = torch.cuda.get_device_name().lower()
    for key in ("h200", "h100", "h20", "gb10", "rtx pro 6000", "5090", "dgx spark"):
        if key in name:
            return key.replace(" ", "-")
    return name.replace("nvidia", "").strip().replace(" ", "-")


def kernel_calls(run):
    """The FlashInfer calls with exactly the arguments the patched forward
    passes (q after its prefill-regime slack step), prepared beforehand, for the
    overhead comparison: one pair per entry of the patch's `md.calls` (one
    per side of a mixed batch)."""
    mod, md, impl, batch = run.module, run.metadata, run.impl, run.batch
    H = impl.num_index_heads
    q_all = batch.index_query[: md.num_actual_tokens].view(-1, H, 128)
    kv = impl.index_cache.kv_cache
    k_pages = kv.view(kv.shape[0], 1, 128, impl.index_head_dim)
    buf = impl.topk_indices_buffer
    fb = min(impl.init_blocks, md.max_k_tiles, impl.topk_blocks)
    fe = min(impl.local_blocks, impl.topk_blocks - fb)
    proxy, topk = mod.msa_proxy_score, mod.msa_topk_select
    pairs = []
    for c in md.calls:
        q = q_all[c.token_start : c.token_end]
        if c.prefill_regime:
            q = mod._with_overread_slack(q, mod._PREFILL_Q_OVERREAD_ROWS)
        pairs.append(
            (
                q,
                c.cu_seqlens_q,
                c.page_table,
                c.seqused_k,
                c.max_seqlen_q,
                c.num_valid_pages,
                buf[c.token_start : c.token_end],
            )
        )

    def call():
        for q, cu, pt, sk, msq, nvp, out in pairs:
            s = proxy(
                q,
                k_pages,
                cu,
                page_table=pt,
                seqused_k=sk,
                causal=True,
                max_seqlen_q=msq,
                max_k_tiles=md.max_k_tiles,
            )
            topk(
                s,
                impl.topk_blocks,
                num_valid_pages=nvp,
                force_begin_blocks=fb,
                force_end_blocks=fe,
                output=out,
            )

    return call


def run_case(case, module, ops, copy_gbps, check=True):
    batch = make_batch(case, "cuda")
    run = patched_run(module, batch)
    pm.set_forward_context(run.attn_metadata())
    iq = batch.index_query

    def fi():
        run.impl.forward(iq)

    row = {
        "case": case.name,
        "phase": case.phase,
        "batch": case.batch,
        "q_per_req": max(batch.query_lens),
        "total_q": batch.total_q,
        "max_seq_len": max(batch.seq_lens),
        "heads": case.heads,
        "index_dtype": case.index_dtype,
        "seed": batch.seed,
    }
    row["flashinfer_first_call_ms"] = first_call_ms(fi)
    fi_sel = batch.topk_buffer[: batch.total_q].clone()
    tmd = triton_build(batch.common, reorder_batch_threshold=case.reorder_batch_threshold)

    def tri():
        triton_forward(
            ops,
            tmd,
            iq,
            batch.kv_cache,
            batch.topk_buffer,
            num_index_heads=case.heads,
            init_blocks=case.init_blocks,
            local_blocks=case.local_blocks,
        )

    batch.poison()
    row["triton_first_call_ms"] = first_call_ms(tri)
    tri_sel = normalize_selection(batch.topk_buffer[: batch.total_q])
    if check:
        scores = reference_scores(batch)
        nvp = batch.num_valid_pages
        fb, fe = forced_counts(case)
        want = expected_topk_values(scores, nvp, fb=fb, fe=fe)
        fv = value_check(fi_sel, want, scores)
        tv = value_check(tri_sel, want, scores)
        row["value_match"] = fv.all_values_match
        row["triton_value_match"] = tv.all_values_match
        row["fi_triton_exact_rate"] = float((fi_sel == tri_sel).all(-1).float().mean())
        if not fv.all_values_match:
            row["first_mismatch"] = fv.first_mismatch
        del scores, want
    else:
        row["value_match"] = None
    kern = kernel_calls(run)
    row["flashinfer_ms"] = bench(fi)
    row["flashinfer_kernels_ms"] = bench(kern)
    row["triton_ms"] = bench(tri)
    row["speedup"] = row["triton_ms"] / row["flashinfer_ms"]
    row["index_k_bytes"] = batch.index_k_bytes
    row["bandwidth_gbps"] = batch.index_k_bytes / row["flashinfer_ms"] / 1e6
    row["triton_bandwidth_gbps"] = batch.index_k_bytes / row["triton_ms"] / 1e6
    row["copy_gbps"] = copy_gbps
    row["bandwidth_frac_of_copy"] = row["bandwidth_gbps"] / copy_gbps
    row["flashinfer_graph_ms"] = graph_ms(fi)
    row["flashinfer_kernels_graph_ms"] = graph_ms(kern)
    row["triton_graph_ms"] = graph_ms(tri)
    if row["flashinfer_kernels_graph_ms"] and row["triton_graph_ms"]:
        row["graph_speedup"] = row["triton_graph_ms"] / row["flashinfer_kernels_graph_ms"]
        row["graph_bandwidth_gbps"] = batch.index_k_bytes / row["flashinfer_kernels_graph_ms"] / 1e6
    row["host_us_forward"] = host_us(fi)
    row["host_us_kernels"] = host_us(kern)
    row["host_us_build"] = host_us(run.rebuild)
    row["host_us_triton"] = host_us(tri)
    row["eager_loop_ms_forward"] = loop_ms(fi)
    row["eager_loop_ms_kernels"] = loop_ms(kern)
    row["eager_loop_ms_triton"] = loop_ms(tri)
    pm.set_forward_context(None)
    return row


def profile(module, cases, path: Path) -> list[str]:
    """torch.profiler tables of one patched forward per case, and the cost of
    the prefill q copy when q lacks the over-read slack."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof

    notes: list[str] = []
    with path.open("w") as f:
        for case in cases:
            batch = make_batch(case, "cuda")
            run = patched_run(module, batch)
            pm.set_forward_context(run.attn_metadata())
            for _ in range(5):
                run.impl.forward(batch.index_query)
            torch.cuda.synchronize()
            with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    run.impl.forward(batch.index_query)
                torch.cuda.synchronize()
            f.write(f"=== {case.name}: 10 x patched forward ===\n")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
            f.write("\n")
            with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    run.rebuild()
                torch.cuda.synchronize()
            f.write(f"=== {case.name}: 10 x patched builder.build ===\n")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
            f.write("\n")
            if run.metadata.num_prefills > 0:
                slack = make_batch(case, "cuda", q_slack_rows=127)
                srun = patched_run(module, slack)
                pm.set_forward_context(srun.attn_metadata())
                with_slack = bench(
                    lambda srun=srun, slack=slack: srun.impl.forward(slack.index_query)
                )
                pm.set_forward_context(run.attn_metadata())
                without = bench(lambda run=run, batch=batch: run.impl.forward(batch.index_query))
                note = (
                    f"{case.name}: forward {without:.4f} ms when q has no over-read slack "
                    f"(the patch copies q), {with_slack:.4f} ms when q's storage has 127 rows "
                    f"of slack behind it"
                )
                notes.append(note)
                f.write(note + "\n\n")
            pm.set_forward_context(None)
    return notes


COLUMNS = (
    ("case", "{}"),
    ("flashinfer_ms", "{:.4f}"),
    ("flashinfer_kernels_ms", "{:.4f}"),
    ("triton_ms", "{:.4f}"),
    ("speedup", "{:.2f}x"),
    ("bandwidth_gbps", "{:.0f}"),
    ("bandwidth_frac_of_copy", "{:.0%}"),
    ("flashinfer_kernels_graph_ms", "{:.4f}"),
    ("triton_graph_ms", "{:.4f}"),
    ("graph_speedup", "{:.2f}x"),
    ("graph_bandwidth_gbps", "{:.0f}"),
    ("value_match", "{}"),
    ("triton_value_match", "{}"),
    ("flashinfer_first_call_ms", "{:.0f}"),
    ("triton_first_call_ms", "{:.0f}"),
    ("host_us_forward", "{:.0f}"),
    ("host_us_kernels", "{:.0f}"),
    ("host_us_build", "{:.0f}"),
    ("host_us_triton", "{:.0f}"),
    ("eager_loop_ms_forward", "{:.4f}"),
    ("eager_loop_ms_triton", "{:.4f}"),
)
HEAD = (
    "case",
    "FlashInfer forward ms",
    "bare 2 kernels ms",
    "Triton ms",
    "speed-up",
    "index-K GB/s",
    "of copy",
    "FI kernels graph ms",
    "Triton graph ms",
    "graph speed-up",
    "graph index-K GB/s",
    "FI value match",
    "Triton value match",
    "FI 1st call ms",
    "Triton 1st call ms",
    "host us fwd",
    "host us kernels",
    "host us build",
    "host us Triton",
    "eager loop ms fwd",
    "eager loop ms Triton",
)


def markdown(rows, meta) -> str:
    lines = [
        f"# Indexer benchmark: {meta['device']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, flashinfer {meta['flashinfer']}; "
        f"Triton indexer from {meta['triton_source']}; device-to-device copy "
        f"{meta['copy_gbps']:.0f} GB/s (read + write) in the same run; FlashInfer JIT cache "
        f"{'warm' if meta['jit_cache_existed'] else 'cold'} at start.",
        "",
        "Times are `triton.testing.do_bench(..., return_mode='median')` (L2 flushed between "
        "calls). 'FlashInfer forward' is the patch's `MiniMaxM3IndexerFlashInferImpl.forward`; "
        "'bare 2 kernels' the same two calls with the same arguments prepared beforehand. "
        "index-K GB/s = index-K bytes of every request's pages / FlashInfer forward time. "
        "Host us: median host time to issue one call; eager loop: wall time per call of 100 "
        "back-to-back calls. 'graph' columns: the same calls captured in one CUDA graph and "
        "replayed (GPU time without host cost; speed-up and GB/s there use the bare kernels).",
        "",
        "| " + " | ".join(HEAD) + " |",
        "|" + "---|" * len(HEAD),
    ]
    for r in rows:
        cells = []
        for key, fmt in COLUMNS:
            v = r.get(key)
            cells.append("n/a" if v is None else fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows, path: Path, title: str) -> bool:
    """Speed-up by case: eager (as the impl runs in vLLM, host cost included)
    and CUDA-graph replay (GPU time only)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return False
    colors = {"decode": "tab:blue", "mtp": "tab:green", "prefill": "tab:orange", "mixed": "tab:red"}
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(rows)), 5.5))
    xs = list(range(len(rows)))
    w = 0.4
    ax.bar(
        [x - w / 2 for x in xs],
        [r["speedup"] for r in rows],
        w,
        color=[colors[r["phase"]] for r in rows],
    )
    ax.bar(
        [x + w / 2 for x in xs],
        [r.get("graph_speedup") or 0 for r in rows],
        w,
        color=[colors[r["phase"]] for r in rows],
        alpha=0.45,
        hatch="//",
    )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(xs)
    ax.set_xticklabels([r["case"] for r in rows], rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("Triton time / FlashInfer time (x)")
    ax.set_title(title + ": solid = eager do_bench, hatched = CUDA-graph replay (GPU only)")
    for p, c in colors.items():
        ax.bar([0], [0], color=c, label=p)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def replot(folder: Path) -> int:
    rows = json.loads((folder / "indexer_bench.json").read_text())
    good = [r for r in rows if "error" not in r]
    meta = json.loads((folder / "indexer_bench_meta.json").read_text())
    plot(good, folder / "indexer_bench.png", f"MiniMax M3 indexer, {meta['device']}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="default: results/<gpu>")
    ap.add_argument("--cases", default="", help="only cases whose name contains this")
    ap.add_argument("--no-check", action="store_true", help="skip the reference comparison")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--command", default=None, help="command line to record in the outputs")
    ap.add_argument(
        "--replot",
        type=Path,
        default=None,
        help="only redraw FOLDER/indexer_bench.png from its JSON",
    )
    args = ap.parse_args(argv)
    if args.replot:
        return replot(args.replot)
    if not torch.cuda.is_available():
        print("no CUDA GPU")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    out = args.out or REPO / "results" / gpu_slug() / "indexer-kernels"
    out.mkdir(parents=True, exist_ok=True)
    # Checked before flashinfer is imported (importing it creates the folder).
    base = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", Path.home()))
    jit_dir = base / ".cache" / "flashinfer"
    jit_cache_existed = jit_dir.is_dir() and any(jit_dir.rglob("*.o"))
    import flashinfer
    import triton

    meta = {
        "device": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flashinfer": flashinfer.__version__,
        "jit_cache_existed": jit_cache_existed,
        "command": args.command or "python " + " ".join(sys.argv),
        "installed_vllm_module_matches_patch": pm.real_module_matches_patch(),
    }
    module = pm.load_patched_module()
    ops = load_index_topk()
    meta["triton_source"] = getattr(ops, "__file__", "?")
    if "vllm_minimax" in ops.__name__:
        meta["triton_source"] = "the unmodified vLLM 0.34.0 index_topk.py under the test shim"
    meta["copy_gbps"] = copy_bandwidth_gbps()
    print(f"copy bandwidth {meta['copy_gbps']:.0f} GB/s", flush=True)
    cases = [c for c in cases_for_bench() if args.cases in c.name]
    rows = []
    for case in cases:
        try:
            row = run_case(case, module, ops, meta["copy_gbps"], check=not args.no_check)
            torch.cuda.empty_cache()
        except Exception as exc:  # report and go on
            print(f"{case.name}: FAILED {exc!r}", flush=True)
            rows.append({"case": case.name, "phase": case.phase, "error": repr(exc)})
            continue
        rows.append(row)
        print(
            f"{case.name:40s} fi {row['flashinfer_ms']:.4f} ms (kernels "
            f"{row['flashinfer_kernels_ms']:.4f}) triton {row['triton_ms']:.4f} ms "
            f"x{row['speedup']:.2f} {row['bandwidth_gbps']:.0f} GB/s match={row['value_match']}"
            f"/{row.get('triton_value_match')} host fwd {row['host_us_forward']:.0f} us",
            flush=True,
        )
    good = [r for r in rows if "error" not in r]
    for r in good:
        r.update({k: meta[k] for k in ("device", "torch", "triton", "flashinfer")})
    notes = []
    if not args.no_profile:
        pc = [
            c
            for c in cases_for_bench()
            if c.name in ("decode B=32 32k h1 fp8", "prefill 8k on 0 ctx h1 fp8")
        ]
        notes = profile(module, pc, out / "profile.txt")
    (out / "indexer_bench.json").write_text(json.dumps(rows, indent=1) + "\n")
    md = markdown(good, meta)
    if notes:
        md += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    bad = [r for r in rows if "error" in r]
    if bad:
        md += "\nFailed cases:\n" + "\n".join(f"- {r['case']}: {r['error']}" for r in bad) + "\n"
    (out / "indexer_bench.md").write_text(md)
    (out / "indexer_bench_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    if good:
        plot(good, out / "indexer_bench.png", f"MiniMax M3 indexer, {meta['device']}")
    print(md)
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
