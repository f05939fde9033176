"""What the speculative serving run (`tests/gpu_e2e/test_serve_chat.py`) reads off the
server: the draft's attention backend in the log, vLLM's spec-decode counters from
``/metrics``, and what was compiled after the server was ready.

- The draft's backend: vLLM 0.34.0's CUDA platform logs ``Using <backend> backend.`` when a
  layer's backend was chosen by configuration (``speculative-config.attention_backend`` for the
  draft; the shipped configs choose none for the target) and ``Using X attention backend out of
  potential backends: [...]`` when it picked one itself (``platforms/cuda.py``).
- The counters: ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
  ``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos`` (one sample per draft
  position), ``vllm/v1/spec_decode/metrics.py``.
- Compiled after ready: FlashInfer's build lines (``Building JIT module``, ``Compiling CuTe-DSL
  kernel``) and vLLM's JIT monitor warnings (`engine_runs.jit_events_in`) in the log past the
  offset the server had reached when it answered ``/health``. The series' kernels are
  FlashInfer's programs, MiniMax M3's own Triton kernels (the ``@triton.jit`` functions of
  ``vllm/models/minimax_m3``) and, where patch 0009 warms it, vLLM's sampler logprobs kernel;
  other kernels compiled after ready are reported, not counted.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from vllm_minimax.testing.engine_runs import (
    STOCK_KERNELS_COMPILED_AFTER_READY,
    jit_events_in,
    logprobs_kernel_warmed,
)

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
FLASHINFER_BUILD_LINES = ("Building JIT module", "Compiling CuTe-DSL kernel")
_CONFIGURED_BACKEND = re.compile(
    r"Using (?:AttentionBackendEnum\.)?(?P<backend>[A-Z0-9_]+) backend\."
)
_PICKED_BACKEND = re.compile(r"Using (?P<backend>[A-Z0-9_]+) attention backend out of potential")
_TRITON_KERNEL = re.compile(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (?P<name>\w+)\(")
_SAMPLE = re.compile(r"^(?P<name>[\w:]+?)(?:_total)?(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def configured_backends(log: str) -> list[str]:
    """The attention backends the log says were chosen by configuration, in order."""
    return [match["backend"] for match in _CONFIGURED_BACKEND.finditer(log)]


def picked_backends(log: str) -> list[str]:
    """The attention backends vLLM picked itself (where nothing chose one)."""
    return [match["backend"] for match in _PICKED_BACKEND.finditer(log)]


def spec_decode_counters(metrics: str) -> dict[str, Any]:
    """The spec-decode counters of a ``/metrics`` text, summed over their label sets, and the
    accepted tokens by draft position (``per_position``, position order)."""
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for line in metrics.splitlines():
        if line.startswith("#"):
            continue
        match = _SAMPLE.match(line.strip())
        if not match or not match["name"].startswith("vllm:spec_decode"):
            continue
        if not line.split("{")[0].split(" ")[0].endswith("_total"):
            continue  # the _created samples
        name, value = match["name"], float(match["value"])
        if name == PER_POSITION:
            position = re.search(r'position="(\d+)"', match["labels"] or "")
            if position:
                index = int(position[1])
                per_position[index] = per_position.get(index, 0.0) + value
            continue
        totals[name] = totals.get(name, 0.0) + value
    missing = [name for name in SPEC_COUNTERS if name not in totals]
    if missing:
        raise ValueError(f"no {', '.join(missing)} samples in /metrics")
    drafts = totals["vllm:spec_decode_num_drafts"]
    draft_tokens = totals["vllm:spec_decode_num_draft_tokens"]
    accepted = totals["vllm:spec_decode_num_accepted_tokens"]
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position": [per_position[i] for i in sorted(per_position)],
    }


def m3_triton_kernels(vllm_root: Path) -> set[str]:
    """The names of the ``@triton.jit`` functions under ``vllm_root/vllm/models/minimax_m3``."""
    names: set[str] = set()
    for path in sorted((Path(vllm_root) / "vllm" / "models" / "minimax_m3").rglob("*.py")):
        names.update(m["name"] for m in _TRITON_KERNEL.finditer(path.read_text(errors="replace")))
    return names


def series_triton_kernels(vllm_root: Path) -> set[str]:
    """The Triton kernels the series warms in the tree under ``vllm_root``: MiniMax M3's own
    (`m3_triton_kernels`) and, where patch 0009 is applied (`logprobs_kernel_warmed`), vLLM's
    sampler logprobs kernel."""
    names = m3_triton_kernels(vllm_root)
    if logprobs_kernel_warmed(vllm_root):
        names |= STOCK_KERNELS_COMPILED_AFTER_READY
    return names


def compiled_after_ready(log_after_ready: str, series_kernels: set[str]) -> dict[str, list[str]]:
    """What the log past the ready offset says was built or compiled: ``flashinfer`` (its
    build lines), ``series`` (JIT monitor events of ``series_kernels``), ``other`` (the other
    JIT monitor events, vLLM's own sampler kernel left out)."""
    flashinfer = [
        line.strip()
        for line in log_after_ready.splitlines()
        if any(marker in line for marker in FLASHINFER_BUILD_LINES)
    ]
    events = [event["kernel"] for event in jit_events_in(log_after_ready)]
    return {
        "flashinfer": flashinfer,
        "series": [kernel for kernel in events if kernel in series_kernels],
        "other": [
            kernel
            for kernel in events
            if kernel not in series_kernels and kernel not in STOCK_KERNELS_COMPILED_AFTER_READY
        ],
    }


# --- method mtp on a checkpoint without the tensors (tests/gpu_e2e/mtp_without_tensors.py) ---

# vLLM 0.34.0's DefaultModelLoader, when a checkpoint without a quantization config leaves
# parameters unloaded (model_executor/model_loader/default_loader.py).
NOT_INITIALIZED = "Following weights were not initialized from checkpoint"


def published_layout(target: Path, work: Path, mtp_modules: int = 1) -> Path:
    """``work``: the tiny checkpoint as the published MiniMax M3 checkpoints are laid out, with
    ``mtp_modules`` MTP modules declared and none carried.

    - ``config.json``: the ``minimax_m3_vl`` wrapper with the VL architecture
      (:data:`~vllm_minimax.tiny_model.VL_ARCHITECTURE`), which vLLM 0.34.0 builds with the
      text model under ``language_model.``; ``text_config.num_mtp_modules`` is what vLLM
      rewrites into a ``MiniMaxM3MTP`` draft of the target itself. The wrapper's vision
      config is transformers' default: serve it with ``limit_mm_per_prompt`` 0 for image
      and video, so that vLLM skips the tower (the checkpoint has none of its weights).
    - ``*.safetensors`` (and the index's weight map): the target's tensors, each name
      prefixed ``language_model.`` as in the published files; the data bytes are copied.
    - every other top-level file: a link to the target's.

    The text-only architecture cannot serve here: its layers are ``model.layers.{i}``, the
    names ``MiniMaxM3MTP`` gives its own modules."""
    from vllm_minimax.checkpoint_weights import INDEX_FILE
    from vllm_minimax.tiny_model import (
        PUBLISHED_MODEL_TYPE,
        PUBLISHED_MODEL_TYPE_LAYOUT,
        VL_ARCHITECTURE,
        target_config_json,
    )

    target, work = Path(target), Path(work)
    work.mkdir(parents=True, exist_ok=True)
    for entry in target.iterdir():
        if not entry.is_file() or entry.name == "config.json":
            continue
        destination = work / entry.name
        if entry.suffix == ".safetensors":
            prefix_safetensors_names(entry, destination, LANGUAGE_MODEL_PREFIX)
        elif entry.name == INDEX_FILE:
            index = json.loads(entry.read_text())
            index["weight_map"] = {
                LANGUAGE_MODEL_PREFIX + name: shard for name, shard in index["weight_map"].items()
            }
            destination.write_text(json.dumps(index, indent=2) + "\n")
        elif not destination.exists():
            destination.symlink_to(entry.resolve())
    config = json.loads((target / "config.json").read_text())
    if config.get("model_type") != PUBLISHED_MODEL_TYPE:
        config = target_config_json(config, PUBLISHED_MODEL_TYPE_LAYOUT)
    config["architectures"] = [VL_ARCHITECTURE]
    config["text_config"]["num_mtp_modules"] = mtp_modules
    (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return work


# The published checkpoints' name prefix of the text model's tensors.
LANGUAGE_MODEL_PREFIX = "language_model."


def prefix_safetensors_names(source: Path, destination: Path, prefix: str) -> None:
    """``destination``: ``source``'s safetensors file with ``prefix`` before every tensor name.

    Only the header changes: the offsets in it count from the end of the header, so the data
    section is copied as it is. The new header is padded with spaces to 8 bytes, as the
    format recommends."""
    with source.open("rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
        renamed = {
            (name if name == "__metadata__" else prefix + name): entry
            for name, entry in header.items()
        }
        encoded = json.dumps(renamed, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        partial = destination.with_name(destination.name + ".partial")
        with partial.open("wb") as out:
            out.write(len(encoded).to_bytes(8, "little"))
            out.write(encoded)
            shutil.copyfileobj(file, out)
    partial.replace(destination)


def not_initialized(text: str) -> list[str]:
    """The parameter names the loader's message lists (``...: {'a', 'b'}``), sorted."""
    match = re.search(NOT_INITIALIZED + r": (\{[^}]*\})", text)
    return sorted(re.findall(r"'([^']+)'", match[1])) if match else []
