"""The shipped `vllm serve` configs: found by name from any directory, inside the wheel too;
read as `vllm serve --config` reads them; and the sparse-attention rule doctor reports."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from patchset_helpers import REPO_ROOT, build_and_unpack_wheel

from vllm_minimax import selection, serve_config
from vllm_minimax.probe import SPARSE_ATTENTION_KEY
from vllm_minimax.serve_config import ServeConfig, ServeConfigError

SERVE_CONFIGS = sorted((REPO_ROOT / "configs" / "serve").glob("*.yaml"))


def test_every_serving_config_and_eval_server_config_has_a_name() -> None:
    shipped = serve_config.shipped_configs()
    for path in [*SERVE_CONFIGS, *sorted((REPO_ROOT / "evals").glob("*.yaml"))]:
        assert shipped[path.stem].resolve() == path.resolve()


def test_a_name_resolves_and_an_unknown_one_lists_the_names() -> None:
    assert serve_config.resolve_config("h200-8x") == (
        REPO_ROOT / "configs" / "serve" / "h200-8x.yaml"
    )
    with pytest.raises(
        ServeConfigError, match=r"no shipped config named 'h300'; one of: .*h200-8x"
    ):
        serve_config.resolve_config("h300")
    with pytest.raises(ServeConfigError, match="does not exist"):
        serve_config.resolve_config("configs/serve/h300.yaml")


def test_config_list_puts_the_serving_configs_apart_with_their_checkpoints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A newcomer picks a config from `config list`: the serving configs come first, each with
    the checkpoint its budget names, and the eval suite's server configs (one rank with dummy
    weights, tiny models) only under their own heading."""
    from vllm_minimax.cli import main

    assert main(["config", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("serving configs: vllm serve CHECKPOINT --config")
    eval_heading = next(i for i, line in enumerate(lines) if line.startswith("the eval suite's"))
    serving = {line.split()[0]: line.split()[1:] for line in lines[1:eval_heading]}
    assert list(serving) == [path.stem for path in SERVE_CONFIGS]
    for path in SERVE_CONFIGS:
        budget = re.search(r"^#\s+checkpoint:\s*(\S+)", path.read_text(), re.M)
        checkpoint = budget.group(1) if budget else "(no checkpoint sized)"
        assert " ".join(serving[path.stem][:-1]) == checkpoint
        assert Path(serving[path.stem][-1]).resolve() == path.resolve()
    assert serving["h100-8x"][0] == "MiniMaxAI/MiniMax-M3-MXFP8"
    assert serving["h200-8x-bf16"][0] == "MiniMaxAI/MiniMax-M3"
    eval_suite = [line.split()[0] for line in lines[eval_heading + 1 :]]
    assert eval_suite == [path.stem for path in sorted((REPO_ROOT / "evals").glob("*.yaml"))]


def test_config_path_works_from_any_directory(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "vllm_minimax", "config", "path", "h200-8x"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    printed = Path(done.stdout.strip())
    assert printed.is_absolute()
    assert printed.read_bytes() == (REPO_ROOT / "configs/serve/h200-8x.yaml").read_bytes()


def test_serving_configs_ship_inside_the_wheel(tmp_path: Path) -> None:
    installed = build_and_unpack_wheel(tmp_path)
    shipped = installed / "vllm_minimax" / "_serve_configs"
    for path in [*SERVE_CONFIGS, REPO_ROOT / "configs" / "serve" / "README.md"]:
        assert (shipped / path.name).read_bytes() == path.read_bytes()
    probe = "from vllm_minimax import serve_config; print(serve_config.resolve_config('h100-8x'))"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(installed)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(result.stdout.strip()) == shipped / "h100-8x.yaml"


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda path: path.stem)
def test_the_defaults_are_what_every_shipped_config_selects_with(path: Path) -> None:
    """doctor without --config checks what the shipped configs run: same index cache,
    backends, KV cache, page and index heads per rank."""
    shipped = serve_config.read_serve_config(path)
    default = serve_config.default_serve_config()
    assert shipped.indexer_kv_dtype == default.indexer_kv_dtype == "fp8"
    assert shipped.indexer_backend == default.indexer_backend == "auto"
    assert shipped.kv_cache_dtype_resolved == default.kv_cache_dtype_resolved
    assert shipped.block_size == default.block_size
    assert shipped.index_heads_per_rank == default.index_heads_per_rank


@pytest.mark.parametrize(
    ("tp", "query", "kv", "index", "group"),
    [(1, 64, 4, 4, 16), (2, 32, 2, 2, 16), (4, 16, 1, 1, 16), (8, 8, 1, 1, 8), (16, 4, 1, 1, 4)],
)
def test_per_rank_heads(tp: int, query: int, kv: int, index: int, group: int) -> None:
    config = ServeConfig(source="test", tensor_parallel_size=tp)
    assert config.query_heads_per_rank == query
    assert config.kv_heads_per_rank == kv
    assert config.index_heads_per_rank == index
    assert config.queries_per_kv_head == group


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- a\n- b\n", "a mapping of option names"),
        ("tensor-parallel-size: eight\n", "tensor-parallel-size must be a positive integer"),
        ("tensor-parallel-size: 0\n", "tensor-parallel-size must be a positive integer"),
        ("block-size: true\n", "block-size must be a positive integer"),
        ("attention-config: '{not json'\n", "attention-config is not JSON"),
        ("attention-config: [1]\n", "attention-config must be a mapping"),
        ("key: [unclosed\n", "cannot be read as YAML"),
    ],
)
def test_a_config_vllm_could_not_read_is_one_message(tmp_path: Path, text: str, message: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ServeConfigError, match=message):
        serve_config.read_serve_config(path)


def test_a_config_is_read_as_vllm_serve_reads_it(tmp_path: Path) -> None:
    """Underscores or dashes alike, attention-config as a mapping or as JSON text."""
    path = tmp_path / "c.yml"
    path.write_text(
        "tensor_parallel_size: 4\nkv-cache-dtype: fp8\n"
        'attention_config: \'{"indexer_kv_dtype": "auto"}\'\n'
    )
    config = serve_config.read_serve_config(path)
    assert (config.tensor_parallel_size, config.kv_cache_dtype) == (4, "fp8")
    assert config.indexer_kv_dtype == "bf16"  # auto, as vLLM's model resolves it
    assert config.block_size is None


SM90_FP8 = {
    "capability": (9, 0),
    "kv_cache_dtype": "fp8",
    "head_dim": 128,
    "block_size": 128,
    "topk_blocks": 16,
    "num_queries_per_kv": 8,
}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, None),
        ({"kv_cache_dtype": "fp8_e4m3", "num_queries_per_kv": 16}, None),
        ({"capability": (12, 0)}, "compute capability 12.0"),
        ({"capability": (10, 0)}, "compute capability 10.0"),
        ({"kv_cache_dtype": "bf16"}, "set kv-cache-dtype: fp8"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "KV cache is fp8_e5m2"),
        ({"head_dim": 64}, "head dim 64"),
        ({"block_size": 64}, "block-size 64"),
        ({"topk_blocks": 32}, "topk_blocks=32"),
        ({"num_queries_per_kv": 4}, "4 query heads per KV head"),
    ],
)
def test_the_sparse_attention_rule(change: dict[str, object], reason: str | None) -> None:
    usable, why = selection.sparse_attention_rule(**{**SM90_FP8, **change})  # type: ignore[arg-type]
    assert usable is (reason is None)
    assert (why is None) if reason is None else (reason in (why or ""))


FI_LOG = "MiniMax M3 sparse attention: selected FlashInfer (...)"
BF16_LOG = (
    "MiniMax M3 sparse attention: selected Triton (FlashInfer not used: kv_cache_dtype=auto;"
    " FlashInfer's SM90 MSA attention reads an fp8 e4m3 KV cache: set --kv-cache-dtype fp8)"
)
NO_BUILD_LOG = "MiniMax M3 sparse attention: selected Triton (FlashInfer not used: no build)"
FORCED_TRITON_LOG = (
    "MiniMax M3 sparse attention: selected Triton (FlashInfer not used:"
    f" {SPARSE_ATTENTION_KEY}='triton') [kv_cache_dtype=fp8, topk_blocks=16]"
)
OWN_TRITON_LOG = "MiniMax M3 sparse attention selected Triton (kv_cache_dtype=fp8, topk_blocks=16)"


def chose(impl: str | None, log: str | None = None, error: str | None = None):
    from vllm_minimax import probe

    return lambda **_: probe.Selection(impl=impl, log=log, error=error)


@pytest.mark.parametrize(
    ("key", "kv", "answer", "backend", "outcome"),
    [
        ("auto", "fp8", chose("MiniMaxM3SparseFlashInferImpl", FI_LOG), "FlashInfer", "READY"),
        ("auto", "auto", chose("MiniMaxM3SparseTritonImpl", BF16_LOG), "Triton", "READY"),
        ("auto", "fp8", chose("MiniMaxM3SparseTritonImpl", NO_BUILD_LOG), "Triton", "FALLBACK"),
        # A GPU with no FlashInfer attend (12.0): Triton is vLLM's own choice there.
        ("auto", "fp8", chose("MiniMaxM3SparseTritonImpl", OWN_TRITON_LOG), "Triton", "READY"),
        # SM100 attends with vLLM's own MSA kernels.
        ("auto", "fp8", chose("MiniMaxM3SparseMSAImpl", "selected MSA"), "MSA", "READY"),
        # Forced Triton on 9.0: vLLM's log names FlashInfer as not used, and the config
        # asked for it.
        ("triton", "fp8", chose("MiniMaxM3SparseTritonImpl", FORCED_TRITON_LOG), "Triton", "READY"),
        (
            "flashinfer",
            "auto",
            chose(None, error="ValueError: cannot run here: set --kv-cache-dtype fp8"),
            "-",
            "FAILS",
        ),
    ],
)
def test_the_sparse_attention_row(monkeypatch, key, kv, answer, backend, outcome) -> None:
    from vllm_minimax import probe

    monkeypatch.setattr(probe, "sparse_attention_in_series", lambda: True)
    monkeypatch.setattr(probe, "select_sparse_attention", answer)
    config = ServeConfig(
        source="test",
        kv_cache_dtype=kv,
        attention_config={"indexer_kv_dtype": "fp8", probe.SPARSE_ATTENTION_KEY: key},
    )
    row = selection.sparse_attention_row(config, (9, 0))
    assert (row.backend, row.outcome) == (backend, selection.Outcome[outcome])
    if kv == "auto" and key != "triton":
        # A bf16 KV cache is a choice (Triton as configured); the hint says what changes it.
        assert row.hint == "kv-cache-dtype: fp8 in the config"


def test_a_series_without_the_sparse_attention_selection(monkeypatch) -> None:
    from vllm_minimax import probe

    monkeypatch.setattr(probe, "sparse_attention_in_series", lambda: False)
    row = selection.sparse_attention_row(ServeConfig(source="test", kv_cache_dtype="fp8"), (9, 0))
    assert (row.backend, row.outcome) == ("not in this series", selection.Outcome.INFO)
    assert "would get FlashInfer" in row.reason


# The pages a user follows; every `--config` they give works from any directory.
USER_DOCS = [
    REPO_ROOT / "README.md",
    REPO_ROOT / "docs" / "deploy.md",
    REPO_ROOT / "docs" / "deploy-multinode.md",
    REPO_ROOT / "docs" / "warm-start.md",
    REPO_ROOT / "configs" / "serve" / "README.md",
]


def documented_configs(text: str) -> list[str]:
    """The value after each `--config` in the page's console and code blocks."""
    values = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            try:
                argv = shlex.split(line.split("#", 1)[0] if " #" in line else line)
            except ValueError:
                continue
            values += [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--config"]
    return values


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda path: path.name)
def test_every_documented_config_works_from_any_directory(doc: Path) -> None:
    """A shipped name, the shipped file's path via `config path`, or the image's absolute
    path: never a path relative to a checkout."""
    values = documented_configs(doc.read_text())
    names = serve_config.shipped_configs()
    for value in values:
        named = re.fullmatch(r"\$\(vllm-minimax config path ([\w.-]+)\)", value)
        if named:
            assert named.group(1) in names, value
        elif value.startswith("/opt/vllm-minimax/configs/serve/"):
            assert (
                value.removeprefix("/opt/vllm-minimax/configs/serve/").removesuffix(".yaml")
                in names
            )
        else:
            assert value in names, f"{doc.name}: --config {value} works only from a checkout"


@pytest.mark.parametrize(
    "argv",
    [
        ["doctor", "--config", "h200-8x"],
        ["warmup", "--config", "h200-8x"],
        ["eval", "ab", "--config", "h200-8x", "--model", "m", "--out", "o"],
    ],
)
def test_commands_take_a_shipped_configs_name(argv: list[str]) -> None:
    from vllm_minimax import cli

    args = cli.build_parser().parse_args(argv)
    # warmup takes --config more than once (with --prebuild): a list of the files.
    configs = args.config if isinstance(args.config, list) else [args.config]
    assert configs == [REPO_ROOT / "configs" / "serve" / "h200-8x.yaml"]


def test_a_bf16_kv_cache_off_sm90_names_no_key_that_would_bring_flashinfer(monkeypatch) -> None:
    """On 12.0 FlashInfer's sparse attention does not exist: the row of a bf16 cache must not
    send the user to the backend key (setting it to flashinfer stops the engine)."""
    from vllm_minimax import probe

    stock_log = "MiniMax M3 sparse attention selected Triton (kv_cache_dtype=bf16, topk_blocks=16)"
    monkeypatch.setattr(probe, "sparse_attention_in_series", lambda: True)
    monkeypatch.setattr(
        probe, "select_sparse_attention", chose("MiniMaxM3SparseTritonImpl", stock_log)
    )
    row = selection.sparse_attention_row(ServeConfig(source="test"), (12, 0))
    assert (row.backend, row.outcome) == ("Triton", selection.Outcome.READY)
    assert row.hint == "none in the config: FlashInfer's sparse attention runs on 9.0 only"


def test_an_fp8_index_cache_on_a_gpu_without_fp8_points_at_the_dtype() -> None:
    """vLLM refuses an fp8 index cache where the GPU has no fp8 (e.g. 8.0): the change is the
    cache's dtype, not the backend key the config already leaves at auto."""
    reason = (
        "NotImplementedError: indexer_kv_dtype='fp8' requires CUDA fp8 support or ROCm gfx942"
        " for the Triton indexer. ROCm gfx950 supports fp8 through the AITER MSA indexer."
    )
    assert selection.indexer_hint(reason, True) == (
        "attention-config.indexer_kv_dtype: bf16 (this GPU has no fp8 for the index cache)"
    )
