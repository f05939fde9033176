"""vllm_minimax.cuda_bindings: whether the installed cuda-bindings is whole, read from
distributions written here the way installers write them, and the repair command doctor
advises. tests/cpu/test_install_states.py builds the real states with pip."""

from __future__ import annotations

import base64
import hashlib
import shlex
import sys
from pathlib import Path

import pytest
from patchset_helpers import REPO_ROOT

from vllm_minimax import cuda_bindings, doctor

BINDINGS_FILES = [
    "cuda/bindings/__init__.py",
    "cuda/bindings/driver.so",
    "cuda/bindings/runtime.so",
]


def write_dist(site: Path, name: str, version: str, files: dict[str, bytes]) -> None:
    """A dist-info with METADATA and a RECORD of `files` (path, sha256, size), and the files."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    rows = []
    for rel, data in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{rel},sha256={digest},{len(data)}")
    rows += [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(rows) + "\n")


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """cuda-python 13.4.4 (no files of its own under cuda/) and a whole cuda-bindings."""
    site = tmp_path / "site-packages"
    write_dist(site, "cuda-python", "13.4.4", {"cuda_python_meta.txt": b"x"})
    write_dist(site, "cuda-bindings", "13.4.4", {rel: rel.encode() * 3 for rel in BINDINGS_FILES})
    return site


def test_a_whole_pair_has_no_problem(site: Path) -> None:
    assert cuda_bindings.pair_problem([str(site)]) is None


def test_files_gone_are_counted_and_named(site: Path) -> None:
    """What pip leaves after removing cuda-python 12 over a new cuda-bindings."""
    (site / "cuda/bindings/driver.so").unlink()
    (site / "cuda/bindings/__init__.py").unlink()
    problem = cuda_bindings.pair_problem([str(site)])
    assert problem is not None
    assert problem.startswith("2 of the files cuda-bindings 13.4.4 installed are missing")
    assert "cuda/bindings/__init__.py, cuda/bindings/driver.so" in problem


def test_a_file_of_another_size_is_changed(site: Path) -> None:
    (site / "cuda/bindings/runtime.so").write_bytes(b"cuda-python 12's runtime")
    problem = cuda_bindings.pair_problem([str(site)])
    assert problem is not None and "(cuda/bindings/runtime.so)" in problem


def test_bytecode_python_rewrote_is_not_damage(site: Path) -> None:
    info = next(site.glob("cuda_bindings-*.dist-info"))
    pyc = site / "cuda/bindings/__pycache__/__init__.cpython-311.pyc"
    pyc.parent.mkdir()
    pyc.write_bytes(b"rewritten")
    with (info / "RECORD").open("a") as record:
        record.write("cuda/bindings/__pycache__/__init__.cpython-311.pyc,,1\n")
    assert cuda_bindings.pair_problem([str(site)]) is None


def test_cuda_python_12_beside_cuda_bindings_13_is_named(tmp_path: Path) -> None:
    """uv's resolution beside vLLM 0.34.0 with only FlashInfer overridden."""
    site = tmp_path / "site-packages"
    write_dist(site, "cuda-bindings", "13.5.0", {rel: b"13" for rel in BINDINGS_FILES})
    twelve = {"cuda/__init__.py": b"", **{rel: b"12" for rel in BINDINGS_FILES}}
    write_dist(site, "cuda-python", "12.6.2.post1", twelve)
    problem = cuda_bindings.pair_problem([str(site)])
    assert problem is not None
    assert problem.startswith(
        "cuda-python 12.6.2.post1 also writes cuda/bindings/ beside cuda-bindings 13.5.0"
    )


def test_no_cuda_bindings_is_a_problem(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    write_dist(site, "cuda-python", "13.4.4", {"cuda_python_meta.txt": b"x"})
    assert cuda_bindings.pair_problem([str(site)]) == (
        "cuda-bindings is not installed (flashinfer.msa_ops imports cuda.bindings)"
    )


def test_the_first_distribution_of_a_name_on_the_path_counts(site: Path, tmp_path: Path) -> None:
    """As for importlib.metadata.version: a damaged copy later on the path is not loaded."""
    later = tmp_path / "later"
    write_dist(later, "cuda-bindings", "13.5.0", {"cuda/bindings/gone.so": b"x"})
    (later / "cuda/bindings/gone.so").unlink()
    assert cuda_bindings.pair_problem([str(site), str(later)]) is None
    assert cuda_bindings.pair_problem([str(later), str(site)]) is not None


def test_the_repair_pins_the_recipes_pair_and_quotes_the_python() -> None:
    recipe = cuda_bindings.recipe_pins(REPO_ROOT / "requirements" / "user-flashinfer.txt")
    assert cuda_bindings.recipe_pins() == recipe
    pair = f"cuda-python=={recipe['cuda-python']} cuda-bindings=={recipe['cuda-bindings']}"
    python = "/opt/my env/bin/python"
    quoted = shlex.quote(python)
    assert cuda_bindings.repair_command(python, pip=True) == (
        f"{quoted} -m pip uninstall -y cuda-python cuda-bindings && {quoted} -m pip install {pair}"
    )
    assert cuda_bindings.repair_command(python, pip=False) == (
        f"uv pip uninstall --python {quoted} cuda-python cuda-bindings"
        f" && uv pip install --python {quoted} {pair}"
    )
    # This environment's own Python, pip's form only where pip is importable.
    assert sys.executable in cuda_bindings.repair_command()


def test_doctor_prints_the_problem_and_the_repair(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cuda_bindings, "pair_problem", lambda path=None: "3 files gone")
    monkeypatch.setattr(cuda_bindings, "repair_command", lambda: "REPAIR")
    problem = doctor.cuda_bindings_problem()
    assert problem == "3 files gone"
    assert doctor.cuda_bindings_lines(problem) == [
        "  CUDA bindings: 3 files gone",
        "  repair: REPAIR",
    ]
    assert doctor.cuda_bindings_lines(None) == []
