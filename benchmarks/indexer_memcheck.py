"""compute-sanitizer memcheck of the patched FlashInfer indexer's forward, with and
without its over-read guards.

The patch (0003) gives the q of every prefill-regime ``msa_proxy_score`` call 127 rows
of addressable storage behind it (``_PREFILL_Q_OVERREAD_ROWS``) and can do the same for
the call's int metadata (``_PREFILL_INT_OVERREAD_ROWS``, 0 in the patch). Both pass
through ``_with_overread_slack`` inside ``forward``; this driver wraps that function to
run four variants of the same forward over the same batches:

    q-slack   q with the patch's slack            | q in an allocation of exactly its rows
    ints      cu_seqlens_q, seqused_k, page table | the same, each copied into an
              as the builder hands them           | allocation with 128 spare rows

The batches are the shapes FlashInfer sends to its prefill regime: a zero-length row
among MTP decodes beside a chunk (where 0.7.4 read out of bounds next to a 12-byte
allocation in ``results/h200/overread-probe``), MTP with 4 speculative tokens beside a
chunk, tiny, uniform and ragged prefills, decodes beside a chunk, and a prefill long
enough to be scored in query chunks that cut requests (``_SCORE_CHUNK_ELEMENTS`` is
lowered for it). Every tensor is its own cudaMalloc (``PYTORCH_NO_CUDA_MEMORY_CACHING``),
so a read past one is an out-of-bounds access memcheck reports.

On an SM90 GPU with torch, Triton and FlashInfer 0.7.4 (vLLM is not needed), from the
project's root:

    python3 -m benchmarks.indexer_memcheck --out "$OUT/memcheck"

builds the JIT programs once without the sanitizer, then runs each variant under
``compute-sanitizer --tool memcheck``; a variant whose process dies on an error is
resumed at the next case. ``--control`` adds a planted one-element over-read (a Triton
kernel without a mask), which memcheck must report. ``$OUT/memcheck/summary.md`` says,
per variant and case, ``clean`` or the first error; the logs are beside it.

Reading it (the patch's switches are the two constants above):
- q-slack off is clean everywhere: the slack is not needed; set
  ``_PREFILL_Q_OVERREAD_ROWS = 0``.
- q-slack off reports reads past q and q-slack on is clean: keep it.
- q-slack on reports errors that padded ints remove: the kernel reads past its int
  metadata; set ``_PREFILL_INT_OVERREAD_ROWS = 128``.
- errors in every variant on the zero-length case only: the uneven decode call itself
  is at fault; the builder must not make it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

VARIANTS = {
    # name: (q slack, int metadata padded)
    "patch": (True, False),
    "no-q-slack": (False, False),
    "padded-ints": (True, True),
    "no-q-slack-padded-ints": (False, True),
}
INT_PAD_ROWS = 128
OK_PREFIX = "memcheck-case-ok: "


def cases():
    from vllm_minimax.testing.indexer_cases import IndexerCase, decode

    mtp = ("mtp",)
    return [
        IndexerCase(
            "zero-length row among mtp K=1 + 700 chunk h1",
            "mixed",
            ((2, 3000), (0, 500), (2, 9000), (700, 1700)),
            1,
            tags=mtp,
        ),
        IndexerCase(
            "zero-length row among mtp K=1 + 300 chunk h4",
            "mixed",
            ((2, 3000), (2, 4000), (0, 500), (300, 2300)),
            4,
            tags=mtp,
        ),
        IndexerCase(
            "mtp K=4 x4 + 300 chunk h2",
            "mixed",
            ((5, None),) * 4 + ((300, 4300),),
            2,
            kv_min=5,
            kv_max=20000,
            tags=mtp,
        ),
        decode("mtp K=4 B=8 h4", 8, 20000, heads=4, q=5),
        IndexerCase("prefill 1x5 h1", "prefill", ((5, 5),), 1),
        IndexerCase("prefill 1x65 h4", "prefill", ((65, 8065),), 4),
        IndexerCase("prefill 1x129 h1", "prefill", ((129, 129),), 1),
        IndexerCase("prefill 4x1000 h4", "prefill", ((1000, 1000),) * 4, 4),
        IndexerCase(
            "prefill ragged 3 req h2", "prefill", ((1000, 1000), (2500, 12500), (700, 33700)), 2
        ),
        IndexerCase("mixed 8 dec + 777 h2", "mixed", ((1, 5000),) * 8 + ((777, 9777),), 2),
        IndexerCase("mixed 3 dec + 6 chunk h1", "mixed", ((1, 5000),) * 3 + ((6, 6),), 1),
        IndexerCase(
            "chunked prefill 2 dec + 700 + 900 h2",
            "mixed",
            ((1, 9000), (1, 11000), (700, 700), (900, 2900)),
            2,
            tags=("chunked",),
        ),
    ]


def _exact(t):
    out = t.new_empty(t.shape)
    out.copy_(t)
    return out


def run_cases(variant: str, first: int, chunk_elements: int, device: str = "cuda") -> None:
    """Run cases[first:] through the patched forward in this process, printing a line
    after each one's kernels have finished. ``device="cpu"`` runs the float32
    reference kernels instead of FlashInfer's (a dry run of the driver itself)."""
    import torch

    from vllm_minimax.testing.indexer_cases import make_batch, patched_run
    from vllm_minimax.testing.patched_module import load_patched_module, reference_msa_ops

    q_slack, pad_ints = VARIANTS[variant]
    module = load_patched_module(reference_msa_ops() if device == "cpu" else None)
    real_slack = module._with_overread_slack
    int_dtypes = (torch.int32, torch.int64)

    def slack(t, rows):
        if t.dtype in int_dtypes:
            return real_slack(t, INT_PAD_ROWS) if pad_ints else t
        return real_slack(t, rows) if q_slack else _exact(t)

    module._with_overread_slack = slack
    default_chunk = module._SCORE_CHUNK_ELEMENTS
    for index, case in enumerate(cases()):
        if index < first:
            continue
        module._SCORE_CHUNK_ELEMENTS = chunk_elements if "chunked" in case.tags else default_chunk
        batch = make_batch(case, device, seed=index, spare_pages=0)
        run = patched_run(module, batch)
        # Each call's inputs in allocations of exactly their size, as a view ending at
        # its runner buffer's end would be; the wrapped slack then decides.
        run.metadata.calls = tuple(
            type(call)(
                **{
                    **vars(call),
                    "cu_seqlens_q": _exact(call.cu_seqlens_q),
                    "seqused_k": _exact(call.seqused_k),
                    "page_table": _exact(call.page_table),
                }
            )
            for call in run.metadata.calls
        )
        run.forward()
        if device != "cpu":
            torch.cuda.synchronize()
        shapes = ", ".join(
            f"[{c.token_start}:{c.token_end}) {'prefill' if c.prefill_regime else 'decode'}"
            f" regime, max_seqlen_q {c.max_seqlen_q}"
            for c in run.metadata.calls
        )
        print(f"{OK_PREFIX}{index} {case.name}: {shapes}", flush=True)


def control() -> None:
    """A planted read one element past a tensor's end: memcheck must report it."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def read_past(src, dst, n):
        dst[0] = tl.load(src + n)  # no mask: reads src[n]

    src = torch.zeros(1024, dtype=torch.float32, device="cuda")
    dst = torch.zeros(1, dtype=torch.float32, device="cuda")
    read_past[(1,)](src, dst, 1024 + 64)
    torch.cuda.synchronize()
    print(f"{OK_PREFIX}control", flush=True)


def _device_args() -> list[str]:
    """``--device cpu`` for a dry run of the orchestration (``INDEXER_MEMCHECK_DEVICE``)."""
    device = os.environ.get("INDEXER_MEMCHECK_DEVICE")
    return ["--device", device] if device else []


def _sanitizer() -> str:
    found = shutil.which("compute-sanitizer")
    if found is None:
        cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
        candidate = Path(cuda_home) / "bin" / "compute-sanitizer"
        if candidate.exists():
            found = str(candidate)
    if found is None:
        sys.exit("indexer_memcheck: compute-sanitizer is not on PATH nor in $CUDA_HOME/bin")
    return found


def _first_error(log: str) -> str:
    match = re.search(r"=+ (Invalid [^\n]*|Program hit [^\n]*)\n(?:.*\n){0,4}", log)
    if match is None:
        return "the process failed without a memcheck report (see the log)"
    lines = [line.strip("= ").strip() for line in match.group(0).splitlines()]
    return "; ".join(line for line in lines if line)


def orchestrate(out: Path, chunk_elements: int, with_control: bool, variants: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    me = [sys.executable, "-m", "benchmarks.indexer_memcheck"]
    names = [case.name for case in cases()]
    # The JIT programs, built once without the sanitizer.
    warm = subprocess.run(
        [*me, "--run", "patch", "--chunk-elements", str(chunk_elements), *_device_args()],
        env=env,
        capture_output=True,
        text=True,
    )
    (out / "warm.log").write_text(warm.stdout + warm.stderr)
    print(f"warm run (no sanitizer): rc {warm.returncode}", flush=True)
    sanitizer = [_sanitizer(), "--tool", "memcheck", "--report-api-errors", "no"]
    sanitizer += ["--print-limit", "20", "--error-exitcode", "3"]
    rows: dict[str, dict[int, str]] = {}
    for variant in variants:
        results: dict[int, str] = {}
        first = 0
        part = 0
        while first < len(names):
            cmd = [*sanitizer, *me, "--run", variant, "--from", str(first)]
            cmd += ["--chunk-elements", str(chunk_elements)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            log = done.stdout + done.stderr
            (out / f"{variant}.{part}.log").write_text(" ".join(cmd) + "\n" + log)
            part += 1
            finished = [int(m) for m in re.findall(rf"^{OK_PREFIX}(\d+) ", log, re.M)]
            reported = "ERROR SUMMARY: 0 errors" not in log
            for index in finished:
                results[index] = "errors in this run (see its log)" if reported else "clean"
            if done.returncode == 0 and not reported:
                break
            # The run stopped in the case after the last one it finished.
            culprit = max(finished, default=first - 1) + 1
            if culprit >= len(names):
                break
            results[culprit] = _first_error(log)
            first = culprit + 1
        rows[variant] = results
        print(f"{variant}: {sum(r == 'clean' for r in results.values())}/{len(names)} clean")
    lines = [
        "# Patched forward under compute-sanitizer memcheck",
        "",
        f"Variants: q slack on/off x int metadata as built/padded ({INT_PAD_ROWS} rows);"
        " every tensor its own cudaMalloc. Command: "
        "`python3 -m benchmarks.indexer_memcheck --out DIR`.",
        "",
        "| case | " + " | ".join(variants) + " |",
        "|---|" + "---|" * len(variants),
    ]
    for index, name in enumerate(names):
        cells = [rows[v].get(index, "not run") for v in variants]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if with_control:
        done = subprocess.run(
            [*sanitizer, *me, "--control"], env=env, capture_output=True, text=True
        )
        log = done.stdout + done.stderr
        (out / "control.log").write_text(log)
        seen = "Invalid __global__ read" in log
        lines += ["", f"Control (planted over-read): {'reported' if seen else 'NOT reported'}."]
        print(f"control: {'reported' if seen else 'NOT reported'}")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="run every variant under memcheck here")
    parser.add_argument("--run", choices=VARIANTS, help="run one variant in this process")
    parser.add_argument("--from", dest="first", type=int, default=0)
    # Per-head score cap of the chunked case: 3 rows-tiles at its 89 pages.
    parser.add_argument("--chunk-elements", type=int, default=3 * 128 * 89)
    parser.add_argument("--control", action="store_true")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="with --out: a comma-separated subset"
    )
    parser.add_argument("--device", default="cuda", help="cpu: a dry run on the reference")
    args = parser.parse_args(argv)
    if args.run:
        run_cases(args.run, args.first, args.chunk_elements, args.device)
        return 0
    if args.out:
        variants = args.variants.split(",")
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown:
            parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
        return orchestrate(args.out, args.chunk_elements, args.control, variants)
    if args.control:
        control()
        return 0
    parser.error("give --out DIR (all variants under memcheck) or --run VARIANT")
    return 2


if __name__ == "__main__":
    sys.exit(main())
