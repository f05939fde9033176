"""benchmarks/kernel_families.py: kernel names as real traces and the kernels' sources name
them, each in its family; a planted misclassification is caught; a Humming GEMM placed by
its launch."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from benchmarks import kernel_families
from benchmarks.kernel_families import FAMILIES, classify, resolve

# Names as torch-profiler and Nsight traces of vLLM on Hopper give them: from this project's
# results/ (the indexer-hardening profile of FlashInfer's indexer, the sparse-attention JIT
# logs) and from public traces of vLLM (cuBLAS's nvjet and xmma kernels, FlashAttention 3,
# vLLM's custom all-reduce, NCCL, vLLM's CUDA norm and cache kernels, Inductor's kernels).
REAL_NAMES: dict[str, str] = {
    # results/h200/indexer-hardening/2026-12-04/guard-profile.txt: the indexer's forward.
    "kernel_cake_hopper_msa_fc14209ebc6cac7e0653": "indexer",
    "kernel_cake_hopper_msa_bb22f86b3d99286ad074": "indexer",
    "kernel_cutlass__msa_kernel_CopyAtom_ThrID10_TVLayout": "indexer",
    "kernel_cutlass__topk_kernel_tensorptrf32gmemo1_tenso": "indexer",
    (
        "kernel_cutlass_kernel_flashinfermsa_opscute_dslproxy_score_prefill_sm90MsaProxyScore_"
        "object_at__CopyAtom_ThrID10_TVLayoutSrc11638401_TVLayoutDst11638401_Valuetypef8E4M3FN_"
        "tensor000o128128_0"
    ): "indexer",
    # The sparse-attention JIT logs (results/h100/sparse-attention*/): FlashInfer's Hopper
    # sparse decode and prefill programs (routes decode_v5:nc8:s16:..., prefill_v1:g8:...).
    "kernel_cake_hopper_msa_200ffb0330dbc8893eeb": "attention",
    "kernel_cake_hopper_msa_93a9c57f2a8dddc0caab": "attention",
    "kernel_cake_hopper_msa_2841be2dbf5dd0850755": "attention",
    (
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::"
        "CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1>>, cute::"
        "tuple<cute::C<128>, cute::C<128>, cute::C<128>>, 128, cutlass::bfloat16_t, float, "
        "cutlass::arch::Sm90, true, false>>>>(flash::FlashAttnFwdSm90<...>::Params)"
    ): "attention",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": "linear_gemm",
    "nvjet_tst_64x8_64x16_2x1_v_bz_splitK_TNT": "linear_gemm",
    "splitKreduce_kernel": "linear_gemm",
    (
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_"
        "execute_segment_k_off_kernel__5x_cublas"
    ): "linear_gemm",
    (
        "void cutlass::device_kernel<vllm::enable_sm90_or_later<cutlass::gemm::kernel::"
        "GemmUniversal<cute::tuple<int, int, int, int>, cutlass::gemm::collective::"
        "CollectiveMma<cutlass::gemm::MainloopSm90TmaGmmaWarpSpecializedFP8<4, 2>>>>>(Params)"
    ): "linear_gemm",
    (
        "void cutlass::device_kernel<vllm::enable_sm90_or_later<cutlass::gemm::kernel::"
        "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, "
        "cutlass::gemm::collective::CollectiveMma<cutlass::gemm::"
        "MainloopSm90ArrayTmaGmmaWarpSpecialized<4>>>>>(Params)"
    ): "moe_gemm",
    (
        "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*, "
        "vllm::RankSignals, vllm::Signal*, __nv_bfloat16*, int, int)"
    ): "communication",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    (
        "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, c10::BFloat16*, "
        "c10::BFloat16 const*, float, int, int)"
    ): "rest",
    (
        "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, "
        "(vllm::Fp8KVCacheDataType)0>(__nv_bfloat16 const*, __nv_bfloat16 const*)"
    ): "rest",
    "triton_poi_fused_mul_silu_2": "rest",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "rest",
    (
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::"
        "ArgMaxOps<float>, unsigned int, long, 4>>(at::native::ReduceOp<float>)"
    ): "rest",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "rest",
    "Memcpy DtoD (Device -> Device)": "rest",
    # vLLM 0.34.0's Triton kernels (the JIT function's name is the kernel's).
    "fused_moe_kernel": "moe_gemm",
    "_w8a8_triton_block_scaled_mm": "linear_gemm",
    "_per_token_group_quant_fp8": "rest",
    "_gemma_rmsnorm_kernel": "rest",
    "_gemma_rmsnorm_mxfp8_kernel": "rest",
    "_gqa_sparse_fwd_tiled_kernel": "attention",
    "_gqa_sparse_decode_kernel": "attention",
    "_merge_topk_attn_out_kernel": "attention",
    "_index_block_score_kernel": "indexer",
    "_topk_index_partial_kernel": "indexer",
    "_decode_index_score_kernel": "indexer",
    # Humming's GEMM (its template humming<MmaOpClass, Shape<0, N, K>, ...>): MoE or linear
    # is the launch's to say.
    (
        "void humming<MmaOpClass, Shape<0, 6144, 6144>, Shape<64, 128, 128>, Shape<64, 32, 128>,"
        " Shape<0, 0, 0>, BFloat16, Float8E4M3, BFloat16, Float8E8M0, LayerConfig, ComputeConfig,"
        " TuningConfig>(int4 const*, int4 const*, int4*)"
    ): "gemm_unresolved",
    "process_input_kernel": "rest",
    "some_unknown_kernel_xyz": "other",
}
# results/h100/mxfp8-w8a8/profile.json (W8A8 MXFP8, EP slice, decode under CUDA graphs): vLLM's
# CUTLASS grouped fp8 MoE GEMM and the kernel that writes its per-expert pointers first.
W8A8_GROUPED_GEMM = (
    "void cutlass::device_kernel<(anonymous namespace)::cutlass_3x_group_gemm<cutlass::"
    "float_e4m3_t, cutlass::bfloat16_t, cutlass::arch::Sm90, vllm::c3x::ScaledEpilogueArray, "
    "cute::tuple<cute::C<128>, cute::C<16>, cute::C<256> >, cute::tuple<cute::C<2>, cute::C<1>, "
    "cute::C<1> >, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum, "
    "cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, true>::GemmKernel>((anonymous "
    "namespace)::cutlass_3x_group_gemm<cutlass::float_e4m3_t, cutlass::bfloat16_t, cutlass::"
    "arch::Sm90, vllm::c3x::ScaledEpilogueArray, cute::tuple<cute::C<128>, cute::C<16>, "
    "cute::C<256> >, cute::tuple<cute::C<2>, cute::C<1>, cute::C<1> >, cutlass::gemm::"
    "KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum, cutlass::epilogue::"
    "PtrArrayTmaWarpSpecializedPingpong, true>::GemmKernel::Params)"
)
W8A8_GROUPED_GEMM_SETUP = (
    "void get_group_gemm_starts<cutlass::float_e4m3_t, cutlass::bfloat16_t, float>(long*, "
    "cutlass::float_e4m3_t**, cutlass::float_e4m3_t**, cutlass::bfloat16_t**, float**, float**, "
    "cutlass::float_e4m3_t*, cutlass::float_e4m3_t*, cutlass::bfloat16_t*, float*, float*, long, "
    "long, bool, bool)"
)
REAL_NAMES[W8A8_GROUPED_GEMM] = "moe_gemm"
REAL_NAMES[W8A8_GROUPED_GEMM_SETUP] = "moe_gemm"
# The same profile's router GEMMs (vLLM's GateLinear): the CuTe-DSL fp32-weight dot product at
# decode (the kernel of the JIT warm-up's LLFp32WGemm), the bf16x3 kernel at prefill.
W8A8_ROUTER_DOTPROD = (
    "kernel_cutlass_kernel_vllmmodel_executorkernelslinearcute_dsl_ll_fp32w_dotprodLLFp32WDotprod_"
    "object_at__tensorptrbf16gmemalign16o86144i64div81_tensorptrf32gmemalign32o6144i64div81_"
    "tensorp_0"
)
REAL_NAMES[W8A8_ROUTER_DOTPROD] = "linear_gemm"
REAL_NAMES[
    "kernel_cutlass_kernel_vllmmodel_executorlayersfused_moerouterbf16x3_router_gemm_sm90_"
    "Sm90BF16x3RouterGemm_object_at__CopyAtom_ThrID10_TVLayoutSrc1204801_TVLayoutDst1204801_"
    "Valuetypef32_te_0"
] = "linear_gemm"
VLLM = Path(__import__("vllm").__file__).parent
# The M3 model's own Triton kernels (vllm/models/minimax_m3/{common,nvidia}), by the family
# their source file says.
M3_KERNEL_FILES = {
    "common/ops/sparse_attn.py": "attention",
    "nvidia/ops/sparse_prefill.py": "attention",
    "common/ops/index_topk.py": "indexer",
    "nvidia/ops/gather_nvfp4_index_k.py": "indexer",
    "nvidia/ops/norm_mxfp8.py": "rest",
}


def misclassified(names: dict[str, str]) -> dict[str, tuple[str, str]]:
    """The names whose family is not the one given: name -> (expected, got)."""
    wrong = {}
    for name, family in names.items():
        got = classify(name)[0]
        if got != family:
            wrong[name] = (family, got)
    return wrong


def triton_kernels(path: Path) -> list[str]:
    """The ``@triton.jit`` functions of ``path`` that are launched (named ``*kernel``)."""
    tree = ast.parse(path.read_text())
    return [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and node.name.endswith("kernel")
        and any("jit" in ast.unparse(d) for d in node.decorator_list)
    ]


def test_real_kernel_names_fall_in_their_families():
    assert misclassified(REAL_NAMES) == {}


def test_a_planted_misclassification_is_caught(monkeypatch):
    """A GEMM pattern that forgets Gemma's norms (``gemm`` without ``(?!a)``), planted
    first, puts ``_gemma_rmsnorm_kernel`` among the GEMMs: the check above sees it."""
    planted = kernel_families._p("linear_gemm", "planted", r"gemm")
    monkeypatch.setattr(kernel_families, "PATTERNS", (planted, *kernel_families.PATTERNS))
    wrong = misclassified(REAL_NAMES)
    assert wrong["_gemma_rmsnorm_kernel"] == ("rest", "linear_gemm")
    assert wrong["_gemma_rmsnorm_mxfp8_kernel"] == ("rest", "linear_gemm")


def test_every_hopper_msa_program_of_flashinfer_is_attention_or_indexer_by_its_route():
    """FlashInfer 0.7.4's route table, read here by a pattern over its source (the module
    reads it as a Python literal), every program in the family its route's stage says."""
    source = Path(importlib.util.find_spec("flashinfer").origin).parent / "jit/cake_hopper_msa.py"
    routes = re.findall(
        r'"([a-z_0-9]+:[^"]*)": "(cake_hopper_msa_[0-9a-f]{20})"', source.read_text()
    )
    assert len(routes) > 50
    for route, program in routes:
        stage = route.split(":")[0]
        expected = "attention" if stage.startswith(("decode", "prefill")) else "indexer"
        assert stage.startswith(("decode", "prefill", "proxy", "topk")), route
        assert classify(f"kernel_{program}")[0] == expected, route


def test_an_msa_program_flashinfer_does_not_list_is_other_not_a_guess():
    assert classify("kernel_cake_hopper_msa_0123456789abcdef0123", routes={}) == (
        "other",
        "FlashInfer MSA program of unknown role",
    )


@pytest.mark.parametrize(("relative", "family"), sorted(M3_KERNEL_FILES.items()))
def test_the_m3_models_triton_kernels_fall_in_their_files_family(relative, family):
    path = VLLM / "models" / "minimax_m3" / relative
    kernels = triton_kernels(path)
    assert kernels, path
    assert misclassified(dict.fromkeys(kernels, family)) == {}


def test_every_vllm_moe_and_fp8_triton_kernel_is_known():
    """No Triton kernel of vLLM's fused MoE or fp8 helpers falls to 'other'."""
    files = [
        VLLM / "model_executor/layers/fused_moe/fused_moe.py",
        VLLM / "model_executor/layers/quantization/utils/fp8_utils.py",
    ]
    names = [name for path in files for name in triton_kernels(path)]
    assert "fused_moe_kernel" in names
    assert [name for name in names if classify(name)[0] == "other"] == []


def test_humming_gemm_is_the_moe_or_a_linear_layer_by_its_launch():
    name = next(n for n, f in REAL_NAMES.items() if f == "gemm_unresolved")
    family, kind = classify(name)
    assert (family, kind) == ("gemm_unresolved", kernel_families.HUMMING_KIND)

    def place(**launch):
        base = {"in_moe": False, "direct_launch": True, "moe_ranges_seen": True}
        return resolve(family, kind, name, **{**base, **launch})[0]

    assert place(in_moe=True) == "moe_gemm"
    assert place() == "linear_gemm"
    # Without MoE ranges in the trace a direct launch says nothing.
    assert place(moe_ranges_seen=False) == "gemm_unresolved"
    # A CUDA graph's: the registry, where it knows the name.
    assert place(direct_launch=False) == "gemm_unresolved"
    assert place(direct_launch=False, humming_moe={name: True}) == "moe_gemm"
    assert place(direct_launch=False, humming_moe={name: False}) == "linear_gemm"
    assert place(direct_launch=False, humming_moe={"another": True}) == "gemm_unresolved"


# The other grouped MoE GEMMs' setup kernels, named as vLLM 0.34.0's csrc declares and launches
# them, their argument lists shortened (no trace of them here): cutlass_w4a8/get_group_starts.cuh,
# fp4/nvfp4_blockwise_moe_kernel.cu and fp4/mxfp4_blockwise_moe_kernel.cu.
GROUPED_GEMM_SETUPS = (
    W8A8_GROUPED_GEMM_SETUP,
    "void get_group_gemm_starts<cutlass::float_e4m3_t, int, cutlass::bfloat16_t, float, cutlass::"
    "Array<cutlass::float_e4m3_t, 8, false> >(long*, cutlass::float_e4m3_t**, int**)",
    "void __get_group_gemm_starts<cutlass::float_e2m1_t, cutlass::bfloat16_t, cutlass::"
    "float_ue4m3_t, float>(cutlass::float_e2m1_t**, cutlass::float_e2m1_t**)",
    "void __mxfp4_get_group_gemm_starts<cutlass::float_e2m1_t, cutlass::bfloat16_t, cutlass::"
    "float_ue8m0_t>(cutlass::float_e2m1_t**, cutlass::float_e2m1_t**)",
)


@pytest.mark.parametrize("name", GROUPED_GEMM_SETUPS)
def test_the_grouped_moe_gemms_setup_kernel_is_the_moes_in_a_cuda_graph_too(name):
    """Under CUDA graphs (decode) no launch lies in the MoE experts' range, so the name alone
    must place the setup kernel; a direct launch inside the range (prefill) agrees."""
    family, kind = classify(name)
    assert (family, kind) == ("moe_gemm", "CUTLASS grouped GEMM setup")
    graph = {"in_moe": False, "direct_launch": False, "moe_ranges_seen": False}
    assert resolve(family, kind, name, **graph)[0] == "moe_gemm"
    direct = {"in_moe": True, "direct_launch": True, "moe_ranges_seen": True}
    assert resolve(family, kind, name, **direct)[0] == "moe_gemm"


# vLLM's GateLinear tiers' CuTe-DSL kernels: the modules that define them.
GATE_CUTE_MODULES = (
    "model_executor/kernels/linear/cute_dsl/_ll_fp32w_dotprod.py",
    "model_executor/kernels/linear/cute_dsl/_ll_bf16_dotprod.py",
    "model_executor/kernels/linear/cute_dsl/_ll_bf16_splitk.py",
    "model_executor/layers/fused_moe/router/bf16x3_router_gemm_sm90.py",
    "model_executor/layers/fused_moe/router/bf16x3_router_gemm_sm100.py",
)


def cute_kernel_names(relative: str) -> list[str]:
    """The GPU kernel names the CuTe DSL gives the classes of vLLM module ``relative`` that
    have a ``@cute.kernel`` method: ``kernel_cutlass_kernel_``, the module's dotted path
    without its dots, the class's name, then the arguments (as in W8A8_ROUTER_DOTPROD)."""
    module = "vllm" + relative.removesuffix(".py").replace("/", "")
    tree = ast.parse((VLLM / relative).read_text())
    return [
        f"kernel_cutlass_kernel_{module}{node.name}_object_at__tensorptrf32gmem_0"
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and any(
            "cute.kernel" in ast.unparse(decorator)
            for item in node.body
            if isinstance(item, ast.FunctionDef)
            for decorator in item.decorator_list
        )
    ]


def test_the_cute_dsl_naming_is_the_traces():
    names = cute_kernel_names(GATE_CUTE_MODULES[0])
    assert [name.split("_object_at_")[0] for name in names] == [
        W8A8_ROUTER_DOTPROD.split("_object_at_")[0]
    ]


@pytest.mark.parametrize("relative", GATE_CUTE_MODULES)
def test_every_router_gemm_of_gatelinear_is_a_linear_gemm(relative):
    """The gate is a linear layer outside the MoE experts' range: each of its tiers' CuTe-DSL
    kernels is a linear GEMM by its name, with the router's kind."""
    names = cute_kernel_names(relative)
    assert names, relative
    for name in names:
        assert classify(name) == ("linear_gemm", "vLLM router GEMM (GateLinear)"), name


# vLLM's MoE permute and CUTLASS MoE data kernels: the first three as the W8A8 profile's decode
# trace names them (expandInputRowsKernel was 'quantization' by its fp8 argument,
# preprocessTopkIdKernel 'other'), the others as vLLM 0.34.0's csrc declares them
# (moe/moe_permute_unpermute_op.cu, quantization/w8a8/cutlass/moe/moe_data.cu), shortened.
MOE_DATA_KERNELS = (
    "void expandInputRowsKernel<__nv_fp8_e4m3, false>(__nv_fp8_e4m3 const*, __nv_fp8_e4m3*, "
    "int const*, int*, int*, long const*, long, long const*, long, long, int)",
    "preprocessTopkIdKernel(int*, int, int const*, int)",
    "void compute_problem_sizes_from_expert_offsets<true>(long const*, int*, int*, int, int, int)",
    "void shuffleInputRowsKernel<__nv_fp8_e4m3>(__nv_fp8_e4m3 const*, int const*)",
    "void compute_problem_sizes<false>(int const*, int*, int*, int*, int, int, int)",
    "compute_arg_sorts(int const*, int*, int*, int*, int*, int, int)",
    "void compute_batched_moe_data<true>(int*, int*, int*, int const*, int, int, int)",
)


@pytest.mark.parametrize("name", MOE_DATA_KERNELS)
def test_the_moes_permute_and_data_kernels_are_its_routing(name):
    assert classify(name) == ("rest", "MoE routing")


def test_the_moe_range_makes_any_gemm_the_moes_and_leaves_the_rest_alone():
    def placed(name):
        family, kind = classify(name)
        return resolve(family, kind, name, in_moe=True, direct_launch=True, moe_ranges_seen=True)[0]

    assert placed("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT") == "moe_gemm"
    assert placed("moe_align_block_size_kernel") == "rest"
    assert placed("some_unknown_kernel_xyz") == "rest"
    assert placed("_per_token_group_quant_fp8") == "rest"


def test_the_table_names_only_known_families():
    assert {p.family for p in kernel_families.PATTERNS} <= set(FAMILIES)
    for pattern in kernel_families.PATTERNS:
        assert pattern.regex.flags & re.IGNORECASE
