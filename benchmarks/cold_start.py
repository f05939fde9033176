"""A vLLM server's start in three states (issues 58 and 64): fresh_empty (arm ``empty``),
fresh_prebuilt (``prebuilt``) and warm (``carried``).

    python -m benchmarks.cold_start run --name NAME --arm ARM --model DIR --config YAML
        --work DIR --out FILE.json [--prebuilt BASE] [--requests N] [--server-arg=ARG ...]
    python -m benchmarks.cold_start summary RUN.json [RUN.json ...] --gpu NAME --commit SHA
        --out-dir DIR
    python -m benchmarks.cold_start from-ab AB.json --arm ARM --name NAME --out RUN.json
    python -m benchmarks.cold_start report RUN.json [RUN.json ...] --out REPORT.md

``run`` starts ``vllm serve`` (``python3 -m vllm.entrypoints.openai.api_server``) once, in a
home directory of the arm's (``HOME``, and every cache variable pointed under it, so each
compile cache starts as the arm says), waits for ``/health``, sends a few completions (short
and long prompts, one asking for logprobs, several at once), stops it and writes what it
measured:

- ``empty``: a fresh home; every compile cache empty, as on a new machine.
- ``prebuilt``: a fresh home, with ``FLASHINFER_WORKSPACE_BASE`` the directory ``--prebuilt``
  where `vllm-minimax warmup --prebuild` built, restored as the prebuild left it, the
  model-info file and CuTe-DSL router GEMMs the prebuild wrote (``BASE/vllm/modelinfos``,
  ``BASE/vllm/cutedsl``) in the home's vLLM cache, and Humming's kernels it built
  (``BASE/humming``) in the home's ``~/.humming/cache``.
- ``carried``: the ``empty`` arm's home after its start, every cache it filled, in place.

What it records: the seconds from launch to ``/health``; the phases of the start from vLLM's
log times and the seconds of each kernel of vLLM's JIT warm-up; the engine's own figures
(model loading, each warm-up, CUDA-graph capture, the engine's init); FlashInfer's builds
(``FLASHINFER_JIT_BUILD_LOG``) before and after ready; each compile cache's files before,
written, and written after ready (:mod:`vllm_minimax.compile_caches`); the prebuild check's
log line; and what vLLM's JIT monitor saw after ready. ``summary`` writes summary.json and a
report.md that opens with issue 64's targets; ``from-ab`` makes a fresh_empty record of eval
ab's first start; ``report`` tabulates the engine's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from vllm_minimax import compile_caches
from vllm_minimax.testing.engine_runs import jit_events_in

ARMS = ("empty", "prebuilt", "carried")
# The states issue 64 names, by arm: a fresh machine with every cache empty, a fresh machine
# with what a CPU prebuilt (the image's caches), a machine that started the server once.
STATE_OF_ARM = {"empty": "fresh_empty", "prebuilt": "fresh_prebuilt", "carried": "warm"}
SERVER_COMMAND = "python3 -m vllm.entrypoints.openai.api_server"
# Engine log lines: (key, pattern whose last group is the seconds).
LOG_SECONDS = (
    ("model_loading_s", r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds"),
    ("weights_s", r"Loading weights took ([\d.]+) seconds"),
    ("memory_profiling_s", r"Memory profiling takes ([\d.]+) seconds"),
    ("jit_warmup_s", r"JIT kernel warmup finished in ([\d.]+)s"),
    ("indexer_warmup_s", r"MiniMax M3 FlashInfer indexer warm-up: \d+ programs ready in ([\d.]+)s"),
    (
        "sparse_attention_warmup_s",
        r"MiniMax M3 sparse attention warm-up: \d+ FlashInfer launches ready in ([\d.]+)s",
    ),
    (
        "sparse_decode_warmup_s",
        r"MiniMax M3 sparse decode attention warm-up: .* ready in ([\d.]+)s",
    ),
    ("moe_warmup_s", r"Triton fused MoE warm-up: .* ready in ([\d.]+)s"),
    ("graph_capture_s", r"Graph capturing finished in ([\d.]+) secs"),
    ("init_engine_s", r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
)
INDEXER_ARTIFACTS = r"indexer warm-up: \d+ programs ready in [\d.]+s \((\d+) JIT cache artifacts"
PREBUILT_LINE = r"MiniMax M3: (\d+ prebuilt FlashInfer programs .*|the prebuilt FlashInfer .*)"
# vLLM's log lines carry the local time to the second: "(EngineCore pid=7) INFO 12-06 05:31:34
# [core.py:153] ...". The phases of a start are the gaps between these lines (first of each).
_STAMP = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d\d-\d\d \d\d:\d\d:\d\d) \[")
PHASE_MARKS = (
    ("engine_config", "Initializing a V1 LLM engine"),
    ("model_loaded", "Model loading took "),
    ("memory_profiled", "Available KV cache memory"),
    ("jit_warmup_started", "JIT kernel warmup starting"),
    ("jit_warmup_finished", "JIT kernel warmup finished in "),
    ("graphs_captured", "Graph capturing finished in "),
    ("engine_ready", "init engine (profile, create kv cache, warmup model) took "),
)
# vLLM's JIT warm-up progress bar (tqdm, one update per kernel, the kernel just compiled in
# its postfix): "JIT kernel warmup (70 compile keys):  60%|...| 3/5 [00:32<00:20, 10.45s/kernel,
# LLFp32WGemm (64 keys)]". tqdm skips a redraw within 0.1 s of the last, so two kernels can
# share one step.
_JIT_BAR = re.compile(
    r"JIT kernel warmup \((\d+) compile keys\):[^|\r\n]*\|[^|\r\n]*\|\s*(\d+)/(\d+)"
    r" \[(?:(\d+):)?(\d+):(\d+)<[^\]\r\n]*?, ([\w.]+) \((\d+) keys?\)\]"
)


def _stamps(text: str, year: int) -> list[tuple[datetime, str]]:
    found = []
    for line in re.split(r"[\r\n]", text):
        match = _STAMP.search(line)
        if match:
            found.append((datetime.strptime(f"{year}-{match[1]}", "%Y-%m-%d %H:%M:%S"), line))
    return found


def phase_seconds(text: str, launched: float | None = None) -> dict[str, Any]:
    """A start's phases from the times of vLLM's log lines (to the second, so each phase is
    +-1 s): ``imports_s`` (launch to vLLM's first line: Python and vLLM importing),
    ``before_engine_s`` (launch to the engine's config: the CLI, the config's checks),
    ``engine_config_to_load_s`` (process start-up, distributed init, the model's build and
    weight loading, to "Model loading took"), ``profile_run_s`` (to the KV cache's size: the
    profile run, every program its first forward builds), ``kv_to_jit_s``,
    ``jit_warmup_wall_s`` (the JIT warm-up), ``jit_to_graphs_s`` (FlashInfer's autotune and
    CUDA-graph capture) and ``graphs_to_engine_s``. ``launched`` is the launch's
    ``time.time()``; without it the first two are left out."""
    year = datetime.fromtimestamp(launched).year if launched else datetime.now().year
    stamps = _stamps(text, year)
    at: dict[str, datetime] = {}
    for mark, words in PHASE_MARKS:
        for stamp, line in stamps:
            if words in line:
                at[mark] = stamp
                break
    found: dict[str, Any] = {}
    if launched is not None and stamps:
        start = datetime.fromtimestamp(launched).replace(microsecond=0)
        found["imports_s"] = (stamps[0][0] - start).total_seconds()
        if "engine_config" in at:
            found["before_engine_s"] = (at["engine_config"] - start).total_seconds()
    spans = (
        ("engine_config_to_load_s", "engine_config", "model_loaded"),
        ("profile_run_s", "model_loaded", "memory_profiled"),
        ("kv_to_jit_s", "memory_profiled", "jit_warmup_started"),
        ("jit_warmup_wall_s", "jit_warmup_started", "jit_warmup_finished"),
        ("jit_to_graphs_s", "jit_warmup_finished", "graphs_captured"),
        ("graphs_to_engine_s", "graphs_captured", "engine_ready"),
    )
    for key, first, last in spans:
        if first in at and last in at:
            found[key] = (at[last] - at[first]).total_seconds()
    return found


def jit_warmup_kernels(text: str) -> list[dict[str, Any]]:
    """The seconds each kernel of vLLM's JIT warm-up took, from its progress bar, in order:
    ``kernel``, ``keys``, ``s``, and ``with`` (the kernels whose steps tqdm drew no bar for,
    folded into this one's seconds). The last bar of the log's last warm-up counts."""
    steps: dict[int, tuple[float, str, int]] = {}
    total = None
    for match in _JIT_BAR.finditer(text):
        done, of = int(match[2]), int(match[3])
        if total is not None and (of != total or done < max(steps, default=0)):
            steps = {}  # another warm-up (another engine) began
        total = of
        elapsed = int(match[4] or 0) * 3600 + int(match[5]) * 60 + int(match[6])
        steps.setdefault(done, (float(elapsed), match[7], int(match[8])))
    kernels = []
    previous_done, previous_s = 0, 0.0
    for done in sorted(steps):
        elapsed, name, keys = steps[done]
        kernels.append(
            {
                "kernel": name,
                "keys": keys,
                "s": elapsed - previous_s,
                "with": done - previous_done - 1,
            }
        )
        previous_done, previous_s = done, elapsed
    return kernels


# Variables that would point a cache away from the arm's home; the server never inherits them.
INHERITED_CACHE_VARIABLES = (
    "TRITON_CACHE_DIR",
    "TRITON_HOME",
    "VLLM_CACHE_ROOT",
    "FLASHINFER_WORKSPACE_BASE",
    "HUMMING_CACHE_DIR",
    "HUMMING_TMP_DIR",
)


def _copy_tree(source: Path, target: Path) -> None:
    """``source`` to ``target`` with modification times kept (ninja compares them)."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, symlinks=True, copy_function=shutil.copy2)


# What a prebuild keeps beside FlashInfer's programs (scripts/gpu-cold-start's prebuild runs
# with VLLM_CACHE_ROOT=BASE/vllm and HUMMING_CACHE_DIR=BASE/humming), and where the prebuilt
# arm's server reads it in its home: vLLM's model-info file and the CuTe-DSL executors under
# vLLM's default VLLM_CACHE_ROOT (XDG_CACHE_HOME/vllm), Humming's GEMM kernels under its
# default ~/.humming/cache. None of their keys holds the cache's path, so a copy is found.
PREBUILT_IN_HOME = (
    ("vllm/modelinfos", ".cache/vllm/modelinfos"),
    ("vllm/cutedsl", ".cache/vllm/cutedsl"),
    ("humming", ".humming/cache"),
)


def prepare_home(work: Path, name: str, arm: str, prebuilt: Path | None) -> dict[str, str]:
    """The environment of one arm's start (see the module).

    FlashInfer's ninja files name every object by its absolute path, and ninja rebuilds an
    output its log has no command for: a FlashInfer cache copied to another directory is
    rebuilt whole. So no arm serves a copy. The carried arm starts in the empty arm's own
    home, as a second start on the same machine does. The prebuilt arm serves the prebuild
    where `warmup --prebuild` built it; its first start keeps a copy of it beside
    (``BASE.pristine``, times kept) and every later one restores it to the same path first."""
    home = work / f"home-{name}-{arm}"
    build_log = "flashinfer-builds.jsonl"
    if arm == "carried":
        home = work / f"home-{name}-empty"
        if not home.is_dir():
            raise SystemExit(f"cold_start: no {home}: run the empty arm first on this machine")
        build_log = "flashinfer-builds-carried.jsonl"
        (home / build_log).unlink(missing_ok=True)  # an earlier carried start's
    else:
        if home.exists():
            shutil.rmtree(home)
        home.mkdir(parents=True)
    env = {
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(home / ".cache" / "torchinductor"),
        # The CuTe DSL's file cache defaults to the temporary directory, shared by the arms.
        "CUTE_DSL_CACHE_DIR": str(home / ".cache" / "cutlass_python_cache"),
        "FLASHINFER_JIT_BUILD_LOG": str(home / build_log),
        "HF_HUB_OFFLINE": "1",
    }
    for inherited in INHERITED_CACHE_VARIABLES:
        os.environ.pop(inherited, None)
    if arm == "prebuilt":
        if prebuilt is None or not prebuilt.is_dir():
            raise SystemExit("cold_start: the prebuilt arm needs --prebuilt BASE (a prebuild)")
        prebuilt = prebuilt.absolute()
        pristine = prebuilt.with_name(prebuilt.name + ".pristine")
        if pristine.is_dir():
            _copy_tree(pristine, prebuilt)
        else:
            _copy_tree(prebuilt, pristine)
        env["FLASHINFER_WORKSPACE_BASE"] = str(prebuilt)
        for built, served in PREBUILT_IN_HOME:
            if (prebuilt / built).is_dir():
                _copy_tree(prebuilt / built, home / served)
    return env


def _complete(
    base_url: str, model: str, prompt: str, max_tokens: int, extra: dict[str, Any] | None = None
) -> str:
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        | (extra or {})
    ).encode()
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return str(json.loads(response.read())["choices"][0]["text"])


# What an lm-eval loglikelihood task asks: the sampled tokens' and the prompt's logprobs
# (stock vLLM's sampler compiles its logprobs kernel at the first such request; the series
# warms it before ready, patch 0009).
LOGPROBS = {"logprobs": 2, "prompt_logprobs": 1}


def send_requests(base_url: str, model: str, concurrent: int) -> tuple[float, list[str]]:
    """A short prompt, 2k and 8k words alone, a short prompt asking for logprobs, then
    ``concurrent`` short prompts at once; the seconds it took and the greedy replies (the
    arms run the same programs, so their replies should agree)."""
    began = time.monotonic()
    replies = [
        _complete(base_url, model, " ".join(["hello"] * words), tokens)
        for words, tokens in ((8, 16), (2000, 16), (8000, 8))
    ]
    replies.append(_complete(base_url, model, "the logprobs of this", 4, LOGPROBS))
    concurrent_replies = [""] * concurrent

    def one(n: int) -> None:
        concurrent_replies[n] = _complete(base_url, model, f"count {n}:", 32)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(concurrent)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - began, replies + concurrent_replies


def parse_log(text: str, launched: float | None = None) -> dict[str, Any]:
    """The engine's figures from its log (the last of each), its phases
    (:func:`phase_seconds`) and its JIT warm-up's kernels (:func:`jit_warmup_kernels`)."""
    found: dict[str, Any] = dict(phase_seconds(text, launched))
    found["jit_warmup_kernels"] = jit_warmup_kernels(text)
    for key, pattern in LOG_SECONDS:
        matches = re.findall(pattern, text)
        if matches:
            found[key] = float(matches[-1])
    artifacts = re.findall(INDEXER_ARTIFACTS, text)
    if artifacts:
        found["indexer_artifacts_built"] = int(artifacts[-1])
    prebuilt = re.findall(PREBUILT_LINE, text)
    found["prebuilt_check"] = prebuilt[-1] if prebuilt else None
    found["flashinfer_build_lines"] = len(re.findall(r"Building JIT module ", text))
    found["cute_dsl_compile_lines"] = len(re.findall(r"Compiling CuTe-DSL kernel ", text))
    # Patch 0010's cache of vLLM's CuTe-DSL router GEMMs: each line is logged once a process.
    found["vllm_cutedsl_loaded"] = "Loading CuTe-DSL kernels from " in text
    found["vllm_cutedsl_saved"] = "Saving CuTe-DSL kernels to " in text
    after_ready = jit_events_in(text)
    found["triton_after_ready"] = sorted(
        {e["kernel"] for e in after_ready if e["event"] == "Triton kernel JIT compilation"}
    )
    found["cute_after_ready"] = sorted(
        {e["kernel"] for e in after_ready if e["event"].startswith("CuTeDSL ")}
    )
    return found


def read_builds(path: Path, ready_at: float) -> dict[str, Any]:
    """FlashInfer's build log (JSONL, one line per build): what was built before and after
    ``ready_at`` (a time.time()), by toolchain, with the seconds spent. A ninja run that found
    nothing to do is logged too, with its near-zero time: only builds over 0.5 s count."""
    before: list[dict[str, Any]] = []
    after: list[dict[str, Any]] = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if float(entry.get("seconds", 0)) < 0.5:
                continue
            (after if float(entry.get("time", 0)) > ready_at else before).append(entry)

    def summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
        by_toolchain: dict[str, dict[str, float]] = {}
        for entry in entries:
            slot = by_toolchain.setdefault(str(entry.get("toolchain")), {"n": 0, "s": 0.0})
            slot["n"] += 1
            slot["s"] += float(entry.get("seconds", 0))
        return {"count": len(entries), "by_toolchain": by_toolchain}

    return {
        "before_ready": summary(before),
        "after_ready": summary(after),
        "after_ready_names": [str(e.get("name")) for e in after],
    }


def cache_counts(
    before: dict[str, dict[str, Any]],
    after: dict[str, dict[str, Any]],
    after_ready: dict[str, dict[str, Any]] | None,
) -> dict[str, dict[str, Any]]:
    """Per cache: the files it held before the start and after it, and how many the start
    wrote (``built``) and wrote after ready (``built_after_ready``; None when it never
    became ready)."""
    counts = {}
    for name, entry in after.items():
        counts[name] = {
            "dir": entry["dir"],
            "files_before": before[name]["files"],
            "files": entry["files"],
            "bytes": entry["bytes"],
            "built": entry["since_files"],
            "built_after_ready": None if after_ready is None else after_ready[name]["since_files"],
        }
    return counts


def run(args: argparse.Namespace) -> int:
    from vllm_minimax.evals.server import ServerError, VllmServer

    work = Path(args.work)
    env = prepare_home(work, args.name, args.arm, Path(args.prebuilt) if args.prebuilt else None)
    dirs = compile_caches.cache_dirs({**os.environ, **env})
    before = compile_caches.inventory(dirs)
    log_path = Path(args.out).with_suffix(".log")
    server = VllmServer(
        model=args.model,
        log_path=log_path,
        command=args.server_command,
        config=Path(args.config),
        extra_args=args.server_arg,
        env=env,
        startup_timeout=args.timeout,
        served_name="cold-start",
    )
    result: dict[str, Any] = {
        "name": args.name,
        "arm": args.arm,
        "state": STATE_OF_ARM[args.arm],
        "config": args.config,
        "server_args": list(args.server_arg),
    }
    if args.commit:
        result["commit"] = args.commit
    launched = time.time()
    ready_at: float | None = None
    try:
        server.start()
        ready_at = time.time()
        result["ready_s"] = round(ready_at - launched, 1)
        try:
            seconds, replies = send_requests(server.base_url, "cold-start", args.requests)
            result["requests_s"] = round(seconds, 1)
            result["replies"] = replies
        except (OSError, KeyError, ValueError) as error:  # URLError and HTTPError are OSErrors
            result["requests_error"] = f"{type(error).__name__}: {error}"
        server.check_alive()
    except ServerError as error:
        result["server_error"] = str(error)
    finally:
        server.stop()
    text = log_path.read_text(errors="replace")
    result.update(parse_log(text, launched))
    builds_since = ready_at if ready_at is not None else float("inf")
    result["flashinfer_builds"] = read_builds(Path(env["FLASHINFER_JIT_BUILD_LOG"]), builds_since)
    result["caches"] = cache_counts(
        before,
        compile_caches.inventory(dirs, since=launched),
        None if ready_at is None else compile_caches.inventory(dirs, since=ready_at),
    )
    known = ("model_loading_s", "init_engine_s")
    if "ready_s" in result and all(key in result for key in known):
        result["other_s"] = round(result["ready_s"] - sum(result[key] for key in known), 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    failed = "server_error" in result or "requests_error" in result
    return 1 if failed else 0


REPORT_COLUMNS = (
    ("ready s", "ready_s"),
    ("model loading s", "model_loading_s"),
    ("memory profiling s", "memory_profiling_s"),
    ("JIT warm-up s", "jit_warmup_s"),
    ("indexer warm-up s", "indexer_warmup_s"),
    ("sparse attention warm-up s", "sparse_attention_warmup_s"),
    ("sparse decode (Triton) warm-up s", "sparse_decode_warmup_s"),
    ("fused MoE (Triton) warm-up s", "moe_warmup_s"),
    ("graph capture s", "graph_capture_s"),
    ("engine init s", "init_engine_s"),
    ("rest s", "other_s"),
)


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def report(runs: Sequence[Path], out: Path) -> str:
    text = runs_table([json.loads(path.read_text()) for path in runs])
    out.write_text(text)
    return text


def runs_table(rows: Sequence[dict[str, Any]]) -> str:
    """The engine's own figures of each start, FlashInfer's builds and the compiles after
    ready, and whether each arm's greedy replies match the empty arm's."""
    lines = [
        "| run | arm | " + " | ".join(title for title, _ in REPORT_COLUMNS) + " |"
        " FlashInfer builds before / after ready | Triton / CuTe-DSL compiles after ready |",
        "|---|---|" + "---|" * (len(REPORT_COLUMNS) + 2),
    ]
    for row in rows:
        builds = row["flashinfer_builds"]
        before = builds["before_ready"]
        per = ", ".join(
            f"{n} {v['n']} in {v['s']:.0f} s" for n, v in before["by_toolchain"].items()
        )
        lines.append(
            f"| {row['name']} | {row['arm']} | "
            + " | ".join(_cell(row.get(key)) for _, key in REPORT_COLUMNS)
            + f" | {before['count']}{f' ({per})' if per else ''} / {builds['after_ready']['count']}"
            + f" | {len(row.get('triton_after_ready', []))}"
            + f" / {len(row.get('cute_after_ready', []))} |"
        )
    notes = [
        f"- {row['name']} {row['arm']}: {row['prebuilt_check']}"
        for row in rows
        if row.get("prebuilt_check")
    ]
    empty = {row["name"]: row.get("replies") for row in rows if row["arm"] == "empty"}
    for row in rows:
        if row["arm"] != "empty" and empty.get(row["name"]) is not None:
            same = row.get("replies") == empty[row["name"]]
            notes.append(
                f"- {row['name']} {row['arm']}: greedy replies"
                f" {'the same as' if same else 'DIFFER from'} the empty arm's"
            )
    return "\n".join([*lines, "", *notes]) + "\n"


# Issue 64's targets: (what, model label, state, the most seconds to ready).
SLICE = "rank-mxfp8-ep"
READY_TARGETS = (
    ("MXFP8 EP slice ready, fresh machine with the image's caches", SLICE, "fresh_prebuilt", 120),
    ("MXFP8 EP slice ready, machine that started it once", SLICE, "warm", 60),
)
# The phases a start's ready time is made of, in order (phase_seconds); the rest is the time
# from the engine's end of start-up to /health.
PHASES = (
    ("before the engine", "before_engine_s"),
    ("to weights loaded", "engine_config_to_load_s"),
    ("profile run", "profile_run_s"),
    ("to JIT warm-up", "kv_to_jit_s"),
    ("JIT warm-up", "jit_warmup_wall_s"),
    ("autotune and CUDA graphs", "jit_to_graphs_s"),
    ("to engine ready", "graphs_to_engine_s"),
)
# JIT warm-up kernels a rank slice builds that MiniMax M3 as deployed does not: the slice's
# gate has the rank's 16 experts, not M3's 128, so vLLM's GateLinear compiles LLFp32WGemm
# (64 keys) where M3's 6144 x 128 gate runs a precompiled kernel (benchmarks/router_gemm_tiers).
SLICE_ONLY_KERNELS = ("LLFp32WGemm",)
# Caches whose files a start may write after ready only by building a program then.
PROGRAM_CACHES = (
    "flashinfer",
    "humming",
    "triton",
    "torchinductor",
    "vllm_torch_compile",
    "vllm_cutedsl",
)


def built_after_ready(row: dict[str, Any]) -> list[str]:
    """What one start built after it was ready, as found by each witness: vLLM's JIT monitor
    (its warnings, or its error in error mode), FlashInfer's build log, and the files each
    program cache gained after ready. Empty when nothing was."""
    found = [f"JIT monitor: Triton {name}" for name in row.get("triton_after_ready", [])]
    found += [f"JIT monitor: CuTe-DSL {name}" for name in row.get("cute_after_ready", [])]
    found += [f"FlashInfer: {name}" for name in row["flashinfer_builds"]["after_ready_names"]]
    for name in PROGRAM_CACHES:
        count = row.get("caches", {}).get(name, {}).get("built_after_ready")
        if count:
            found.append(f"{name} cache: {count} files written after ready")
    return found


def held_by(row: dict[str, Any]) -> str:
    """The phase that takes most of a start, and inside it what was built: for the JIT
    warm-up, its slowest kernel; otherwise the files the start wrote to each program cache."""
    phases = [(row[key], title, key) for title, key in PHASES if row.get(key) is not None]
    if not phases:
        return "no phase in the log"
    seconds, title, key = max(phases)
    words = f"{title} {seconds:.0f} s"
    kernels = row.get("jit_warmup_kernels") or []
    if key == "jit_warmup_wall_s" and kernels:
        slowest = max(kernels, key=lambda kernel: kernel["s"])
        others = f" with {slowest['with']} more" if slowest["with"] else ""
        words += f" ({slowest['kernel']}, {slowest['keys']} keys{others}: {slowest['s']:.0f} s)"
    else:
        built = [
            f"{name} {entry['built']} files"
            for name, entry in row.get("caches", {}).items()
            if name in PROGRAM_CACHES and entry.get("built")
        ]
        if built:
            words += f" (this start wrote: {', '.join(built)})"
    return words


def summarize(rows: Sequence[dict[str, Any]], gpu: str, commit: str) -> dict[str, Any]:
    """summary.json: per model label and state the commit it ran at (the run's own, else
    ``commit``), the ready time, phases, JIT warm-up kernels and cache builds; and each
    target, met or missed (None: not measured)."""
    runs: dict[str, dict[str, Any]] = {}
    for row in rows:
        state = row.get("state") or STATE_OF_ARM[row["arm"]]
        slice_only = sum(
            kernel["s"]
            for kernel in row.get("jit_warmup_kernels", [])
            if row["name"].startswith("rank") and kernel["kernel"] in SLICE_ONLY_KERNELS
        )
        ready = row.get("ready_s")
        runs.setdefault(row["name"], {})[state] = {
            "commit": row.get("commit", commit),
            "ready_s": ready,
            # What the start would take without the slice's own router kernel (an estimate
            # for M3 as deployed, from the warm-up's progress bar).
            "slice_only_s": slice_only,
            "ready_without_slice_only_s": None if ready is None else round(ready - slice_only, 1),
            "phases_s": {key: row[key] for _, key in PHASES if key in row},
            "jit_warmup_kernels": row.get("jit_warmup_kernels", []),
            "built": {name: entry["built"] for name, entry in row.get("caches", {}).items()},
            "built_after_ready": built_after_ready(row),
            # Patch 0010's log lines: a prebuilt start of current entries loads, saves nothing.
            "vllm_cutedsl": {
                "loaded": row.get("vllm_cutedsl_loaded"),
                "saved": row.get("vllm_cutedsl_saved"),
            },
            "errors": [row[key] for key in ("server_error", "requests_error") if key in row],
            "held_by": held_by(row),
        }
    targets = []
    for what, name, state, limit in READY_TARGETS:
        measured = runs.get(name, {}).get(state)
        ready = None if measured is None else measured["ready_s"]
        targets.append(
            {
                "target": f"{what} <= {limit} s",
                "model": name,
                "state": state,
                "limit_s": limit,
                "ready_s": ready,
                "met": None if measured is None else ready is not None and ready <= limit,
                "held_by": None if measured is None else measured["held_by"],
                "ready_without_slice_only_s": (
                    None if measured is None else measured["ready_without_slice_only_s"]
                ),
            }
        )
    slice_runs = runs.get(SLICE, {})
    after = {state: run["built_after_ready"] for state, run in slice_runs.items()}
    errors = {state: run["errors"] for state, run in slice_runs.items() if run["errors"]}
    targets.append(
        {
            "target": "MXFP8 EP slice: no program built after ready (logprobs requests included)",
            "model": SLICE,
            "state": "every state",
            "met": None if not slice_runs else not any(after.values()) and not errors,
            "built_after_ready": after,
            "errors": errors,
        }
    )
    return {"gpu": gpu, "commit": commit, "targets": targets, "runs": runs}


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "MISSED", None: "not measured"}[met]


def render_summary(summary: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """report.md: the targets first (met or missed, and for a miss what holds it), then each
    start's phases, then the engine's figures (:func:`runs_table`)."""
    lines = [
        f"# Cold start on {summary['gpu']} (commit {summary['commit']})",
        "",
        "| target | state | measured | verdict |",
        "|---|---|---|---|",
    ]
    misses = []
    for target in summary["targets"]:
        if "limit_s" in target:
            measured = _cell(target["ready_s"]) + " s" if target["ready_s"] is not None else "-"
            without = target["ready_without_slice_only_s"]
            if target["ready_s"] is not None and without != target["ready_s"]:
                measured += f" ({without} s without the slice's LLFp32WGemm)"
        else:
            found = target["built_after_ready"].values()
            built = sorted({what for one in found for what in one})
            measured = "; ".join(built) or ("nothing" if target["met"] is not None else "-")
        lines.append(
            f"| {target['target']} | {target['state']} | {measured} | {_verdict(target['met'])} |"
        )
        if target["met"] is False and target.get("held_by"):
            misses.append(f"- {target['target']}: held by {target['held_by']}")
        if target.get("errors"):
            for state, errors in target["errors"].items():
                misses.append(f"- {state}: {'; '.join(errors)}")
    lines += ["", *misses, ""] if misses else [""]
    lines += [
        "| model | state | commit | ready s | "
        + " | ".join(title for title, _ in PHASES)
        + " | JIT warm-up kernels | built (files) |",
        "|---|---|---|---|" + "---|" * (len(PHASES) + 2),
    ]
    for name, states in summary["runs"].items():
        for state, run in states.items():
            kernels = ", ".join(
                f"{k['kernel']} {k['s']:.0f} s" for k in run["jit_warmup_kernels"] if k["s"] >= 1
            )
            built = ", ".join(f"{cache} {n}" for cache, n in run["built"].items() if n)
            lines.append(
                f"| {name} | {state} | {run['commit']} | {_cell(run['ready_s'])} | "
                + " | ".join(_cell(run["phases_s"].get(key)) for _, key in PHASES)
                + f" | {kernels or '-'} | {built or '-'} |"
            )
    lines += ["", "Phases from vLLM's log times, to the second.", "", runs_table(rows)]
    return "\n".join(lines)


def write_summary(
    runs: Sequence[Path],
    gpu: str,
    commit: str,
    out_dir: Path,
    commit_of: Mapping[Path, str] | None = None,
) -> dict[str, Any]:
    """summary.json and report.md of ``runs``; ``commit_of`` names the commit of a run whose
    record has none (one written before ``run --commit`` existed)."""
    rows = []
    for path in runs:
        row = json.loads(path.read_text())
        if commit_of and path in commit_of:
            row.setdefault("commit", commit_of[path])
        rows.append(row)
    summary = summarize(rows, gpu, commit)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out_dir / "report.md").write_text(render_summary(summary, rows))
    return summary


def run_from_ab(ab_path: Path, arm: str, name: str, log: Path | None = None) -> dict[str, Any]:
    """A run record from ``vllm-minimax eval ab``'s ab.json: the first round of ``arm``, its
    ``startup_seconds`` as the ready time and its server log (``<arm>/round-1/server.log``
    beside ab.json unless ``log`` names one) for the phases. Only the first start on a fresh
    machine is a fresh_empty start (a later arm finds the caches the earlier ones filled), so
    an arm that was not first in the first round is refused. The log has no launch time, so
    the phases before the engine are left out, and eval ab keeps no inventory of the caches
    nor FlashInfer's build log: only vLLM's JIT monitor witnesses what was built after ready."""
    ab = json.loads(ab_path.read_text())
    arms = {entry["name"]: entry for entry in ab.get("arms", [])}
    if arm not in arms:
        raise SystemExit(f"cold_start: {ab_path} has no arm {arm!r} (arms: {', '.join(arms)})")
    rounds = arms[arm].get("rounds") or []
    if not rounds or rounds[0].get("startup_seconds") is None:
        raise SystemExit(f"cold_start: arm {arm} of {ab_path} has no measured first start")
    first_round = (ab.get("round_order") or [[arm]])[0]
    if first_round[0] != arm:
        raise SystemExit(
            f"cold_start: arm {arm} started after {first_round[0]} in {ab_path}'s first round,"
            " on caches that arm filled: not a start on empty caches"
        )
    log = log or ab_path.parent / arm / "round-1" / "server.log"
    row: dict[str, Any] = {
        "name": name,
        "arm": "empty",
        "state": "fresh_empty",
        "source": f"eval ab {ab_path}, arm {arm}, round 1",
        "config": ab.get("config"),
        "ready_s": round(float(rounds[0]["startup_seconds"]), 1),
    }
    if log.is_file():
        row.update(parse_log(log.read_text(errors="replace")))
    else:
        row["source"] += " (no server log: no phases)"
    row["flashinfer_builds"] = {
        "before_ready": {"count": 0, "by_toolchain": {}},
        "after_ready": {"count": 0, "by_toolchain": {}},
        "after_ready_names": [],
        "recorded": False,
    }
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cold_start")
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="one start of one arm")
    one.add_argument("--name", required=True, help="the model's label (tiny, rank)")
    one.add_argument("--arm", required=True, choices=ARMS)
    one.add_argument("--model", required=True)
    one.add_argument("--config", required=True)
    one.add_argument("--work", required=True, help="where the arms' homes live")
    one.add_argument("--out", required=True, help="the run's JSON (its log beside it)")
    one.add_argument("--prebuilt", help="FLASHINFER_WORKSPACE_BASE of a prebuild")
    one.add_argument("--commit", help="the checkout's commit, kept in the run's record")
    one.add_argument("--requests", type=int, default=8, help="short requests sent at once")
    one.add_argument("--timeout", type=float, default=540.0, help="seconds to wait for ready")
    one.add_argument("--server-command", default=SERVER_COMMAND)
    one.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="an argument for the server after --config (repeat it; e.g. --jit-monitor-mode)",
    )
    table = commands.add_parser("report", help="the table of runs")
    table.add_argument("runs", nargs="+", type=Path)
    table.add_argument("--out", required=True, type=Path)
    summary = commands.add_parser("summary", help="summary.json and report.md of runs")
    summary.add_argument("runs", nargs="+", type=Path)
    summary.add_argument("--gpu", required=True, help="the GPU's name")
    summary.add_argument("--commit", required=True, help="the checkout's commit")
    summary.add_argument(
        "--commit-of",
        action="append",
        default=[],
        metavar="RUN=SHA",
        help="the commit of a run whose record names none (repeat it)",
    )
    summary.add_argument("--out-dir", required=True, type=Path)
    from_ab = commands.add_parser("from-ab", help="a fresh_empty run record from eval ab")
    from_ab.add_argument("ab_json", type=Path)
    from_ab.add_argument("--arm", required=True, help="the arm whose first start it was")
    from_ab.add_argument("--name", required=True, help="the model's label (rank-mxfp8-ep)")
    from_ab.add_argument("--log", type=Path, help="its server log (default: beside ab.json)")
    from_ab.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args)
    if args.command == "from-ab":
        row = run_from_ab(args.ab_json, args.arm, args.name, args.log)
        args.out.write_text(json.dumps(row, indent=1) + "\n")
        return 0
    if args.command == "summary":
        commit_of = {}
        for item in args.commit_of:
            path, sep, sha = item.rpartition("=")
            if not sep or not path or not sha:
                parser.error(f"--commit-of takes RUN=SHA, got {item!r}")
            commit_of[Path(path)] = sha
        write_summary(args.runs, args.gpu, args.commit, args.out_dir, commit_of)
        print((args.out_dir / "report.md").read_text())
        return 0
    print(report(args.runs, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
