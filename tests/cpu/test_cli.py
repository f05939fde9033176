"""Command line parsing, error reporting and dispatch."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from patchset_helpers import REPO_ROOT

from vllm_minimax import __version__, cli
from vllm_minimax.cli import main


def test_module_entry_point_prints_help() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "vllm_minimax", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 0
    for command in ("apply", "revert", "status", "doctor", "config", "dev"):
        assert command in completed.stdout


def test_expected_error_has_no_traceback(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "vllm_minimax", "status", "--target", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 2
    assert completed.stdout == ""
    assert completed.stderr.startswith("vllm-minimax: error: target ")
    assert "does not exist" in completed.stderr
    assert "Traceback" not in completed.stderr


def test_a_path_the_terminal_cannot_encode_is_escaped(tmp_path: Path) -> None:
    directory = tmp_path / "mod\u00e8le"
    completed = subprocess.run(
        [sys.executable, "-m", "vllm_minimax", "make-tiny-model", str(directory)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONIOENCODING": "ascii"},
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stderr == ""
    assert completed.stdout.rstrip().endswith(f"to {tmp_path}/mod\\xe8le")
    assert (directory / "config.json").is_file()


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    shipped = sorted(
        (
            series.parent.name.removeprefix("vllm-")
            for series in REPO_ROOT.glob("patches/vllm-*/series")
        ),
        key=lambda version: tuple(int(part) for part in version.split(".")),
    )
    assert len(shipped) >= 2
    assert capsys.readouterr().out == (
        f"vllm-minimax {__version__} (patch series for vLLM {', '.join(shipped)})\n"
    )


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["dev"],
        ["dev", "checkout", "0.34.0"],
        ["doctor", "--indexer-kv-dtype", "fp16"],
        ["doctor", "--indexer-backend", "cuda"],
        ["doctor", "--config", "h300-8x"],
        ["doctor", "--config", "missing/h200-8x.yaml"],
        ["doctor", "--tensor-parallel-size", "0"],
        ["config"],
        ["config", "path"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "usage: vllm-minimax" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--kind=llama", "--mtp-modules=1"], "apply to --kind minimax-m3 only"),
        (["--kind=llama", "--initializer-range=0.1"], "apply to --kind minimax-m3 only"),
        (["--kind=llama", "--for-vllm=0.33.0"], "--for-vllm applies to the tiny MiniMax M3"),
        (["--geometry=m3-tp8-rank", "--for-vllm=0.33.0"], "--for-vllm applies to the tiny"),
    ],
)
def test_make_tiny_model_refuses_options_it_would_ignore(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    directory = tmp_path / "tiny"
    assert main(["make-tiny-model", str(directory), *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm-minimax: error: ") and message in err
    assert not directory.exists()


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--initializer-range=0", "not a finite number in (0, 1.0]"),
        ("--initializer-range=-0.1", "not a finite number in (0, 1.0]"),
        ("--initializer-range=nan", "not a finite number in (0, 1.0]"),
        ("--initializer-range=inf", "not a finite number in (0, 1.0]"),
        ("--initializer-range=-inf", "not a finite number in (0, 1.0]"),
        ("--initializer-range=1e3", "not a finite number in (0, 1.0]"),
        ("--initializer-range=abc", "is not a number"),
        ("--mtp-modules=-1", "-1 is not in [0, 8]"),
        ("--mtp-modules=1000", "1000 is not in [0, 8]"),
        ("--seed=-1", "-1 is not in [0, "),
        ("--seed=99999999999999999999", "is not in [0, "),
        ("--for-vllm=0.32.0", "invalid choice: '0.32.0'"),
    ],
)
def test_make_tiny_model_refuses_absurd_numbers_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, message: str
) -> None:
    directory = tmp_path / "tiny"
    with pytest.raises(SystemExit) as exit_info:
        main(["make-tiny-model", str(directory), option])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert option.split("=")[0] in err and message in err, err
    assert list(tmp_path.iterdir()) == []


def test_make_tiny_model_refuses_a_non_empty_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "tiny"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    assert main(["make-tiny-model", str(directory)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm-minimax: error: ") and "is not empty" in err and "--force" in err
    assert [p.name for p in directory.iterdir()] == ["config.json"]
    assert (directory / "config.json").read_text() == "{}"
    (tmp_path / "file").write_text("x")
    assert main(["make-tiny-model", str(tmp_path / "file")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "x"


def fake_writer(fail: bool) -> object:
    def write(directory: Path, **_: object) -> dict[str, object]:
        (directory / "config.json").write_text("new")
        if fail:
            raise OSError(28, "No space left on device", str(directory / "model.safetensors"))
        return {"directory": directory, "parameters": 1, "tensors": 1}

    return write


def test_make_tiny_model_failure_leaves_the_directory_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_minimax import tiny_model

    monkeypatch.setattr(tiny_model, "make_tiny_model", fake_writer(fail=True))
    absent = tmp_path / "deeper" / "tiny"
    assert main(["make-tiny-model", str(absent)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm-minimax: error: no space left on the device of ")
    assert list(tmp_path.iterdir()) == []
    existing = tmp_path / "tiny"
    existing.mkdir()
    (existing / "config.json").write_text("old")
    assert main(["make-tiny-model", "--force", str(existing)]) == 2
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]
    assert [p.name for p in existing.iterdir()] == ["config.json"]
    assert (existing / "config.json").read_text() == "old"
    monkeypatch.setattr(tiny_model, "make_tiny_model", fake_writer(fail=False))
    assert main(["make-tiny-model", "--force", str(existing)]) == 0
    assert f"to {existing}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]
    assert (existing / "config.json").read_text() == "new"


def test_make_tiny_model_refuses_to_replace_the_current_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replacing DIR while the shell stands in it would delete the shell's directory, and a
    relative ``../x`` given from inside ``x`` names nothing once ``x`` is moved aside."""
    from vllm_minimax import tiny_model

    monkeypatch.setattr(tiny_model, "make_tiny_model", fake_writer(fail=False))
    existing = tmp_path / "tiny"
    (existing / "sub").mkdir(parents=True)
    (existing / "config.json").write_text("old")
    for cwd, given in [(existing, "../tiny"), (existing, "."), (existing / "sub", "..")]:
        monkeypatch.chdir(cwd)
        assert main(["make-tiny-model", "--force", given]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(f"vllm-minimax: error: {given} is or holds the current directory")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]
        assert sorted(p.name for p in existing.iterdir()) == ["config.json", "sub"]
        assert (existing / "config.json").read_text() == "old"
    monkeypatch.chdir(tmp_path)
    assert main(["make-tiny-model", "--force", "tiny/sub/../../tiny"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]
    assert (existing / "config.json").read_text() == "new"


def test_make_tiny_model_replaces_a_directory_reached_through_a_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model lands in the real directory, and the link above it stays a link."""
    from vllm_minimax import tiny_model

    monkeypatch.setattr(tiny_model, "make_tiny_model", fake_writer(fail=False))
    real = tmp_path / "real"
    (real / "tiny").mkdir(parents=True)
    (real / "tiny" / "config.json").write_text("old")
    (tmp_path / "link").symlink_to(real)
    assert main(["make-tiny-model", "--force", str(tmp_path / "link" / "tiny")]) == 0
    capsys.readouterr()
    assert (tmp_path / "link").is_symlink()
    assert sorted(p.name for p in real.iterdir()) == ["tiny"]
    assert (real / "tiny" / "config.json").read_text() == "new"


def test_make_tiny_model_reports_a_rust_writers_full_disk_as_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors and tokenizers raise their own exceptions for an I/O error, with the OS
    error number only in the text."""
    from vllm_minimax import tiny_model

    def full_disk(directory: Path, *_: object) -> dict[str, object]:
        (directory / "config.json").write_text("partial")
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(tiny_model, "make_rank_model", full_disk)
    directory = tmp_path / "rank"
    assert main(["make-tiny-model", str(directory), "--geometry", "m3-tp8-rank"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == (
        f"vllm-minimax: error: no space left on the device of {directory.absolute()}:"
        " free some space there and retry"
    )
    assert list(tmp_path.iterdir()) == []


def test_make_tiny_model_refuses_a_mount_point_and_a_path_under_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: path == volume or real_ismount(path))
    assert main(["make-tiny-model", str(volume)]) == 2
    err = capsys.readouterr().err
    assert f"{volume} is a mount point" in err and "a directory inside it" in err
    assert list(volume.iterdir()) == []
    (tmp_path / "keep").write_text("x")
    assert main(["make-tiny-model", str(tmp_path / "keep" / "sub")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'keep'} is not a directory" in err
    assert (tmp_path / "keep").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep", "volume"]


def test_make_tiny_model_names_the_parent_it_cannot_write_in(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def read_only(prefix: str, suffix: str, dir: Path) -> str:
        raise PermissionError(13, "Permission denied", str(Path(dir) / f"{prefix}x{suffix}"))

    monkeypatch.setattr("tempfile.mkdtemp", read_only)
    assert main(["make-tiny-model", str(tmp_path / "tiny")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"vllm-minimax: error: permission denied: {tmp_path}: ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "value",
    [
        "abc", "9", "9.0.1", "-1.0", "99.99", "", " ", "9.", ".0", "9.x", "13.0", "6.1",
        "12.01", "09.0", "9.00", "\u00b2.0", "\u0669.0",
    ],
)  # fmt: skip
def test_doctor_refuses_an_unknown_capability(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", f"--capability={value}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--capability" in err and "not the MAJOR.MINOR compute capability" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("value", ["8.0", "8.9", "9.0", "10.0", "10.3", "12.0", "12.1"])
def test_doctor_accepts_known_capabilities(value: str) -> None:
    args = cli.build_parser().parse_args(["doctor", "--capability", value])
    major, minor = value.split(".")
    assert args.capability == (int(major), int(minor))


def test_doctor_is_imported_lazily_and_gets_parsed_arguments(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    received: list[argparse.Namespace] = []

    def fake_main(args: argparse.Namespace) -> int:
        received.append(args)
        return 3

    fake = types.ModuleType("vllm_minimax.doctor")
    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm_minimax.doctor", fake)
    import vllm_minimax

    monkeypatch.setattr(vllm_minimax, "doctor", fake, raising=False)
    argv = [
        "doctor",
        "--target",
        str(tmp_path),
        "--capability",
        "12.1",
        "--indexer-kv-dtype",
        "nvfp4",
        "--indexer-backend",
        "flashinfer",
        "--config",
        "h200-8x",
        "--tensor-parallel-size",
        "4",
        "--kv-cache-dtype",
        "fp8",
    ]
    assert main(argv) == 3
    (args,) = received
    assert args.target == tmp_path
    assert args.capability == (12, 1)
    assert args.indexer_kv_dtype == "nvfp4"
    assert args.indexer_backend == "flashinfer"
    assert args.config == REPO_ROOT / "configs" / "serve" / "h200-8x.yaml"
    assert args.tensor_parallel_size == 4
    assert args.kv_cache_dtype == "fp8"


def test_doctor_defaults() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["doctor"])
    assert args.target is None
    assert args.capability is None
    assert args.config is None
    assert args.indexer_kv_dtype is None
    assert args.indexer_backend is None
    assert args.verbose is False


def test_cli_does_not_import_vllm_or_torch() -> None:
    code = (
        "import sys; from vllm_minimax import cli; cli.build_parser();"
        "print('vllm' in sys.modules, 'torch' in sys.modules)"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    )
    assert completed.stdout.strip() == "False False"


def test_dev_export_error_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dev", "export", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm-minimax: error: ")
    assert "not a `vllm-minimax dev checkout`" in err


def test_apply_default_target_is_installed_vllm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_minimax import patchset

    seen: list[Path | None] = []

    def fake_series_state(target: Path | None = None) -> patchset.SeriesState:
        seen.append(target)
        return patchset.SeriesState(Path("/x"), "0.34.0", None, False, [])

    monkeypatch.setattr(cli, "series_state", fake_series_state)
    assert main(["status"]) == 2  # no series for this version
    assert seen == [None]
    assert "vLLM version: 0.34.0" in capsys.readouterr().out


def test_status_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    out = capsys.readouterr().out
    assert "exit status:" in out
    for line in ("0  the series for this vLLM is applied", "1  not applied", "2  anything else"):
        assert line in out, out


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_apply_and_revert_help_document_the_exit_codes_they_return(
    command: str, small_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 57: status and doctor had an exit-status table, apply and revert none."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    table = out[out.index("exit status:") :]
    assert [line.split()[0] for line in table.splitlines() if line[:3].strip()] == [
        "exit", "0", "2", "130"
    ]  # fmt: skip
    # The two that need no Ctrl-C (130: test_patchset_faults.py).
    target = ["--target", str(small_target)]
    if command == "apply":
        assert main(["apply", *target]) == 0
        assert main(["apply", *target]) == 0  # already applied
        bare = tmp_path / "bare"
        (bare / "vllm").mkdir(parents=True)
        version = (small_target / "vllm" / "_version.py").read_text()
        (bare / "vllm" / "_version.py").write_text(version)
        assert main(["apply", "--target", str(bare)]) == 2  # the series does not apply
    else:
        assert main(["revert", *target]) == 2  # nothing applied
        assert main(["apply", *target]) == 0
        assert main(["revert", *target]) == 0
    assert "nothing" in capsys.readouterr().err


def test_doctor_on_a_vllm_that_does_not_import_is_one_finding(small_target: Path) -> None:
    """A tree whose vLLM fails to import gets doctor's one line and exit 5 (will not start),
    in a fresh interpreter so that the installed vLLM is not already imported."""
    assert main(["apply", "--target", str(small_target)]) == 0
    package = small_target / "vllm" / "__init__.py"
    package.write_text('raise RuntimeError("a broken install")\n' + package.read_text())
    doctor = ["doctor", "--target", str(small_target), "--capability", "9.0"]
    result = subprocess.run(
        [sys.executable, "-m", "vllm_minimax", *doctor],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 5, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout.strip().splitlines()[-2] == (
        f"  vLLM: -: vLLM at {small_target.resolve()} failed to import or to run"
        " its selection (RuntimeError: a broken install)"
    )


def test_an_os_error_of_make_tiny_model_is_not_blamed_on_the_vllm_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(directory: Path, force: bool) -> None:
        raise PermissionError(13, "Permission denied", str(directory))

    monkeypatch.setattr(cli, "check_model_directory", refused)
    assert main(["make-tiny-model", str(tmp_path / "model")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"vllm-minimax: error: permission denied: {tmp_path / 'model'}: run as a user who may"
        " use it, or choose a path you own"
    )


@pytest.mark.parametrize("command", ["apply", "status", "revert"])
def test_no_vllm_here_names_this_python_and_the_way_out(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run from a Python without vLLM (e.g. installed by another Python's bare `pip` from a uv
    venv), the commands name that Python, so the user sees which environment they are in."""
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def no_vllm(name: str, package: str | None = None) -> object:
        return None if name == "vllm" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", no_vllm)
    assert main([command]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.strip().splitlines()
    assert line == (
        f"vllm-minimax: error: vLLM is not installed for {sys.executable}, the Python this"
        " vllm-minimax runs in: install vllm-minimax into the environment that has vLLM (in a"
        " uv venv, with `uv pip install`), or pass --target DIR"
    )


def test_make_tiny_model_without_torch_is_one_line_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Outside a vLLM environment (no torch), make-tiny-model says what it needs, in one line
    with exit 2, instead of a traceback half-way through."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails, as without it
    directory = tmp_path / "tiny"
    assert main(["make-tiny-model", str(directory)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.strip().splitlines()
    assert line == (
        f"vllm-minimax: error: make-tiny-model needs torch, which {sys.executable} cannot"
        " import: run it in the environment where vLLM is installed (vLLM brings them)"
    )
    assert not directory.exists()
