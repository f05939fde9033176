"""benchmarks.timing without a GPU: its arithmetic against a stand-in device whose clock
advances by a known cost a call, the order of warm-up, capture and timed calls, the arms'
rotation, the medians and spreads, and the poisoning of outputs."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from benchmarks import timing


class FakeCuda:
    """What `benchmarks.timing` calls of ``torch.cuda``: events read a clock that each call of
    the timed function advances; streams and graphs record what ran where."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.log: list[str] = []
        self.in_stream = False
        self.capturing = False

    # streams
    class _Stream:
        def __init__(self, cuda: FakeCuda) -> None:
            self.cuda = cuda

        def wait_stream(self, other: object) -> None:
            self.cuda.log.append("wait")

    def Stream(self) -> FakeCuda._Stream:
        return self._Stream(self)

    def current_stream(self) -> FakeCuda._Stream:
        return self._Stream(self)

    @contextlib.contextmanager
    def stream(self, stream: object):
        self.in_stream = True
        yield
        self.in_stream = False

    # graphs
    class CUDAGraph:
        def __init__(self) -> None:
            self.replays = 0

        def replay(self) -> None:
            self.replays += 1

    @contextlib.contextmanager
    def graph(self, graph: object):
        self.capturing = True
        self.log.append("capture")
        yield
        self.capturing = False

    def synchronize(self) -> None:
        self.log.append("sync")

    # events
    class _Event:
        def __init__(self, cuda: FakeCuda, enable_timing: bool = False) -> None:
            assert enable_timing
            self.cuda = cuda
            self.at: float | None = None

        def record(self) -> None:
            self.at = self.cuda.now_ms

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: FakeCuda._Event) -> float:
            assert self.at is not None and end.at is not None
            return end.at - self.at

    def Event(self, enable_timing: bool = False) -> FakeCuda._Event:
        return self._Event(self, enable_timing)


def test_per_call_ms_divides_the_timed_span_by_the_calls_and_skips_the_warm_up() -> None:
    cuda = FakeCuda()
    costs = iter([50.0] * 3 + [2.0] * 10)  # a slow first few calls (JIT), then 2 ms a call

    def call() -> None:
        cuda.now_ms += next(costs)

    assert timing.per_call_ms(call, iters=10, warmup=3, cuda=cuda) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="iters must be at least 1"):
        timing.per_call_ms(call, iters=0, cuda=cuda)


def test_per_call_ms_of_random_costs_is_their_mean() -> None:
    cuda, rng = FakeCuda(), random.Random()
    costs = [rng.uniform(0.01, 5.0) for _ in range(37)]
    it = iter([0.0] * timing.WARMUP_CALLS + costs)

    def call() -> None:
        cuda.now_ms += next(it)

    assert timing.per_call_ms(call, iters=len(costs), cuda=cuda) == pytest.approx(
        sum(costs) / len(costs)
    )


def test_capture_warms_up_on_a_side_stream_then_captures_one_call() -> None:
    cuda = FakeCuda()
    calls: list[tuple[bool, bool]] = []

    def call() -> None:
        calls.append((cuda.in_stream, cuda.capturing))

    graph = timing.capture_graph(call, warmup=2, cuda=cuda)
    assert calls == [(True, False), (True, False), (False, True)]
    assert cuda.log == ["wait", "wait", "capture", "sync"]
    graph.replay()
    assert graph.replays == 1 and len(calls) == 3  # a replay does not call the function


def test_rounds_rotate_the_arms_order_and_keep_each_arms_samples() -> None:
    order: list[str] = []

    def measure(name: str, value: float):
        def run() -> float:
            order.append(name)
            return value + len(order)

        return run

    samples = timing.alternated_rounds(
        {"a": measure("a", 0.0), "b": measure("b", 100.0), "c": measure("c", 200.0)}, rounds=4
    )
    assert order == list("abcbcacababc")
    assert samples == {"a": [1, 6, 8, 10], "b": [102, 104, 109, 111], "c": [203, 205, 207, 212]}
    assert timing.rotated(["x", "y"], 5) == ["y", "x"]
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        timing.alternated_rounds({"a": lambda: 1.0}, rounds=0)


def test_spread_is_the_median_with_its_extremes() -> None:
    s = timing.Spread.of([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.low, s.high) == (2.5, 1.0, 10.0)
    assert s.relative == pytest.approx(9.0 / 2.5)
    assert timing.Spread.of([0.29312, 0.29171, 0.29662]).text() == "0.2931 (0.2917..0.2966)"
    assert timing.median_ratio([4.0, 6.0, 5.0], [2.0, 2.5, 3.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no values"):
        timing.Spread.of([])


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int32, torch.uint8]
)
def test_poison_marks_every_element_until_a_kernel_writes_it(dtype: torch.dtype) -> None:
    out = torch.zeros(6, 5).to(dtype)
    timing.poison(out)
    assert timing.unwritten(out) == 30
    # A "kernel" that writes all but one row: the row it skipped is counted.
    out[:5] = torch.ones(5, 5).to(dtype)
    assert timing.unwritten(out) == 5
    out[5] = torch.ones(5).to(dtype)
    assert timing.unwritten(out) == 0


def test_poison_refuses_a_bool_tensor() -> None:
    with pytest.raises(ValueError, match="bool"):
        timing.poison(torch.zeros(3, dtype=torch.bool))
