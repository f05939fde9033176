"""Command line parsing, error reporting and dispatch."""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import pytest
from patchset_helpers import REPO_ROOT

from vllm_minimax import cli
from vllm_minimax.cli import main


def test_module_entry_point_prints_help() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "vllm_minimax", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 0
    for command in ("apply", "revert", "status", "doctor", "dev"):
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


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("vllm-minimax ")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["dev"],
        ["dev", "checkout", "0.34.0"],
        ["doctor", "--indexer-kv-dtype", "fp16"],
        ["doctor", "--indexer-backend", "cuda"],
        ["doctor", "--topk-blocks", "many"],
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
        (["--initializer-range=0"], "--initializer-range must be positive"),
        (["--mtp-modules=-1"], "--mtp-modules must be 0 or more"),
    ],
)
def test_make_tiny_model_refuses_options_it_would_ignore(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    directory = tmp_path / "tiny"
    assert main(["make-tiny-model", str(directory), *options]) == 2
    assert message in capsys.readouterr().err
    assert not directory.exists()


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
        "--topk-blocks",
        "64",
        "--indexer-backend",
        "flashinfer",
    ]
    assert main(argv) == 3
    (args,) = received
    assert args.target == tmp_path
    assert args.capability == "12.1"
    assert args.indexer_kv_dtype == "nvfp4"
    assert args.topk_blocks == 64
    assert args.indexer_backend == "flashinfer"


def test_doctor_defaults() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["doctor"])
    assert args.target is None
    assert args.capability is None
    assert args.indexer_kv_dtype is None
    assert args.topk_blocks is None
    assert args.indexer_backend == "auto"


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
    assert main(["status"]) == 0
    assert seen == [None]
    assert "vLLM version: 0.34.0" in capsys.readouterr().out
