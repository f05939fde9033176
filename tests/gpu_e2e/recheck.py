"""Run test_engine.py's and test_mtp.py's checks over saved engine runs, on any machine.

    python tests/gpu_e2e/recheck.py DIR [--capability 9.0]

DIR holds the `<run>.json` / `<run>.log` pairs a GPU session wrote
(`VLLM_MINIMAX_E2E_DIR`, or `results/h200-e2e/engine-runs.tar.gz` unpacked);
`--capability` is the GPU they came from. Prints PASS/FAIL per check, or SKIP
where a run it needs is not in DIR (e.g. saved before the `mtp-*` runs existed),
and writes DIR/summary.json. Nothing runs on a GPU here: this re-reads what one
produced.
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
import test_mtp

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
    "test_engine_ran_the_mtp_draft": [{"name": n} for n in test_mtp.MTP_RUNS],
    "test_speculative_decoding_ran": [{"name": n} for n in test_mtp.MTP_RUNS],
    "test_forced_indexer_serves_target_and_draft": [{"name": n} for n in test_mtp.MTP_RUNS],
    "test_greedy_tokens_match_the_run_without_mtp": [{"name": n} for n in test_mtp.MTP_RUNS],
    "test_mtp_graphs_reproduce_eager": [{"eager": n} for n in sorted(test_mtp.GRAPHS_OF_EAGER)],
    "test_prompt_logprobs_agree_flashinfer_vs_triton_with_mtp": [
        {"mode": m} for m in sorted(test_mtp.BACKEND_PAIRS)
    ],
    "test_greedy_tokens_agree_flashinfer_vs_triton_with_mtp": [
        {"mode": m} for m in sorted(test_mtp.BACKEND_PAIRS)
    ],
}


class RunAbsent(Exception):
    """A check needs an engine run that the directory does not hold."""


class SavedRuns(dict):
    def __missing__(self, name: str):
        raise RunAbsent(name)


def load_runs(directory: Path) -> SavedRuns:
    runs = SavedRuns()
    for name in conftest.ENGINE_RUNS:
        result, log = directory / f"{name}.json", directory / f"{name}.log"
        if result.exists():
            text = log.read_text(errors="replace") if log.exists() else ""
            runs[name] = conftest.EngineResult(name, json.loads(result.read_text()), text)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--capability", default="9.0")
    args = parser.parse_args()
    results = load_runs(args.directory)
    test_engine._sm90 = lambda: args.capability == "9.0"
    failed = 0
    for module in (test_engine, test_mtp):
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if not name.startswith("test_") or function.__module__ != module.__name__:
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
                except RunAbsent as absent:
                    print(f"SKIP {name} {params}: no saved run {absent}")
                except AssertionError as exc:
                    failed += 1
                    print(f"FAIL {name} {params}: {str(exc)[:300]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
