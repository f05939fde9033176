"""The MTP draft of the tiny MiniMax M3 next to its text-only target, in one engine.

vLLM 0.34.0 builds the draft (`MiniMaxM3MTP`) with an empty prefix
(`load_eagle_model` -> `get_model(...)` without one), so its module `i` registers
its attention layer as `model.layers.{i}.self_attn.attn`, in the same forward
context as the target's layers. Behind the published `minimax_m3_vl` wrapper the
target's layers are `language_model.model.layers.*` and nothing collides; the
tiny checkpoint's text-only target (`MiniMaxM3SparseForCausalLM`, no wrapper)
owns `model.layers.0.self_attn.attn` itself, and the draft fails with
`ValueError: Duplicate layer name`.

`install()` gives the draft the prefix `DRAFT_PREFIX` instead (its layers become
`mtp.model.layers.{i}.*`), which is what the wrapper achieves for the target. A
prefix names layers only: parameter names, weight loading and every kernel the
draft runs stay vLLM's own. `is_draft_layer_name` tells the two apart in the
audit.
"""

from __future__ import annotations

from collections.abc import Callable

DRAFT_PREFIX = "mtp"


def is_draft_layer_name(name: str) -> bool:
    return name.startswith(f"{DRAFT_PREFIX}.")


def install() -> Callable:
    """Make `MiniMaxM3MTP` prefix its layers with `DRAFT_PREFIX`; returns the original
    `__init__` (idempotent)."""
    from vllm.models.minimax_m3.nvidia.mtp import MiniMaxM3MTP

    original = MiniMaxM3MTP.__init__
    wrapped = getattr(original, "__wrapped_original__", None)
    if wrapped is not None:
        return wrapped

    def prefixed_init(self, *, vllm_config, prefix: str = "") -> None:
        if prefix != DRAFT_PREFIX and not is_draft_layer_name(prefix):
            prefix = f"{DRAFT_PREFIX}.{prefix}" if prefix else DRAFT_PREFIX
        original(self, vllm_config=vllm_config, prefix=prefix)

    prefixed_init.__wrapped_original__ = original  # type: ignore[attr-defined]
    MiniMaxM3MTP.__init__ = prefixed_init  # type: ignore[method-assign]
    return original
