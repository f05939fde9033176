"""Every `configs/serve/*.yaml` parses with the patched vLLM's own `vllm serve`
argument parser, and its attention config builds a valid AttentionConfig."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from vllm.config import AttentionConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs" / "serve"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))


def test_there_are_serving_configs():
    assert CONFIGS, f"no serving configs in {CONFIG_DIR}"


@pytest.fixture
def cpu_device(monkeypatch):
    """The parser fills its defaults from a DeviceConfig, which needs a device type;
    this machine has no GPU, and vLLM's CUDA platform cannot load without one."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_type", "cpu")


@pytest.mark.usefixtures("cpu_device")
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_with_vllm_serve(path):
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    args = parser.parse_args(["--model", "MiniMaxAI/MiniMax-M3", "--config", str(path)])
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
