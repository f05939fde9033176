"""The MTP draft of the tiny MiniMax M3 next to its text-only target, in one engine.

vLLM 0.34.0 builds the draft (`MiniMaxM3MTP`) with an empty prefix
(`load_eagle_model` -> `get_model(...)` without one), so its module `i` registers
its attention layer as `model.layers.{i}.self_attn.attn`, in the same forward
context as the target's layers. Behind the published `minimax_m3_vl` wrapper the
target's layers are `language_model.model.layers.*` and nothing collides; the
tiny checkpoint's text-only target (`MiniMaxM3SparseForCausalLM`, no wrapper)
owns `model.layers.0.self_attn.attn` itself, and the draft fails with
`ValueError: Duplicate layer name`.

`PrefixedMiniMaxM3MTP` (`mtp_draft_model.py`) is vLLM's draft with the prefix
`DRAFT_PREFIX` (its layers become `mtp.model.layers.{i}.*`), which is what the
wrapper achieves for the target. A prefix names layers only: parameter names,
weight loading and every kernel the draft runs stay vLLM's own.
`is_draft_layer_name` tells the two apart in the audit.

`install()` registers that class with vLLM's model registry for the draft's
architecture, by its import path: the registry imports it only where a model is
inspected or built (a registry subprocess, the worker), so the process calling
`install()` imports no model code. Importing vLLM's MiniMax M3 model initialises
CUDA on a GPU host, and vLLM then starts its engine core with `spawn`, a fresh
interpreter that keeps nothing the parent set up. A served engine gets the
registration in each of its processes through vLLM's `vllm.general_plugins`
entry-point group, loaded by the API server, the engine core and every worker,
forked or spawned: `write_plugin_distribution` declares `install` there.
"""

from __future__ import annotations

from pathlib import Path

DRAFT_PREFIX = "mtp"
DRAFT_ARCHITECTURE = "MiniMaxM3MTP"
PREFIXED_DRAFT_CLASS = "vllm_minimax.testing.mtp_draft_model:PrefixedMiniMaxM3MTP"
PLUGIN_DISTRIBUTION = "vllm_minimax_tiny_mtp_draft"
PLUGIN_NAME = "tiny_mtp_draft_prefix"


def is_draft_layer_name(name: str) -> bool:
    return name.startswith(f"{DRAFT_PREFIX}.")


def draft_prefix(prefix: str) -> str:
    """`prefix` moved under `DRAFT_PREFIX`; unchanged when it is there already."""
    if prefix == DRAFT_PREFIX or is_draft_layer_name(prefix):
        return prefix
    return f"{DRAFT_PREFIX}.{prefix}" if prefix else DRAFT_PREFIX


def install() -> None:
    """Make vLLM build `PrefixedMiniMaxM3MTP` for `DRAFT_ARCHITECTURE` in this process.

    Imports vLLM's model registry, not the model; safe to call more than once. A model
    architecture vLLM has already resolved in this process stays resolved
    (`get_model_architecture` caches it), so call this before the engine is built."""
    from vllm.model_executor.models.registry import ModelRegistry

    ModelRegistry.register_model(DRAFT_ARCHITECTURE, PREFIXED_DRAFT_CLASS)


def speculative_config(model: str | Path, num_speculative_tokens: int) -> dict[str, object]:
    """`install()`, then vLLM's ``speculative_config`` for the tiny checkpoint `model`'s MTP
    draft (``model/MTP_SUBDIRECTORY``, written by ``make-tiny-model --mtp-modules N``),
    speculating `num_speculative_tokens` a step."""
    from vllm_minimax.tiny_model import MTP_SUBDIRECTORY

    install()
    return {
        "method": "mtp",
        "model": str(Path(model) / MTP_SUBDIRECTORY),
        "num_speculative_tokens": num_speculative_tokens,
    }


def write_plugin_distribution(directory: Path) -> Path:
    """Declare `install` as a `vllm.general_plugins` entry point in `directory`.

    Writes `PLUGIN_DISTRIBUTION-0.dist-info/` (`METADATA`, `entry_points.txt`), the
    form an installed distribution has, which `importlib.metadata` finds on any
    `sys.path` entry: put `directory` on the server's `PYTHONPATH`. Returns
    `directory`."""
    directory = Path(directory)
    dist_info = directory / f"{PLUGIN_DISTRIBUTION}-0.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {PLUGIN_DISTRIBUTION}\nVersion: 0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{PLUGIN_NAME} = {__name__}:install\n"
    )
    return directory
