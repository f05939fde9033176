"""Developer workflow: a git checkout of vLLM's sdist with the series as commits.

``checkout`` downloads the official sdist from PyPI (sha256 verified, cached), commits the
pristine tree with a fixed identity and date, tags it ``vllm-<version>``, and ``git am``s each
patch of the series. ``export`` turns the commits since that tag back into the series with
``git format-patch``, deterministically: running it twice gives byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from vllm_minimax.errors import Interrupted, UserError, describe_os_error
from vllm_minimax.patchset import (
    SERIES_FILE_NAME,
    git_executable,
    isolated_git_env,
    parse_series_file,
    patches_root,
    read_vllm_version,
    require_series_dir,
)

PYPI_SIMPLE_URL = "https://pypi.org/simple/vllm/"
PYPI_JSON_ACCEPT = "application/vnd.pypi.simple.v1+json"
# Pinned hashes of sdists the series was written against; PyPI must agree with them.
KNOWN_SDIST_SHA256 = {
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    "0.34.0": "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
}
PRISTINE_IDENTITY = ("vLLM sdist", "sdist@vllm-minimax.invalid")
COMMITTER_IDENTITY = ("vllm-minimax", "dev@vllm-minimax.invalid")
FIXED_DATE = "2000-01-01T00:00:00+0000"
SERIES_HEADER = (
    "# Applied in order by 'vllm-minimax apply'. Written by 'vllm-minimax dev export'.\n"
)
FORMAT_PATCH_OPTIONS = [
    "--zero-commit",
    "--no-signature",
    "--abbrev=7",
    "--no-renames",
    "--no-cover-letter",
    "--no-thread",
    "--filename-max-length=100",
]


class DevTreeError(UserError):
    """A dev checkout or export failed: PyPI, the download, git, or the directory given."""


def cache_dir() -> Path:
    configured = os.environ.get("VLLM_MINIMAX_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "vllm-minimax"


def pristine_tag(version: str) -> str:
    return f"vllm-{version}"


# --------------------------------------------------------------------------------------------
# Downloading the sdist
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SdistRelease:
    filename: str
    url: str
    sha256: str


def find_sdist_release(version: str) -> SdistRelease:
    filename = f"vllm-{version}.tar.gz"
    request = urllib.request.Request(PYPI_SIMPLE_URL, headers={"Accept": PYPI_JSON_ACCEPT})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            index = json.load(response)
    except OSError as error:
        raise DevTreeError(f"cannot read the PyPI index {PYPI_SIMPLE_URL}: {error}") from error
    for entry in index.get("files", []):
        if entry.get("filename") == filename:
            sha256 = entry.get("hashes", {}).get("sha256")
            if not sha256:
                raise DevTreeError(f"PyPI lists {filename} without a sha256")
            pinned = KNOWN_SDIST_SHA256.get(version)
            if pinned is not None and pinned != sha256:
                raise DevTreeError(
                    f"PyPI's sha256 for {filename} is {sha256}, but vllm-minimax pins {pinned}"
                )
            return SdistRelease(filename=filename, url=entry["url"], sha256=sha256)
    raise DevTreeError(f"PyPI has no sdist {filename} for vLLM {version}")


def fetch_sdist(version: str) -> Path:
    """Return the cached sdist of ``version``, downloading and verifying it if needed."""
    directory = cache_dir() / "sdist"
    cached = directory / f"vllm-{version}.tar.gz"
    pinned = KNOWN_SDIST_SHA256.get(version)
    if pinned is not None and cached.is_file() and file_sha256(cached) == pinned:
        return cached
    release = find_sdist_release(version)
    if cached.is_file() and file_sha256(cached) == release.sha256:
        return cached
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{release.filename}.{os.getpid()}.part"
    digest = hashlib.sha256()
    try:
        with (
            urllib.request.urlopen(release.url, timeout=120) as response,
            partial.open("wb") as out,
        ):
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != release.sha256:
            raise DevTreeError(
                f"downloaded {release.url} has sha256 {digest.hexdigest()}, expected"
                f" {release.sha256}"
            )
        os.replace(partial, cached)
    except OSError as error:
        raise DevTreeError(f"cannot download {release.url}: {error}") from error
    finally:
        partial.unlink(missing_ok=True)
    return cached


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# git helpers
# --------------------------------------------------------------------------------------------


def fixed_identity_env(directory: Path) -> dict[str, str]:
    env = isolated_git_env(ceiling=directory.parent)
    env.update(
        GIT_AUTHOR_NAME=PRISTINE_IDENTITY[0],
        GIT_AUTHOR_EMAIL=PRISTINE_IDENTITY[1],
        GIT_AUTHOR_DATE=FIXED_DATE,
        GIT_COMMITTER_NAME=COMMITTER_IDENTITY[0],
        GIT_COMMITTER_EMAIL=COMMITTER_IDENTITY[1],
        GIT_COMMITTER_DATE=FIXED_DATE,
    )
    return env


def git(
    directory: Path, *arguments: str, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    command = [
        git_executable(),
        "-c",
        "core.hooksPath=/dev/null",
        "-c",
        "commit.gpgSign=false",
        "-c",
        "tag.gpgSign=false",
        "-c",
        "core.autocrlf=false",
        "-c",
        "core.quotePath=true",
        *arguments,
    ]
    completed = subprocess.run(
        command,
        cwd=directory,
        env=env if env is not None else fixed_identity_env(directory),
        capture_output=True,
        text=True,
    )
    if check and completed.returncode != 0:
        raise DevTreeError(
            f"`git {' '.join(arguments[:3])}` failed in {directory}:\n"
            + (completed.stderr or completed.stdout).strip()
        )
    return completed


# --------------------------------------------------------------------------------------------
# checkout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkout:
    directory: Path
    version: str
    pristine_tag: str
    patch_commits: list[str]


def checkout(
    version: str, directory: Path, patches_dir: Path | None = None, with_series: bool = True
) -> Checkout:
    """Make DIR a git repo of vLLM ``version``'s sdist, tagged, with the series as commits.

    ``with_series=False`` stops at the tagged pristine tree and needs no series for
    ``version``: that is where a rebase onto a new release starts.
    """
    directory = Path(directory).absolute()
    names: list[str] = []
    if with_series:
        series_dir = require_series_dir(version, patches_dir)
        names = parse_series_file((series_dir / SERIES_FILE_NAME).read_text(encoding="utf-8"))
        for name in names:
            if not (series_dir / name).is_file():
                raise DevTreeError(
                    f"{series_dir / SERIES_FILE_NAME} names {name}, which does not exist"
                )
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise DevTreeError(f"{directory} exists and is not an empty directory")
    existed = directory.exists()
    git_executable()
    sdist = fetch_sdist(version)
    directory.parent.mkdir(parents=True, exist_ok=True)
    made = False
    try:
        extract_sdist(sdist, version, directory)
        made = True
        env = fixed_identity_env(directory)
        git(directory, "init", "--quiet", "--initial-branch=main", env=env)
        git(directory, "add", "--all", "--force", ".", env=env)
        git(directory, "commit", "--quiet", "--no-verify", "-m", f"vLLM {version} sdist", env=env)
        git(directory, "tag", pristine_tag(version), env=env)
        if names:
            commit_series(directory, version, series_dir, names, env)
    except SeriesDoesNotApply:
        raise
    except BaseException as error:
        if made:
            # A checkout stopped part way (no tag, or part of the series) is of no use: DIR
            # goes back to what it was, absent or empty, so that the command can run again.
            shutil.rmtree(directory, ignore_errors=True)
            outcome = f"the partial checkout in {directory} was removed"
        else:
            outcome = f"nothing was written to {directory}"
        if existed:
            directory.mkdir(exist_ok=True)
        if isinstance(error, KeyboardInterrupt):
            raise Interrupted(f"interrupted: {outcome}") from None
        if isinstance(error, OSError):
            if error.filename is None:  # tarfile's writes name no file
                error = OSError(error.errno, error.strerror, str(directory))
            raise DevTreeError(f"{describe_os_error(error, vllm_tree=False)}; {outcome}") from None
        if isinstance(error, UserError):
            raise DevTreeError(f"{error}; {outcome}") from None
        raise
    commits = patch_commits(directory, version)
    return Checkout(directory, version, pristine_tag(version), commits)


class SeriesDoesNotApply(DevTreeError):
    """`git am` of the series failed; the tagged pristine tree stays for the developer to fix."""


def commit_series(
    directory: Path, version: str, series_dir: Path, names: list[str], env: dict[str, str]
) -> None:
    """`git am` the series' patches onto the tagged pristine tree, one commit each."""
    # Authors and author dates come from the patches; the committer is fixed.
    am_env = dict(env)
    for key in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_AUTHOR_DATE"):
        am_env.pop(key)
    completed = git(
        directory,
        "am",
        "--quiet",
        "--keep-cr",
        "--keep-non-patch",
        *[str(series_dir / name) for name in names],
        env=am_env,
        check=False,
    )
    if completed.returncode != 0:
        git(directory, "am", "--abort", env=am_env, check=False)
        raise SeriesDoesNotApply(
            f"`git am` of the series failed in {directory} (the pristine tree is committed"
            f" and tagged {pristine_tag(version)}):\n"
            + (completed.stderr or completed.stdout).strip()
        )


def extract_sdist(sdist: Path, version: str, directory: Path) -> None:
    top = f"vllm-{version}"
    with tempfile.TemporaryDirectory(prefix=".vllm-minimax-extract-", dir=directory.parent) as tmp:
        with tarfile.open(sdist, "r:gz") as archive:
            members = archive.getmembers()
            for member in members:
                if member.name != top and not member.name.startswith(top + "/"):
                    raise DevTreeError(f"{sdist} has {member.name} outside {top}/")
            archive.extractall(tmp, members=members, filter="data")
        if directory.exists():
            directory.rmdir()
        os.replace(Path(tmp) / top, directory)


def pristine_tree(version: str) -> Path:
    """Return a directory holding vLLM ``version``'s pristine ``vllm/`` package from its sdist.

    Extracted once into the cache (``pristine/vllm-<version>/``) and reused; callers mirror
    or copy it and never write into it. Only the Python sources are there: the sdist has
    no compiled extensions.
    """
    root = cache_dir() / "pristine" / f"vllm-{version}"
    if (root / "vllm" / "__init__.py").is_file():
        return root
    sdist = fetch_sdist(version)
    root.parent.mkdir(parents=True, exist_ok=True)
    top = f"vllm-{version}/"
    with tempfile.TemporaryDirectory(prefix=".vllm-minimax-pristine-", dir=root.parent) as tmp:
        with tarfile.open(sdist, "r:gz") as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(top + "vllm/")]
            archive.extractall(tmp, members=members, filter="data")
        try:
            os.replace(Path(tmp) / top, root)
        except OSError:
            if not (root / "vllm" / "__init__.py").is_file():
                raise
    return root


def patch_commits(directory: Path, version: str) -> list[str]:
    output = git(directory, "rev-list", "--reverse", f"{pristine_tag(version)}..HEAD").stdout
    return output.split()


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Export:
    series_dir: Path
    patch_files: list[Path]


def checkout_version(directory: Path) -> str:
    """Return the vLLM version of a `dev checkout` directory, or raise DevTreeError."""
    directory = Path(directory)
    if not (directory / ".git").is_dir() or not (directory / "vllm").is_dir():
        raise DevTreeError(f"{directory} is not a `vllm-minimax dev checkout` (no .git or vllm/)")
    version = read_vllm_version(directory)
    tag = pristine_tag(version)
    if git(
        directory, "rev-parse", "--verify", "--quiet", f"refs/tags/{tag}", check=False
    ).returncode:
        raise DevTreeError(f"{directory} has no tag {tag}; it is not a `vllm-minimax dev checkout`")
    if git(directory, "merge-base", "--is-ancestor", tag, "HEAD", check=False).returncode:
        raise DevTreeError(f"HEAD of {directory} does not descend from the pristine tag {tag}")
    return version


def export(directory: Path, patches_dir: Path | None = None) -> Export:
    directory = Path(directory).absolute()
    version = checkout_version(directory)
    dirty = git(directory, "status", "--porcelain", "--untracked-files=normal").stdout
    if dirty.strip():
        raise DevTreeError(
            f"{directory} has uncommitted changes; commit them (one commit per patch) first:\n"
            + dirty.rstrip()
        )
    root = patches_root() if patches_dir is None else Path(patches_dir)
    if root.resolve() == (Path(__file__).resolve().parent / "_patches"):
        raise DevTreeError(
            f"{root} is the copy of the series inside an installed vllm-minimax; export into"
            " the repository instead (run from an editable install, or set VLLM_MINIMAX_PATCHES)"
        )
    series_dir = root / f"vllm-{version}"
    tag = pristine_tag(version)
    with tempfile.TemporaryDirectory(prefix="vllm-minimax-export-") as tmp:
        output_dir = Path(tmp)
        git(directory, "format-patch", *FORMAT_PATCH_OPTIONS, "-o", str(output_dir), f"{tag}..HEAD")
        produced = sorted(output_dir.glob("*.patch"))
        series_dir.mkdir(parents=True, exist_ok=True)
        for stale in old_patch_files(series_dir):
            stale.unlink()
        written = []
        for patch in produced:
            destination = series_dir / patch.name
            shutil.copyfile(patch, destination)
            written.append(destination)
    series_text = SERIES_HEADER + "".join(f"{path.name}\n" for path in written)
    (series_dir / SERIES_FILE_NAME).write_text(series_text, encoding="utf-8")
    return Export(series_dir, written)


def old_patch_files(series_dir: Path) -> list[Path]:
    listed: set[str] = set()
    series_file = series_dir / SERIES_FILE_NAME
    if series_file.is_file():
        listed = set(parse_series_file(series_file.read_text(encoding="utf-8")))
    numbered = {path.name for path in series_dir.glob("*.patch") if re.match(r"\d{4}-", path.name)}
    return [
        series_dir / name for name in sorted(listed | numbered) if (series_dir / name).is_file()
    ]
