"""A vLLM server's start on a fresh machine: with empty caches, with only the prebuilt FlashInfer
programs, and with the caches an earlier start left (issue 58).

    python -m benchmarks.cold_start run --name NAME --arm ARM --model DIR --config YAML
        --work DIR --out FILE.json [--prebuilt BASE] [--requests N]
    python -m benchmarks.cold_start report RUN.json [RUN.json ...] --out REPORT.md

``run`` starts ``vllm serve`` (``python3 -m vllm.entrypoints.openai.api_server``) once, in a
home directory of its own (``HOME``, so FlashInfer's, Triton's, vLLM's and TorchInductor's
caches all start where this arm says), waits for ``/health``, sends a few completions (short
and long prompts, one alone and several at once), stops it and writes what it measured:

- ``empty``: a fresh home; every compile cache empty, as on a new machine.
- ``prebuilt``: a fresh home, with ``FLASHINFER_WORKSPACE_BASE`` a copy (modification times
  kept, which ninja compares) of ``--prebuilt``, what `vllm-minimax warmup --prebuild` built.
- ``carried``: a copy of the ``empty`` arm's home after its start: every cache it filled.

What it records: the seconds from launch to ``/health``; the engine's own figures from its log
(model loading, memory profiling, the JIT warm-up and each MiniMax M3 warm-up, CUDA-graph
capture, the engine's init); FlashInfer's builds (``FLASHINFER_JIT_BUILD_LOG``: nvcc and
CuTe-DSL, each with its seconds) before and after ready; the prebuild check's log line; and
the Triton kernels vLLM's JIT monitor saw compile after ready. ``report`` tabulates runs.
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
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_minimax.testing.engine_runs import jit_events_in

ARMS = ("empty", "prebuilt", "carried")
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


def _copy_tree(source: Path, target: Path) -> None:
    """``source`` to ``target`` with modification times kept (ninja compares them)."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, symlinks=True, copy_function=shutil.copy2)


def prepare_home(work: Path, name: str, arm: str, prebuilt: Path | None) -> dict[str, str]:
    """The environment of one arm's start (see the module)."""
    home = work / f"home-{name}-{arm}"
    if arm == "carried":
        earlier = work / f"home-{name}-empty"
        if not earlier.is_dir():
            raise SystemExit(f"cold_start: no {earlier}: run the empty arm first on this machine")
        _copy_tree(earlier, home)
    else:
        if home.exists():
            shutil.rmtree(home)
        home.mkdir(parents=True)
    env = {
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(home / ".cache" / "torchinductor"),
        "FLASHINFER_JIT_BUILD_LOG": str(home / "flashinfer-builds.jsonl"),
        "HF_HUB_OFFLINE": "1",
    }
    for inherited in ("TRITON_CACHE_DIR", "VLLM_CACHE_ROOT", "FLASHINFER_WORKSPACE_BASE"):
        os.environ.pop(inherited, None)
    if arm == "prebuilt":
        if prebuilt is None or not prebuilt.is_dir():
            raise SystemExit("cold_start: the prebuilt arm needs --prebuilt BASE (a prebuild)")
        base = work / f"flashinfer-{name}-prebuilt"
        _copy_tree(prebuilt, base)
        env["FLASHINFER_WORKSPACE_BASE"] = str(base)
    if arm == "carried" and (home / "flashinfer-builds.jsonl").exists():
        (home / "flashinfer-builds.jsonl").unlink()  # the empty arm's builds
    return env


def _complete(base_url: str, model: str, prompt: str, max_tokens: int) -> str:
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return str(json.loads(response.read())["choices"][0]["text"])


def send_requests(base_url: str, model: str, concurrent: int) -> tuple[float, list[str]]:
    """A short prompt, 2k and 8k words alone, then ``concurrent`` short prompts at once;
    the seconds it took and the greedy replies (the arms run the same programs, so their
    replies should agree)."""
    began = time.monotonic()
    replies = [
        _complete(base_url, model, " ".join(["hello"] * words), tokens)
        for words, tokens in ((8, 16), (2000, 16), (8000, 8))
    ]
    concurrent_replies = [""] * concurrent

    def one(n: int) -> None:
        concurrent_replies[n] = _complete(base_url, model, f"count {n}:", 32)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(concurrent)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - began, replies + concurrent_replies


def parse_log(text: str) -> dict[str, Any]:
    """The engine's figures from its log (the last of each)."""
    found: dict[str, Any] = {}
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


def run(args: argparse.Namespace) -> int:
    from vllm_minimax.evals.server import VllmServer

    work = Path(args.work)
    env = prepare_home(work, args.name, args.arm, Path(args.prebuilt) if args.prebuilt else None)
    log_path = Path(args.out).with_suffix(".log")
    server = VllmServer(
        model=args.model,
        log_path=log_path,
        command=args.server_command,
        config=Path(args.config),
        env=env,
        startup_timeout=args.timeout,
        served_name="cold-start",
    )
    launched = time.time()
    result: dict[str, Any] = {"name": args.name, "arm": args.arm, "config": args.config}
    try:
        server.start()
        ready_at = time.time()
        result["ready_s"] = round(ready_at - launched, 1)
        seconds, replies = send_requests(server.base_url, "cold-start", args.requests)
        result["requests_s"] = round(seconds, 1)
        result["replies"] = replies
        server.check_alive()
    finally:
        server.stop()
    text = log_path.read_text(errors="replace")
    result.update(parse_log(text))
    result["flashinfer_builds"] = read_builds(Path(env["FLASHINFER_JIT_BUILD_LOG"]), ready_at)
    known = ("model_loading_s", "init_engine_s")
    if all(key in result for key in known):
        result["other_s"] = round(result["ready_s"] - sum(result[key] for key in known), 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


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
    rows = [json.loads(path.read_text()) for path in runs]
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
    text = "\n".join([*lines, "", *notes]) + "\n"
    out.write_text(text)
    return text


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
    one.add_argument("--requests", type=int, default=8, help="short requests sent at once")
    one.add_argument("--timeout", type=float, default=540.0, help="seconds to wait for ready")
    one.add_argument("--server-command", default=SERVER_COMMAND)
    table = commands.add_parser("report", help="the table of runs")
    table.add_argument("runs", nargs="+", type=Path)
    table.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args)
    print(report(args.runs, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
