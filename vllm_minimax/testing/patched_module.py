"""The patch's own FlashInfer indexer module, loaded without vLLM.

Patch 0003 adds `vllm/models/minimax_m3/nvidia/indexer_flashinfer.py` to vLLM
0.34.0. Machines that cannot import vLLM 0.34.0 (the H200 test machine has
torch 2.11; vLLM 0.34.0 pins torch 2.14) still need to run exactly that file's
`build()` and `forward()`, so that the GPU tests and the benchmark cannot drift
from what the patch does. This module

- builds the added file from the series with `git apply` (`patched_source`),
- execs it as a module under a small shim that stands in for the vLLM names it
  imports (`load_patched_module`), with the real `flashinfer.msa_ops` or any
  stand-in namespace of the two functions,
- and builds the objects the patched code needs (`make_builder`, `make_impl`,
  `forward_context`; `scheduled_step.common_metadata` makes the batch metadata).

The stand-ins carry the same fields as vLLM 0.34.0's classes
(`MiniMaxM3IndexerMetadataBuilder.__init__`'s buffers and
`reorder_batch_threshold`, `MiniMaxM3IndexerMetadata`'s fields,
`MiniMaxM3IndexerImpl`'s attributes, `CommonAttentionMetadata`'s fields),
`split_decodes_and_prefills` is vLLM 0.34.0's own code, copied, and the
workspace manager hands out views of one growing buffer as vLLM's
`WorkspaceManager.get_simultaneous` does.

The shim's modules are placed in `sys.modules` only while the patched source is
executed and restored afterwards, so a real vLLM in the same process is left as
it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

from vllm_minimax import patchset

SERIES_VERSION = "0.34.0"
# Names the series (a supported vLLM version) the loader builds the file from.
SERIES_VERSION_ENV = "VLLM_MINIMAX_SERIES_VERSION"
NEW_FILE = "vllm/models/minimax_m3/nvidia/indexer_flashinfer.py"
# The series' gate module, whose constants the indexer imports.
GATE_FILE = "vllm/models/minimax_m3/nvidia/indexer_flashinfer_gate.py"
GATE_MODULE = "vllm.models.minimax_m3.nvidia.indexer_flashinfer_gate"
MODULE_NAME = "vllm_minimax._patched_indexer_flashinfer"


def series_version() -> str:
    """The series the loader uses: `$VLLM_MINIMAX_SERIES_VERSION`, else 0.34.0's."""
    return os.environ.get(SERIES_VERSION_ENV, "").strip() or SERIES_VERSION


def patched_source(version: str | None = None, path: str = NEW_FILE) -> str:
    """Source of `path` as the series for vLLM `version` creates it.

    The series is found the way `vllm-minimax apply` finds it
    (`patchset.require_series_dir`), and `git apply` builds the file from the
    patches that touch it, in series order, in an empty directory; the stand-ins
    below are vLLM 0.34.0's, so other versions are for comparison only.
    """
    version = version or series_version()
    patches = [
        patch
        for patch in patchset.read_series(patchset.require_series_dir(version))
        if path in patch.paths
    ]
    if not patches or path not in patches[0].created:
        raise patchset.PatchError(f"the vLLM {version} series does not create {path}")
    git = patchset.git_executable()
    with tempfile.TemporaryDirectory(prefix="vllm-minimax-patched-module-") as scratch:
        env = patchset.isolated_git_env(ceiling=Path(scratch))
        tree = Path(scratch) / "tree"
        tree.mkdir()
        for patch in patches:
            completed = subprocess.run(
                [git, "apply", "--whitespace=nowarn", f"--include={path}", str(patch.path)],
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
            )
            if completed.returncode != 0:
                raise patchset.PatchError(
                    patchset.describe_apply_failure(patch, completed.stderr, tree)
                )
        return (tree / path).read_text(encoding="utf-8")


# ---------------------------------------------------------------------------
# Stand-ins for the vLLM 0.34.0 names the patched module imports.
# ---------------------------------------------------------------------------
def indexer_text_config(
    *,
    index_n_heads: int,
    index_local_blocks: int | None = 1,
    index_init_blocks: int | None = None,
    index_topk_blocks: int = 16,
    index_head_dim: int = 128,
    index_block_size: int = 128,
) -> SimpleNamespace:
    """A model text config with the indexer geometry as every supported vLLM reads it:
    0.34.0's flat ``index_*`` fields and 0.33.0's ``sparse_attention_config`` dict
    (``sparse_num_index_heads``, ``sparse_local_block``, ...). ``index_local_blocks=None``
    leaves the local window out of both; ``index_init_blocks`` sets 0.33.0's
    ``sparse_init_block`` (0.34.0's model reads no forced leading blocks)."""
    sparse = {
        "sparse_num_index_heads": index_n_heads,
        "sparse_topk_blocks": index_topk_blocks,
        "sparse_index_dim": index_head_dim,
        "sparse_block_size": index_block_size,
    }
    flat: dict[str, Any] = {
        "index_n_heads": index_n_heads,
        "index_topk_blocks": index_topk_blocks,
        "index_head_dim": index_head_dim,
        "index_block_size": index_block_size,
    }
    if index_init_blocks is not None:
        sparse["sparse_init_block"] = index_init_blocks
    if index_local_blocks is not None:
        sparse["sparse_local_block"] = index_local_blocks
        flat["index_local_blocks"] = index_local_blocks
    return SimpleNamespace(**flat, sparse_attention_config=sparse)


class VllmConfig:
    """Just what the builders and the impl read: model_config.hf_config and
    max_model_len, scheduler_config.max_num_batched_tokens and max_num_seqs,
    speculative_config."""

    def __init__(
        self,
        *,
        index_n_heads: int = 4,
        index_local_blocks: int = 1,
        index_topk_blocks: int = 16,
        max_num_batched_tokens: int = 16384,
        max_model_len: int = 262144,
        num_speculative_tokens: int = 0,
        max_num_seqs: int = 256,
    ) -> None:
        text_config = indexer_text_config(
            index_n_heads=index_n_heads,
            index_local_blocks=index_local_blocks,
            index_topk_blocks=index_topk_blocks,
        )
        self.model_config = SimpleNamespace(
            hf_config=SimpleNamespace(text_config=text_config), max_model_len=max_model_len
        )
        self.scheduler_config = SimpleNamespace(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs
        )
        self.speculative_config = (
            SimpleNamespace(num_speculative_tokens=num_speculative_tokens)
            if num_speculative_tokens
            else None
        )


_CURRENT_VLLM_CONFIG: list[VllmConfig] = []


def get_current_vllm_config() -> VllmConfig:
    """The config `make_impl` constructs the impl under."""
    assert _CURRENT_VLLM_CONFIG, "no current vLLM config (construct through make_impl)"
    return _CURRENT_VLLM_CONFIG[-1]


@contextlib.contextmanager
def current_vllm_config(config: VllmConfig) -> Iterator[None]:
    _CURRENT_VLLM_CONFIG.append(config)
    try:
        yield
    finally:
        _CURRENT_VLLM_CONFIG.pop()


def cdiv(a: int, b: int) -> int:
    """vllm.utils.math_utils.cdiv."""
    return -(a // -b)


_VIEW_ALIGNMENT = 256


class WorkspaceManager:
    """vLLM 0.34.0's `WorkspaceManager.get_simultaneous` for one ubatch and
    lane: views from the start of one uint8 buffer, grown (never shrunk) to
    the largest request, each view starting 256-byte aligned."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.buffer: torch.Tensor | None = None

    def get_simultaneous(
        self, *shapes_and_dtypes: tuple[tuple[int, ...], torch.dtype]
    ) -> list[torch.Tensor]:
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in shapes_and_dtypes]
        aligned = [-(-n // _VIEW_ALIGNMENT) * _VIEW_ALIGNMENT for n in sizes]
        total = sum(aligned)
        if self.buffer is None or self.buffer.numel() < total:
            self.buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
        views, offset = [], 0
        for (shape, dtype), n, step in zip(shapes_and_dtypes, sizes, aligned, strict=True):
            views.append(self.buffer[offset : offset + n].view(dtype).reshape(shape))
            offset += step
        return views


_WORKSPACE: list[WorkspaceManager] = []


def current_workspace_manager() -> WorkspaceManager:
    """The process's one manager (`init_workspace_manager`)."""
    assert _WORKSPACE, "no workspace manager (construct the impl through make_impl)"
    return _WORKSPACE[0]


def init_workspace_manager(device: torch.device | str) -> WorkspaceManager:
    """The process's manager, made on `device` unless it is already there."""
    device = torch.device(device)
    if not _WORKSPACE or _WORKSPACE[0].device != device:
        _WORKSPACE[:] = [WorkspaceManager(device)]
    return _WORKSPACE[0]


@dataclass
class CommonAttentionMetadata:
    """vLLM 0.34.0's fields (v1/attention/backend.py), defaults included."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool | torch.Tensor = True
    logits_indices_padded: torch.Tensor | None = None
    num_logits_indices: int | None = None
    max_logits_per_req: int | None = None
    encoder_seq_lens: torch.Tensor | None = None
    encoder_seq_lens_cpu: Any = None
    dcp_local_seq_lens: torch.Tensor | None = None
    dcp_local_seq_lens_cpu_upper_bound: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    is_prefilling: torch.Tensor | None = None
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    req_idx: Any = None
    mm_req_doc_ranges: Any = None
    rswa_prefix_lens: torch.Tensor | None = None
    _num_computed_tokens_cache: torch.Tensor | None = None
    _token_to_req_indices_cache: torch.Tensor | None = None

    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    def replace(self, **kwargs) -> CommonAttentionMetadata:
        return dataclasses.replace(self, **kwargs)

    def compute_num_computed_tokens(self) -> torch.Tensor:
        if self._num_computed_tokens_cache is None:
            query_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
            self._num_computed_tokens_cache = self.seq_lens - query_lens
        return self._num_computed_tokens_cache


def split_decodes_and_prefills(
    common_attn_metadata: CommonAttentionMetadata,
    decode_threshold: int = 1,
    require_uniform: bool = False,
    treat_short_extends_as_decodes: bool = True,
) -> tuple[int, int, int, int]:
    """vLLM 0.34.0's v1/attention/backends/utils.py function, unchanged."""
    max_query_len = common_attn_metadata.max_query_len
    num_reqs = common_attn_metadata.num_reqs
    num_tokens = common_attn_metadata.num_actual_tokens
    query_start_loc = common_attn_metadata.query_start_loc_cpu

    if (
        max_query_len <= decode_threshold
        and (not require_uniform or decode_threshold <= 1)
        and treat_short_extends_as_decodes
    ):
        return num_reqs, 0, num_tokens, 0

    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if query_lens[0].item() > decode_threshold:
        return 0, num_reqs, 0, num_tokens

    if require_uniform:
        if treat_short_extends_as_decodes and torch.all(
            (query_lens == query_lens[0]) | (query_lens == 0)
        ):
            return num_reqs, 0, num_tokens, 0
        is_prefill = (query_lens != query_lens[0]) & (query_lens != 0)
    else:
        is_prefill = query_lens > decode_threshold

    if not treat_short_extends_as_decodes:
        assert common_attn_metadata.is_prefilling is not None
        is_prefill |= common_attn_metadata.is_prefilling

    if not torch.any(is_prefill):
        return num_reqs, 0, num_tokens, 0

    first_prefill = is_prefill.int().argmax(dim=-1).item()
    num_decodes = first_prefill
    num_prefills = num_reqs - num_decodes
    num_decode_tokens = query_start_loc[first_prefill].item()
    num_prefill_tokens = num_tokens - num_decode_tokens
    return (num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)


class AttentionBackend:
    """Stand-in base class."""


@dataclass
class AttentionSpec:
    """Stand-in: the patched builder reads its block size."""

    block_size: int = 128


class MiniMaxM3IndexerBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "MINIMAX_M3_SPARSE_INDEXER"


class AttentionMetadata:
    """Stand-in of vLLM's empty metadata base."""


@dataclass
class MiniMaxM3IndexerMetadata(AttentionMetadata):
    """vLLM 0.34.0's fields."""

    seq_lens: torch.Tensor
    max_seq_len: int
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    prefill: Any = None
    decode: Any = None


class MiniMaxM3IndexerMetadataBuilder:
    """Shared setup of vLLM 0.34.0's base builder: index-head count,
    `reorder_batch_threshold` (1 + num_speculative_tokens), the stable
    `context_len_buffer` and `num_valid_pages_buffer`."""

    reorder_batch_threshold: int = 1

    def __init__(
        self,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device
        text_config = vllm_config.model_config.hf_config.text_config
        self.num_index_heads = max(1, text_config.index_n_heads)
        spec = vllm_config.speculative_config
        self.reorder_batch_threshold = 1 + (spec.num_speculative_tokens if spec else 0)
        self.max_decode_query_len = self.reorder_batch_threshold
        n = vllm_config.scheduler_config.max_num_batched_tokens
        self.context_len_buffer = torch.empty(n, dtype=torch.int32, device=device)
        self.num_valid_pages_buffer = torch.empty(n, dtype=torch.int32, device=device)


class MiniMaxM3IndexerImpl(torch.nn.Module):
    """The attributes vLLM 0.34.0's impl base sets that the patched forward
    reads; `index_cache` holds `kv_cache` ([num_pages, 128, D]) and `prefix`."""

    indexer_backend_cls: ClassVar[type] = MiniMaxM3IndexerBackend

    def __init__(
        self,
        *,
        kv_cache: torch.Tensor,
        num_index_heads: int,
        index_head_dim: int = 128,
        topk_blocks: int = 16,
        init_blocks: int = 0,
        local_blocks: int = 0,
        topk_indices_buffer: torch.Tensor | None = None,
        prefix: str = "model.layers.0.self_attn.indexer",
        num_kv_heads: int | None = None,
        sparse_block_size: int = 128,
    ) -> None:
        super().__init__()
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_index_heads
        self.topk_blocks = topk_blocks
        self.block_size = sparse_block_size
        self.init_blocks = init_blocks
        self.local_blocks = local_blocks
        self.num_index_heads = num_index_heads
        self.index_head_dim = index_head_dim
        self.topk_indices_buffer = topk_indices_buffer
        self.index_cache = SimpleNamespace(kv_cache=kv_cache, prefix=f"{prefix}.index_cache")


_FORWARD_CONTEXT = SimpleNamespace(attn_metadata=None)


def get_forward_context() -> SimpleNamespace:
    return _FORWARD_CONTEXT


@contextlib.contextmanager
def forward_context(attn_metadata: Any) -> Iterator[None]:
    """Sets `get_forward_context().attn_metadata` for the duration."""
    old = _FORWARD_CONTEXT.attn_metadata
    _FORWARD_CONTEXT.attn_metadata = attn_metadata
    try:
        yield
    finally:
        _FORWARD_CONTEXT.attn_metadata = old


def set_forward_context(attn_metadata: Any) -> None:
    """Sets the forward context until changed (for timing loops)."""
    _FORWARD_CONTEXT.attn_metadata = attn_metadata


def _mod(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def load_patched_gate(version: str | None = None) -> types.ModuleType:
    """The series' gate module (the indexer's shared constants), exec'd with
    stand-ins for the two vLLM names it imports; its functions are not for use
    here (the platform stand-in is no platform)."""
    version = version or series_version()
    module = types.ModuleType(GATE_MODULE)
    module.__file__ = f"vllm-{version} series::{GATE_FILE}"
    shims = {
        "vllm": _mod("vllm"),
        "vllm.platforms": _mod("vllm.platforms", current_platform=None),
        "vllm.utils": _mod("vllm.utils"),
        "vllm.utils.flashinfer": _mod("vllm.utils.flashinfer", has_flashinfer=lambda: False),
    }
    with temporary_modules(shims):
        exec(compile(patched_source(version, GATE_FILE), module.__file__, "exec"), module.__dict__)
    return module


def _shim_modules(msa_ops: Any) -> dict[str, types.ModuleType]:
    mod = _mod

    mods = {
        "vllm": mod("vllm"),
        "vllm.config": mod(
            "vllm.config", VllmConfig=VllmConfig, get_current_vllm_config=get_current_vllm_config
        ),
        "vllm.forward_context": mod(
            "vllm.forward_context", get_forward_context=get_forward_context
        ),
        "vllm.models": mod("vllm.models"),
        "vllm.models.minimax_m3": mod("vllm.models.minimax_m3"),
        "vllm.models.minimax_m3.common": mod("vllm.models.minimax_m3.common"),
        "vllm.models.minimax_m3.nvidia": mod("vllm.models.minimax_m3.nvidia"),
        GATE_MODULE: load_patched_gate(),
        "vllm.models.minimax_m3.common.indexer": mod(
            "vllm.models.minimax_m3.common.indexer",
            MiniMaxM3IndexerBackend=MiniMaxM3IndexerBackend,
            MiniMaxM3IndexerImpl=MiniMaxM3IndexerImpl,
            MiniMaxM3IndexerMetadata=MiniMaxM3IndexerMetadata,
            MiniMaxM3IndexerMetadataBuilder=MiniMaxM3IndexerMetadataBuilder,
        ),
        "vllm.v1": mod("vllm.v1"),
        "vllm.v1.attention": mod("vllm.v1.attention"),
        "vllm.v1.attention.backend": mod(
            "vllm.v1.attention.backend",
            AttentionBackend=AttentionBackend,
            CommonAttentionMetadata=CommonAttentionMetadata,
        ),
        "vllm.v1.attention.backends": mod("vllm.v1.attention.backends"),
        "vllm.v1.attention.backends.utils": mod(
            "vllm.v1.attention.backends.utils",
            split_decodes_and_prefills=split_decodes_and_prefills,
        ),
        "vllm.v1.kv_cache_interface": mod(
            "vllm.v1.kv_cache_interface", AttentionSpec=AttentionSpec
        ),
        "vllm.utils": mod("vllm.utils"),
        "vllm.utils.math_utils": mod("vllm.utils.math_utils", cdiv=cdiv),
        "vllm.v1.worker": mod("vllm.v1.worker"),
        "vllm.v1.worker.workspace": mod(
            "vllm.v1.worker.workspace", current_workspace_manager=current_workspace_manager
        ),
    }
    if msa_ops is not None:
        mods["flashinfer"] = mod("flashinfer")
        mods["flashinfer.msa_ops"] = mod(
            "flashinfer.msa_ops",
            msa_proxy_score=msa_ops.msa_proxy_score,
            msa_topk_select=msa_ops.msa_topk_select,
        )
        mods["flashinfer"].msa_ops = mods["flashinfer.msa_ops"]
    return mods


@contextlib.contextmanager
def temporary_modules(mods: dict[str, types.ModuleType]) -> Iterator[None]:
    """Put `mods` into `sys.modules` for the duration, then restore."""
    saved = {name: sys.modules.get(name) for name in mods}
    sys.modules.update(mods)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def reference_msa_ops() -> SimpleNamespace:
    """`msa_proxy_score` / `msa_topk_select` with the kernels' signatures,
    computed by `vllm_minimax.reference` (CPU or GPU, float32)."""
    from vllm_minimax.testing import reference

    def msa_proxy_score(
        q,
        k,
        cu_seqlens_q,
        cu_seqlens_k=None,
        *,
        page_table,
        seqused_k,
        causal=True,
        max_seqlen_q=None,
        max_k_tiles=None,
        output=None,
        **_: Any,
    ):
        assert causal and cu_seqlens_k is None
        scores = reference.proxy_score(
            q,
            k,
            cu_seqlens_q,
            page_table=page_table,
            seqused_k=seqused_k,
            max_k_tiles=max_k_tiles,
        )
        if output is None:
            return scores
        # FlashInfer's checks, then the scores written into `output`.
        assert output.shape == scores.shape and output.dtype == torch.float32
        output.copy_(scores)
        return output

    def msa_topk_select(
        max_score,
        topk,
        num_valid_pages=None,
        output=None,
        force_begin_blocks=0,
        force_end_blocks=0,
    ):
        assert topk == 16 and force_begin_blocks + force_end_blocks <= topk
        sel = reference.topk_select(
            max_score,
            topk,
            num_valid_pages,
            force_begin_blocks=force_begin_blocks,
            force_end_blocks=force_end_blocks,
        )
        if output is None:
            return sel
        output.copy_(sel)
        return output

    return SimpleNamespace(msa_proxy_score=msa_proxy_score, msa_topk_select=msa_topk_select)


def load_patched_module(
    msa_ops: Any = None,
    *,
    name: str = MODULE_NAME,
) -> types.ModuleType:
    """Exec the patch's new file as module `name` under the vLLM shim.

    `msa_ops`: None imports the real `flashinfer.msa_ops`; otherwise any object
    with `msa_proxy_score` and `msa_topk_select` (e.g. `reference_msa_ops()`).
    The module's globals `msa_proxy_score`/`msa_topk_select` may also be
    replaced afterwards.
    """
    version = series_version()
    source = patched_source(version)
    module = types.ModuleType(name)
    module.__file__ = f"vllm-{version} series::{NEW_FILE}"
    with temporary_modules(_shim_modules(msa_ops)):
        # dataclasses resolve string annotations through sys.modules[__module__].
        sys.modules[name] = module
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def real_module_matches_patch() -> bool | None:
    """None when no patched vLLM is importable; else whether the installed
    `indexer_flashinfer.py` is byte-identical to the patch's file."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("vllm.models.minimax_m3.nvidia.indexer_flashinfer")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).read_text() == patched_source()


# ---------------------------------------------------------------------------
# Constructors of the patched objects.
# ---------------------------------------------------------------------------
def make_builder(
    module: types.ModuleType,
    *,
    device: torch.device | str,
    num_index_heads: int,
    local_blocks: int = 1,
    reorder_batch_threshold: int = 1,
    max_num_batched_tokens: int = 65536,
    block_size: int = 128,
):
    """`local_blocks` is the model config's `index_local_blocks`, which the
    patched builder does not read (the impl's own `local_blocks` is used)."""
    config = VllmConfig(
        index_n_heads=num_index_heads,
        index_local_blocks=local_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        num_speculative_tokens=reorder_batch_threshold - 1,
    )
    return module.MiniMaxM3IndexerFlashInferMetadataBuilder(
        AttentionSpec(block_size=block_size), ["layer.0"], config, torch.device(device)
    )


def make_impl(
    module: types.ModuleType,
    *,
    kv_cache: torch.Tensor,
    num_index_heads: int,
    topk_indices_buffer: torch.Tensor,
    init_blocks: int = 1,
    local_blocks: int = 1,
    topk_blocks: int = 16,
    max_model_len: int = 262144,
    max_num_batched_tokens: int = 65536,
):
    """The impl, constructed under a config of `max_model_len` and
    `max_num_batched_tokens`, with the stand-in workspace manager of the
    cache's device made current for its forward calls."""
    init_workspace_manager(kv_cache.device)
    config = VllmConfig(
        index_n_heads=num_index_heads,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    with current_vllm_config(config):
        return module.MiniMaxM3IndexerFlashInferImpl(
            kv_cache=kv_cache,
            num_index_heads=num_index_heads,
            index_head_dim=kv_cache.shape[-1],
            topk_blocks=topk_blocks,
            init_blocks=init_blocks,
            local_blocks=local_blocks,
            topk_indices_buffer=topk_indices_buffer,
        )
