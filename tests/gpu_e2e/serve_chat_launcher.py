"""`python -m vllm.entrypoints.openai.api_server` with the tiny MTP draft's layer prefix.

    python tests/gpu_e2e/serve_chat_launcher.py --model DIR [vllm serve arguments...]

`mtp_draft.install()` runs first, in the API server process; the engine core
process is forked from it (VLLM_WORKER_MULTIPROC_METHOD=fork, which vLLM keeps
while CUDA is not initialized here) and inherits the prefix, and with TP 1 the
model runs in that process. Everything else is vLLM's own server.
"""

from __future__ import annotations

import runpy
import sys

from vllm_minimax.testing import mtp_draft

mtp_draft.install()

import torch  # noqa: E402

if torch.cuda.is_initialized():
    sys.exit("serve_chat_launcher: CUDA is initialized; vLLM would spawn and lose the prefix")
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
