"""docker/build.sh, the Dockerfile's build steps, run here against scratch vLLM trees
(no Docker engine on CI): it applies the series and insists on a clean status, and it
refuses a vLLM that has no series, or that is not the image tag's version."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from patchset_helpers import REPO_ROOT, installed_vllm_site, real_series_paths, tree_manifest

from vllm_minimax import devtree, patchset

BUILD_SH = REPO_ROOT / "docker" / "build.sh"
PREBUILD_SH = REPO_ROOT / "docker" / "prebuild.sh"
DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
# Where the image's `docker run` lines are documented.
IMAGE_DOCS = [
    DOCKERFILE,
    REPO_ROOT / "README.md",
    REPO_ROOT / "configs" / "serve" / "README.md",
    *sorted((REPO_ROOT / "docs").glob("*.md")),
]
VENV_BIN = Path(sys.executable).parent


def scratch_vllm(root: Path, version: str | None = None) -> Path:
    """The files the series reads, copied from the installed vLLM 0.34.0."""
    site = installed_vllm_site()
    for rel in ["vllm/_version.py", *real_series_paths()]:
        if (site / rel).is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(site / rel, root / rel)
    if version is not None:
        version_file = root / "vllm" / "_version.py"
        text = version_file.read_text()
        version_file.write_text(text.replace(patchset.read_vllm_version(root), version))
    return root


def run_build(*arguments: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(
        ["bash", str(BUILD_SH), *arguments],
        env=environment,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_applies_the_series_and_status_is_clean(tmp_path):
    target = scratch_vllm(tmp_path / "site")
    result = run_build("--skip-pip", TARGET=str(target))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "vLLM 0.34.0" in result.stdout and "series vllm-0.34.0" in result.stdout
    assert "state:        applied (vllm-0.34.0)" in result.stdout
    assert "the series is applied and status is clean" in result.stdout
    state = patchset.series_state(target)
    assert state.applied and state.clean
    assert all(file_state == "as-applied" for _, file_state in state.files)
    assert (target / "vllm/models/minimax_m3/nvidia/indexer_flashinfer.py").is_file()

    again = run_build("--skip-pip", "--target", str(target))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already applied" in again.stdout


def test_version_without_a_series_fails_clearly_and_changes_nothing(tmp_path):
    target = scratch_vllm(tmp_path / "site", version="0.33.9")
    before = tree_manifest(target)
    result = run_build("--skip-pip", TARGET=str(target))
    assert result.returncode == 1
    assert "build.sh: error: no patch series for vLLM 0.33.9" in result.stderr
    assert "supported vLLM versions: 0.33.0, 0.34.0" in result.stderr
    assert tree_manifest(target) == before


def test_image_tag_mismatch_fails_clearly(tmp_path):
    target = scratch_vllm(tmp_path / "site")
    before = tree_manifest(target)
    result = run_build("--skip-pip", TARGET=str(target), EXPECTED_VLLM_VERSION="0.35.0")
    assert result.returncode == 1
    assert "is 0.34.0, but this build expects 0.35.0" in result.stderr
    assert tree_manifest(target) == before


def pristine_033(root: Path) -> Path:
    """vLLM 0.33.0's files the 0.33.0 series reads, from its sdist (cached)."""
    source = devtree.pristine_tree("0.33.0")
    series = patchset.read_series(patchset.require_series_dir("0.33.0"))
    for rel in ["vllm/_version.py", *patchset.touched_paths(series)]:
        if (source / rel).is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / rel, root / rel)
    return root


def test_image_tag_v0_33_0_applies_the_0_33_0_series(tmp_path):
    """VLLM_IMAGE_TAG=v0.33.0 (the Dockerfile passes EXPECTED_VLLM_VERSION=0.33.0) on
    vLLM 0.33.0's own files: the 0.33.0 series goes on and status is clean."""
    target = pristine_033(tmp_path / "site")
    result = run_build("--skip-pip", TARGET=str(target), EXPECTED_VLLM_VERSION="0.33.0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "vLLM 0.33.0" in result.stdout and "series vllm-0.33.0" in result.stdout
    assert "state:        applied (vllm-0.33.0)" in result.stdout
    state = patchset.series_state(target)
    assert state.applied and state.clean and state.series_dir is not None
    assert state.series_dir.name == "vllm-0.33.0"


@pytest.mark.parametrize(
    ("tree", "tag_version"), [("0.33.0", "0.34.0"), ("0.34.0", "0.33.0")], ids=str
)
def test_tag_of_the_other_supported_release_is_refused(tmp_path, tree, tag_version):
    """Both releases have a series, so only the tag check stands between a v0.34.0 build
    and a 0.33.0 tree (and back): it refuses before anything is written."""
    site = tmp_path / "site"
    target = pristine_033(site) if tree == "0.33.0" else scratch_vllm(site)
    before = tree_manifest(target)
    result = run_build("--skip-pip", TARGET=str(target), EXPECTED_VLLM_VERSION=tag_version)
    assert result.returncode == 1
    assert f"is {tree}, but this build expects {tag_version}" in result.stderr
    assert tree_manifest(target) == before


def test_pip_steps_install_flashinfer_074_and_the_package_without_deps(tmp_path):
    """The pip half, with pip replaced by echo: the requirement check runs against this
    environment (which has flashinfer-python 0.7.4 and everything it needs)."""
    target = scratch_vllm(tmp_path / "site")
    result = run_build(TARGET=str(target), PIP="echo PIP")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    recipe = REPO_ROOT / "requirements" / "user-flashinfer.txt"
    # The CUDA-bindings pair goes first, as in README's recipe (issue 57).
    uninstall = lines.index("PIP uninstall -y cuda-python cuda-bindings")
    assert lines[uninstall + 1] == f"PIP install --no-cache-dir --no-deps -r {recipe}"
    assert "build.sh: flashinfer-python 0.7.4's requirements are already met" in lines
    assert f"PIP install --no-cache-dir --no-deps {REPO_ROOT}" in lines
    assert "build.sh: flashinfer.msa_ops imports" in lines
    assert patchset.series_state(target).clean


def test_the_build_fails_when_msa_ops_does_not_import(tmp_path):
    """pip exits 0 from installs that leave msa_ops unimportable (issue 57); the build does
    not, and applies nothing."""
    planted = tmp_path / "planted" / "flashinfer"
    planted.mkdir(parents=True)
    (planted / "__init__.py").write_text("")
    (planted / "msa_ops.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'cuda.bindings.driver'\")\n"
    )
    target = scratch_vllm(tmp_path / "site")
    before = tree_manifest(target)
    result = run_build(TARGET=str(target), PIP="echo PIP", PYTHONPATH=str(planted.parent))
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "build.sh: error: flashinfer.msa_ops does not import after the installs above:"
        " ModuleNotFoundError: No module named 'cuda.bindings.driver'"
    ) in result.stderr
    assert tree_manifest(target) == before


def test_dockerfile_builds_from_the_series_image_and_keeps_its_entrypoint():
    text = DOCKERFILE.read_text()
    default_tag = re.search(r"^ARG VLLM_IMAGE_TAG=v(\S+)$", text, re.M)
    assert default_tag, "Dockerfile must declare ARG VLLM_IMAGE_TAG=v<version>"
    assert patchset.series_dir_for(default_tag.group(1)) is not None
    assert re.search(r"^FROM vllm/vllm-openai:\$\{VLLM_IMAGE_TAG\}$", text, re.M)
    assert "docker/build.sh" in text
    instructions = {line.split()[0] for line in text.splitlines() if line and line[0] != "#"}
    assert not instructions & {"ENTRYPOINT", "CMD"}, "the base image's entrypoint is kept"


def dockerignored(relative: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `relative` out of the build context: a pattern matches the
    path or one of its parent directories (a leading `**/` at any depth); the last
    matching pattern wins, `!` re-includes."""
    parts = relative.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for raw in patterns:
        include = raw.startswith("!")
        pattern = raw.removeprefix("!").strip("/")
        if pattern.startswith("**/"):
            tail = pattern.removeprefix("**/")
            matched = any(
                fnmatch.fnmatchcase("/".join(parts[start : n + 1]), tail)
                for n in range(len(parts))
                for start in range(n + 1)
            )
        else:
            matched = any(fnmatch.fnmatchcase(candidate, pattern) for candidate in candidates)
        if matched:
            ignored = not include
    return ignored


def test_dockerignore_matching():
    patterns = [".git", "**/__pycache__", "*.egg-info", "results", "!results/keep.md"]
    assert dockerignored("results/h200/report.md", patterns)
    assert not dockerignored("results/keep.md", patterns)
    assert dockerignored("vllm_minimax/__pycache__/cli.pyc", patterns)
    assert dockerignored("vllm_minimax.egg-info/PKG-INFO", patterns)
    assert not dockerignored("configs/serve/h200-8x.yaml", patterns)


def test_documented_image_config_paths_are_in_the_image():
    """Each `/opt/vllm-minimax/...` path that a documented `docker run` line passes is a
    repository file that the Dockerfile's `COPY . /opt/vllm-minimax` puts there (not left
    out by .dockerignore)."""
    copy = re.search(r"^COPY \. (/\S+)$", DOCKERFILE.read_text(), re.M)
    assert copy, "the Dockerfile copies the repository with one `COPY . <dir>`"
    image_root = copy.group(1).rstrip("/")
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    documented = {
        (doc.relative_to(REPO_ROOT).as_posix(), path)
        for doc in IMAGE_DOCS
        for path in re.findall(rf"{re.escape(image_root)}/(\S+\.yaml)", doc.read_text())
    }
    assert {path for _, path in documented} >= {
        "configs/serve/h200-8x.yaml",
        "configs/serve/h100-16x-2node.yaml",
    }, documented
    for doc, path in sorted(documented):
        assert (REPO_ROOT / path).is_file(), f"{doc} passes {image_root}/{path}: no such file"
        assert not dockerignored(path, patterns), f"{doc}: .dockerignore leaves {path} out"


@pytest.mark.parametrize(
    ("tool", "arguments"),
    [
        ("hadolint", [str(DOCKERFILE)]),
        (
            "shellcheck",
            [
                str(BUILD_SH),
                str(PREBUILD_SH),
                *(str(REPO_ROOT / "scripts" / n) for n in ("smoke-gpu", "setup-cpu-server")),
            ],
        ),
    ],
)
def test_lint(tool, arguments):
    executable = VENV_BIN / tool
    assert executable.exists(), f"{tool} is in requirements/dev.lock; run scripts/setup"
    result = subprocess.run(
        [str(executable), *arguments], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


# Shipped serving configs for SM120 cards: FlashInfer 0.7.4 keeps no SM12x MSA kernel on disk,
# so the image has nothing to prebuild for them.
SM120_CONFIGS = {"rtx-pro-6000-4x", "rtx-pro-6000-8x"}


def _fake_distribution(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def run_prebuild(tmp_path: Path, **env: str | None) -> subprocess.CompletedProcess[str]:
    """docker/prebuild.sh with pip and the build command echoed; ``NAME=None`` unsets NAME."""
    environment = {
        **os.environ,
        "PYTHON": sys.executable,
        "PIP": "echo PIP",
        "VLLM_MINIMAX": "echo VLLM_MINIMAX",
        "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "flashinfer"),
        "HUMMING_CACHE_DIR": str(tmp_path / "humming"),
        **env,
    }
    for name in ("PREBUILD_CONFIGS", "PREBUILD_KV_CACHE_DTYPES", "PREBUILD_GPUS"):
        if name not in env:
            environment.pop(name, None)
    for name in [name for name, value in env.items() if value is None]:
        environment.pop(name)
    return subprocess.run(
        ["bash", str(PREBUILD_SH)], env=environment, capture_output=True, text=True, timeout=120
    )


def test_prebuild_step_uninstalls_kernel_wheels_flashinfer_ignores(tmp_path):
    """The base image's FlashInfer kernel wheels for its pinned 0.7.3 go; wheels of the
    installed FlashInfer (0.7.4, with or without a CUDA suffix) stay."""
    site = tmp_path / "site"
    _fake_distribution(site, "flashinfer-cubin", "0.7.3")
    _fake_distribution(site, "flashinfer-jit-cache", "0.7.3+cu130")
    _fake_distribution(site, "flashinfer-jit-cache-sm90a", "0.7.3+cu130")
    _fake_distribution(site, "flashinfer-jit-cache-sm100a", "0.7.4+cu130")
    result = run_prebuild(tmp_path, PYTHONPATH=str(site), PREBUILD_CONFIGS="")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "PIP uninstall -y flashinfer-cubin flashinfer-jit-cache flashinfer-jit-cache-sm90a"
        in result.stdout.splitlines()
    )
    assert "PREBUILD_CONFIGS is empty: nothing prebuilt" in result.stdout


def test_prebuild_step_builds_the_sm90_configs_for_both_kv_caches_and_cards(tmp_path):
    result = run_prebuild(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no FlashInfer kernel wheels of another release" in result.stdout
    [command] = [line for line in result.stdout.splitlines() if line.startswith("VLLM_MINIMAX")]
    arguments = command.split()[1:]
    assert arguments[:4] == ["warmup", "--prebuild", "--cache-dir", str(tmp_path / "flashinfer")]
    pairs = list(zip(arguments[4::2], arguments[5::2], strict=True))
    shipped = {path.stem for path in (REPO_ROOT / "configs" / "serve").glob("*.yaml")}
    assert {value for flag, value in pairs if flag == "--config"} == shipped - SM120_CONFIGS
    assert [value for flag, value in pairs if flag == "--kv-cache-dtype"] == ["auto", "fp8"]
    assert [value for flag, value in pairs if flag == "--gpu"] == ["h100", "h200"]
    # Group 0 may write the cache (FlashInfer's locks), as the non-root `vllm` user needs.
    assert (tmp_path / "flashinfer").stat().st_mode & 0o070 == 0o070


def test_dockerfile_prebuilds_into_the_cache_the_server_reads():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ENV FLASHINFER_WORKSPACE_BASE=/opt/flashinfer$", text, re.M)
    build, prebuild = text.index("docker/build.sh"), text.index("docker/prebuild.sh")
    assert build < prebuild  # FlashInfer 0.7.4 and the series first
    script_default = re.search(
        r'^CONFIGS="\$\{PREBUILD_CONFIGS-(.*)\}"$', PREBUILD_SH.read_text(), re.M
    )
    dockerfile_default = re.search(r'^ARG PREBUILD_CONFIGS="(.*)"$', text, re.M)
    assert script_default and dockerfile_default
    assert script_default.group(1) == dockerfile_default.group(1)


# Where the image's prebuild writes vLLM's model-info file and CuTe-DSL entries: vLLM's default
# VLLM_CACHE_ROOT for root, as the Dockerfile sets none.
IMAGE_VLLM_CACHE = "/root/.cache/vllm"


def test_documented_docker_runs_hide_none_of_the_images_caches():
    """No documented `docker run` mounts a host directory over (or above) the image's FlashInfer,
    Humming or vLLM cache, which would hide what `docker build` put there, nor Humming's default
    cache under /root, which the image's HUMMING_CACHE_DIR leaves unread (a named volume starts
    as a copy of the image's directory, so it may)."""
    text = DOCKERFILE.read_text()
    assert not re.search(r"^ENV VLLM_CACHE_ROOT=", text, re.M), "update IMAGE_VLLM_CACHE"
    caches = [
        re.search(rf"^ENV {name}=(/\S+)$", text, re.M).group(1)  # type: ignore[union-attr]
        for name in ("FLASHINFER_WORKSPACE_BASE", "HUMMING_CACHE_DIR")
    ] + [IMAGE_VLLM_CACHE]
    for doc in IMAGE_DOCS:
        for source, target in re.findall(r"-v (\S+?):(/\S*)", doc.read_text()):
            where = f"{doc.relative_to(REPO_ROOT)}: -v {source}:{target}"
            assert not target.startswith("/root/.humming"), f"{where}: not read in the image"
            if source.startswith(("/", "~", ".", "$")):
                for cache in caches:
                    hidden = cache == target or cache.startswith(target.rstrip("/") + "/")
                    assert not hidden, f"{where} hides the image's {cache}"


REPORT_ENV = """#!/bin/sh
echo "LIBRARY_PATH=${LIBRARY_PATH:-}"
echo "HUMMING_CACHE_DIR=${HUMMING_CACHE_DIR:-}"
"""


def test_the_image_builds_hummings_kernels_where_its_server_reads_them(tmp_path):
    """The Dockerfile's HUMMING_CACHE_DIR is set before the prebuild step runs, reaches the build
    command (which builds the published checkpoint's Humming kernels: test_prebuild_humming.py),
    and the cache is group-0 writable after; without it the step stops before building."""
    text = DOCKERFILE.read_text()
    env = re.search(r"^ENV HUMMING_CACHE_DIR=(/\S+)$", text, re.M)
    assert env, "the Dockerfile sets HUMMING_CACHE_DIR to a path in the image"
    assert env.start() < text.index("docker/prebuild.sh")
    assert env.group(1) != "/opt/flashinfer"  # not under the FlashInfer mount's path either
    report = tmp_path / "report-env"
    report.write_text(REPORT_ENV)
    report.chmod(0o755)
    humming = tmp_path / "image" / "humming"
    result = run_prebuild(tmp_path, VLLM_MINIMAX=str(report), HUMMING_CACHE_DIR=str(humming))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"HUMMING_CACHE_DIR={humming}" in result.stdout.splitlines()
    assert humming.stat().st_mode & 0o070 == 0o070
    unset = run_prebuild(tmp_path, VLLM_MINIMAX=str(report), HUMMING_CACHE_DIR=None)
    assert unset.returncode == 1
    assert "prebuild.sh: set HUMMING_CACHE_DIR" in unset.stderr
    assert "HUMMING_CACHE_DIR=" not in unset.stdout


@pytest.mark.parametrize("with_stubs", [False, True])
def test_prebuild_step_gives_the_linker_a_libcuda_only_when_it_has_none(tmp_path, with_stubs):
    """FlashInfer links with -lcuda; at `docker build` no driver is there. Without a libcuda.so
    the step puts a stand-in with the driver's soname on LIBRARY_PATH; with the toolkit's stubs
    it adds nothing."""
    cuda_home = tmp_path / "cuda"
    if with_stubs:
        from vllm_minimax.testing.pypi_cuda import make_cuda_home

        make_cuda_home(cuda_home)
    report = tmp_path / "report-env"
    report.write_text(REPORT_ENV)
    report.chmod(0o755)
    result = run_prebuild(
        tmp_path, CUDA_HOME=str(cuda_home), VLLM_MINIMAX=str(report), LIBRARY_PATH=""
    )
    assert result.returncode == 0, result.stdout + result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("LIBRARY_PATH=")]
    if with_stubs:
        assert line == "LIBRARY_PATH="
        return
    stub = Path(line.removeprefix("LIBRARY_PATH=")) / "libcuda.so"
    dynamic = subprocess.run(["readelf", "-d", str(stub)], capture_output=True, text=True).stdout
    assert "Library soname: [libcuda.so.1]" in dynamic
