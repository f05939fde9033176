"""``method: mtp`` against a checkpoint that declares an MTP module and carries no
``model.mtp.*`` tensors: what vLLM 0.34.0 does (issue 63).

The tiny MiniMax M3 (``make-tiny-model``, no ``--mtp-modules``: its ``model.safetensors``
has no ``model.mtp.*`` names) is laid out as the published checkpoints are
(`speculative_run.published_layout`): the ``minimax_m3_vl`` wrapper with the VL architecture,
the tensors under ``language_model.``, ``num_mtp_modules: 1`` in the text config. Then:

1. doctor's checkpoint row (`vllm_minimax.checkpoint_weights.check`) for that directory;
2. ``vllm.LLM`` with ``speculative_config={"method": "mtp", "num_speculative_tokens": 2}``
   and image and video off (the checkpoint has no tower), in this process
   (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the load's exception reaches here whole).
   Expected from the code, and seen on the CPU (tests/cpu/test_mtp_published_layout.py): the
   default loader's check of weights not loaded raises ``ValueError: Following weights were
   not initialized from checkpoint: {...}`` for the MTP module's norms (the checkpoint has
   no quantization config, so the check is on; its linear layers are exempt).

Writes one JSON (``--out``) with both and exits 0 when the engine stopped with that
message and doctor said absent, 1 otherwise. From the project's root, after staging:
``python3 tests/gpu_e2e/mtp_without_tensors.py --target TINY --work DIR --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

# A parameter of MTP module 0 the loader's check reports (a norm: not exempt).
EXPECTED_NOT_INITIALIZED = "model.layers.0.enorm.weight"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm_minimax.checkpoint_weights import check
    from vllm_minimax.testing.speculative_run import (
        NOT_INITIALIZED,
        not_initialized,
        published_layout,
    )

    model = published_layout(args.target, args.work)
    speculative = {"method": "mtp", "num_speculative_tokens": 2}
    row = check(speculative, str(model))
    result: dict = {"model": str(model), "doctor": [row.outcome.value, row.text]}
    print(f"doctor: {row.outcome.value}: {row.text}", flush=True)
    began = time.perf_counter()
    try:
        from vllm import LLM

        LLM(
            model=str(model),
            speculative_config=speculative,
            block_size=128,
            max_model_len=4096,
            gpu_memory_utilization=0.2,
            enforce_eager=True,
            attention_config={"indexer_kv_dtype": "fp8"},
            limit_mm_per_prompt={"image": 0, "video": 0},
        )
        result["engine"] = "started"
    except Exception as exc:  # the finding: what stopped it
        text = "".join(traceback.format_exception(exc))
        result["engine"] = "stopped"
        result["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        result["not_initialized"] = not_initialized(text)
        result["expected_message"] = NOT_INITIALIZED in text
    result["seconds"] = round(time.perf_counter() - began, 1)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "error"}, indent=2))
    as_expected = (
        result["engine"] == "stopped"
        and result.get("expected_message")
        and EXPECTED_NOT_INITIALIZED in result.get("not_initialized", [])
        and row.outcome.value == "absent"
    )
    print("as expected" if as_expected else "NOT as expected: see the JSON", flush=True)
    return 0 if as_expected else 1


if __name__ == "__main__":
    sys.exit(main())
