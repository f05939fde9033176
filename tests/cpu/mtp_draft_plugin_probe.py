"""What a served engine's processes see of the tiny MTP draft's registration; JSON out.

    python tests/cpu/mtp_draft_plugin_probe.py [--install-in-parent]

Run by test_mtp_draft_plugin.py in a fresh interpreter, standing for `vllm serve`'s
API server process: it loads vLLM's general plugins as `EngineArgs` does there
(or, with `--install-in-parent`, calls `mtp_draft.install()` itself, as the old
launcher did), then records whether any MiniMax M3 model module got imported and
whether torch's CUDA state was initialised. It then starts a child through
vLLM's own `get_mp_context()` (the test sets `VLLM_WORKER_MULTIPROC_METHOD=spawn`,
the method vLLM falls back to once CUDA is initialised), which loads the general
plugins as vLLM's engine core does at its start and reports the class vLLM's
model registry would import for the draft's architecture.
"""

from __future__ import annotations

import argparse
import json
import sys


def registered_draft_class() -> str:
    from vllm.model_executor.models.registry import ModelRegistry

    from vllm_minimax.testing.mtp_draft import DRAFT_ARCHITECTURE

    entry = ModelRegistry.models[DRAFT_ARCHITECTURE]
    return f"{entry.module_name}:{entry.class_name}"


def engine_process(queue) -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    queue.put(registered_draft_class())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install-in-parent", action="store_true")
    args = parser.parse_args(argv)

    import torch

    if args.install_in_parent:
        from vllm_minimax.testing import mtp_draft

        mtp_draft.install()
    else:
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
    queue = context.Queue()
    child = context.Process(target=engine_process, args=(queue,))
    child.start()
    child_class = queue.get(timeout=300)
    child.join(timeout=60)
    print(
        json.dumps(
            {
                "parent": parent,
                "start_method": context.get_start_method(),
                "child_draft_class": child_class,
                "child_exitcode": child.exitcode,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
