"""``vllm-minimax eval``: accuracy (lm-eval) and serving throughput against an
OpenAI-compatible vLLM server, and an A/B of server configurations (by default MiniMax M3's
Triton and FlashInfer indexers) that starts and stops the servers itself.

Modules: :mod:`.cli` (the options), :mod:`.presets` (the YAML presets of ``evals/``),
:mod:`.server` (the ``vllm serve`` lifecycle and the checks of a running server),
:mod:`.accuracy`, :mod:`.throughput`, :mod:`.ab` and :mod:`.report`. The user's guide is
``evals/README.md``. lm-eval, aiohttp and matplotlib come with the ``eval`` extra
(``pip install vllm-minimax[eval]``); :func:`.common.require` names the extra when one is
missing.
"""
