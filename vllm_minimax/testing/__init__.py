"""Test rigs: the float32 reference, the patched module's loader, vLLM's Triton
indexer runner, the shared indexer cases, and the GPU engine audit.

They serve `tests/` and `benchmarks/` from a source checkout and are not shipped in
the wheel (`pyproject.toml` lists the packages it carries).
"""
