"""`PrefixedMiniMaxM3MTP`: vLLM's MiniMax M3 MTP draft, its layers under `DRAFT_PREFIX`.

vLLM's model registry imports this module where it inspects or builds the draft
(`mtp_draft.install()` registers the class by name); importing it imports vLLM's
MiniMax M3 model, so nothing imports it up front.
"""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.models.minimax_m3 import MiniMaxM3MTP

from vllm_minimax.testing.mtp_draft import draft_prefix


class PrefixedMiniMaxM3MTP(MiniMaxM3MTP):
    """vLLM's `MiniMaxM3MTP` built with its prefix moved under `DRAFT_PREFIX`."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=draft_prefix(prefix))
