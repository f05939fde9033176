"""Run test_engine.py's checks over saved engine runs, on any machine.

    python tests/gpu_e2e/recheck.py DIR [--capability 9.0]

DIR holds the `<run>.json` / `<run>.log` pairs a GPU session wrote
(`VLLM_MINIMAX_E2E_DIR`, or `results/h200-e2e/engine-runs.tar.gz` unpacked);
`--capability` is the GPU they came from. Prints PASS/FAIL per check and writes
DIR/summary.json. Nothing runs on a GPU here: this re-reads what one produced.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import conftest
import test_engine

PARAMETERS = {
    "test_selected_indexer_is_logged": [{"name": n} for n in sorted(test_engine.EXPECTED_LOG)],
    "test_every_selection_matches_the_reference": [
        {"name": n} for n in sorted(test_engine.AUDITED_KINDS)
    ],
    "test_graphs_reproduce_eager": [
        {"eager": "flashinfer-eager", "graphs": "auto-graphs"},
        {"eager": "triton-eager", "graphs": "triton-graphs"},
    ],
    "test_prompt_logprobs_agree": [{"mode": m} for m in sorted(test_engine.PAIRS)],
    "test_greedy_tokens_agree": [{"mode": m} for m in sorted(test_engine.PAIRS)],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--capability", default="9.0")
    args = parser.parse_args()
    results = {
        name: conftest.EngineResult(
            name,
            json.loads((args.directory / f"{name}.json").read_text()),
            (args.directory / f"{name}.log").read_text(errors="replace"),
        )
        for name in conftest.ENGINE_RUNS
    }
    test_engine._sm90 = lambda: args.capability == "9.0"
    failed = 0
    for name, function in inspect.getmembers(test_engine, inspect.isfunction):
        if not name.startswith("test_"):
            continue
        for params in PARAMETERS.get(name, [{}]):
            wanted = inspect.signature(function).parameters
            kwargs = dict(params)
            if "engine_results" in wanted:
                kwargs["engine_results"] = results
            if "e2e_dir" in wanted:
                kwargs["e2e_dir"] = args.directory
            try:
                function(**kwargs)
                print(f"PASS {name} {params}")
            except AssertionError as exc:
                failed += 1
                print(f"FAIL {name} {params}: {str(exc)[:300]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
