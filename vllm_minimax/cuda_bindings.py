"""The cuda-python / cuda-bindings pair that `flashinfer.msa_ops` imports with: whether the
installed pair is whole, read from the distributions' metadata and files (nothing is
imported), and the commands that reinstall it.

cuda-python 12.x ships `cuda/bindings/` itself, and cuda-bindings 13.x writes the same
files. pip, taking an environment from cuda-python 12.6.2.post1 beside cuda-bindings 13.5.0
to the pair `requirements/user-flashinfer.txt` pins, installs the new cuda-bindings first
and then removes cuda-python 12's files, which are now cuda-bindings' own: it exits 0 and
`import flashinfer.msa_ops` fails (`No module named 'cuda.bindings.driver'`), and running it
again changes nothing, as pip finds both at the pinned versions. Uninstalling both first,
then installing, gives whole files from every such state (README, "Install").
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shlex
import sys
from collections.abc import Iterable
from pathlib import Path

PAIR = ("cuda-python", "cuda-bindings")
BINDINGS_DIR = "cuda/bindings/"
RECIPE_NAME = "user-flashinfer.txt"
# Damaged files named in a problem before "and N more".
SHOWN_FILES = 3


def requirements_root() -> Path:
    """The directory of `user-flashinfer.txt`: `vllm_minimax/_requirements` (a wheel), else
    the repository's `requirements/` next to the package (source tree, editable install)."""
    package_dir = Path(__file__).resolve().parent
    shipped = package_dir / "_requirements"
    if shipped.is_dir():
        return shipped
    return package_dir.parent / "requirements"


def recipe_pins(recipe: Path | None = None) -> dict[str, str]:
    """`name==version` lines of the FlashInfer recipe, by normalized name."""
    text = (recipe or requirements_root() / RECIPE_NAME).read_text()
    pins = {}
    for line in text.splitlines():
        name, sep, version = line.split("#", 1)[0].partition("==")
        if sep:
            pins[normalized(name)] = version.strip()
    return pins


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def installed(path: list[str] | None = None) -> dict[str, importlib.metadata.Distribution]:
    """The distributions Python would load, by normalized name: the first of each name on
    `path` (default `sys.path`), as `importlib.metadata.version` finds it."""
    found: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions(path=path if path is not None else sys.path):
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalized(name), dist)
    return found


def writes_bindings(dist: importlib.metadata.Distribution) -> bool:
    return any(str(file).startswith(BINDINGS_DIR) for file in dist.files or ())


def damaged_files(dist: importlib.metadata.Distribution) -> list[str]:
    """Files under `cuda/` that the distribution's RECORD lists but that are gone or not the
    size it recorded (bytecode aside: Python may rewrite it)."""
    damaged = []
    for file in dist.files or ():
        name = str(file)
        if not name.startswith("cuda/") or "__pycache__" in file.parts:
            continue
        path = Path(str(file.locate()))
        try:
            size = path.stat().st_size
        except OSError:
            damaged.append(name)
            continue
        if file.size is not None and file.size != size:
            damaged.append(name)
    return damaged


def describe(files: Iterable[str]) -> str:
    names = list(files)
    shown = ", ".join(names[:SHOWN_FILES])
    more = len(names) - SHOWN_FILES
    return f"{shown} and {more} more" if more > 0 else shown


def pair_problem(path: list[str] | None = None) -> str | None:
    """Why the installed CUDA bindings are not one whole cuda-bindings, or None: none is
    installed, another distribution writes `cuda/bindings/` too, or files it installed are
    gone or changed."""
    dists = installed(path)
    bindings = dists.get("cuda-bindings")
    if bindings is None:
        return "cuda-bindings is not installed (flashinfer.msa_ops imports cuda.bindings)"
    version = bindings.version
    # The `cuda` namespace's distributions: reading every record (torch's is large) would
    # cost doctor more than half a second.
    others = [
        f"{dist.metadata['Name']} {dist.version}"
        for name, dist in sorted(dists.items())
        if name.startswith("cuda") and name != "cuda-bindings" and writes_bindings(dist)
    ]
    if others:
        return (
            f"{' and '.join(others)} also write{'s' if len(others) == 1 else ''}"
            f" {BINDINGS_DIR} beside cuda-bindings {version}: the files are whichever"
            " was installed last, and removing one deletes the other's"
        )
    damaged = damaged_files(bindings)
    if damaged:
        return (
            f"{len(damaged)} of the files cuda-bindings {version} installed are missing or"
            f" changed ({describe(damaged)})"
        )
    return None


def repair_command(python: str | None = None, *, pip: bool | None = None) -> str:
    """The commands that leave one whole pair as the recipe pins it: both removed, then
    installed, in the environment of `python` (this one by default); with pip where this
    environment has it, else uv's pip (a `uv venv` has none)."""
    python = shlex.quote(python or sys.executable)
    pins = recipe_pins()
    pair = " ".join(f"{name}=={pins[name]}" for name in PAIR)
    names = " ".join(PAIR)
    if pip if pip is not None else importlib.util.find_spec("pip") is not None:
        return f"{python} -m pip uninstall -y {names} && {python} -m pip install {pair}"
    return f"uv pip uninstall --python {python} {names} && uv pip install --python {python} {pair}"
