"""The vLLM under test parses the tiny MiniMax M3 written for it (`make-tiny-model --for-vllm
<its version>`) into the geometry the checkpoint was made with.

The reference is the flat config of `vllm_minimax.tiny_model` and, for RoPE, what transformers
(the model that drew the weights) rotates. Each release reads the geometry its own way: 0.34.0
the flat `index_*` fields and `rope_parameters`, 0.33.0 `sparse_attention_config` and
`partial_rotary_factor`; the layer kinds both through their model module's own helpers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm
from transformers import MiniMaxM3VLTextConfig
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLRotaryEmbedding
from vllm.config import ModelConfig
from vllm.models.minimax_m3.nvidia import model as m3_model
from vllm.transformers_utils.config import get_config

from vllm_minimax import tiny_model
from vllm_minimax.testing import selection_audit
from vllm_minimax.tiny_model import MTP_SUBDIRECTORY, TINY_TEXT_CONFIG

MTP_MODULES = 2
# Read the same way by both releases (the published schema spells them as the flat one does).
SHARED_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "dense_intermediate_size",
    "num_local_experts",
    "num_experts_per_tok",
    "routed_scaling_factor",
    "rms_norm_eps",
    "swiglu_alpha",
    "swiglu_limit",
    "vocab_size",
)


@pytest.fixture(scope="module")
def tiny_configs(tmp_path_factory) -> tuple[Path, dict]:
    assert vllm.__version__ in tiny_model.CONFIG_LAYOUTS, vllm.__version__
    directory = tmp_path_factory.mktemp("tiny-config")
    flat = tiny_model.write_tiny_config_files(
        directory, mtp_modules=MTP_MODULES, config_layout=vllm.__version__
    )
    return directory, flat


def _index_geometry(text_config) -> dict:
    """The indexer geometry and rotated channels as this release's MiniMax M3 reads them
    (its `nvidia/model.py`, `common/indexer.py` and the rotary embedding it builds)."""
    if vllm.__version__ == "0.33.0":
        sparse = text_config.sparse_attention_config
        return {
            "heads": sparse["sparse_num_index_heads"],
            "dim": sparse["sparse_index_dim"],
            "block": sparse["sparse_block_size"],
            "topk": sparse["sparse_topk_blocks"],
            "local": sparse["sparse_local_block"],
            "init": sparse.get("sparse_init_block", 0),
            "rotary": int(text_config.head_dim * text_config.partial_rotary_factor),
        }
    factor = text_config.rope_parameters.get("partial_rotary_factor", 1.0)
    return {
        "heads": text_config.index_n_heads,
        "dim": text_config.index_head_dim,
        "block": text_config.index_block_size,
        "topk": text_config.index_topk_blocks,
        "local": text_config.index_local_blocks,
        "init": 0,
        "rotary": int(text_config.head_dim * factor),
    }


def _transformers_rotary_channels(flat: dict) -> int:
    """The channels transformers' MiniMax M3 rotates for the flat config."""
    fields = {k: v for k, v in flat.items() if k not in ("architectures", "transformers_version")}
    fields.pop("model_type")
    inv_freq, _ = MiniMaxM3VLRotaryEmbedding.compute_default_rope_parameters(
        MiniMaxM3VLTextConfig(**fields)
    )
    return 2 * inv_freq.numel()


def _expected_index_geometry(flat: dict) -> dict:
    return {
        "heads": TINY_TEXT_CONFIG["index_n_heads"],
        "dim": TINY_TEXT_CONFIG["index_head_dim"],
        "block": TINY_TEXT_CONFIG["index_block_size"],
        "topk": TINY_TEXT_CONFIG["index_topk_blocks"],
        "local": TINY_TEXT_CONFIG["index_local_blocks"],
        "init": 0,
        "rotary": _transformers_rotary_channels(flat),
    }


def _layer_kinds(text_config) -> tuple[list[str], list[str]]:
    layers = range(text_config.num_hidden_layers)
    sparse = m3_model._sparse_attention_layer_ids(text_config)
    attention = ["minimax_m3_sparse" if i in sparse else "full_attention" for i in layers]
    mlp = ["sparse" if m3_model._is_moe_layer(text_config, i) else "dense" for i in layers]
    return attention, mlp


def test_target_config_is_read_as_the_tiny_geometry(tiny_configs):
    directory, flat = tiny_configs
    model_config = ModelConfig(model=str(directory), tokenizer=str(directory))
    assert model_config.architecture == tiny_model.ARCHITECTURE
    assert model_config.max_model_len == TINY_TEXT_CONFIG["max_position_embeddings"]
    text = model_config.hf_text_config
    assert {key: getattr(text, key) for key in SHARED_FIELDS} == {
        key: flat[key] for key in SHARED_FIELDS
    }
    assert _index_geometry(text) == _expected_index_geometry(flat)
    assert _layer_kinds(text) == (
        TINY_TEXT_CONFIG["layer_types"],
        TINY_TEXT_CONFIG["mlp_layer_types"],
    )
    if vllm.__version__ == "0.33.0":
        # Its MLP refuses any other activation (transformers' class would report "silu").
        assert text.hidden_act == "swigluoai"


def test_draft_config_is_read_as_one_sparse_moe_layer_of_the_same_geometry(tiny_configs):
    directory, flat = tiny_configs
    draft = get_config(str(directory / MTP_SUBDIRECTORY), trust_remote_code=False)
    assert type(draft).__name__ == "MiniMaxM3MTPConfig"
    assert draft.num_mtp_modules == MTP_MODULES
    shared = [key for key in SHARED_FIELDS if key != "num_hidden_layers"]
    assert {key: getattr(draft, key) for key in shared} == {key: flat[key] for key in shared}
    assert draft.num_hidden_layers == 1
    assert _index_geometry(draft) == _expected_index_geometry(flat)
    assert _layer_kinds(draft) == (["minimax_m3_sparse"], ["sparse"])
    if vllm.__version__ == "0.33.0":
        assert draft.hidden_act == "swigluoai"


def test_the_engine_audit_expects_the_local_window_this_release_builds(tiny_configs):
    """The engine audit (`selection_audit`) forces the window the release's model takes
    from the config, so it does not expect a selection the model never asked for."""
    directory, _ = tiny_configs
    text = ModelConfig(model=str(directory), tokenizer=str(directory)).hf_text_config
    local = selection_audit.model_local_blocks(text, vllm.__version__)
    assert local == _index_geometry(text)["local"] == TINY_TEXT_CONFIG["index_local_blocks"]
