"""The patched engine across the GPUs of one host, against its own TP 1 runs.

Reads the runs of `tp_engine.py` from `VLLM_MINIMAX_TP_RUNS`: a directory of
`<run>.json` and `<run>.log` (GPU runs, checked here on any machine; JSON also
gzip'ed). A run is named `tp<N>-<attend>` (fp8 KV cache, FlashInfer indexer
asked for, the sparse attend `auto`, `flashinfer` or `triton`); the TP 1 runs
`tp1-flashinfer` and `tp1-triton` are the references, and `tp1-triton-bf16`
(a bf16 KV cache) the control. Every run with N > 1 is checked: every rank
logged the indexer's FlashInfer selection and the sparse attend it asked for
(`auto` must resolve to FlashInfer), no FlashInfer program was built after the
engine was ready, and its prompt logprobs agree with the TP 1 run of the same
attend (`auto` against `tp1-flashinfer`).

Bound. The same checkpoint at TP N differs from TP 1 only in rounding where
partial results are summed across ranks: the row-parallel outputs (attention's
o_proj, the dense MLP's down projection) and the MoE's combine (with expert
parallelism a rank sums the experts it holds, the ranks' sums are then summed).
At TP 1 each is an fp32 accumulation rounded once to bf16. At TP N each rank's
partial is rounded to bf16, and the cross-rank sum may round again at each of
its N - 1 steps (NCCL's ring). bf16 rounds with a relative error uniform within
+-2^-8, RMS u = 2^-8 / sqrt(3). With partials of about equal size, the N partial
roundings add up to u of the output, the ring's sums of k of N partials
u * sqrt(sum k / N) = u * sqrt((N - 1) / 2), and TP 1's own rounding u more:
the TP N output differs from TP 1's by at most u * sqrt(2 + (N - 1) / 2)
relative RMS, u * sqrt(5.5) at N = 8. The control moves every key and value by
fp8 e4m3's rounding, relative error uniform within +-2^-4, RMS 2^-4 / sqrt(3).
Both enter the residual stream twice a layer, so to first order the logprobs
move in proportion: TP 8 against TP 1 at most sqrt(5.5) * 2^-8 / 2^-4 = 0.147
of what the control pair moves them. The bound allows three times that, 0.44 of
the control: under 1, so a pair that differs as the control does must fail it,
which each TP N run against the bf16 control run checks (it holds the cache's
difference and TP's).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest

from vllm_minimax.testing.engine_runs import load_run, mean_abs_diff

RUNS_ENV = "VLLM_MINIMAX_TP_RUNS"
BF16_UNIT = 2.0**-8
FP8_E4M3_UNIT = 2.0**-4
LARGEST_TP = 8
TP_ROUNDING_RATIO = math.sqrt(2 + (LARGEST_TP - 1) / 2) * BF16_UNIT / FP8_E4M3_UNIT
RATIO_BOUND = 3 * TP_ROUNDING_RATIO
MIN_CONTROL = 1e-3
CONTROL = ("tp1-triton", "tp1-triton-bf16")
REFERENCE = {"flashinfer": "tp1-flashinfer", "auto": "tp1-flashinfer", "triton": "tp1-triton"}
RUN_NAME = re.compile(r"^tp(?P<tp>[1-9][0-9]*)-(?P<attend>auto|flashinfer|triton)(?P<bf16>-bf16)?$")
# The selection lines of the series (patches 0003 and 0007), what a rank logs once.
INDEXER_FLASHINFER = "MiniMax M3 indexer: selected FlashInfer"
ATTEND_SELECTED = {
    "flashinfer": "MiniMax M3 sparse attention: selected FlashInfer",
    "triton": "MiniMax M3 sparse attention: selected Triton",
}
# vLLM's log prefix: "(<process name> pid=<pid>)"; a worker's name holds "_TP<rank>"
# when the tensor-parallel group has more than one rank.
PROCESS = re.compile(r"\((?P<name>[^()\s]+) pid=\d+\)")
WORKER_RANK = re.compile(r"_TP(?P<rank>\d+)(?![0-9])")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_names(directory: Path) -> list[str]:
    """The run names in `directory` (`<name>.json` or `.json.gz`), sorted by TP then name."""
    names = {
        p.name.removesuffix(".gz").removesuffix(".json")
        for p in directory.iterdir()
        if p.name.endswith((".json", ".json.gz"))
    }
    matched = [n for n in names if RUN_NAME.match(n)]
    return sorted(matched, key=lambda n: (int(RUN_NAME.match(n)["tp"]), n))


def tp_of(name: str) -> int:
    match = RUN_NAME.match(name)
    assert match, f"{name}: not a tp<N>-<attend> run"
    return int(match["tp"])


def attend_of(name: str) -> str:
    """The attend the run should have selected (`auto` resolves to FlashInfer)."""
    match = RUN_NAME.match(name)
    assert match, f"{name}: not a tp<N>-<attend> run"
    return "flashinfer" if match["attend"] == "auto" else match["attend"]


def ranks_logging(log: str, marker: str, tensor_parallel_size: int) -> set[int]:
    """The tensor-parallel ranks whose lines of `log` contain `marker`. At TP 1 the one
    rank may log from a process of any name; at TP N only workers with `_TP<rank>` in
    their name count."""
    ranks: set[int] = set()
    for line in ANSI.sub("", log).splitlines():
        if marker not in line:
            continue
        process = PROCESS.search(line)
        rank = WORKER_RANK.search(process["name"]) if process else None
        if rank is not None:
            ranks.add(int(rank["rank"]))
        elif tensor_parallel_size == 1:
            ranks.add(0)
    return ranks


def selection_faults(log: str, tensor_parallel_size: int, attend: str) -> list[str]:
    """What is missing or wrong in a run's log: ranks that did not log the FlashInfer
    indexer or the attend asked for, and ranks that logged the other attend."""
    every = set(range(tensor_parallel_size))
    faults = []
    missing = every - ranks_logging(log, INDEXER_FLASHINFER, tensor_parallel_size)
    if missing:
        faults.append(f"ranks {sorted(missing)} did not log {INDEXER_FLASHINFER!r}")
    missing = every - ranks_logging(log, ATTEND_SELECTED[attend], tensor_parallel_size)
    if missing:
        faults.append(f"ranks {sorted(missing)} did not log {ATTEND_SELECTED[attend]!r}")
    other = next(a for a in ATTEND_SELECTED if a != attend)
    wrong = ranks_logging(log, ATTEND_SELECTED[other], tensor_parallel_size)
    if wrong:
        faults.append(f"ranks {sorted(wrong)} logged {ATTEND_SELECTED[other]!r}")
    return faults


def _directory() -> Path:
    return Path(os.environ[RUNS_ENV])


def _load(name: str) -> dict:
    run = load_run(_directory(), name)
    assert "error" not in run, f"{name}: {run['error']}"
    return run


def _log(name: str) -> str:
    path = _directory() / f"{name}.log"
    assert path.exists(), f"no log {path}"
    return path.read_text(errors="replace")


def _control() -> float:
    return mean_abs_diff(_load(CONTROL[0]), _load(CONTROL[1]))


def _runs() -> list[str]:
    if not os.environ.get(RUNS_ENV):
        return []
    return [n for n in run_names(_directory()) if not n.endswith("-bf16")]


MULTI_GPU_RUNS = [n for n in _runs() if tp_of(n) > 1]

pytestmark = pytest.mark.skipif(
    not os.environ.get(RUNS_ENV), reason=f"set {RUNS_ENV} to a directory of engine runs"
)


def test_the_references_and_a_multi_gpu_run_are_there():
    names = run_names(_directory())
    missing = [n for n in (*REFERENCE.values(), *CONTROL) if n not in names]
    assert not missing, f"missing runs {missing} in {_directory()}"
    assert MULTI_GPU_RUNS, f"no run with TP > 1 in {_directory()}"


def test_control_pair_moves_the_logprobs():
    control = _control()
    print(f"control ({CONTROL[0]} vs {CONTROL[1]}): mean |d logprob| {control:.3e}")
    assert control > MIN_CONTROL


@pytest.mark.parametrize("run", _runs())
def test_every_rank_logs_the_flashinfer_selection(run):
    assert _load(run)["tensor_parallel_size"] == tp_of(run), f"{run}: run at another TP"
    faults = selection_faults(_log(run), tp_of(run), attend_of(run))
    assert not faults, f"{run}: " + "; ".join(faults)


@pytest.mark.parametrize("run", _runs())
def test_no_flashinfer_program_built_after_ready(run):
    assert _load(run)["jit_built_after_ready"] == []


@pytest.mark.parametrize("run", MULTI_GPU_RUNS)
def test_prompt_logprobs_agree_with_tp1(run):
    reference = REFERENCE[RUN_NAME.match(run)["attend"]]
    control = _control()
    diff = mean_abs_diff(_load(run), _load(reference))
    print(f"{run} vs {reference}: {diff:.3e} = {diff / control:.3f} x control")
    assert diff <= RATIO_BOUND * control


@pytest.mark.parametrize("run", MULTI_GPU_RUNS)
def test_against_the_bf16_control_run_it_fails_the_bound(run):
    control = _control()
    diff = mean_abs_diff(_load(run), _load(CONTROL[1]))
    print(f"{run} vs {CONTROL[1]}: {diff:.3e} = {diff / control:.3f} x control")
    assert diff > RATIO_BOUND * control
