"""client_agreement_probe.py --wait-for: the clients are imported first, and nothing reaches
the server before the file exists (the quiet_cpu test's levels need the CPU alone)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import client_agreement_probe as probe
import pytest

from vllm_minimax.evals.throughput import Vocabulary


def test_the_probe_imports_first_and_sends_nothing_before_the_file_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    signal = tmp_path / "main-lane-done"
    events: list[tuple[str, bool]] = []

    async def run_level(base_url, model, prompts, concurrency, label, timeouts):
        events.append((f"sent {label}", signal.exists()))
        return [], 1.0

    monkeypatch.setattr(probe, "run_level", run_level)
    monkeypatch.setattr(probe.bench, "import_bench", lambda: events.append(("import", False)))
    monkeypatch.setattr(
        Vocabulary, "from_tokenizer", classmethod(lambda cls, name: cls(1000, frozenset()))
    )
    argv = ["probe", "http://127.0.0.1:9", "model", str(tmp_path), "--rounds", "0"]
    argv += ["--input-tokens", "8", "--output-tokens", "2", "--num-requests", "2"]
    argv += ["--concurrency", "1", "--wait-for", str(signal)]
    monkeypatch.setattr(sys, "argv", argv)
    maker = threading.Timer(1.5, signal.touch)
    maker.start()
    start = time.monotonic()
    probe.main()
    maker.join()
    assert time.monotonic() - start >= 1.5
    assert events == [("import", False), ("sent warm-up", True)]
    waited = probe.json.loads(capsys.readouterr().out.strip().splitlines()[-1])["waited_s"]
    assert 1.0 <= waited <= time.monotonic() - start


def test_a_file_that_never_comes_stops_the_probe(tmp_path: Path):
    with pytest.raises(SystemExit, match="did not appear in 0 s"):
        probe.wait_for(tmp_path / "never", limit_s=0.2)
