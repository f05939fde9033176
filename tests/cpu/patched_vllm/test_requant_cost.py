"""`benchmarks.requant_cost` on a CPU: its arguments, its summary and exit status, its
mismatch report and its traffic counter (the GPU run only changes the clock)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from vllm.model_executor.layers.quantization.online import pow2_requant

from benchmarks import requant_cost
from vllm_minimax.testing import pow2_requant_v1

TINY = ["--device", "cpu", "--geometry", "tiny", "--rounds", "2"]


def test_a_run_writes_its_summary_and_passes(tmp_path: Path, capsys) -> None:
    argv = [*TINY, "--breakdown", "--commit", "abc1234", "--out", str(tmp_path)]
    assert requant_cost.main(argv) == 0
    summary = json.loads((tmp_path / requant_cost.RESULT_FILE).read_text())
    assert summary["identical"] is True and summary["mismatches"] == []
    assert (summary["device"], summary["rounds"], summary["experts"]) == ("cpu", 2, 6)
    assert summary["commit"] == "abc1234"
    layers = summary["layers"]
    assert sorted(layers) == ["dense", "sparse"]
    for result in layers.values():
        for arm in requant_cost.ARMS:
            assert len(result["samples_ms"][arm]) == 2
            assert result["ms"][arm]["low"] <= result["ms"][arm]["median"] > 0
        assert set(result["v1_steps_ms"]) <= set(pow2_requant_v1.STEPS)
    for arm in requant_cost.ARMS:
        expected = (
            layers["sparse"]["ms"][arm]["median"] * requant_cost.SPARSE_LAYERS
            + layers["dense"]["ms"][arm]["median"] * requant_cost.DENSE_LAYERS
        ) / 1000
        assert summary["per_start_s"][arm] == pytest.approx(expected)
    assert (requant_cost.SPARSE_LAYERS, requant_cost.DENSE_LAYERS) == (57, 3)
    out = capsys.readouterr().out
    assert "outputs identical (bytes, scales, log line): yes" in out
    assert "per start (57 sparse + 3 dense layers)" in out


def test_a_changed_byte_fails_the_run(tmp_path: Path, monkeypatch, capsys) -> None:
    real = requant_cost.CONVERTERS["current"]

    def one_byte_off(layer):
        outputs, log = real(layer)
        if "moe" in outputs:
            w13 = outputs["moe"][0]
            w13.view(torch.uint8)[-1, -1, -1] ^= 1
        return outputs, log

    monkeypatch.setitem(requant_cost.CONVERTERS, "current", one_byte_off)
    assert requant_cost.main([*TINY, "--out", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / requant_cost.RESULT_FILE).read_text())
    assert summary["identical"] is False
    assert any("moe[0]: 1 of" in problem for problem in summary["mismatches"])
    assert "NO (" in capsys.readouterr().out


def test_a_changed_log_line_fails_the_run(monkeypatch) -> None:
    real = requant_cost.CONVERTERS["current"]
    monkeypatch.setitem(
        requant_cost.CONVERTERS, "current", lambda layer: (real(layer)[0], ["moe w13: ..."])
    )
    assert requant_cost.main(TINY) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    (
        (["--rounds", "0"], "--rounds 0: at least 1"),
        (["--experts", "0"], "--experts 0: at least 1"),
        (["--spread", "-1"], "--spread -1"),
        (["--device", "cuda"], "--device cuda: torch sees no CUDA device"),
    ),
)
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys) -> None:
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    assert requant_cost.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_vllm_without_the_chunked_conversion_is_refused(monkeypatch, capsys) -> None:
    monkeypatch.delattr(pow2_requant, "requantize_power_of_two")
    assert requant_cost.main(TINY) == 2
    assert "apply this checkout's series" in capsys.readouterr().err


def test_nan_of_either_sign_is_the_same_and_any_other_bit_is_not() -> None:
    e4m3 = torch.float8_e4m3fn
    want = torch.tensor([0x7F, 0x10, 0x00], dtype=torch.uint8).view(e4m3)
    assert not requant_cost._differ(
        want, torch.tensor([0xFF, 0x10, 0x00]).to(torch.uint8).view(e4m3)
    ).any()
    differ = requant_cost._differ(want, torch.tensor([0x7F, 0x11, 0x80]).to(torch.uint8).view(e4m3))
    assert differ.tolist() == [False, True, True]  # +0 and -0 differ in bits


def test_traffic_counts_bytes_launches_and_host_reads() -> None:
    source = torch.randn(1000).to(torch.bfloat16)
    target = torch.empty(1000, dtype=torch.float8_e4m3fn)
    with requant_cost.Traffic() as traffic:
        target.copy_(source)  # reads 2000 bytes, writes 1000
        target.view(10, 100)  # a view moves nothing
        doubled = source.float() * 2  # _to_copy 2000 + 4000, mul 4000 + 4000 (+ the scalar)
        doubled.sum().item()
    assert traffic.syncs == 1
    assert traffic.ops == 5  # copy_, _to_copy, mul, sum, _local_scalar_dense
    assert 3000 + 6000 + 8000 + 4000 <= traffic.bytes <= 3000 + 6000 + 8000 + 4000 + 16


class FakeCuda:
    """torch.cuda's events and synchronize, on a clock that the test advances."""

    def __init__(self) -> None:
        self.now = 0.0
        self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1

    def Event(self, enable_timing: bool) -> FakeEvent:
        assert enable_timing
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda, self.at = cuda, None

    def record(self) -> None:
        self.at = self.cuda.now

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return end.at - self.at


def test_the_cuda_clock_times_calls_and_steps_with_events() -> None:
    cuda = FakeCuda()
    clock = requant_cost.Clock(torch.device("cuda"), cuda=cuda)

    def work() -> None:
        cuda.now += 2.5

    assert clock.time(work) == 2.5 and cuda.syncs == 1
    totals: dict[str, float] = {}
    with clock.steps(totals) as step:
        for ms in (1.0, 3.0):
            with step("quantize"):
                cuda.now += ms
            with step("statistics"):
                cuda.now += 10 * ms
    assert totals == {"quantize": 4.0, "statistics": 40.0} and cuda.syncs == 2
    assert requant_cost.Clock(torch.device("cpu"), cuda=cuda).cuda is None
