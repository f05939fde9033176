"""The kernel benchmarks' timing harness: CUDA-graph capture, warm-up, GPU time per call,
rounds with the arms' order rotated, medians with their spread, and poisoned outputs.

    graph = capture_graph(call)                     # warm-up on a side stream, one capture
    poison(out)                                     # NaN (or an int sentinel) in every element
    samples = alternated_rounds(
        {arm: partial(per_call_ms, graphs[arm].replay, iters) for arm in arms}, rounds
    )
    Spread.of(samples[arm]).text()                  # "0.2931 (0.2917..0.2966)"
    assert unwritten(out) == 0                      # the timed calls wrote every element

Every function that touches the device takes ``cuda`` (default ``torch.cuda``), so the
arithmetic and the order of calls can be checked on a CPU with a stand-in
(tests/cpu/test_benchmark_timing.py). `benchmarks.dense_layout_bench`,
`benchmarks.sparse_attention_bench` and `benchmarks.indexer_bench` time through it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Calls before a capture (on a side stream, as torch.cuda.graphs asks) or before a timed loop:
# lazy initialisation, autotuning and JIT builds happen there, not in the timed calls.
WARMUP_CALLS = 3


def _cuda(cuda: Any) -> Any:
    if cuda is not None:
        return cuda
    import torch

    return torch.cuda


def capture_graph(fn: Callable[[], Any], warmup: int = WARMUP_CALLS, cuda: Any = None) -> Any:
    """A CUDA graph of one call of ``fn``, after ``warmup`` calls on a side stream. Replaying
    it runs the call with almost no host work. Raises what the capture raises."""
    cuda = _cuda(cuda)
    stream = cuda.Stream()
    stream.wait_stream(cuda.current_stream())
    with cuda.stream(stream):
        for _ in range(warmup):
            fn()
    cuda.current_stream().wait_stream(stream)
    graph = cuda.CUDAGraph()
    with cuda.graph(graph):
        fn()
    cuda.synchronize()
    return graph


def per_call_ms(
    fn: Callable[[], Any], iters: int, warmup: int = WARMUP_CALLS, cuda: Any = None
) -> float:
    """GPU time per call, in ms, of ``iters`` back-to-back calls of ``fn`` between two CUDA
    events, after ``warmup`` untimed calls. For a graph's ``replay`` this is the kernels'
    time; for an eager call it includes the host's issue time where that is longer."""
    if iters < 1:
        raise ValueError(f"iters must be at least 1, not {iters}")
    cuda = _cuda(cuda)
    for _ in range(warmup):
        fn()
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """The arms' order in round ``round_index``: round r starts at arm r (mod the count)."""
    k = round_index % len(names)
    return [*names[k:], *names[:k]]


def alternated_rounds(
    measures: Mapping[str, Callable[[], float]], rounds: int
) -> dict[str, list[float]]:
    """Each arm's measurements, one a round, the arms' order rotated each round (`rotated`),
    so no arm always runs first (clocks, caches) or last."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    names = list(measures)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            samples[name].append(measures[name]())
    return samples


@dataclass(frozen=True)
class Spread:
    """A median with the lowest and highest value it was taken over."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("no values to take a median of")
        return cls(statistics.median(values), min(values), max(values))

    @property
    def relative(self) -> float:
        """(high - low) / median."""
        return (self.high - self.low) / self.median

    def text(self, digits: int = 4) -> str:
        return f"{self.median:.{digits}f} ({self.low:.{digits}f}..{self.high:.{digits}f})"


def median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """The ratio of two arms' medians."""
    return statistics.median(numerator) / statistics.median(denominator)


def poison_value(dtype: Any) -> float | int:
    """What `poison` writes: NaN in a floating tensor, else the integer type's lowest value
    (its highest for an unsigned type), which no index, count or flag the benchmarks check
    takes."""
    import torch

    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool:
        raise ValueError("a bool tensor has no value to poison it with")
    info = torch.iinfo(dtype)
    return info.min if info.min < 0 else info.max


def poison(*tensors: Any) -> None:
    """Fill each output with `poison_value`, so what a kernel leaves unwritten shows as NaN
    (or the sentinel) instead of an earlier call's right answer."""
    for tensor in tensors:
        tensor.fill_(poison_value(tensor.dtype))


def unwritten(tensor: Any) -> int:
    """How many elements of ``tensor`` still hold `poison_value`."""
    value = poison_value(tensor.dtype)
    if tensor.dtype.is_floating_point:
        return int(tensor.float().isnan().sum())
    return int((tensor == value).sum())
