"""doctor's stored answers (vllm_minimax.doctor_cache): the fingerprint changes with each
thing an answer depends on and with nothing else, and doctor reuses an answer only within
one fingerprint, without asking FlashInfer or vLLM again (issue 57: doctor took 12 to 81 s
a call, nearly all of it importing them). No vLLM is imported here; the answers of every
shipped config, stored against asked, are compared in tests/cpu/patched_vllm/test_doctor.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_minimax import cli, doctor, doctor_cache, patchset, selection


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A site-packages of this test's on sys.path, holding one distribution."""
    site = tmp_path / "site-packages"
    (site / "flashinfer_python-0.7.4.dist-info").mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    return site


def fingerprint(state_file: Path, series: object = "applied", gpu=None) -> str:
    return doctor_cache.environment_fingerprint(series, state_file, gpu)


def reinstall(site: Path) -> None:
    """What pip does to a distribution it reinstalls: a new dist-info directory."""
    info = site / "flashinfer_python-0.7.4.dist-info"
    shutil.rmtree(info)
    info.mkdir()


def touch_pth(site: Path) -> None:
    (site / "a-new.pth").write_text("/somewhere\n")


def set_variable(site: Path) -> None:
    os.environ["VLLM_MINIMAX_TEST_ONLY"] = "1"


def add_nvcc(site: Path) -> None:
    """An nvcc appears in a directory already on PATH: FlashInfer can now compile."""
    nvcc = Path(os.environ["PATH"].split(os.pathsep)[0]) / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)


def add_top_level_module(site: Path) -> None:
    (site / "flashinfer").mkdir()


@pytest.mark.parametrize(
    "change",
    [reinstall, touch_pth, set_variable, add_nvcc, add_top_level_module],
    ids=lambda change: change.__name__,
)
def test_each_thing_an_answer_depends_on_changes_the_fingerprint(
    change: Callable[[Path], None], site: Path, tmp_path: Path, monkeypatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("VLLM_MINIMAX_TEST_ONLY", raising=False)
    state_file = tmp_path / "state.json"
    before = fingerprint(state_file)
    assert fingerprint(state_file) == before  # nothing changed: the same
    change(site)
    assert fingerprint(state_file) != before


def test_the_series_state_file_and_gpu_change_the_fingerprint(site: Path, tmp_path) -> None:
    state_file = tmp_path / "state.json"
    before = fingerprint(state_file)
    state_file.write_text('{"series": "vllm-0.34.0"}')  # apply
    applied = fingerprint(state_file)
    assert applied != before
    assert fingerprint(state_file, series="not applied") != applied
    assert fingerprint(state_file, gpu=(9, 0)) != applied


def test_what_a_shell_changes_between_commands_does_not(site, tmp_path, monkeypatch) -> None:
    state_file = tmp_path / "state.json"
    before = fingerprint(state_file)
    for name in ("_", "PWD", "OLDPWD", "SHLVL"):
        monkeypatch.setenv(name, "changed")
    assert fingerprint(state_file) == before


# What each new login (ssh, a desktop session, another terminal) sets afresh; none of vLLM,
# FlashInfer or torch reads them.
SESSION_VARIABLES = (
    "SSH_CONNECTION",
    "SSH_CLIENT",
    "SSH_TTY",
    "XDG_SESSION_ID",
    "XDG_RUNTIME_DIR",
    "TERM",
    "DISPLAY",
    "TMUX",
)


def test_a_new_login_is_the_same_environment(site, tmp_path, monkeypatch) -> None:
    state_file = tmp_path / "state.json"
    before = fingerprint(state_file)
    for number, name in enumerate(SESSION_VARIABLES):
        monkeypatch.setenv(name, f"10.0.0.{number} 52{number} 10.0.0.9 22")
        assert fingerprint(state_file) == before, name


@pytest.mark.parametrize("variable", ["CUDA_HOME", "CUDA_PATH"])
def test_an_nvcc_that_appears_under_the_cuda_home_changes_the_fingerprint(
    variable: str, site: Path, tmp_path: Path, monkeypatch
) -> None:
    """vLLM's has_flashinfer() looks for bin/nvcc under $CUDA_HOME (else $CUDA_PATH), not on
    PATH: a toolkit installed there lets FlashInfer run with the variable's value unchanged."""
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    for name in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, str(home))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvcc on PATH
    state_file = tmp_path / "state.json"
    before = fingerprint(state_file)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    assert fingerprint(state_file) == before  # not executable: vLLM does not see it either
    nvcc.chmod(0o755)
    assert doctor_cache.vllm_flashinfer_nvcc() == str(nvcc)
    assert fingerprint(state_file) != before


def test_vllms_nvcc_is_found_as_vllm_finds_it(tmp_path: Path, monkeypatch) -> None:
    """`vllm_flashinfer_nvcc` against vLLM 0.34.0's own `_flashinfer_nvcc_path` (imported
    from the installed vLLM: its module imports torch, not vLLM's engine)."""
    flashinfer_utils = pytest.importorskip("vllm.utils.flashinfer")
    homes = {name: tmp_path / name for name in ("home", "path", "on-path")}
    for home in homes.values():
        (home / "bin").mkdir(parents=True)
        (home / "bin" / "nvcc").write_text("#!/bin/sh\n")
        (home / "bin" / "nvcc").chmod(0o755)
    cases = [
        {"CUDA_HOME": homes["home"], "CUDA_PATH": homes["path"]},
        {"CUDA_PATH": homes["path"]},
        {"PATH": homes["on-path"] / "bin"},
        {"PATH": tmp_path / "empty"},
        {"CUDA_HOME": tmp_path / "empty", "PATH": homes["on-path"] / "bin"},
    ]
    for case in cases:
        for name in ("CUDA_HOME", "CUDA_PATH"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        for name, value in case.items():
            monkeypatch.setenv(name, str(value))
        ours = doctor_cache.vllm_flashinfer_nvcc()
        assert ours == flashinfer_utils._flashinfer_nvcc_path(), case


def test_a_driver_change_changes_the_fingerprint(site, tmp_path, monkeypatch) -> None:
    """Both halves: the kernel module's version and the CUDA version libcuda reports."""
    version_file = tmp_path / "version"
    version_file.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05\n")
    monkeypatch.setattr(doctor_cache, "NVIDIA_DRIVER_VERSION_FILE", version_file)
    reported = {"cuda": 13000}
    monkeypatch.setattr(doctor_cache, "cuda_driver_version", lambda: reported["cuda"])
    state_file = tmp_path / "state.json"
    before = fingerprint(state_file)
    assert fingerprint(state_file) == before
    version_file.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04\n")
    upgraded = fingerprint(state_file)
    assert upgraded != before
    reported["cuda"] = 13010
    assert fingerprint(state_file) != upgraded
    version_file.unlink()  # the driver gone
    assert fingerprint(state_file) not in (before, upgraded)


def test_a_library_without_the_driver_reports_no_version(monkeypatch) -> None:
    monkeypatch.setattr(doctor_cache, "CUDA_DRIVER_LIBRARY", "libvllm-minimax-none.so.1")
    assert doctor_cache.cuda_driver_version() is None
    monkeypatch.setattr(doctor_cache, "CUDA_DRIVER_LIBRARY", "libc.so.6")  # no cuDriverGetVersion
    assert doctor_cache.cuda_driver_version() is None


def test_the_driver_version_is_read_without_torch() -> None:
    probe = (
        "import sys; from vllm_minimax import doctor_cache; doctor_cache.driver_version();"
        " doctor_cache.environment_fingerprint('s', doctor_cache.Path('/nonexistent'), None);"
        " print(sorted(m for m in ('torch', 'vllm', 'flashinfer') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


def test_the_store_keeps_the_most_recently_used_answers(tmp_path: Path) -> None:
    directory = tmp_path / "answers"
    store = doctor_cache.AnswerStore("env", directory, limit=4)
    for question in range(4):
        store.save({"q": question}, question)
    stamp = 1_000_000_000
    for question in range(4):  # saved in order, a second apart
        os.utime(store.path({"q": question}), (stamp + question, stamp + question))
    assert store.load({"q": 0}) == 0  # used now: the most recent
    (directory / "killed.part").write_text("")
    os.utime(directory / "killed.part", (stamp, stamp))
    store.save({"q": 4}, 4)
    assert sorted(path.name for path in directory.iterdir()) == sorted(
        store.path({"q": question}).name for question in (0, 2, 3, 4)
    )
    for question in range(5, 40):
        doctor_cache.AnswerStore(f"env-{question}", directory, limit=4).save({"q": 1}, 1)
    assert len(list(directory.iterdir())) == 4
    assert doctor_cache.AnswerStore("env").limit == doctor_cache.MAX_ANSWERS


def test_a_store_answers_its_own_question_only(tmp_path: Path) -> None:
    store = doctor_cache.AnswerStore("env-a", tmp_path / "answers")
    assert store.load({"q": 1}) is None
    store.save({"q": 1}, ["an", "answer"])
    assert store.load({"q": 1}) == ["an", "answer"]
    assert store.load({"q": 2}) is None
    assert doctor_cache.AnswerStore("env-b", tmp_path / "answers").load({"q": 1}) is None
    assert len(store.used) == 1
    # Torn or foreign files are no answer; leftovers of an interrupted save are ignored.
    store.path({"q": 1}).write_text("{not json")
    assert store.load({"q": 1}) is None
    assert not list((tmp_path / "answers").glob("*.part"))


def test_a_store_that_cannot_be_written_stores_nothing_and_says_nothing(tmp_path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    store = doctor_cache.AnswerStore("env", blocked / "answers")
    store.save({"q": 1}, "answer")  # no exception
    assert store.load({"q": 1}) is None


READY_ROWS = [
    selection.Row("indexer", "FlashInfer", "selected FlashInfer", selection.Outcome.READY),
    selection.Row(
        "sparse attention", "Triton", "as configured", selection.Outcome.READY, "kv-cache-dtype"
    ),
]


@pytest.fixture
def clean_machine(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """A CPU-only machine with the series applied: FlashInfer's line and vLLM's selection
    are stand-ins that count their calls."""
    calls = {"flashinfer": 0, "select": 0}
    state = patchset.SeriesState(
        Path("/x"), "0.34.0", Path("/s"), True, [("vllm/config/attention.py", "as-applied")]
    )
    monkeypatch.setattr(patchset, "series_state", lambda target=None: state)
    monkeypatch.setattr(patchset, "format_status", lambda state: "state:        (test)")
    monkeypatch.setattr(doctor, "gpu_line", lambda: ("none", None))

    def flashinfer_line() -> str:
        calls["flashinfer"] += 1
        return "0.7.4; flashinfer.msa_ops has msa_proxy_score and msa_topk_select"

    def select_rows(config, capability, *, simulated=True):
        calls["select"] += 1
        return READY_ROWS

    monkeypatch.setattr(doctor, "flashinfer_line", flashinfer_line)
    monkeypatch.setattr(selection, "select_rows", select_rows)
    return calls


def run_doctor(capsys, *extra: str) -> tuple[int, list[str]]:
    code = cli.main(["doctor", "--config", "h200-8x", "--capability", "9.0", *extra])
    return code, capsys.readouterr().out.splitlines()


def test_the_second_doctor_asks_neither_flashinfer_nor_vllm(clean_machine, capsys) -> None:
    code, first = run_doctor(capsys)
    assert code == doctor.EXIT_READY
    assert clean_machine == {"flashinfer": 1, "select": 1}
    code, second = run_doctor(capsys)
    assert code == doctor.EXIT_READY
    assert clean_machine == {"flashinfer": 1, "select": 1}
    [stored] = [line for line in second if line.startswith("stored:")]
    assert "reused (--no-cache asks FlashInfer and vLLM again)" in stored
    assert [line for line in second if line != stored] == first
    # Another config, or another GPU, is another question: vLLM is asked, FlashInfer's line
    # is reused.
    run_doctor(capsys, "--kv-cache-dtype", "fp8")
    assert clean_machine == {"flashinfer": 1, "select": 2}
    cli.main(["doctor", "--config", "h200-8x", "--capability", "12.0"])
    assert clean_machine == {"flashinfer": 1, "select": 3}


@pytest.mark.parametrize("flag", ["--no-cache", "--verbose"])
def test_no_cache_and_verbose_ask_again(clean_machine, capsys, flag: str) -> None:
    run_doctor(capsys)
    code, out = run_doctor(capsys, flag)
    assert code == doctor.EXIT_READY
    assert clean_machine == {"flashinfer": 2, "select": 2}
    assert not [line for line in out if line.startswith("stored:")]


@pytest.mark.parametrize("broken", ["flashinfer", "vllm"])
def test_a_broken_flashinfer_or_vllm_is_asked_again_every_time(
    clean_machine, capsys, monkeypatch, broken: str
) -> None:
    """Until it is repaired: a repair that the fingerprint does not see (files put back by
    hand) must still show. A run whose msa_ops does not import stores no selection either
    (its rows say Triton because of it)."""
    if broken == "flashinfer":
        line = "0.7.4; flashinfer.msa_ops does not import (ModuleNotFoundError: cuda)"
        monkeypatch.setattr(doctor, "flashinfer_line", lambda: line)
    else:

        def select_rows(config, capability, *, simulated=True):
            clean_machine["select"] += 1
            raise ImportError("vllm._C")

        monkeypatch.setattr(selection, "select_rows", select_rows)
    for _ in range(2):
        code, out = run_doctor(capsys)
        assert code == (doctor.EXIT_READY if broken == "flashinfer" else doctor.EXIT_FAILS)
    assert clean_machine["select"] == 2
    if broken == "flashinfer":
        assert clean_machine["flashinfer"] == 0  # the stand-in above, called each time
        assert not [line for line in out if line.startswith("stored:")]


def test_a_new_login_reuses_the_answers(clean_machine, capsys, monkeypatch) -> None:
    run_doctor(capsys)
    for name in SESSION_VARIABLES:
        monkeypatch.setenv(name, "another login")
    code, out = run_doctor(capsys)
    assert code == doctor.EXIT_READY
    assert clean_machine == {"flashinfer": 1, "select": 1}
    assert [line for line in out if line.startswith("stored:")]


def test_damaged_cuda_bindings_are_another_environment(clean_machine, capsys, monkeypatch):
    """Files of cuda-bindings deleted outside an installer change no install record; the
    bindings' own check is part of the fingerprint."""
    run_doctor(capsys)
    monkeypatch.setattr(doctor, "cuda_bindings_problem", lambda: "2 files gone")
    _, out = run_doctor(capsys)
    assert clean_machine == {"flashinfer": 2, "select": 2}
    assert "  CUDA bindings: 2 files gone" in out
