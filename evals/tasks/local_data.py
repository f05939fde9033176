"""Datasets of the tasks in this directory, read from files next to this module.

lm-eval imports this file for a task YAML's ``custom_dataset: !function local_data.NAME``
(it looks for the module beside the YAML), and calls the function with the task's metadata
and ``dataset_kwargs``. Paths are relative to this file, not to the working directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def jsonl_test_split(file_name: str) -> Any:
    import datasets

    path = HERE / file_name
    if not path.is_file():
        raise FileNotFoundError(f"task data {path} is missing")
    return datasets.load_dataset("json", data_files={"test": str(path)})


def tiny_arithmetic(**_: Any) -> Any:
    return jsonl_test_split("tiny_arithmetic.jsonl")
