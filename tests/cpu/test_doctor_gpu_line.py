"""doctor's GPU line: on Linux without a GPU driver torch finds no GPU, and doctor says so
without importing torch, which was most of a call whose other answers were stored (issue 57);
with a driver, torch is asked, as before."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_minimax import doctor

# The GPU line and whether torch was imported, in a process of its own (pytest's has torch),
# with `doctor.gpu_drivers` answering DRIVERS.
PROBE = """
import json, sys
from vllm_minimax import doctor
doctor.gpu_drivers = lambda: DRIVERS
line, capability = doctor.gpu_line()
print(json.dumps([line, capability, "torch" in sys.modules]))
"""


def gpu_line_in_a_new_process(drivers: list[str]) -> tuple[str, object, bool]:
    code = PROBE.replace("DRIVERS", repr(drivers))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    line, capability, imported = json.loads(done.stdout.splitlines()[-1])
    return line, capability, imported


@pytest.mark.skipif(sys.platform != "linux", reason="the driver check is Linux's")
def test_without_a_driver_the_gpu_line_is_none_and_torch_is_not_imported() -> None:
    assert gpu_line_in_a_new_process([]) == ("none", None, False)


def test_with_a_driver_torch_is_asked() -> None:
    line, capability, imported = gpu_line_in_a_new_process(["libcuda.so.1"])
    assert imported
    if line == "none":  # this machine's torch finds no GPU
        assert capability is None
    else:
        assert line.endswith(f"(compute capability {capability[0]}.{capability[1]})")


def test_where_no_driver_is_found_torch_finds_no_gpu() -> None:
    """The rule on this machine: no driver found means torch finds no GPU (a GPU machine,
    where a driver is found, checks the other half: gpu_line names the GPU torch finds)."""
    drivers = doctor.gpu_drivers()
    import torch

    if not drivers:
        assert not torch.cuda.is_available()
    else:
        line, capability = doctor.gpu_line()
        assert capability == (
            torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None
        ), line


@pytest.mark.parametrize("loads", [(), ("libcuda.so.1",), ("libnvidia-ml.so.1",)])
@pytest.mark.parametrize("rocm", [False, True])
def test_a_driver_is_each_library_the_loader_opens_and_rocms_node(monkeypatch, loads, rocm):
    opened: list[str] = []

    def cdll(name: str) -> object:
        opened.append(name)
        if name not in loads:
            raise OSError(f"{name}: cannot open shared object file")
        return object()

    monkeypatch.setattr(doctor.ctypes, "CDLL", cdll)
    monkeypatch.setattr(doctor.os.path, "exists", lambda path: rocm and path == "/dev/kfd")
    assert doctor.gpu_drivers() == [*loads, *(["/dev/kfd"] if rocm else [])]
    assert opened == ["libcuda.so.1", "libnvidia-ml.so.1"]
