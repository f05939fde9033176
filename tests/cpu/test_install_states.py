"""README's pip recipe for FlashInfer (issue 57), run as written from each state users are
in, leaves `flashinfer.msa_ops` importable; doctor's repair of the pair pip broke repairs it.

Each state is a virtualenv of its own (tests/cpu/install_states.py): its CUDA-bindings
distributions installed by pip from pinned wheels, the rest of this environment seen
through links."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import shutil
from pathlib import Path

import pytest
from install_states import CUDA_NAMESPACE_REST, WHEELS, StateVenv, fetch_wheels, make_links
from install_states import wheel_name_version as name_version
from patchset_helpers import REPO_ROOT

from vllm_minimax import cuda_bindings

README = REPO_ROOT / "README.md"
PINNED = dict(name_version(filename) for filename in WHEELS if not filename.startswith("pip-"))
REST = [f"{name}=={PINNED[name]}" for name in CUDA_NAMESPACE_REST]
TWELVE = "cuda-python==12.6.2.post1"
FIVE = "cuda-bindings==13.5.0"
# Each state's CUDA-bindings distributions, in the order they were installed.
STATES = {
    "a new venv": [],
    # uv's resolution beside vLLM 0.34.0 with only FlashInfer overridden; which pair's
    # files are on disk depends on the order they were written.
    "cuda-python 12 beside cuda-bindings 13.5.0, 12's files last": [*REST, FIVE, TWELVE],
    "cuda-python 12 beside cuda-bindings 13.5.0, 13.5.0's files last": [*REST, TWELVE, FIVE],
    # What `pip install -r requirements/user-flashinfer.txt` alone left of the state above.
    "the pair pip broke": [*REST, TWELVE, FIVE],
    "the recipe's pair already": [
        *REST,
        f"cuda-bindings=={PINNED['cuda-bindings']}",
        f"cuda-python=={PINNED['cuda-python']}",
    ],
}


def readme_recipe() -> list[list[str]]:
    """The pip lines of README's install into an existing environment that install
    FlashInfer (those before vllm-minimax's own), with the clone's path resolved."""
    text = README.read_text()
    heading = text.index("Or into the environment where vLLM 0.34.0 is installed")
    block = text[heading:].split("```console\n", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.splitlines():
        command = line.removeprefix("$ ").split("  #")[0].strip()
        if command.startswith("pip install ./"):
            break
        argv = shlex.split(command.replace("vllm-minimax/", f"{REPO_ROOT}/"))
        assert argv[0] == "pip", line
        commands.append(argv[1:])
    return commands


@pytest.fixture(scope="module")
def wheels() -> Path:
    return fetch_wheels()


@pytest.fixture(scope="module")
def links(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_links(tmp_path_factory.mktemp("links") / "site-packages")


def state_venv(state: str, root: Path, links: Path, wheels: Path) -> StateVenv:
    venv = StateVenv(root, links, wheels)
    venv.install(*STATES[state])
    if state == "the pair pip broke":
        recipe = REPO_ROOT / "requirements" / "user-flashinfer.txt"
        done = venv.pip("install", "-r", str(recipe))
        # The bug: exit 0, and the files the new cuda-bindings wrote are gone.
        assert done.returncode == 0, done.stdout + done.stderr
        imported, out = venv.probe("cuda.bindings.driver")
        assert not imported and "No module named 'cuda.bindings.driver'" in out, out
    return venv


def test_the_wheels_are_the_recipes_pair_and_this_environments_cuda_namespace() -> None:
    recipe = cuda_bindings.recipe_pins()
    for name in cuda_bindings.PAIR:
        assert PINNED[name] == recipe[name] == importlib.metadata.version(name)
    for name in CUDA_NAMESPACE_REST:
        assert PINNED[name] == importlib.metadata.version(name), f"update WHEELS: {name}"


def test_the_readme_recipe_uninstalls_the_pair_then_installs_the_file() -> None:
    assert readme_recipe() == [
        ["uninstall", "-y", "cuda-python", "cuda-bindings"],
        ["install", "-r", f"{REPO_ROOT}/requirements/user-flashinfer.txt"],
    ]


@pytest.mark.slow
@pytest.mark.parametrize("state", STATES)
def test_the_readme_recipe_leaves_msa_ops_importable(
    state: str, tmp_path: Path, links: Path, wheels: Path
) -> None:
    venv = state_venv(state, tmp_path / "venv", links, wheels)
    if state.endswith("12's files last"):
        imported, out = venv.probe("cuda.bindings.runtime")
        assert not imported and "cudaLibrary_t" in out, out
    for argv in readme_recipe():
        done = venv.pip(*argv)
        assert done.returncode == 0, f"pip {' '.join(argv)}:\n{done.stdout}{done.stderr}"
    imported, out = venv.probe()
    assert imported, out
    pair = f"pair {PINNED['cuda-python']} {PINNED['cuda-bindings']}"
    assert pair in out, out


@pytest.mark.slow
def test_doctor_repairs_the_pair_pip_broke(tmp_path: Path, links: Path, wheels: Path) -> None:
    """doctor, run in the broken venv, names the problem and a command; that command, run
    as printed, leaves msa_ops importable, and doctor then finds nothing to repair."""
    venv = state_venv("the pair pip broke", tmp_path / "venv", links, wheels)
    pip_wheel = wheels / next(name for name in WHEELS if name.startswith("pip-"))
    done = venv.pip("install", "-q", str(pip_wheel))  # `python -m pip` in the venv
    assert done.returncode == 0, done.stdout + done.stderr
    # A vLLM tree of its version file alone: doctor reports the series not applied (exit 1)
    # after the FlashInfer lines, without importing vLLM.
    target = tmp_path / "vllm-tree"
    (target / "vllm").mkdir(parents=True)
    version_file = Path(importlib.metadata.distribution("vllm").locate_file("vllm/_version.py"))
    shutil.copy2(version_file, target / "vllm" / "_version.py")
    doctor = [venv.python, "-m", "vllm_minimax", "doctor", "--capability", "9.0"]
    doctor += ["--target", str(target)]
    environment = {"PYTHONPATH": str(REPO_ROOT), "VLLM_MINIMAX_CACHE": str(tmp_path / "cache")}
    done = venv.run(doctor, **environment)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    problem = re.search(r"^  CUDA bindings: (.*)$", out, re.M)
    assert problem, out
    assert f"cuda-bindings {PINNED['cuda-bindings']} installed are missing" in problem.group(1)
    assert "No module named 'cuda.bindings.driver'" in out
    repair = re.search(r"^  repair: (.*)$", out, re.M)
    assert repair, out
    assert repair.group(1).startswith(f"{shlex.quote(venv.python)} -m pip ")  # this venv's pip
    fixed = venv.run(["bash", "-c", repair.group(1)])
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    after = venv.run(doctor, **environment).stdout
    assert "CUDA bindings:" not in after, after
    assert "flashinfer.msa_ops has msa_proxy_score and msa_topk_select" in after, after
