"""doctor's exit status for the outcomes that need no vLLM selection: not applied, no GPU,
a config that cannot be read; and the table in its --help."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_minimax import cli, doctor, patchset


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch):
    """A CPU-only machine with a working FlashInfer, and a series state of the test's
    choosing (no vLLM, torch or FlashInfer is imported)."""

    def set_state(applied: bool | patchset.SeriesState) -> None:
        if isinstance(applied, patchset.SeriesState):
            state = applied
        else:
            files = [("vllm/config/attention.py", "as-applied" if applied else "pristine")]
            state = patchset.SeriesState(Path("/x"), "0.34.0", Path("/s"), applied, files)
        monkeypatch.setattr(patchset, "series_state", lambda target=None: state)
        monkeypatch.setattr(patchset, "format_status", lambda state: "state:        (test)")

    monkeypatch.setattr(doctor, "gpu_line", lambda: ("none", None))
    monkeypatch.setattr(doctor, "flashinfer_line", lambda: "0.7.4 (test)")
    return set_state


def test_not_applied_exits_1(machine, capsys) -> None:
    machine(False)
    assert cli.main(["doctor", "--capability", "9.0"]) == doctor.EXIT_NOT_APPLIED == 1
    assert "run `vllm-minimax apply`" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("applied", "files", "problem", "advice"),
    [
        # An update of vllm-minimax whose series changed: apply refuses until it is reverted.
        (
            True,
            ["as-applied"],
            "/s has changed since it was applied; run `vllm-minimax revert` and ...",
            "run `vllm-minimax revert`, then `vllm-minimax apply` (the problem above)",
        ),
        # Files edited since apply, or no series for this vLLM: apply is not the way either.
        (True, ["as-applied", "edited"], None, "`vllm-minimax apply` alone does not fix this"),
        (False, [], "no patch series for vLLM 0.35.0", "`vllm-minimax apply` alone does not"),
    ],
)
def test_not_clean_says_apply_only_where_apply_would_work(
    machine, capsys, applied: bool, files: list[str], problem: str | None, advice: str
) -> None:
    state = patchset.SeriesState(
        Path("/x"),
        "0.34.0",
        Path("/s"),
        applied,
        [(f"vllm/f{i}.py", file_state) for i, file_state in enumerate(files)],
        recorded_series="vllm-0.34.0" if applied else None,
        problem=problem,
    )
    machine(state)
    assert cli.main(["doctor", "--capability", "9.0"]) == doctor.EXIT_NOT_APPLIED
    [result] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("result:")]
    assert advice in result
    if applied or problem:
        assert "run `vllm-minimax apply`" not in result


def test_no_gpu_and_no_capability_exits_4(machine, capsys) -> None:
    machine(True)
    assert cli.main(["doctor", "--config", "h200-8x"]) == doctor.EXIT_CANNOT_CHECK == 4
    out = capsys.readouterr().out
    assert "selection:    not checked: no GPU here" in out
    assert "pass --capability" in out


def test_an_unreadable_config_exits_2(machine, tmp_path: Path, capsys) -> None:
    machine(True)
    bad = tmp_path / "bad.yaml"
    bad.write_text("- not\n- a mapping\n")
    assert cli.main(["doctor", "--config", str(bad), "--capability", "9.0"]) == 2
    assert "a vllm serve config is a mapping" in capsys.readouterr().err


def test_help_has_the_exit_status_table(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--help"])
    out = capsys.readouterr().out
    for code, words in (
        (doctor.EXIT_READY, "ready"),
        (doctor.EXIT_NOT_APPLIED, "not applied"),
        (doctor.EXIT_FALLBACK, "will fall back to Triton"),
        (doctor.EXIT_CANNOT_CHECK, "cannot check here"),
        (doctor.EXIT_FAILS, "will not start as configured"),
    ):
        assert f"  {code}  {words}" in out
    assert len({0, 1, 2, 3, 4, 5}) == len(
        {doctor.EXIT_READY, doctor.EXIT_NOT_APPLIED, doctor.EXIT_USAGE, doctor.EXIT_FALLBACK,
         doctor.EXIT_CANNOT_CHECK, doctor.EXIT_FAILS}
    )  # fmt: skip
