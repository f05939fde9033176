"""One vLLM engine configuration over the end-to-end prompt set; results as JSON.

    python tests/gpu_e2e/engine_run.py --model DIR --backend flashinfer --kv-dtype fp8 \
        [--graphs] [--audit] [--mtp K] [--fault page-count] --out run.json

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that
`--audit` can check the FlashInfer indexer's selections inside it, and name the
rows where vLLM's Triton indexer leaves or ties the reference (`selection_audit`).
Prompts are random token ids from a fixed seed, identical in every run, submitted
in two workloads:

- ``long``: three prompts of 8k, 16k and 30k tokens (the indexer keeps 16 of up
  to 235 blocks), greedy, prompt logprobs on;
- ``mixed``: six 2.5k-token prompts that decode 96 tokens, followed by 20k and
  12k-token prompts whose chunks (4096 tokens a step) are scheduled beside the
  running decodes, so steps mix decode and prefill rows.

``--mtp K`` speculates K tokens a step with the MTP draft in ``DIR/mtp``
(``make-tiny-model --mtp-modules N``), so the target verifies 1 + K query
tokens per decoding request; the draft gets the layer prefix of
``mtp_draft.install()``. Stats logging is on for those runs: the JSON gets vLLM's
spec-decode counters (``spec_decode``), the speculative config and each
MiniMax M3 sparse layer's indexer impl class (``sparse_layers``).

On a release of `triton_indexer.ROW_ORDER_PREFILL_RELEASES` (vLLM 0.33.0) every run
makes vLLM's Triton indexer, wherever the engine selects it, sort its top-k rows
ascending after writing them (`triton_indexer.install_ascending_rows`, recorded as
``triton_rows``): the same blocks in the order FlashInfer writes them. That release's
Hopper prefill attend sums the blocks in row order, and the Triton top-k writes them by
descending score, so without it the two backends' prompt logprobs differ in rounding
wherever a token has two blocks or more, whatever they selected.

``--fault page-count`` plants a builder bug (`selection_fault.install_page_count_fault`:
each token's page count less one, so its own block is never selected). The tests use
that run as the control that each engine comparison must fail (test_engine.py,
`FAULT_CONTROL`).

A configuration the engine refuses at start is recorded as ``error``. Every run
records the series applied to the vLLM it imported (``series``,
`vllm_minimax.testing.series_record`), so the tests can refuse a run of another
revision.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

from vllm_minimax.testing import series_record

WORKLOADS = {
    # name: [(prompt tokens, max new tokens), ...] in submission order
    "long": [(8192, 24), (16384, 24), (30000, 24)],
    "mixed": [(2560, 96)] * 6 + [(20000, 16), (12000, 16)],
}
MAX_MODEL_LEN = 32768
MAX_NUM_BATCHED_TOKENS = 4096
PROMPT_SEED = 1234
FIRST_TOKEN_ID = 3  # below: <pad>, <s>, </s>


def make_prompts(vocab_size: int) -> dict[str, list[list[int]]]:
    import torch

    g = torch.Generator().manual_seed(PROMPT_SEED)
    return {
        name: [
            torch.randint(FIRST_TOKEN_ID, vocab_size, (length,), generator=g).tolist()
            for length, _ in spec
        ]
        for name, spec in WORKLOADS.items()
    }


def request_result(output) -> dict:
    prompt_lp = [
        None if entry is None else entry[token].logprob
        for token, entry in zip(output.prompt_token_ids, output.prompt_logprobs, strict=True)
    ]
    completion = output.outputs[0]
    steps = []
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        top = sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)
        steps.append(
            {"token": token, "top": [[tok, lp.logprob] for tok, lp in top]},
        )
    return {
        "prompt_tokens": len(output.prompt_token_ids),
        "prompt_logprobs": prompt_lp,
        "token_ids": list(completion.token_ids),
        "steps": steps,
    }


def spec_decode_counters(llm) -> dict[str, int | list[int]]:
    """vLLM's spec-decode metrics (drafts, draft tokens, accepted tokens, per position)."""
    counters: dict[str, int | list[int]] = {}
    for metric in llm.get_metrics():
        if "spec_decode" not in metric.name:
            continue
        value = getattr(metric, "values", None)
        counters[metric.name] = list(value) if value is not None else metric.value
    return counters


def sparse_layer_impls(worker) -> dict[str, str]:
    """Per MiniMax M3 sparse attention layer of the engine (target and draft): the class
    of its indexer impl. Runs inside the worker (`LLM.collective_rpc`)."""
    context = worker.vllm_config.compilation_config.static_forward_context
    return {
        name: type(layer.indexer.impl).__name__
        for name, layer in sorted(context.items())
        if hasattr(layer, "indexer")
    }


def speculative_summary(llm) -> dict | None:
    spec = llm.llm_engine.vllm_config.speculative_config
    if spec is None:
        return None
    draft = spec.draft_model_config
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "draft_model": draft.model,
        "draft_model_type": draft.hf_config.model_type,
        "draft_architectures": list(draft.architectures),
    }


def run(args: argparse.Namespace) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    audit = None
    if args.audit:
        from vllm_minimax.testing import selection_audit

        selection_audit.install()
        selection_audit.install_triton()
        audit = selection_audit.AUDIT
    if args.fault:
        from vllm_minimax.testing.selection_fault import install_page_count_fault

        install_page_count_fault()
    import vllm

    from vllm_minimax.testing import triton_indexer

    sort_rows = vllm.__version__ in triton_indexer.ROW_ORDER_PREFILL_RELEASES
    if sort_rows:
        triton_indexer.install_ascending_rows()
    speculative_config = None
    if args.mtp:
        from vllm_minimax.testing import mtp_draft

        speculative_config = mtp_draft.speculative_config(args.model, args.mtp)

    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=16,
        enable_prefix_caching=False,
        enforce_eager=not args.graphs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_config={
            "indexer_kv_dtype": args.kv_dtype,
            "minimax_m3_indexer_backend": args.backend,
        },
        speculative_config=speculative_config,
        disable_log_stats=not args.mtp,
    )
    result: dict = {"engine_start_s": round(time.perf_counter() - started, 1)}
    result["triton_rows"] = "ascending" if sort_rows else "as written"
    if args.mtp:
        result["speculative"] = speculative_summary(llm)
        try:
            result["sparse_layers"] = llm.collective_rpc(sparse_layer_impls)[0]
        except Exception as exc:  # the workloads still run; the tests report it
            result["sparse_layers_error"] = f"{type(exc).__name__}: {exc}"
    vocab_size = llm.get_tokenizer().vocab_size
    prompts = make_prompts(min(vocab_size, llm.llm_engine.model_config.get_vocab_size()))
    result["workloads"] = {}
    for name, spec in WORKLOADS.items():
        params = [
            SamplingParams(temperature=0.0, max_tokens=new, prompt_logprobs=0, logprobs=2)
            for _, new in spec
        ]
        if audit is not None:
            audit.enabled = True
        began = time.perf_counter()
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in prompts[name]], params, use_tqdm=False
        )
        elapsed = time.perf_counter() - began
        if audit is not None:
            audit.enabled = False
        result["workloads"][name] = {
            "seconds": round(elapsed, 2),
            "requests": [request_result(o) for o in outputs],
        }
    if audit is not None:
        result["audit"] = audit.summary()
    if args.mtp:
        result["spec_decode"] = spec_decode_counters(llm)
    return result


def device_capability() -> list[int] | None:
    import torch

    return list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--backend", choices=["auto", "flashinfer", "triton"], required=True)
    parser.add_argument("--kv-dtype", choices=["fp8", "bf16"], default="fp8")
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs on (not eager)")
    parser.add_argument(
        "--audit", action="store_true", help="check FlashInfer selections, name Triton's"
    )
    parser.add_argument(
        "--mtp",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding with the MTP draft in MODEL/mtp, K tokens a step",
    )
    parser.add_argument(
        "--fault", choices=["page-count"], help="a planted builder bug, for the control run"
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    try:
        result = run(args)
    except Exception as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["config"] = config
    result["device_capability"] = device_capability()
    result[series_record.RUN_KEY] = series_record.applied_series()
    args.out.write_text(json.dumps(result))
    print(f"engine_run: wrote {args.out}", flush=True)
    # The in-process engine core's teardown can hang at interpreter exit; the
    # results are on disk.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
