"""Virtualenvs in the install states of issue 57, for the pip recipe's tests.

A state's venv holds that state's CUDA-bindings distributions, installed by uv (as users'
were) from pinned wheels one after the other, and sees the rest of this environment
(torch, FlashInfer, vLLM) through a directory of links that its `.pth` adds as a site
directory: on `sys.path` after the venv's own site-packages, with the `.pth` files there
run (CUTLASS's DSL, which imports `cuda.bindings.driver`, is found through one). The links
leave out the `cuda` namespace and every distribution that writes it, so that `cuda.*`
resolves to the venv's files alone, as in an environment of its own. pip runs offline (no
index, the wheels as find-links, no configuration file) and never removes what the links
point at: it does not uninstall outside the venv.

The wheels are downloaded once from PyPI, sha256-checked, into
`${VLLM_MINIMAX_CACHE:-~/.cache/vllm-minimax}/wheels/`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

# pip itself, the two CUDA-bindings states users were found in (cuda-python 12.6.2.post1 is
# what uv picks beside vLLM 0.34.0 with only FlashInfer overridden, with cuda-bindings
# 13.5.0), the pair the recipe pins, and what the pair needs from the `cuda` namespace at
# this environment's versions (requirements/dev.lock).
WHEELS = {
    "pip-26.3-py3-none-any.whl": (
        "f3b60b20ffaadd4415ed7957212a38ac63fa4c5fa375bd0f4a797777940fad13"
    ),
    "cuda_python-12.6.2.post1-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl": (
        "d47ba3464fd890025a6d1929dac5e71f2d8c16d0abfe461123cf8be1f975d3a0"
    ),
    "cuda_bindings-13.5.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl": (
        "08b7e8d674c3266facb00453a7e34ea7d3ea965c2f594bb728f269f45f39fbe2"
    ),
    "cuda_python-13.4.4-py3-none-any.whl": (
        "2a4a35c7f102e3c51b9e18e65b34a24b82d7363893b6e2f228978c18bafa1957"
    ),
    "cuda_bindings-13.4.4-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl": (
        "e1cef1eaf5a08cc3bf3675ca9d3f97f3fc7085998556c848b4053e74ba4ba392"
    ),
    "cuda_core-1.2.2-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl": (
        "55a0ea9e590e54e696f04f20b037f52dbac3af09bce0039602324cd4151daab9"
    ),
    "cuda_pathfinder-1.9.1-py3-none-any.whl": (
        "b743c132f90ad2d1e71d43fd28f31ebcde518f943e50fd44aca62b2a80d5230d"
    ),
    "cuda_tile-1.7.0-cp311-cp311-manylinux2014_x86_64.whl": (
        "8a7b5392486c66c7a5668975740d514aee03fb5c38bd6657445091d5076d0291"
    ),
}
PYPI_SIMPLE = "https://pypi.org/simple/{project}/"
PYPI_JSON_ACCEPT = "application/vnd.pypi.simple.v1+json"
# What every state beside vLLM has of the `cuda` namespace besides the pair.
CUDA_NAMESPACE_REST = ("cuda-pathfinder", "cuda-core", "cuda-tile")


def wheel_name_version(filename: str) -> tuple[str, str]:
    name, version = filename.split("-")[:2]
    return re.sub(r"[-_.]+", "-", name).lower(), version


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_root() -> Path:
    configured = os.environ.get("VLLM_MINIMAX_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "vllm-minimax"


def wheel_dir() -> Path:
    return cache_root() / "wheels"


def fetch_wheels() -> Path:
    """The pinned wheels in the cache directory, downloaded from PyPI where missing."""
    directory = wheel_dir()
    directory.mkdir(parents=True, exist_ok=True)
    for filename, pinned in WHEELS.items():
        target = directory / filename
        if target.is_file() and sha256(target) == pinned:
            continue
        project, _ = wheel_name_version(filename)
        request = urllib.request.Request(
            PYPI_SIMPLE.format(project=project), headers={"Accept": PYPI_JSON_ACCEPT}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            files = json.load(response)["files"]
        [entry] = [entry for entry in files if entry["filename"] == filename]
        partial = target.with_suffix(".part")
        with urllib.request.urlopen(entry["url"], timeout=300) as response:
            partial.write_bytes(response.read())
        got = sha256(partial)
        if got != pinned:
            partial.unlink()
            raise AssertionError(f"{entry['url']} has sha256 {got}, pinned {pinned}")
        partial.replace(target)
    return directory


def dev_site_packages() -> Path:
    return Path(importlib.metadata.distribution("flashinfer-python").locate_file(""))


def writes_cuda_namespace(info: Path) -> bool:
    if info.name.startswith("cuda_python-"):
        return True
    record = info / "RECORD"
    return record.is_file() and any(
        line.startswith("cuda/") for line in record.read_text().splitlines()
    )


def make_links(directory: Path) -> Path:
    """This environment's site-packages as links, without the `cuda` namespace and the
    distributions that write it."""
    directory.mkdir()
    for entry in dev_site_packages().iterdir():
        if entry.name == "cuda":
            continue
        if entry.name.endswith(".dist-info") and writes_cuda_namespace(entry):
            continue
        (directory / entry.name).symlink_to(entry)
    return directory


class StateVenv:
    """A virtualenv (no pip of its own) whose `sys.path` ends with the links."""

    def __init__(self, root: Path, links: Path, wheels: Path) -> None:
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120
        )
        self.root = root
        self.python = str(root / "bin" / "python")
        self.wheels = wheels
        [site] = (root / "lib").glob("python3*/site-packages")
        self.site = site
        (site / "00-links.pth").write_text(f"import site; site.addsitedir({str(links)!r})\n")
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
        self.env.update(
            PIP_CONFIG_FILE=os.devnull,
            PIP_NO_INDEX="1",
            PIP_FIND_LINKS=str(wheels),
            PIP_DISABLE_PIP_VERSION_CHECK="1",
            PIP_NO_CACHE_DIR="1",
        )

    def pip(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`pip ARGS` with the pinned pip, run from its wheel, in this venv."""
        pip_wheel = self.wheels / next(name for name in WHEELS if name.startswith("pip-"))
        return self.run([self.python, f"{pip_wheel}/pip", *args])

    def run(self, argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=600,
            cwd=self.root,
        )

    def install(self, *requirements: str) -> None:
        """Install exactly these with uv, without dependencies, in this order, one after the
        other (the later ones' files over the earlier ones')."""
        uv = shutil.which("uv")
        command = [uv] if uv else [sys.executable, "-m", "uv"]
        for requirement in requirements:
            done = self.run(
                [
                    *command, "pip", "install", "-q", "--python", self.python, "--no-deps",
                    "--offline", "--no-index", "--find-links", str(self.wheels),
                    "--link-mode", "copy", requirement,
                ],
                UV_CACHE_DIR=str(cache_root() / "uv"),
            )  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr

    def probe(self, module: str = "flashinfer.msa_ops") -> tuple[bool, str]:
        """Whether `module` imports here with `cuda.bindings` from this venv, and what
        the probe printed (the pair's versions, or the error)."""
        script = (
            "import importlib, importlib.metadata as m\n"
            "def v(n):\n"
            "    try:\n        return m.version(n)\n"
            "    except m.PackageNotFoundError:\n        return None\n"
            "print('pair', v('cuda-python'), v('cuda-bindings'))\n"
            f"importlib.import_module({module!r})\n"
            "import cuda.bindings, cuda.bindings.driver, cuda.bindings.runtime as r\n"
            "r.cudaLibrary_t\n"
            "print('bindings', cuda.bindings.__file__)\n"
        )
        done = self.run([self.python, "-c", script])
        out = done.stdout + done.stderr[-2000:]
        if done.returncode != 0:
            return False, out
        bindings = done.stdout.split("bindings ", 1)[1].strip()
        assert bindings.startswith(str(self.site)), f"cuda.bindings from outside the venv: {out}"
        return True, out
