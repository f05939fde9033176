"""The extra wheels a vLLM 0.34.0 installed without its dependencies lacks (humming-kernels):
pinned as vLLM pins them, downloaded by scripts/prepare-extra-wheels (the real wheel, from
PyPI), installed by scripts/install-extra-wheels into a site, and checked by
scripts/humming-ready, the guard scripts/gpu-rank-slice runs before an MXFP8 slice (exit 6 when
humming is missing)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
PINS = REPO / "requirements" / "gpu-extra-wheels.txt"
WHEEL_NAME = re.compile(r"^(?P<name>[A-Za-z0-9_.]+)-(?P<version>[^-]+)-")


def _pins() -> dict[str, str]:
    lines = [line.strip() for line in PINS.read_text().splitlines()]
    pairs = [line.split("==") for line in lines if line and not line.startswith("#")]
    return {name: version for name, version in pairs}


def _device_provides() -> set[str]:
    [line] = [line for line in PINS.read_text().splitlines() if "device-provides:" in line]
    return set(line.split("device-provides:")[1].split())


def _run(*argv: str, env: dict[str, str] | None = None, timeout: int = 120, with_pip: bool = False):
    """Run from the repository root with python3 the test's interpreter, which holds torch and
    cuda-bindings as the device's does; ``with_pip``: the system's python3 instead, which
    has pip (the test's venv has none) for the installs."""
    path = os.environ["PATH"] if with_pip else f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    return subprocess.run(
        list(argv),
        cwd=REPO,
        env={**os.environ, "PATH": path, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    """What scripts/prepare-extra-wheels downloads: the real wheels and their checksums."""
    dest = tmp_path_factory.mktemp("gpu-extra")
    run = subprocess.run(
        [str(SCRIPTS / "prepare-extra-wheels"), str(dest)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    return dest


@pytest.fixture(scope="module")
def site(wheels, tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    run = _run(str(SCRIPTS / "install-extra-wheels"), str(wheels), str(site), with_pip=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        f"extra wheels: installed humming_kernels 0.1.19 into {site}"
    ]
    return site


def test_the_pin_is_vllms():
    """vLLM 0.34.0 requires humming-kernels[cu13]==0.1.19; the staged wheel is that version."""
    required = importlib.metadata.requires("vllm") or []
    [humming] = [line for line in required if line.startswith("humming-kernels")]
    assert re.fullmatch(r"humming-kernels\[cu13\]==(\S+)", humming)
    assert _pins() == {"humming-kernels": humming.split("==")[1]}


def test_prepare_downloads_each_pinned_wheel_with_its_checksum(wheels):
    [wheel] = sorted(wheels.glob("*.whl"))
    match = WHEEL_NAME.match(wheel.name)
    assert (match["name"], match["version"]) == ("humming_kernels", "0.1.19")
    assert "manylinux" in wheel.name and "x86_64" in wheel.name
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert (wheels / "SHA256SUMS").read_text() == f"{digest}  ./{wheel.name}\n"


def test_every_requirement_of_the_wheels_is_on_the_device(wheels):
    """Installed without dependencies, so each one the wheel declares (outside extras and
    Windows) must be among what the device provides, as the pin file lists it."""
    provides = _device_provides()
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            [metadata] = [name for name in archive.namelist() if name.endswith("/METADATA")]
            lines = archive.read(metadata).decode().splitlines()
        required = [
            line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")
        ]
        plain = [req for req in required if "extra ==" not in req and "win32" not in req]
        names = {re.match(r"[A-Za-z0-9_.-]+", req)[0].lower() for req in plain}
        assert names >= {"torch", "cuda-bindings", "tabulate"}
        assert names <= provides, names - provides


def test_install_puts_the_real_wheel_into_the_site(site):
    assert (site / "humming_kernels-0.1.19.dist-info").is_dir()
    native = site / "humming" / "_native" / "x86_64"
    assert {path.name for path in native.iterdir()} >= {"nvrtc_compile", "libhumming_launcher.so"}


def test_install_again_leaves_the_site_alone(wheels, site):
    marker = site / "humming" / "__init__.py"
    before = marker.stat().st_mtime_ns
    run = _run(str(SCRIPTS / "install-extra-wheels"), str(wheels), str(site))
    assert run.returncode == 0
    assert run.stdout == f"extra wheels: humming_kernels 0.1.19 already in {site}\n"
    assert marker.stat().st_mtime_ns == before


def test_install_refuses_wheels_that_do_not_match_their_checksums(wheels, tmp_path):
    tampered = tmp_path / "wheels"
    tampered.mkdir()
    [wheel] = wheels.glob("*.whl")
    (tampered / wheel.name).write_bytes(wheel.read_bytes() + b"\0")
    (tampered / "SHA256SUMS").write_text((wheels / "SHA256SUMS").read_text())
    target = tmp_path / "site"
    target.mkdir()
    run = _run(str(SCRIPTS / "install-extra-wheels"), str(tampered), str(target), with_pip=True)
    assert run.returncode == 3
    assert f"the wheels in {tampered} do not match" in run.stderr
    assert list(target.iterdir()) == []


def test_install_without_wheels_or_site(wheels, tmp_path):
    run = _run(str(SCRIPTS / "install-extra-wheels"), str(tmp_path / "none"), str(tmp_path))
    assert (run.returncode, run.stdout) == (0, f"extra wheels: none in {tmp_path / 'none'}\n")
    run = _run(str(SCRIPTS / "install-extra-wheels"), str(wheels), str(tmp_path / "no-site"))
    assert run.returncode == 2
    assert run.stderr == f"install-extra-wheels: {tmp_path / 'no-site'} is not a directory\n"


def test_the_toolchain_report_on_the_staged_humming(site):
    """With the staged site first on the path (as on the device), humming imports from it
    and what its first kernel needs (NVRTC, headers with CCCL, the prebuilt helpers) is
    found, without touching a GPU: exit 0. The same report without libnvrtc: exit 2, naming
    what is missing (one process: each run imports torch)."""
    runner = (
        "import runpy, humming.utils.nvrtc as nvrtc\n"
        f"script = {str(SCRIPTS / 'humming_toolchain.py')!r}\n"
        "main = runpy.run_path(script)['main']\n"
        "print('rc', main())\n"
        "def missing():\n    raise RuntimeError('Could not locate the NVRTC library')\n"
        "nvrtc.get_nvrtc_library_path = missing\n"
        "print('rc', main())\n"
    )
    env = {"PYTHONPATH": str(site), "HUMMING_DISABLE_PARALLEL_BUILD": "1"}
    run = _run(sys.executable, "-c", runner, env=env)
    assert run.returncode == 0, run.stderr
    found, without_nvrtc = run.stdout.split("rc 0\n")
    report = dict(
        line.removeprefix("humming: ").split(": ", 1)
        for line in found.splitlines()
        if line.startswith("humming: ")
    )
    assert report["version"] == f"0.1.19 at {site}/humming"
    assert report["compiler"] == "nvrtc"
    assert "libnvrtc.so" in report["nvrtc"]
    assert "cccl" in report["kernel headers"]
    assert report["nvrtc_compile"] == report["libhumming_launcher.so"] == "prebuilt"
    assert without_nvrtc.endswith("humming: missing: libnvrtc with nvrtc.h\nrc 2\n")


@pytest.fixture
def humming_broken(tmp_path) -> dict[str, str]:
    """A path on which ``import humming`` fails, as on a site without the package (the test
    interpreter's own site-packages holds humming-kernels, as vLLM's dependency)."""
    shadow = tmp_path / "shadow" / "humming"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no humming here')\n")
    return {"PYTHONPATH": str(shadow.parent)}


def test_humming_ready_stops_an_mxfp8_slice_without_humming(tmp_path, humming_broken):
    """No wheel staged and no humming: exit 6, as scripts/gpu-rank-slice exits for the slice."""
    run = _run(
        str(SCRIPTS / "humming-ready"), str(tmp_path / "none"), str(tmp_path), env=humming_broken
    )
    assert run.returncode == 6
    assert "humming: import: FAILED (ImportError: no humming here)" in run.stdout
    assert "vLLM would run the MXFP8 MoE through Marlin" in run.stderr


def test_marlin_on_purpose_passes(tmp_path, humming_broken):
    env = {**humming_broken, "MXFP8_MOE_MARLIN_OK": "1"}
    run = _run(str(SCRIPTS / "humming-ready"), str(tmp_path / "none"), str(tmp_path), env=env)
    assert run.returncode == 0
    assert "measuring Marlin" in run.stdout


def test_the_rank_script_runs_the_guard_for_an_mxfp8_slice_only():
    script = (SCRIPTS / "gpu-rank-slice").read_text()
    guard = re.search(r'if \[ "\$weights" = mxfp8 \]; then\n(.*?)\nfi', script, re.S)
    assert guard and guard[1].strip() == 'scripts/humming-ready .gpu-extra "$site" || exit $?'
    # Before the model is made or any server starts.
    assert (
        script.index(guard[0])
        < script.index("vllm_minimax make-tiny-model")
        < script.index("ab_round() {")
    )
