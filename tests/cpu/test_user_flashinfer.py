"""requirements/user-flashinfer.txt, the one FlashInfer recipe README, docs/deploy.md and
docker/build.sh use: beside vLLM it resolves one cuda-python / cuda-bindings pair, and a
new virtualenv built from that resolution imports flashinfer.msa_ops.

Both tests run uv against the package registry, with the project's uv cache
(`${VLLM_MINIMAX_CACHE:-~/.cache/vllm-minimax}/uv`, which scripts/setup fills)."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from patchset_helpers import REPO_ROOT

RECIPE = REPO_ROOT / "requirements" / "user-flashinfer.txt"
DEV_LOCK = REPO_ROOT / "requirements" / "dev.lock"


def uv_command() -> list[str]:
    found = shutil.which("uv")
    if found:
        return [found]
    return [sys.executable, "-m", "uv"]


def uv(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    cache = Path(os.environ.get("VLLM_MINIMAX_CACHE", Path.home() / ".cache" / "vllm-minimax"))
    env = {**os.environ, "UV_CACHE_DIR": str(cache / "uv")}
    done = subprocess.run(
        [*uv_command(), *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert done.returncode == 0, f"uv {' '.join(args)}:\n{done.stderr[-3000:]}"
    return done


def pins(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith("#"):
            found[name.strip().lower()] = version.split()[0]
    return found


def resolve_user_environment(out: Path) -> dict[str, str]:
    """What `uv pip install vllm==<ours> --override user-flashinfer.txt` resolves."""
    request = out.parent / "request.txt"
    request.write_text(f"vllm=={importlib.metadata.version('vllm')}\n")
    uv(
        "pip", "compile", "-q", str(request), "--override", str(RECIPE),
        "--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28",
        "-o", str(out),
    )  # fmt: skip
    return pins(out.read_text())


def test_beside_vllm_the_recipe_resolves_one_cuda_bindings(tmp_path: Path) -> None:
    resolved = resolve_user_environment(tmp_path / "user.lock")
    recipe = pins(RECIPE.read_text())
    assert resolved["flashinfer-python"] == recipe["flashinfer-python"] == "0.7.4"
    # cuda-python 12.x and cuda-bindings 13.x both own cuda/bindings/: one version of both.
    assert resolved["cuda-python"] == resolved["cuda-bindings"], resolved
    assert resolved["cuda-bindings"].split(".")[0] == "13"


@pytest.mark.slow
def test_a_new_venv_from_the_recipe_imports_msa_ops(tmp_path: Path) -> None:
    """FlashInfer, its requirements and torch at the versions the user's resolution (with
    vLLM) picks, in a virtualenv of their own; vLLM itself is not needed to import
    msa_ops."""
    resolved = tmp_path / "user.lock"
    resolve_user_environment(resolved)
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    uv("venv", "-q", "--python", sys.executable, str(venv))
    uv(
        "pip", "install", "-q", "--python", str(python), "-r", str(RECIPE), "torch",
        "-c", str(resolved),
    )  # fmt: skip
    probe = (
        "import importlib.metadata as m, flashinfer.msa_ops as ops;"
        "print(m.version('cuda-python'), m.version('cuda-bindings'),"
        " callable(ops.msa_proxy_score) and callable(ops.msa_topk_select))"
    )
    done = subprocess.run(
        [str(python), "-c", probe], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    cuda_python, cuda_bindings, has_ops = done.stdout.split()[-3:]
    assert cuda_python == cuda_bindings and has_ops == "True", done.stdout
