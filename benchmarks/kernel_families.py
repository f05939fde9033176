"""Which family a GPU kernel of a MiniMax M3 engine step belongs to, by its name.

The families: ``moe_gemm`` (the routed experts' GEMMs: Humming's grouped or indexed GEMM,
vLLM's CUTLASS grouped fp8 GEMM with its argument-setup kernel, Triton's
``fused_moe_kernel``, Marlin's MoE), ``linear_gemm`` (every other GEMM: Humming's linear
GEMM, CUTLASS ``scaled_mm``, cuBLAS's ``nvjet``/``xmma`` kernels, the MoE router's
``GateLinear``), ``attention`` (FlashInfer's MSA sparse prefill and decode, vLLM's Triton
sparse attention, FlashAttention on the dense layers), ``indexer`` (the lightning indexer's
proxy score and top-k), ``communication`` (NCCL, vLLM's custom all-reduce), ``rest`` (norms,
activations, quantization, rotary, KV-cache writes, MoE routing, sampling, Inductor's fused
kernels, PyTorch's own, copies; each with a ``kind``), ``gemm_unresolved`` (a Humming GEMM
whose launch no range places: it is the MoE's or a linear layer's, and its name does not say
which) and ``other`` (no pattern matched: the report lists these names so that ``PATTERNS``
can be extended).

``PATTERNS`` is ordered, and the first match wins (case-insensitive ``re.search``).
FlashInfer 0.7.4 names its generated Hopper MSA programs ``kernel_cake_hopper_msa_<20 hex>``
for the indexer and the attention alike; their role is read from FlashInfer's own route
table (``ROUTES`` of ``flashinfer/jit/cake_hopper_msa.py``: route keys ``decode_v5:...``,
``prefill_v1:...`` are attention, ``proxy_decode:...``, ``proxy_prefill:...``,
``topk_select:...`` the indexer).

Names alone do not separate a Humming MoE GEMM from a Humming linear GEMM (the template's
class arguments are the same), nor any GEMM the MoE runs through a generic kernel;
``resolve`` takes what the trace knows besides the name: whether the launch lies in the
MoE experts' range, whether it was a direct launch (not a CUDA graph's), and an optional
map of Humming kernel names to MoE or linear, written on the GPU from Humming's registry of
compiled kernels.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

FAMILIES = (
    "moe_gemm",
    "linear_gemm",
    "attention",
    "indexer",
    "communication",
    "rest",
    "gemm_unresolved",
    "other",
)
GEMM_FAMILIES = ("moe_gemm", "linear_gemm", "gemm_unresolved")
HUMMING_KIND = "Humming GEMM"
CAKE_PROGRAM = re.compile(r"cake_hopper_msa_([0-9a-f]{20})")
# Route-key prefixes of FlashInfer's Hopper MSA programs and the family each belongs to.
CAKE_ROLES = {
    "decode": ("attention", "FlashInfer MSA sparse decode"),
    "prefill": ("attention", "FlashInfer MSA sparse prefill"),
    "proxy": ("indexer", "FlashInfer MSA proxy score"),
    "topk": ("indexer", "FlashInfer MSA top-k"),
}


@dataclass(frozen=True)
class Pattern:
    family: str
    kind: str
    regex: re.Pattern[str]


def _p(family: str, kind: str, regex: str) -> Pattern:
    return Pattern(family, kind, re.compile(regex, re.IGNORECASE))


PATTERNS: tuple[Pattern, ...] = (
    _p("communication", "NCCL", r"^nccl|ncclDevKernel"),
    _p(
        "communication",
        "all-reduce",
        r"cross_device_reduce|allreduce|all_reduce|all_gather|allgather|reduce_scatter",
    ),
    # vLLM 0.34.0's Triton indexer (vllm/models/minimax_m3/*/ops/index_topk*.py and the
    # nvidia indexer helpers).
    _p(
        "indexer",
        "vLLM Triton indexer",
        r"index_block_score|topk_index|decode_index_score|decode_topk_fused|m3_parallel_topk"
        r"|m3_row_topk|local_topk_push|insert_index_cache|gather_nvfp4_index_k",
    ),
    # FlashInfer's CuTe-DSL MSA indexer programs (msa_ops/cute_dsl/proxy_score_*_sm90.py,
    # topk_select_sm90.py): the class or function name is in the kernel's name.
    _p(
        "indexer",
        "FlashInfer MSA indexer (CuTe DSL)",
        r"proxy_?score|topk_select|(^|_)msa_kernel|kernel_cutlass__topk_kernel"
        r"|kernel_cutlass__fill_kernel",
    ),
    _p(
        "attention",
        "FlashInfer MSA sparse attention (CuTe DSL)",
        r"MsaSparse|sparse_(prefill|decode)_sm",
    ),
    _p(
        "attention",
        "vLLM Triton sparse attention",
        r"gqa_sparse_(fwd|decode)|merge_topk_attn_out|build_sparse_block_table",
    ),
    _p("attention", "FlashAttention", r"flash::|flash_fwd|FlashAttn|flash_attn"),
    _p(
        "attention",
        "FlashInfer attention",
        r"BatchPrefillWith|BatchDecodeWith|flashinfer::.*attention",
    ),
    _p("attention", "Triton attention", r"unified_attention|paged_attention"),
    _p("moe_gemm", "Triton fused_moe", r"fused_moe_kernel"),
    _p("moe_gemm", "CUTLASS grouped GEMM", r"GroupProblemShape|PtrArray|grouped_mm|cutlass_moe"),
    # The one-block kernel that vLLM's CUTLASS grouped MoE GEMMs launch, inside the same op and
    # just before the GEMM, to write each expert's A, B, C and scale pointers (vLLM 0.34.0's
    # csrc: get_group_gemm_starts of quantization/w8a8/cutlass/moe and cutlass_w4a8,
    # __get_group_gemm_starts of fp4's nvfp4 MoE, __mxfp4_get_group_gemm_starts). Under CUDA
    # graphs no MoE range places it, and the generic ``gemm`` below would make it a linear's.
    _p("moe_gemm", "CUTLASS grouped GEMM setup", r"get_group_gemm_starts"),
    _p("moe_gemm", "Marlin MoE", r"marlin_moe|MarlinMoE|moe_wna16"),
    # Humming's GEMM (humming/kernel/humming.py: the template ``humming<MmaOpClass, ...>``),
    # demangled or not; MoE or linear is for ``resolve`` to say.
    _p("gemm_unresolved", HUMMING_KIND, r"(^|[\s:])humming<|^_Z7hummingI|^humming$"),
    # vLLM's GateLinear, the MoE router's gate: a linear layer, run outside the experts' range.
    # Its tiers' kernels (vllm/model_executor/layers/fused_moe/router/gate_linear.py): the
    # JIT warm-up's LLFp32WGemm compiles the CuTe-DSL class LLFp32WDotprod, whose name is the
    # GPU kernel's (kernel_cutlass_kernel_<module><class>_...), as LLBf16Gemm's are
    # LLBf16Dotprod and LLBf16SplitK: no 'gemm' in them, so they fell to 'other'. The bf16x3
    # and precompiled fp32 tiers' names say 'gemm' and were linear GEMMs already.
    _p(
        "linear_gemm",
        "vLLM router GEMM (GateLinear)",
        r"LLFp32WDotprod|LLBf16(Dotprod|SplitK)|BF16x3RouterGemm|fp32_router_gemm",
    ),
    _p("linear_gemm", "cuBLAS", r"nvjet_|xmma_gemm|s16816gemm|s1688gemm|gemv|splitKreduce|cublas"),
    _p("linear_gemm", "Triton GEMM", r"block_scaled_mm|matmul"),
    # ``gemm`` not followed by ``a``: Gemma's norm kernels (``_gemma_rmsnorm_kernel``) are
    # no GEMMs.
    _p("linear_gemm", "CUTLASS GEMM", r"scaled_mm|cutlass.*gemm(?!a)"),
    _p("linear_gemm", "other GEMM", r"gemm(?!a)|marlin"),
    _p("rest", "KV-cache write", r"reshape_and_cache|concat_and_cache"),
    _p("rest", "norm", r"rms_?norm|layer_?norm|rsqrt"),
    _p("rest", "activation", r"silu|gelu|swiglu|act_and_mul"),
    # vLLM's MoE permute and CUTLASS MoE data kernels (csrc/moe/moe_permute_unpermute_op.cu,
    # moe/permute_unpermute_kernels/, quantization/w8a8/cutlass/moe/moe_data.cu), ahead of
    # 'quantization' and 'sampling', which ``fp8`` in their template arguments and ``sort``
    # would otherwise pick; the MoE routing line below has the rest of them.
    _p(
        "rest",
        "MoE routing",
        r"expandInputRows|shuffleInputRows|preprocessTopkId|compute_problem_sizes"
        r"|compute_arg_sorts|compute_batched_moe_data",
    ),
    _p("rest", "quantization", r"quant|fp8|process_input_kernel|token_scales"),
    _p("rest", "rotary", r"rotary|rope_"),
    _p(
        "rest",
        "MoE routing",
        r"moe_align|moe_sum|topk_?softmax|topkgating|expert|permute|routing|compute_identity",
    ),
    _p("rest", "sampling", r"sampl|argmax|exponential|gumbel|top_?[kp]([^a-z]|$)|sort"),
    _p("rest", "Inductor (fused)", r"^triton_(poi|red|per)_"),
    _p("rest", "PyTorch", r"at::|at_cuda|native::|elementwise|reduce_kernel|CatArrayBatchedCopy"),
    _p("rest", "copy", r"^Memcpy|^Memset"),
)


@functools.cache
def flashinfer_cake_routes() -> dict[str, str]:
    """FlashInfer's Hopper MSA program names -> their route keys, read from the installed
    FlashInfer's ``jit/cake_hopper_msa.py`` without importing FlashInfer (a literal
    ``ROUTES`` dict there); empty when there is no such table (FlashInfer not installed, or
    a version without it)."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(next(iter(spec.submodule_search_locations))) / "jit" / "cake_hopper_msa.py"
    if not path.is_file():
        return {}
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "ROUTES" for t in targets):
            try:
                routes = ast.literal_eval(node.value)
            except ValueError:
                return {}
            return {program: key for key, program in routes.items()}
    return {}


def cake_role(program: str, routes: Mapping[str, str]) -> tuple[str, str]:
    """(family, kind) of FlashInfer Hopper MSA program ``program`` from ``routes``."""
    key = routes.get(program)
    if key is not None:
        for prefix, role in CAKE_ROLES.items():
            if key.startswith(prefix):
                return role
    return "other", "FlashInfer MSA program of unknown role"


def classify(name: str, routes: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(family, kind) of a kernel by its name alone (see the module's docstring)."""
    program = CAKE_PROGRAM.search(name)
    if program is not None:
        table = flashinfer_cake_routes() if routes is None else routes
        return cake_role(f"cake_hopper_msa_{program.group(1)}", table)
    for pattern in PATTERNS:
        if pattern.regex.search(name):
            return pattern.family, pattern.kind
    return "other", "unknown"


def resolve(
    family: str,
    kind: str,
    name: str,
    *,
    in_moe: bool,
    direct_launch: bool,
    moe_ranges_seen: bool,
    humming_moe: Mapping[str, bool] | None = None,
) -> tuple[str, str]:
    """The family of a kernel that ``classify`` named ``family``/``kind``, given its launch:
    a GEMM launched inside the MoE experts' range is the MoE's; a Humming GEMM launched
    directly outside that range (in a trace that has such ranges) is a linear layer's; a
    Humming GEMM of a CUDA graph is what ``humming_moe`` (name -> is the MoE's) says, where
    it says it."""
    if in_moe:
        if family in GEMM_FAMILIES:
            return "moe_gemm", kind
        if family == "other":
            return "rest", "MoE (unnamed kernel)"
        return family, kind
    if family != "gemm_unresolved":
        return family, kind
    if direct_launch and moe_ranges_seen:
        return "linear_gemm", kind
    if humming_moe is not None and name in humming_moe:
        return ("moe_gemm" if humming_moe[name] else "linear_gemm"), kind
    return family, kind
