"""CPU simulation of `scripts/gpu-e2e w8a8`'s three runs, to set its prompt-logprob bound.

    python -m benchmarks.w8a8_tiny_sim [--prompts 2] [--tokens 1536]

transformers' MiniMax M3 with the tiny model's draw (`make-tiny-model --initializer-range
0.1`, seed 0), in float32 on the CPU. W8A16: every projection the MXFP8 checkpoint quantizes
(vllm_minimax/mxfp8_checkpoint.py) replaced by its MXFP8 value, activations kept. W8A8: the
same, each of those projections' input also rounded to e4m3 per token (scale amax / 448), as
the per-token FP8 activations do; the weights need no change, power-of-two per-channel
requantization keeps MXFP8 values (tests/cpu/patched_vllm/test_mxfp8_w8a8.py). Control: W8A8
with each MoE layer's experts rotated by one. bf16: the weights as drawn. Prints the mean,
p99 and max |prompt logprob difference| of each against W8A16. Prompts of at most 2048 tokens
keep every block in the indexer's top 16, so no selection differs between runs.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_minimax import tiny_model, tiny_tokenizer
from vllm_minimax.mxfp8_checkpoint import dequantize_mxfp8, quantize_mxfp8

E4M3_MAX = 448.0


def per_token_e4m3(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def mxfp8_value(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() == 2:
        return dequantize_mxfp8(*quantize_mxfp8(weight))
    return torch.stack([dequantize_mxfp8(*quantize_mxfp8(w)) for w in weight])


def is_quantized(name: str) -> bool:
    skipped = ("embed", "lm_head", ".gate.", "norm", "router")
    return not any(part in name for part in skipped)


def figures(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a - b).abs()
    return f"mean {d.mean():.4f}  p99 {d.quantile(0.99):.4f}  max {d.max():.4f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1536)
    args = parser.parse_args(argv)
    from transformers import MiniMaxM3VLForCausalLM

    tokenizer = tiny_tokenizer.build_tokenizer(Path(tempfile.mkdtemp()))
    torch.manual_seed(0)
    model = MiniMaxM3VLForCausalLM(tiny_model.tiny_config(tokenizer, 0.1)).float().eval()
    drawn = {}
    for name, param in model.named_parameters():
        if param.dim() >= 2 and is_quantized(name):
            drawn[name] = param.data.clone()
            param.data.copy_(mxfp8_value(param.data))
    storages = {model.get_parameter(n).untyped_storage().data_ptr() for n in drawn}
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (args.tokens,), generator=g) for _ in range(args.prompts)]

    def logprobs() -> torch.Tensor:
        out = []
        with torch.no_grad():
            for p in prompts:
                lp = model(p[None]).logits[0].float().log_softmax(-1)
                out.append(lp[:-1].gather(-1, p[1:, None])[:, 0])
        return torch.cat(out)

    linear = F.linear

    def w8a8_linear(x, weight, bias=None):
        if weight.untyped_storage().data_ptr() in storages:
            x = per_token_e4m3(x)
        return linear(x, weight, bias)

    def rotate(by: int) -> None:
        for name, param in model.named_parameters():
            if "experts.gate_up_proj" in name or "experts.down_proj" in name:
                param.data.copy_(torch.roll(param.data, by, 0))

    w8a16 = logprobs()
    torch.nn.functional.linear = w8a8_linear
    try:
        w8a8 = logprobs()
        rotate(-1)
        control = logprobs()
        rotate(1)
    finally:
        torch.nn.functional.linear = linear
    for name, weight in drawn.items():
        model.get_parameter(name).data.copy_(weight)
    bf16 = logprobs()
    print(f"{len(drawn)} projections, {w8a16.numel()} scored tokens")
    print(f"W8A8 vs W8A16:    {figures(w8a8, w8a16)}")
    print(f"control vs W8A16: {figures(control, w8a16)}")
    print(f"bf16 vs W8A16:    {figures(bf16, w8a16)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
