"""What a GPU script found in the vLLM tree it patches, and putting it back when it ends.

    python3 scripts/gpu_site_restore.py save SITE SNAPSHOT
    python3 scripts/gpu_site_restore.py restore SNAPSHOT

Run by scripts/gpu-env.sh around scripts/ensure-series-applied, from the project's root with
the checkout first on PYTHONPATH. ``save`` writes SNAPSHOT only when the script is about to
write SITE, that is when this checkout's series is not cleanly applied there, and exits 0
either way (it prints what it found). There are two such states (ensure-series-applied
writes nothing in any other):

- no series applied: ``restore`` reverts this checkout's series;
- another revision of a series applied (the state file and the files as it left them):
  ``restore`` reverts this checkout's series and writes back that state file and each file
  as that revision had left it, so the tree is byte for byte as the script found it (the
  series it came from need not exist any longer to re-apply it).

``restore`` changes nothing, and says so (exit 1), when SITE holds anything else than this
checkout's series or the state the snapshot recorded: someone else has written there
meanwhile.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

from vllm_minimax.errors import PatchError
from vllm_minimax.patchset import applied_state, revert_series, series_state
from vllm_minimax.patchset.lock import target_lock
from vllm_minimax.patchset.series import read_series, require_series_dir, series_fingerprint
from vllm_minimax.patchset.state import STATE_FILE, sha256_hex
from vllm_minimax.patchset.target import find_vllm_root, read_vllm_version
from vllm_minimax.patchset.tree import TargetTree

FORMAT = 1
EXIT_REFUSED = 1
EXIT_USAGE = 2


def encoded(content: bytes) -> str:
    return base64.b64encode(content).decode("ascii")


def ours(root: Path) -> list[list[str]]:
    """This checkout's series for the tree's vLLM, as the state file records it."""
    series = read_series(require_series_dir(read_vllm_version(root)))
    return [list(entry) for entry in series_fingerprint(series)]


def save(site: Path, snapshot: Path) -> str:
    """Record what ensure-series-applied is about to change; what was found, in words."""
    root = find_vllm_root(site)
    state = series_state(root)
    if state.clean:
        return f"{root}: this checkout's series is applied; nothing will be written there"
    record: dict[str, object] = {"format": FORMAT, "site": str(root), "ours": ours(root)}
    previous = applied_state(root)
    if previous is None:
        record["previous"] = None
        found = "no series applied: reverted on exit"
    else:
        with TargetTree(root) as tree, target_lock(tree, exclusive=False):
            state_file = tree.read(str(STATE_FILE))
            if state_file is None:
                raise PatchError(f"{root}: its state file went away while being read")
            files: dict[str, object] = {}
            for entry in previous.files:
                if entry.after_sha256 is None:
                    files[entry.path] = None
                    continue
                found_file = tree.read(entry.path)
                if found_file is None or sha256_hex(found_file[0]) != entry.after_sha256:
                    # ensure-series-applied's revert refuses such a tree: nothing is written.
                    return f"{root}: {entry.path} is not as its series left it; nothing to save"
                files[entry.path] = {"content": encoded(found_file[0]), "mode": found_file[1]}
        record["previous"] = {
            "state_file": {"content": encoded(state_file[0]), "mode": state_file[1]},
            "created_dirs": previous.created_dirs,
            "files": files,
        }
        found = f"the series {previous.series} of another revision applied: put back on exit"
    snapshot.write_text(json.dumps(record))
    return f"{root}: {found}"


def current_state_file(root: Path) -> bytes | None:
    with TargetTree(root) as tree:
        found = tree.read(str(STATE_FILE))
    return None if found is None else found[0]


def restore(snapshot: Path) -> str:
    record = json.loads(snapshot.read_text())
    if record.get("format") != FORMAT:
        raise PatchError(f"{snapshot} is not a snapshot of this script's format")
    root = Path(record["site"])
    previous = record["previous"]
    found = applied_state(root)
    if previous is not None:
        recorded = base64.b64decode(previous["state_file"]["content"])
        if current_state_file(root) == recorded:
            return f"{root}: as it was found (the earlier series was not replaced)"
    if found is not None:
        if [list(entry) for entry in found.patches] != record["ours"]:
            raise PatchError(
                f"{root} holds the series {found.series} of neither this checkout nor the"
                " snapshot: written by someone else meanwhile; nothing changed"
            )
        revert_series(root)
    if previous is None:
        if found is None:
            return f"{root}: as it was found (no series applied)"
        return f"{root}: this checkout's series reverted, as no series was applied before"
    with TargetTree(root) as tree, target_lock(tree, exclusive=True):
        for directory in sorted(previous["created_dirs"], key=lambda path: path.count("/")):
            if not tree.exists(directory):
                tree.mkdir(directory)
        for path, content in previous["files"].items():
            if content is None:
                if tree.exists(path):
                    tree.unlink(path)
                continue
            tree.write_atomically(path, base64.b64decode(content["content"]), content["mode"])
        state_file = previous["state_file"]
        tree.write_atomically(
            str(STATE_FILE), base64.b64decode(state_file["content"]), state_file["mode"]
        )
    return f"{root}: this checkout's series reverted, the earlier series written back as found"


def main(argv: list[str]) -> int:
    match argv:
        case ["save", site, snapshot]:
            action = lambda: save(Path(site), Path(snapshot))  # noqa: E731
        case ["restore", snapshot]:
            action = lambda: restore(Path(snapshot))  # noqa: E731
        case _:
            print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
            return EXIT_USAGE
    try:
        print(f"gpu-env: {action()}")
    except (PatchError, OSError, ValueError, KeyError, TypeError) as error:
        print(f"gpu-env: {argv[0]}: {error}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
