"""vllm-minimax: FlashInfer's MSA indexer and sparse attention for MiniMax M3 on Hopper, as a
patch series over released vLLM, with the CLI that applies, checks and evaluates it."""

__version__ = "0.1.0"
