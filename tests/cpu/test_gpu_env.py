"""The GPU scripts started in a Python environment of this test's making (scripts/gpu-env.sh,
scripts/gpu_env_check.py): with vLLM, its series appliable, FlashInfer and an SM90 GPU each
script applies the series and runs its phase; without one of them it stops before anything
else with one line naming what is missing. The environment is `python3` on PATH running this
interpreter without its site-packages (-S), so that it sees only the scratch site on
PYTHONPATH: a vLLM tree of the files the series touches, FlashInfer's metadata and a stand-in
torch whose one GPU has the compute capability FAKE_GPU_CAPABILITY names (none when empty)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from patchset_helpers import REPO_ROOT, installed_vllm_site, real_series_paths, tree_manifest

from vllm_minimax import patchset

FAKE_TORCH = """\
import os

_capability = os.environ.get("FAKE_GPU_CAPABILITY", "")


class cuda:
    @staticmethod
    def is_available():
        return bool(_capability)

    @staticmethod
    def device_count():
        return 1 if _capability else 0

    @staticmethod
    def get_device_capability(index=0):
        return tuple(int(part) for part in _capability.split("."))

    @staticmethod
    def get_device_name(index=0):
        return "Fake GPU"
"""

# Each script, and a phase that runs to its end (or to its own first check) right after the
# environment's checks, without a GPU's work: (arguments, expected exit, expected output).
SCRIPTS = {
    "gpu-e2e": (["engine"], 1, "TINY_MODEL: set TINY_MODEL"),
    "gpu-sparse-attention": (["no-such-phase"], 2, "unknown phase no-such-phase"),
    "gpu-tp": (["serve", "no-such.yaml"], 2, "no configs/serve/no-such.yaml"),
    "gpu-rank-slice": (["facts"], 0, "phase facts took"),
    "gpu-cold-start": (["no-such-phase"], 2, "unknown phase no-such-phase"),
}


@pytest.fixture(scope="module")
def site_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM 0.34.0's files that the series touches (pristine), FlashInfer 0.7.4's metadata and
    the stand-in torch."""
    site = tmp_path_factory.mktemp("gpu-env") / "site"
    for rel in ["vllm/_version.py", *real_series_paths()]:
        if (installed_vllm_site() / rel).is_file():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(installed_vllm_site() / rel, site / rel)
    (site / "vllm" / "__init__.py").write_text("")
    metadata = site / "flashinfer_python-0.7.4.dist-info" / "METADATA"
    metadata.parent.mkdir()
    metadata.write_text("Metadata-Version: 2.1\nName: flashinfer-python\nVersion: 0.7.4\n")
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(FAKE_TORCH)
    return site


@pytest.fixture
def site(site_template: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(site_template, tmp_path / "site", symlinks=True))


@pytest.fixture
def env(tmp_path: Path, site: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python3.chmod(0o755)
    rank_model = tmp_path / "rank-model"
    rank_model.mkdir()
    (rank_model / "config.json").write_text("{}")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    environ = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("VLLM", "PYTHON", "TINY_MODEL")) and key != "OUT"
    }
    return {
        **environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(site),
        # Not a virtual environment (python3 -S, the site on PYTHONPATH), as on the lent GPU
        # machine: named, so that the scripts may patch it.
        "VLLM_MINIMAX_GPU_TARGET": str(site),
        "FAKE_GPU_CAPABILITY": "9.0",
        "OUT": str(tmp_path / "out"),
        "RANK_MODEL": str(rank_model),
        "TMPDIR": str(scratch),
    }


def run(script: str, env: dict[str, str], *arguments: str, cwd: Path = REPO_ROOT):
    return subprocess.run(
        [str(REPO_ROOT / "scripts" / script), *arguments],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def missing_line(run: subprocess.CompletedProcess[str], script: str) -> str:
    """What the one line a script stops with, when the environment lacks something, names
    missing (the line less its python and hook)."""
    assert run.returncode == 3, run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"{script}: missing: "), lines[0]
    what, _, where = lines[0].partition(" [python: ")
    assert where.endswith("]"), lines[0]
    assert run.stdout == ""
    return what


def vllm_files(site: Path) -> dict[str, str]:
    """Every file and directory under site/vllm (bytecode aside), with its sha256 and mode."""
    return {
        path: digest
        for path, digest in tree_manifest(site / "vllm").items()
        if "__pycache__" not in path
    }


@pytest.mark.parametrize("script", SCRIPTS)
def test_with_everything_the_script_applies_the_series_runs_and_reverts_it(script, env, site):
    found = vllm_files(site)
    arguments, status, output = SCRIPTS[script]
    done = run(script, env, *arguments)
    assert done.returncode == status, done.stdout + done.stderr
    assert output in done.stdout + done.stderr
    summary = (
        f"{script}: vLLM 0.34.0 in {site} (series appliable), FlashInfer 0.7.4,"
        " Fake GPU (compute capability 9.0) [python: "
    )
    assert summary in done.stdout
    assert "; target: named by VLLM_MINIMAX_GPU_TARGET;" in done.stdout
    assert f"gpu-env: {site}: no series applied: reverted on exit" in done.stdout
    if script == "gpu-rank-slice":  # it prints the status in the phase
        assert re.search(r"^state: +applied \(", done.stdout, re.MULTILINE), done.stdout
    assert (
        f"gpu-env: {site}: this checkout's series reverted, as no series was applied before"
        in done.stdout
    )
    assert vllm_files(site) == found


def test_a_clean_series_is_left_as_found(env, site):
    patchset.apply_series(site)
    found = vllm_files(site)
    done = run("gpu-rank-slice", env, "facts")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nothing will be written there" in done.stdout
    assert "reverted" not in done.stdout
    assert vllm_files(site) == found
    assert patchset.series_state(site).clean


def older_revision(site: Path) -> None:
    """Another revision of the series applied to site: its patch sha256s and one file's
    content differ from this checkout's, and the state file records that file as it is."""
    patchset.apply_series(site)
    state_path = site / patchset.STATE_FILE
    state = json.loads(state_path.read_text())
    changed = site / state["files"][0]["path"]
    changed.write_text(changed.read_text() + "# the older revision's line\n")
    state["files"][0]["after"]["sha256"] = hashlib.sha256(changed.read_bytes()).hexdigest()
    state["patches"][0]["sha256"] = "0" * 64
    state_path.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
    now = patchset.series_state(site)
    assert now.applied and not now.clean and "has changed since it was applied" in now.problem


def test_another_revision_applied_is_put_back_byte_for_byte(env, site):
    older_revision(site)
    found = vllm_files(site)
    done = run("gpu-rank-slice", env, "facts")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(series applied (an older revision: applied again))" in done.stdout
    [during] = re.findall(r"^state: +(.*)$", done.stdout, re.MULTILINE)
    assert during.startswith("applied ("), done.stdout  # this checkout's, during the phase
    assert "the earlier series written back as found" in done.stdout
    assert vllm_files(site) == found


def test_a_script_stopped_by_a_signal_puts_the_tree_back(env, site, tmp_path):
    """TERM while the phase runs: the EXIT trap still restores."""
    found = vllm_files(site)
    probe = tmp_path / "probe.sh"
    probe.write_text(
        "source scripts/gpu-env.sh probe --vllm 0.34.0 --capability 9.0\n"
        'echo "phase running"\n'
        # The sleep holds no end of the pipes, so the test waits for bash alone.
        "sleep 60 > /dev/null 2>&1 &\nwait $!\n"
    )
    process = subprocess.Popen(
        ["bash", str(probe)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    for line in process.stdout:
        if line.strip() == "phase running":
            break
    assert patchset.series_state(site).clean  # applied while the phase runs
    process.send_signal(signal.SIGTERM)
    rest, errors = process.communicate(timeout=60)
    assert process.returncode == 143, rest + errors
    assert "this checkout's series reverted" in rest
    assert vllm_files(site) == found


def test_a_failed_restore_is_the_exit_status(env, site, tmp_path):
    """Someone else's series written over the tree meanwhile: left alone, exit 4."""
    probe = tmp_path / "probe.sh"
    probe.write_text(
        "source scripts/gpu-env.sh probe --vllm 0.34.0 --capability 9.0\n"
        f"python3 -c 'import json, sys; p = sys.argv[1]; s = json.load(open(p));"
        f' s["patches"][0]["sha256"] = "1" * 64; json.dump(s, open(p, "w"))\''
        f" {site / patchset.STATE_FILE}\n"
    )
    done = subprocess.run(
        ["bash", str(probe)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 4, done.stdout + done.stderr
    assert "of neither this checkout nor the snapshot" in done.stderr
    assert "was not put back; python3 scripts/gpu_site_restore.py restore" in done.stderr
    assert patchset.applied_state(site) is not None  # not reverted


def test_a_site_outside_a_virtual_environment_is_refused_unless_named(env, site):
    found = vllm_files(site)
    unnamed = {key: value for key, value in env.items() if key != "VLLM_MINIMAX_GPU_TARGET"}
    line = missing_line(run("gpu-e2e", unnamed, "engine"), "gpu-e2e")
    assert f"a vLLM the script may patch ({site} is not in a virtual environment" in line
    assert f"export VLLM_MINIMAX_GPU_TARGET={site} to name that directory)" in line
    other = {**env, "VLLM_MINIMAX_GPU_TARGET": str(site.parent)}
    line = missing_line(run("gpu-e2e", other, "engine"), "gpu-e2e")
    assert f"VLLM_MINIMAX_GPU_TARGET={site.parent}, but python3 imports vllm from {site}" in line
    assert vllm_files(site) == found


def test_a_site_inside_the_virtual_environment_needs_no_name(env, site, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    [inside] = (venv / "lib").glob("python3*/site-packages")
    shutil.rmtree(inside)
    shutil.copytree(site, inside, symlinks=True)
    (tmp_path / "bin" / "python3").write_text(f'#!/bin/sh\nexec "{venv}/bin/python" "$@"\n')
    bare = {key: value for key, value in env.items() if key != "VLLM_MINIMAX_GPU_TARGET"}
    done = run("gpu-e2e", {**bare, "PYTHONPATH": ""}, "engine")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"; target: in the virtual environment {venv.resolve()};" in done.stdout
    assert not patchset.series_state(inside).applied  # reverted on exit


@pytest.mark.parametrize("script", SCRIPTS)
def test_without_vllm_the_script_names_it(script, env, site):
    shutil.rmtree(site / "vllm")
    line = missing_line(run(script, env, *SCRIPTS[script][0]), script)
    assert "vLLM 0.34.0" in line and "(this Python imports no vllm)" in line
    assert "FlashInfer" not in line and "GPU" not in line and "series" not in line


@pytest.mark.parametrize("script", SCRIPTS)
def test_without_the_series_the_script_names_it(script, env, site):
    """A vLLM 0.34.0 whose files the series does not apply to (an edited one) is not patched."""
    edited = site / "vllm" / "config" / "attention.py"
    edited.write_text("# another vLLM's attention config\n")
    line = missing_line(run(script, env, *SCRIPTS[script][0]), script)
    assert f"the vllm-0.34.0 series (does not apply to {site}:" in line
    assert "vLLM 0.34.0 (" not in line
    assert not patchset.series_state(site).applied
    assert edited.read_text() == "# another vLLM's attention config\n"


@pytest.mark.parametrize("script", SCRIPTS)
def test_without_flashinfer_the_script_names_it(script, env, site):
    shutil.rmtree(site / "flashinfer_python-0.7.4.dist-info")
    line = missing_line(run(script, env, *SCRIPTS[script][0]), script)
    assert "FlashInfer 0.7.4 or later (flashinfer-python is not installed)" in line
    assert "vLLM" not in line
    assert not patchset.series_state(site).applied


@pytest.mark.parametrize("script", SCRIPTS)
def test_without_an_sm90_gpu_the_script_names_it(script, env):
    line = missing_line(run(script, {**env, "FAKE_GPU_CAPABILITY": "8.0"}, "x"), script)
    assert "a GPU of compute capability 9.0" in line and "(Fake GPU is 8.0)" in line


def test_everything_missing_is_one_line(env, site):
    shutil.rmtree(site / "vllm")
    shutil.rmtree(site / "flashinfer_python-0.7.4.dist-info")
    line = missing_line(run("gpu-e2e", {**env, "FAKE_GPU_CAPABILITY": ""}, "engine"), "gpu-e2e")
    assert "vLLM 0.34.0 or 0.33.0 (this Python imports no vllm)" in line
    assert "FlashInfer 0.7.4 or later (flashinfer-python is not installed)" in line
    assert "a GPU of compute capability 9.0 or 12.0 or 12.1 (torch sees no CUDA GPU)" in line


def test_an_older_flashinfer_is_named(env, site):
    metadata = site / "flashinfer_python-0.7.4.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace("0.7.4", "0.7.2.post1"))
    line = missing_line(run("gpu-e2e", env, "engine"), "gpu-e2e")
    assert "FlashInfer 0.7.4 or later (0.7.2.post1 is installed)" in line


def test_vllm_version_names_the_release_wanted(env, site):
    line = missing_line(run("gpu-e2e", {**env, "VLLM_VERSION": "0.33.0"}, "engine"), "gpu-e2e")
    assert f"vLLM 0.33.0 ({site} holds vLLM 0.34.0)" in line


def test_the_hook_provides_the_environment(env, site, tmp_path):
    """Sourced first, in the script's shell: what it exports reaches the checks and the phase."""
    hook = tmp_path / "hook.sh"
    hook.write_text(f'export PYTHONPATH="{site}"\nHOOK_RAN=yes\n')
    bare = {**env, "PYTHONPATH": "", "VLLM_MINIMAX_GPU_ENV_HOOK": str(hook)}
    without = run("gpu-e2e", {**bare, "VLLM_MINIMAX_GPU_ENV_HOOK": ""}, "engine")
    assert "(this Python imports no vllm)" in missing_line(without, "gpu-e2e")
    assert without.stderr.rstrip().endswith("VLLM_MINIMAX_GPU_ENV_HOOK: none]")
    done = run("gpu-e2e", bare, "engine")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"VLLM_MINIMAX_GPU_ENV_HOOK: {hook}]" in done.stdout
    # Applied to the site the hook named, and reverted on exit.
    assert f"gpu-env: {site}: this checkout's series reverted" in done.stdout
    assert not patchset.series_state(site).applied


def test_a_hook_that_fails_or_is_missing_stops_the_script(env, tmp_path):
    hook = tmp_path / "hook.sh"
    hook.write_text("echo staging; return 7\n")
    done = run("gpu-tp", {**env, "VLLM_MINIMAX_GPU_ENV_HOOK": str(hook)}, "engine")
    assert done.returncode == 3
    assert done.stderr.strip() == f"gpu-tp: the environment hook {hook} returned 7"
    gone = tmp_path / "gone.sh"
    done = run("gpu-tp", {**env, "VLLM_MINIMAX_GPU_ENV_HOOK": str(gone)}, "engine")
    assert done.returncode == 3
    assert done.stderr.strip() == f"gpu-tp: VLLM_MINIMAX_GPU_ENV_HOOK={gone} is not a file"


def test_a_script_started_outside_the_projects_root_says_so(env, tmp_path):
    done = run("gpu-e2e", env, "engine", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "gpu-e2e: run it from the project's root, as scripts/gpu-e2e"


def carried_parts(directory: Path, files: dict[str, bytes]) -> None:
    """cache-out's parts of an archive of `files` (paths relative to /)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    directory.mkdir()
    packed = buffer.getvalue()
    half = len(packed) // 2
    (directory / "part00").write_bytes(packed[:half])
    (directory / "part01").write_bytes(packed[half:])


def test_carried_caches_unpack_under_their_cache_directories(env, tmp_path):
    home = tmp_path / "home"
    program = home / ".cache" / "flashinfer" / "msa.so"
    carried = tmp_path / "carried"
    carried_parts(carried, {str(program).lstrip("/"): b"program"})
    done = run(
        "gpu-rank-slice", {**env, "HOME": str(home), "CARRIED_CACHES": str(carried)}, "facts"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "carried caches: 2 parts, 1 members under /" in done.stdout
    assert program.read_bytes() == b"program"
    assert (carried / "unpacked").exists()


def test_carried_caches_with_a_member_elsewhere_unpack_nothing(env, tmp_path):
    """A part that writes outside the cache directories (here a file beside them, reached
    from /): nothing of it is written, the slice starts cold."""
    home = tmp_path / "home"
    program = home / ".cache" / "flashinfer" / "msa.so"
    elsewhere = tmp_path / "elsewhere" / "profile.sh"
    carried = tmp_path / "carried"
    carried_parts(
        carried, {str(program).lstrip("/"): b"program", str(elsewhere).lstrip("/"): b"evil"}
    )
    done = run(
        "gpu-rank-slice", {**env, "HOME": str(home), "CARRIED_CACHES": str(carried)}, "facts"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not elsewhere.exists() and not program.exists()
    assert "lies in none of the cache directories" in done.stderr
    assert "are not unpacked; starting cold" in done.stderr
    assert not (carried / "unpacked").exists()
