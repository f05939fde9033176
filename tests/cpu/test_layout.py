"""The layout CONTRIBUTING.md describes: what ships in the wheel, and no sys.path edits."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from patchset_helpers import REPO_ROOT, build_and_unpack_wheel


def test_wheel_ships_the_package_but_not_the_test_rigs(tmp_path: Path) -> None:
    installed = build_and_unpack_wheel(tmp_path)
    package = installed / "vllm_minimax"
    assert (package / "cli.py").is_file()
    assert (package / "evals" / "ab.py").is_file()
    assert (package / "_eval_configs" / "throughput" / "indexer.yaml").is_file()
    # doctor's repair of the CUDA bindings reads its pins from the recipe.
    recipe = REPO_ROOT / "requirements" / "user-flashinfer.txt"
    assert (package / "_requirements" / recipe.name).read_bytes() == recipe.read_bytes()
    assert [path.name for path in (package / "_requirements").iterdir()] == [recipe.name]
    assert not (package / "testing").exists()
    assert not (installed / "benchmarks").exists()


def test_no_module_edits_sys_path_to_import_project_code() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    # The two places that must: the doctor imports the target's vLLM, and the patched-vLLM
    # tests put the patched tree first (both import vLLM, not this project's modules).
    allowed = {"vllm_minimax/doctor.py", "tests/cpu/patched_vllm/conftest.py"}
    offenders = [
        name
        for name in tracked
        if name not in allowed
        and re.search(r"sys\.path\.(insert|append)\(", (REPO_ROOT / name).read_text())
    ]
    assert offenders == []


def test_benchmarks_import_as_modules_from_the_repository_root() -> None:
    probe = "import benchmarks.indexer_bench, benchmarks.timing; print('ok')"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


DOC_LINE_LIMIT = 300
# One machine's staging and paths: its stash directories, the lab's shared folder, its staging
# script (allowed only as the value of the hook variable that names it), its checkout and its
# staged vLLM directory.
MACHINE_TEXT = re.compile(
    r"/root/stash|cachestash|\.\./shared|stage-e2e-on-device|/work/|/home/|/tmp/site\b|/opt/torch"
)
HOOK_VALUE = re.compile(r"VLLM_MINIMAX_GPU_ENV_HOOK=\S+")
# Raw outputs under results/ (logs, JSON, traces) are kept as the run wrote them.
RAW_RESULT = re.compile(r"^results/.*\.(log|txt|json|jsonl|csv|tsv|gz|png|yaml)$|/exit-status$")


def tracked_files() -> list[str]:
    return subprocess.run(
        ["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()


def test_no_doc_is_longer_than_the_limit() -> None:
    lengths = {
        name: len((REPO_ROOT / name).read_text().splitlines())
        for name in tracked_files()
        if name.startswith("docs/") and name.endswith(".md")
    }
    assert lengths and all(length <= DOC_LINE_LIMIT for length in lengths.values()), {
        name: length for name, length in lengths.items() if length > DOC_LINE_LIMIT
    }


def test_no_doc_report_or_script_names_one_machines_staging_or_paths() -> None:
    """Docs, reports, scripts and code say how to run things anywhere: no machine's stash
    directories, shared folder, staging script (except as the hook variable's value), checkout
    or staged vLLM directory. The tests are left out (they name these to look for them)."""
    offenders = {}
    for name in tracked_files():
        if name.startswith("tests/") or RAW_RESULT.search(name):
            continue
        path = REPO_ROOT / name
        if not path.is_file() or path.is_symlink():
            continue
        try:
            text = HOOK_VALUE.sub("", path.read_text())
        except UnicodeDecodeError:
            continue
        found = sorted(set(MACHINE_TEXT.findall(text)))
        if found:
            offenders[name] = found
    assert offenders == {}


def test_every_script_a_doc_names_exists() -> None:
    """A renamed script leaves no command behind that names its old name."""
    missing = {}
    for name in tracked_files():
        if not name.endswith(".md"):
            continue
        named = set(
            re.findall(r"\bscripts/([A-Za-z0-9_.-]+[A-Za-z0-9_])", (REPO_ROOT / name).read_text())
        )
        gone = sorted(script for script in named if not (REPO_ROOT / "scripts" / script).exists())
        if gone:
            missing[name] = gone
    assert missing == {}


# A relative Markdown link: [text](target) or [text](target#anchor), not a URL.
MARKDOWN_LINK = re.compile(r"\]\((?!\w+://|mailto:|#)([^)#\s]+)(?:#[^)]*)?\)")


def test_every_relative_link_in_a_markdown_file_resolves() -> None:
    """A tracked Markdown file links only to files that are tracked too (a page moved under
    results/ must be committed with the link, and a report whose raw outputs left the tree
    names them without a link)."""
    tracked = set(
        subprocess.run(
            ["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    )
    broken = []
    for name in sorted(n for n in tracked if n.endswith(".md")):
        page = REPO_ROOT / name
        for target in MARKDOWN_LINK.findall(page.read_text(errors="replace")):
            path = (page.parent / target).resolve()
            relative = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
            tracked_dir = any(n.startswith(f"{relative}/") for n in tracked)
            if str(relative) not in tracked and not tracked_dir:
                broken.append(f"{name} -> {target}")
    assert broken == []


RESULTS_LIMIT_BYTES = 5 * 1024 * 1024
RESULT_FILE_LIMIT_BYTES = 512 * 1024


def results_sizes(root: Path, names: list[str]) -> dict[str, int]:
    """The size of each tracked file under results/ (a file deleted but not yet committed is
    left out)."""
    paths = {name: root / name for name in names if name.startswith("results/")}
    return {name: path.stat().st_size for name, path in paths.items() if path.is_file()}


def results_over_limits(sizes: dict[str, int]) -> list[str]:
    """What keeps results/ from being a folder of reports and small summaries: a total over
    5 MB, a file over 512 KB, or a compressed archive or log (raw outputs are regenerated, or
    fetched from the history, not committed)."""
    problems = [
        f"{name}: {size:,} bytes (over {RESULT_FILE_LIMIT_BYTES:,})"
        for name, size in sorted(sizes.items())
        if size > RESULT_FILE_LIMIT_BYTES
    ]
    problems += [
        f"{name}: a compressed raw output" for name in sorted(sizes) if name.endswith(".gz")
    ]
    total = sum(sizes.values())
    if total > RESULTS_LIMIT_BYTES:
        problems.append(f"results/ holds {total:,} bytes (over {RESULTS_LIMIT_BYTES:,})")
    return problems


def test_results_hold_reports_and_small_summaries() -> None:
    assert results_over_limits(results_sizes(REPO_ROOT, tracked_files())) == []


def test_the_results_limits_refuse_a_large_file_an_archive_and_a_large_total() -> None:
    """The check above, on planted trees: each limit alone fails it."""
    assert results_over_limits({"results/a/report.md": 4000, "results/a/bench.json": 9000}) == []
    big = results_over_limits({"results/a/log.txt": RESULT_FILE_LIMIT_BYTES + 1})
    assert big == [f"results/a/log.txt: {RESULT_FILE_LIMIT_BYTES + 1:,} bytes (over 524,288)"]
    assert results_over_limits({"results/a/rounds.tar.gz": 10}) == [
        "results/a/rounds.tar.gz: a compressed raw output"
    ]
    many = {f"results/a/{index}.json": 500_000 for index in range(11)}
    assert results_over_limits(many) == ["results/ holds 5,500,000 bytes (over 5,242,880)"]


SERIES_ROW_LIMIT = 600


def long_table_rows(text: str, limit: int = SERIES_ROW_LIMIT) -> list[str]:
    """The Markdown table rows of ``text`` longer than ``limit`` characters, by their start."""
    return [
        f"{line[:50]}... ({len(line)} characters)"
        for line in text.splitlines()
        if line.startswith("|") and len(line) > limit
    ]


def test_the_series_notes_are_rows_a_reviewer_can_scan() -> None:
    """Each row of a series README says what the patch changes, why, and when to drop it, in
    under 600 characters; the rest is in docs/design.md, with the mapping to upstream's keys."""
    readmes = sorted((REPO_ROOT / "patches").glob("vllm-*/README.md"))
    assert readmes
    for readme in readmes:
        text = readme.read_text()
        assert "| patch | changes | why | drop when |" in text, readme
        assert long_table_rows(text) == [], readme
    design = (REPO_ROOT / "docs" / "design.md").read_text()
    assert "## When a vLLM release carries this" in design
    for key in (
        "minimax_m3_indexer_backend",
        "minimax_m3_sparse_attention_backend",
        "minimax_m3_use_flashinfer_msa",
        "minimax_m3_msa_decode_backend",
    ):
        section = design[design.index("## When a vLLM release carries this") :]
        assert key in section, key


def test_a_long_row_is_reported() -> None:
    row = "| 0009 | " + "x" * 600 + " |"
    assert long_table_rows(f"text\n{row}\n| short |\n") == [f"{row[:50]}... (611 characters)"]


FUNCTION_LIMIT = 120
CLI_FUNCTION_LIMIT = 80


def long_functions(source: str, limit: int) -> list[str]:
    """The functions (and methods) of ``source`` longer than ``limit`` lines."""
    import ast

    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_of_the_package_is_longer_than_the_limit() -> None:
    """A function of vllm_minimax/ fits 120 lines, one of cli.py 80: each command's parser sits
    beside the command, and a long walk is split where a second concern starts."""
    long = {}
    for path in sorted((REPO_ROOT / "vllm_minimax").rglob("*.py")):
        limit = CLI_FUNCTION_LIMIT if path == REPO_ROOT / "vllm_minimax" / "cli.py" else None
        found = long_functions(path.read_text(), limit or FUNCTION_LIMIT)
        if found:
            long[str(path.relative_to(REPO_ROOT))] = found
    assert long == {}


def test_a_long_function_is_reported() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    source = f"def short():\n    pass\n\n\ndef long():\n{body}\n"
    assert long_functions(source, 80) == ["long (82 lines)"]
    assert long_functions(source, 82) == []


WHERE_IT_RAN_LINE_LIMIT = 300


def test_the_readmes_where_it_ran_gives_a_short_line_per_card_and_run() -> None:
    """README's "where it ran" cell: one line (``<br>``-separated) per card and what ran, each
    under 300 characters and opening with the card, the figures left to the linked reports."""
    readme = (REPO_ROOT / "README.md").read_text()
    [row] = [line for line in readme.splitlines() if line.startswith("| where it ran | ")]
    lines = row.removeprefix("| where it ran | ").removesuffix(" |").split("<br>")
    assert len(lines) >= 2
    for line in lines:
        assert len(line) < WHERE_IT_RAN_LINE_LIMIT, line
        assert re.match(r"(H100|H200|GB10|RTX PRO 6000)\b", line), line
        assert MARKDOWN_LINK.search(line), line
