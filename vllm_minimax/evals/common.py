"""What every eval module shares: the error type the CLI reports, JSON output written so that
an interrupted run leaves complete files, progress lines, and the optional-dependency check."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

_START = time.monotonic()


class EvalError(Exception):
    """A failure the user can act on; the CLI prints it and exits non-zero."""


def require(*modules: str) -> None:
    """Fail with the install command when an ``eval`` extra dependency is missing."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise EvalError(
            f"missing Python package(s) for `vllm-minimax eval`: {', '.join(missing)};"
            " install them with `pip install 'vllm-minimax[eval]'`"
        )


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` atomically, so a run killed mid-write keeps the previous file.

    A failed write leaves no scratch file, and its OSError names ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        scratch.write_text(text, encoding="utf-8")
        scratch.replace(path)
    except BaseException as error:
        scratch.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.filename in (None, str(scratch)):
            raise OSError(error.errno, error.strerror, str(path)) from error
        raise
    return path


def write_json(path: Path, data: Any) -> Path:
    """Write ``data`` as JSON atomically (`write_text`)."""
    return write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EvalError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise EvalError(f"{what} {path} is not valid JSON: {error}") from None
    except RecursionError:
        raise EvalError(f"{what} {path} is nested too deeply to read") from None


def read_yaml_mapping(path: Path, what: str, empty_ok: bool = False) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (an empty file is ``{}`` if ``empty_ok``)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EvalError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise EvalError(f"{what} {path} is not valid YAML: {error}") from None
    except RecursionError:
        raise EvalError(f"{what} {path} is nested too deeply to read") from None
    if data is None and empty_ok:
        return {}
    if not isinstance(data, dict):
        raise EvalError(f"{what} {path}: expected a mapping at the top level")
    return data


def log_tail(log_path: Path, lines: int) -> str:
    """The last ``lines`` lines of a log, for an error message."""
    try:
        text = Path(log_path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def progress(message: str) -> None:
    """One progress line on stderr, with the seconds since the command started."""
    print(f"[{time.monotonic() - _START:6.0f}s] {message}", file=sys.stderr, flush=True)
