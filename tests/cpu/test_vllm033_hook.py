"""scripts/prepare-e2e-vllm-0.33.0's environment hook on the CPU: packed from two stand-in wheels
(vLLM 0.33.0 and transformers 5.20.2) and sourced after a base hook that provides a vLLM 0.34.0
directory on PYTHONPATH, it leaves python3 importing vLLM 0.33.0 and transformers 5.20.2 from a
hard-linked sibling of that directory, with everything else the base provides; the base
directory itself keeps vLLM 0.34.0."""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from patchset_helpers import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "prepare-e2e-vllm-0.33.0"


def stand_in_wheel(directory: Path, name: str, version: str) -> Path:
    path = directory / f"{name}-{version}-py3-none-any.whl"
    dist_info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}/__init__.py", f"__version__ = {version!r}\n")
        wheel.writestr(f"{name}/_version.py", f"__version__ = version = {version!r}\n")
        wheel.writestr(
            f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        wheel.writestr(
            f"{dist_info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        wheel.writestr(f"{dist_info}/RECORD", "")
    return path


def package(site: Path, name: str, version: str) -> None:
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text(f"__version__ = {version!r}\n")


@pytest.fixture
def python3_with_pip() -> None:
    done = subprocess.run(["python3", "-m", "pip", "--version"], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip("the hook installs with `python3 -m pip`, which this machine lacks")


def test_the_hook_turns_the_base_vllm_into_0_33_0(tmp_path, python3_with_pip):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    stand_in_wheel(wheels, "vllm", "0.33.0")
    stand_in_wheel(wheels, "transformers", "5.20.2")
    base = tmp_path / "site"
    package(base, "vllm", "0.34.0")
    (base / "vllm" / "_version.py").write_text("__version__ = version = '0.34.0'\n")
    package(base, "transformers", "5.22.0")
    package(base, "torch", "2.14.0")
    package(base / "extra", "cutlass", "4.0")
    base_hook = tmp_path / "base-hook.sh"
    base_hook.write_text(f'export PYTHONPATH="{base}:{base}/extra"\n')
    model_maker = tmp_path / "make-model"
    model_maker.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/model-args"\n')
    model_maker.chmod(0o755)
    parts = tmp_path / "parts"
    dest = tmp_path / "dest"
    environ = {**os.environ, "PYTHON": str(model_maker), "PAYLOAD_CACHE": str(tmp_path / "cache")}
    environ.pop("PYTHONPATH", None)

    subprocess.run(
        [str(SCRIPT), "--parts-dir", str(parts), "--base-hook", str(base_hook),
         "--wheels", str(wheels), str(dest)],
        check=True, timeout=60, env=environ, capture_output=True,
    )  # fmt: skip

    assert (tmp_path / "model-args").read_text().split()[:3] == [
        "-m", "vllm_minimax", "make-tiny-model",
    ]  # fmt: skip
    parts.mkdir()
    for part_dir in sorted(dest.glob("c*")):
        for part in part_dir.iterdir():
            shutil.copy(part, parts)
    probe = (
        f'source "{dest}/stage/vllm-0.33.0-hook.sh" || exit 9\n'
        'python3 -c "import cutlass, torch, transformers, vllm\n'
        'print(vllm.__version__, vllm.__file__, transformers.__version__, torch.__file__)"\n'
        'echo "$PYTHONPATH"\n'
    )
    done = subprocess.run(
        ["bash", "-c", probe], capture_output=True, text=True, timeout=60, env=environ, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    overlay = Path(f"{base}-vllm-0.33.0")
    *_, imported, path = done.stdout.strip().splitlines()
    assert imported.split() == [
        "0.33.0",
        str(overlay / "vllm" / "__init__.py"),
        "5.20.2",
        str(overlay / "torch" / "__init__.py"),
    ]
    assert path == f"{overlay}:{overlay}/extra"
    assert "0.34.0" in (base / "vllm" / "_version.py").read_text()
    assert (base / "transformers" / "__init__.py").read_text() == "__version__ = '5.22.0'\n"

    # Again on the same machine: the overlay is there, nothing is unpacked a second time.
    shutil.rmtree(parts)
    again = subprocess.run(
        ["bash", "-c", probe], capture_output=True, text=True, timeout=60, env=environ, check=False
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.strip().splitlines()[-2:] == [imported, path]
