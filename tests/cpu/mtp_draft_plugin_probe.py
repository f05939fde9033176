"""What a served engine's processes see of the tiny MTP draft's registration; JSON out.

    python tests/cpu/mtp_draft_plugin_probe.py

Run by test_mtp_draft_plugin.py in a fresh interpreter, standing for `vllm serve`'s
API server process, with the plugin's distribution on `PYTHONPATH`: it loads
vLLM's general plugins as `EngineArgs` does there, then records the class vLLM's
model registry would import for the draft's architecture, whether any MiniMax M3
model module got imported and whether torch's CUDA state was initialised.

It then starts two children through vLLM's own `get_mp_context()` (the test sets
`VLLM_WORKER_MULTIPROC_METHOD=spawn`, the method vLLM falls back to once CUDA is
initialised), each loading the general plugins as vLLM's engine core does at its
start and reporting the registry's class: one as vLLM would, one with
`VLLM_PLUGINS=""` (vLLM's allowlist, matching no plugin), which leaves it only
what the parent set up.
"""

from __future__ import annotations

import json
import os
import sys


def registered_draft_class() -> str:
    from vllm.model_executor.models.registry import ModelRegistry

    from vllm_minimax.testing.mtp_draft import DRAFT_ARCHITECTURE

    entry = ModelRegistry.models[DRAFT_ARCHITECTURE]
    return f"{entry.module_name}:{entry.class_name}"


def engine_process(queue, plugins_allowed: bool) -> None:
    if not plugins_allowed:
        os.environ["VLLM_PLUGINS"] = ""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    queue.put(registered_draft_class())


def main() -> int:
    import torch
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    parent = {
        "draft_class": registered_draft_class(),
        "model_modules_imported": sorted(
            name for name in sys.modules if name.startswith("vllm.models.minimax_m3")
        ),
        "cuda_initialized": torch.cuda.is_initialized(),
    }
    from vllm.utils.system_utils import get_mp_context

    context = get_mp_context()
    children = {}
    for label, plugins_allowed in (("with_plugins", True), ("without_plugins", False)):
        queue = context.Queue()
        child = context.Process(target=engine_process, args=(queue, plugins_allowed))
        child.start()
        children[label] = queue.get(timeout=300)
        child.join(timeout=60)
        children[f"{label}_exitcode"] = child.exitcode
    report = {"parent": parent, "start_method": context.get_start_method(), **children}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
