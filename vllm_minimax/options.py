"""Option types shared by the command line's parsers."""

from __future__ import annotations

import argparse
from pathlib import Path


def path_argument(text: str) -> Path:
    """A path option's value; an empty one is refused (``Path("")`` would silently mean the
    current directory)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path; pass . for the current directory")
    return Path(text)
