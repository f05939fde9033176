"""What `test_serve_chat.py` serves: the single-node config scaled to one GPU and the
tiny MiniMax M3, and a copy of the tiny tokenizer with MiniMax M3's reasoning markers.

`configs/serve/h200-8x.yaml` keeps its reasoning and tool-call parsers, auto tool
choice, its speculative block as written (EAGLE3, K = 3, the draft's attention on
FLASH_ATTN), the fp8 index cache, the indexer on `auto` and the 128-token block
size; it gets TP 1, no expert parallelism, the tiny model's context and memory, and
the draft's `model` pointed at a tiny EAGLE3 draft (`vllm_minimax.tiny_eagle3`) in
place of `Inferact/MiniMax-M3-EAGLE3`.

The tiny tokenizer has a chat template (`role: content` lines; it ignores
`tools`), so no `--chat-template` is needed. It lacks `<mm:think>` and
`</mm:think>`, without which vLLM's `minimax_m3` reasoning parser refuses to start
("could not locate think start/end tokens"): `tokenizer_with_reasoning_markers`
adds them. Their ids lie past the model's vocabulary, so the model never emits
them; vLLM allows a tokenizer larger than the model's vocabulary. The CPU test
`tests/cpu/patched_vllm/test_serve_configs.py` checks both with vLLM's own code.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

SINGLE_NODE_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "serve" / "h200-8x.yaml"
REASONING_MARKERS = ("<mm:think>", "</mm:think>")
# The single-node config's keys that change for one GPU and the tiny model.
TINY_OVERRIDES = {
    "tensor-parallel-size": 1,
    "max-model-len": 32768,  # the tiny model's max_position_embeddings
    "max-num-seqs": 16,
    "max-num-batched-tokens": 4096,
    "gpu-memory-utilization": 0.2,
}
DROPPED_KEYS = ("enable-expert-parallel",)  # one GPU holds every expert
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


# Where the fixture writes the tiny EAGLE3 draft, inside the run's directory.
DRAFT_SUBDIRECTORY = "tiny-eagle3-draft"


def scaled_config(draft: Path, source: Path = SINGLE_NODE_CONFIG) -> dict:
    """``source`` scaled to one GPU, its speculative block as written but for ``model``,
    which becomes the local ``draft``."""
    config = yaml.safe_load(Path(source).read_text())
    for key in DROPPED_KEYS:
        config.pop(key)
    config.update(TINY_OVERRIDES)
    config["speculative-config"] = {**config["speculative-config"], "model": str(draft)}
    return config


def write_scaled_config(draft: Path, path: Path, source: Path = SINGLE_NODE_CONFIG) -> Path:
    path.write_text(yaml.safe_dump(scaled_config(draft, source), sort_keys=False))
    return path


def tokenizer_with_reasoning_markers(tiny_model: Path, directory: Path) -> Path:
    """Save the tiny tokenizer plus `REASONING_MARKERS` into `directory`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    added = tokenizer.add_tokens(list(REASONING_MARKERS))
    assert added == len(REASONING_MARKERS), f"the tiny tokenizer already had {REASONING_MARKERS}"
    tokenizer.save_pretrained(directory)
    # As make-tiny-model does: the class name every transformers version reads.
    config_path = Path(directory) / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    return Path(directory)
