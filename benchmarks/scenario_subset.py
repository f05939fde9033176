"""A throughput preset cut down to the scenarios named, for one round of a device script.

    python -m benchmarks.scenario_subset SOURCE TARGET [NAME ...]

Writes SOURCE's preset to TARGET with only the scenarios NAME..., in the order named (a name
given twice counts once); with no names, every scenario in SOURCE's order. An unknown name
writes nothing and exits with a message listing the known ones.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml


def select_scenarios(preset: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    by_name = {scenario["name"]: scenario for scenario in preset["scenarios"]}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise ValueError(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    if not names:
        return preset
    return {**preset, "scenarios": [by_name[name] for name in dict.fromkeys(names)]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("names", nargs="*")
    args = parser.parse_args(argv)
    try:
        subset = select_scenarios(yaml.safe_load(args.source.read_text()), args.names)
    except ValueError as error:
        print(f"scenario_subset: {error}", file=sys.stderr)
        return 2
    args.target.write_text(yaml.safe_dump(subset, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
