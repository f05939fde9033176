"""Which files of the series are byte for byte the same in another release's tree as in the
installed release's, for tests whose outcome depends on nothing else.

A test marked ``same_code_in_every_release(path, ...)`` calls only code of those series files
(and the installed FlashInfer, torch and the test itself, which every release's run shares).
In a run against a release other than the installed one, such a test is deselected where each
of its files in the tree under test equals the file the installed release's series creates:
the installed release's run (tests/cpu/patched_vllm, every test) then ran the same code with
the same inputs. A file another patch also touches, or one the series does not create, counts
as different, so its tests run in every release.
"""

from __future__ import annotations

import re
from pathlib import Path

from vllm_minimax import patchset

MARK = "same_code_in_every_release"

_HUNK = re.compile(r"^@@ -0,0 \+1(?:,(\d+))? @@")


def created_file(series_dir: Path, path: str) -> bytes | None:
    """``path`` as the series in ``series_dir`` leaves it, where exactly one of its patches
    touches it and that patch creates it (in one hunk); otherwise None."""
    touching = [p for p in patchset.read_series(series_dir) if path in p.paths]
    if len(touching) != 1 or path not in touching[0].created:
        return None
    lines = touching[0].path.read_text(encoding="utf-8").split("\n")
    start = lines.index(f"diff --git a/{path} b/{path}")
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].startswith("diff --git ")),
        len(lines),
    )
    section = lines[start:end]
    hunks = [i for i, line in enumerate(section) if line.startswith("@@")]
    if len(hunks) != 1:
        return None
    match = _HUNK.match(section[hunks[0]])
    if match is None:
        return None
    count = int(match.group(1) or 1)
    body = section[hunks[0] + 1 : hunks[0] + 1 + count]
    if len(body) != count or not all(line.startswith("+") for line in body):
        return None
    tail = section[hunks[0] + 1 + count : hunks[0] + 2 + count]
    newline = "" if tail == ["\\ No newline at end of file"] else "\n"
    return ("\n".join(line[1:] for line in body) + newline).encode("utf-8")


def same_as_installed(tree: Path, paths: tuple[str, ...], installed_series_dir: Path) -> bool:
    """Each of ``paths`` in ``tree`` is byte for byte what the installed series creates."""
    if not paths:
        return False
    for path in paths:
        installed = created_file(installed_series_dir, path)
        file = tree / path
        if installed is None or not file.is_file() or file.read_bytes() != installed:
            return False
    return True
