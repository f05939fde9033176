"""Test rigs: float32 references (and transformers' indexer as an oracle), loaders for
the patched modules and vLLM's Triton kernels, the shared indexer and sparse-attention
cases, scheduled-step factories, selection audits and faults, and the helpers the GPU
engine runs share (prompts, saved runs, MTP drafts).

They serve `tests/` and `benchmarks/` from a source checkout and are not shipped in
the wheel (`pyproject.toml` lists the packages it carries).
"""
