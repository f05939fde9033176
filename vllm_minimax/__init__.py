"""vllm-minimax: FlashInfer's MSA indexer for MiniMax M3 as a patch series over vLLM."""

__version__ = "0.1.0"
