"""The ``vllm-minimax`` program: Ctrl-C is one line and exit 130 from the first instruction,
before the command line's modules are imported."""

from __future__ import annotations

import sys


def run() -> int:
    try:
        from vllm_minimax.cli import main

        return main()
    except KeyboardInterrupt:
        print("vllm-minimax: interrupted", file=sys.stderr)
        return 130
