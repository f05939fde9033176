"""What a running vLLM server says about its own capacity and load.

Two figures, read without touching the engine: the KV cache's size in tokens, from the line
vLLM 0.34.0 logs once at start-up (``GPU KV cache size: 2,236,416 tokens, Maximum concurrency
for 132,096 tokens per request: 16.93x``; ``CPU`` on a CPU build), and how many requests the
scheduler runs at once, from the ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` gauges of its Prometheus ``/metrics``, sampled while a load
runs (:class:`RunningSampler`). A level whose requests queue (waiting above 0, running below
the level's concurrency) measured a server whose KV cache could not hold them all.
"""

from __future__ import annotations

import re
import statistics
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KV_CACHE_LINE = re.compile(
    r"(?P<pool>[A-Z]+(?: \+ host)?) KV cache size: (?P<tokens>[\d,]+) tokens,"
    r" Maximum concurrency for (?P<model_len>[\d,]+) tokens per request:"
    r" (?P<concurrency>[\d.]+)x"
)
RUNNING_GAUGE = "vllm:num_requests_running"
WAITING_GAUGE = "vllm:num_requests_waiting"
DEFAULT_SAMPLE_INTERVAL_S = 0.5


@dataclass(frozen=True)
class KvCacheSize:
    """The KV cache a server allocated: tokens it holds and requests of ``max_model_len``."""

    tokens: int
    max_model_len: int
    max_concurrency: float
    pool: str

    def as_record(self) -> dict[str, Any]:
        return {
            "kv_cache_tokens": self.tokens,
            "kv_cache_max_concurrency": self.max_concurrency,
            "kv_cache_pool": self.pool,
        }


def logged_kv_cache(log_path: Path) -> KvCacheSize | None:
    """The last KV cache size line of a server log, or None when it has none (yet)."""
    try:
        text = Path(log_path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found = None
    for found in KV_CACHE_LINE.finditer(text):  # noqa: B007 - the last one counts
        pass
    if found is None:
        return None
    return KvCacheSize(
        tokens=int(found["tokens"].replace(",", "")),
        max_model_len=int(found["model_len"].replace(",", "")),
        max_concurrency=float(found["concurrency"]),
        pool=found["pool"],
    )


def gauge_total(metrics_text: str, name: str) -> float | None:
    """The sum of a gauge over its label sets (one per engine) in Prometheus text, or None
    when the text has no sample of it."""
    total = None
    for line in metrics_text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name) :]
        if rest[:1] not in ("{", " "):
            continue  # another metric whose name starts with this one
        try:
            value = float(rest.rsplit(maxsplit=1)[-1])
        except ValueError:
            continue
        total = value if total is None else total + value
    return total


class RunningSampler:
    """Polls ``base_url/metrics`` every ``interval_s`` in a thread while the ``with`` block
    runs; :meth:`summary` gives the running requests' max and median over the samples in
    which the server had work (running or waiting above 0), and the most that waited.

    A server without ``/metrics`` (or an unreadable answer) gives no samples, and the
    summary is None: the sampler never fails the load it watches."""

    def __init__(self, base_url: str, interval_s: float = DEFAULT_SAMPLE_INTERVAL_S) -> None:
        self.url = f"{base_url.rstrip('/')}/metrics"
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self) -> None:
        try:
            with urllib.request.urlopen(self.url, timeout=2.0) as response:
                text = response.read().decode("utf-8", errors="replace")
        except (urllib.error.URLError, OSError, ValueError):
            return
        running = gauge_total(text, RUNNING_GAUGE)
        if running is not None:
            self.samples.append((running, gauge_total(text, WAITING_GAUGE) or 0.0))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RunningSampler:
        self._thread = threading.Thread(target=self._run, name="running-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def summary(self) -> dict[str, Any] | None:
        busy = [(running, waiting) for running, waiting in self.samples if running or waiting]
        if not busy:
            return None
        running = [sample[0] for sample in busy]
        return {
            "max": max(running),
            "median": statistics.median(running),
            "waiting_max": max(sample[1] for sample in busy),
            "samples": len(busy),
            "interval_s": self.interval_s,
        }
