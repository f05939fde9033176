"""The layout CONTRIBUTING.md describes: what ships in the wheel, and no sys.path edits."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from patchset_helpers import REPO_ROOT, build_and_unpack_wheel


def test_wheel_ships_the_package_but_not_the_test_rigs(tmp_path: Path) -> None:
    installed = build_and_unpack_wheel(tmp_path)
    package = installed / "vllm_minimax"
    assert (package / "cli.py").is_file()
    assert (package / "evals" / "ab.py").is_file()
    assert (package / "_eval_configs" / "throughput" / "indexer.yaml").is_file()
    # doctor's repair of the CUDA bindings reads its pins from the recipe.
    recipe = REPO_ROOT / "requirements" / "user-flashinfer.txt"
    assert (package / "_requirements" / recipe.name).read_bytes() == recipe.read_bytes()
    assert [path.name for path in (package / "_requirements").iterdir()] == [recipe.name]
    assert not (package / "testing").exists()
    assert not (installed / "benchmarks").exists()


def test_no_module_edits_sys_path_to_import_project_code() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    # The two places that must: the doctor imports the target's vLLM, and the patched-vLLM
    # tests put the patched tree first (both import vLLM, not this project's modules).
    allowed = {"vllm_minimax/doctor.py", "tests/cpu/patched_vllm/conftest.py"}
    offenders = [
        name
        for name in tracked
        if name not in allowed
        and re.search(r"sys\.path\.(insert|append)\(", (REPO_ROOT / name).read_text())
    ]
    assert offenders == []


def test_benchmarks_import_as_modules_from_the_repository_root() -> None:
    probe = "import benchmarks.indexer_bench, benchmarks.indexer_overhead; print('ok')"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
