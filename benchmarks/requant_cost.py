"""What patch 0008's MXFP8 -> per-channel FP8 requantization costs at load, per layer of the rank
slice, in its first version (`vllm_minimax.testing.pow2_requant_v1`) and in the patched vLLM's.

    scripts/ensure-series-applied "$VLLM_MINIMAX_GPU_TARGET" && \\
        python3 -m benchmarks.requant_cost --out $OUT/requant-cost

One TP-8 rank of MiniMax M3 as the MXFP8 EP slice holds it (`m3_geometry`: 16 whole experts of
3072, hidden 6144, the 3072-wide shared expert, the rank's attention projections), as MXFP8
tensors drawn on the device: e4m3 values and e8m0 scales whose 32-wide groups spread over
``--spread`` binades within a row (6 is a real checkpoint's range), so that requantizing pushes
some values below e4m3's normal range. Each arm converts the same tensors: a sparse-attention
MoE layer (the routed experts, ``qkv_proj``, ``o_proj`` and the shared expert's two
projections) and a dense layer (the first three of 60: ``qkv_proj``, ``o_proj`` and the dense
MLP), ending with the log line's figures read back to the host. Arms alternate which runs
first each round (`benchmarks.timing`); a round's time is CUDA events around the whole layer
(host ``perf_counter`` on a CPU) after one untimed round per arm. The per-start estimate is
57 sparse layers plus 3 dense ones; vLLM's "Online quantization ... took" log line also holds
the FP8 kernels' set-up, which neither arm runs here.

Checks, each of which fails the run (exit 1, after the JSON is written): the two arms give the
same FP8 bytes and scale bits for every tensor and the same log line, on the timed layers and on
small layers with extreme inputs (spreads 0 to 24 binades, e8m0 bytes 0, 1, 254 and 255, e4m3
NaN, zeros and subnormals). ``--breakdown`` adds the first version's time per step
(`pow2_requant_v1.STEPS`), ``--profile`` the top operators of one round of each arm.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks import timing
from vllm_minimax import m3_geometry

ARMS = ("v1", "current")
GROUP = 32
SPARSE_LAYERS = m3_geometry.M3_LAYERS - m3_geometry.M3_FIRST_DENSE_LAYERS
DENSE_LAYERS = m3_geometry.M3_FIRST_DENSE_LAYERS
# Extreme inputs of the identity check: (rows, K) small layers, each with one planted case.
EXTREME_SPREADS = (0, 3, 6, 10, 24)
RESULT_FILE = "requant-cost.json"


class UsageError(Exception):
    """Bad arguments or an environment that cannot run the benchmark: exit 2, one line."""


@dataclass(frozen=True)
class LayerShapes:
    """One rank's MoE experts and linear projections, as ``(rows, K)`` per projection."""

    experts: int
    hidden: int
    intermediate: int
    sparse_linears: dict[str, tuple[int, int]]
    dense_linears: dict[str, tuple[int, int]]

    @property
    def sparse_elements(self) -> int:
        moe = self.experts * 3 * self.intermediate * self.hidden
        return moe + sum(n * k for n, k in self.sparse_linears.values())

    @property
    def dense_elements(self) -> int:
        return sum(n * k for n, k in self.dense_linears.values())


def rank_shapes(experts: int | None = None) -> LayerShapes:
    """The MXFP8 EP slice's layers (`m3_geometry.rank_text_config(8, experts="ep")`)."""
    config = m3_geometry.rank_text_config(8, experts="ep")
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    index = kv_heads * config["index_head_dim"] + config["index_head_dim"]
    qkv = (heads + 2 * kv_heads) * head_dim
    shared, dense = config["shared_intermediate_size"], config["dense_intermediate_size"]
    return LayerShapes(
        experts=config["num_local_experts"] if experts is None else experts,
        hidden=hidden,
        intermediate=config["intermediate_size"],
        sparse_linears={
            "qkv_proj": (qkv + index, hidden),
            "o_proj": (hidden, heads * head_dim),
            "gate_up_proj": (2 * shared, hidden),
            "down_proj": (hidden, shared),
        },
        dense_linears={
            "qkv_proj": (qkv, hidden),
            "o_proj": (hidden, heads * head_dim),
            "gate_up_proj": (2 * dense, hidden),
            "down_proj": (hidden, dense),
        },
    )


def tiny_shapes(experts: int | None = None) -> LayerShapes:
    """Small layers of the same structure, for the CPU tests of this benchmark."""
    return LayerShapes(
        experts=6 if experts is None else experts,
        hidden=256,
        intermediate=64,
        sparse_linears={"qkv_proj": (96, 256), "o_proj": (256, 64)},
        dense_linears={"gate_up_proj": (128, 256), "down_proj": (256, 64)},
    )


GEOMETRIES: dict[str, Callable[[int | None], LayerShapes]] = {
    "rank": rank_shapes,
    "tiny": tiny_shapes,
}


def draw_mxfp8(shape: tuple[int, ...], spread: int, generator: Any, device: Any) -> tuple[Any, Any]:
    """MXFP8 e4m3 values ``shape`` and uint8 e8m0 scales ``shape[:-1] + (K / 32,)``: each row's
    scale bytes lie ``0..spread`` below a row byte in 115..123 (2 ** -12 .. 2 ** -4), the values
    are normal draws up to e4m3's range (some subnormal, a few zero)."""
    import torch

    *rows, k = shape
    row_byte = torch.randint(115, 124, (*rows, 1), generator=generator, device=device)
    drop = torch.randint(0, spread + 1, (*rows, k // GROUP), generator=generator, device=device)
    scales = (row_byte - drop).clamp_(0, 254).to(torch.uint8)
    values = torch.randn(shape, generator=generator, device=device).mul_(96.0)
    return values.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn), scales


def plant_extremes(values: Any, scales: Any) -> None:
    """Overwrite a few rows of an MXFP8 tensor with the inputs the conversion's edge cases come
    from: e8m0 bytes 0, 1, 254 and 255 (2 ** 128: inf), e4m3 NaN, +-0, subnormals and 448."""
    import torch

    e4m3 = torch.float8_e4m3fn
    rows = values.shape[-2]
    if rows < 6:
        return
    flat_v = values.view(-1, values.shape[-2], values.shape[-1])
    flat_s = scales.view(-1, scales.shape[-2], scales.shape[-1])
    special = torch.tensor(
        [0.0, -0.0, 2.0**-9, -(2.0**-9), 2.0**-7, 448.0, -448.0, 1.0], device=values.device
    ).to(e4m3)
    nan = torch.tensor(float("nan"), device=values.device).to(e4m3)
    zero = torch.tensor(0.0, device=values.device).to(e4m3)
    k = values.shape[-1]
    pattern = special.repeat(k // special.numel() + 1)[:k]
    for block in range(flat_v.shape[0]):
        flat_s[block, 0] = 0  # the smallest scale: products in fp32 and bf16 subnormals
        flat_s[block, 1, ::2] = 254
        flat_s[block, 1, 1::2] = 1  # a row spanning 253 binades
        flat_v[block, 2] = pattern
        flat_s[block, 3, 0] = 255  # inf times the group, NaN times its zeros
        flat_v[block, 4, ::7] = nan
        flat_v[block, 5] = zero  # an all-zero row


@dataclass
class Layer:
    """One layer's MXFP8 tensors: the experts (absent in a dense layer) and the projections."""

    experts: tuple[Any, Any, Any, Any] | None
    linears: dict[str, tuple[Any, Any]]


def make_layer(
    shapes: LayerShapes, kind: str, spread: int, seed: int, device: Any, extremes: bool = False
) -> Layer:
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(shape: tuple[int, ...]) -> tuple[Any, Any]:
        values, scales = draw_mxfp8(shape, spread, generator, device)
        if extremes:
            plant_extremes(values, scales)
        return values, scales

    experts = None
    linears = shapes.sparse_linears if kind == "sparse" else shapes.dense_linears
    if kind == "sparse":
        e, h, i = shapes.experts, shapes.hidden, shapes.intermediate
        w13, s13 = draw((e, 2 * i, h))
        w2, s2 = draw((e, h, i))
        experts = (w13, s13, w2, s2)
    return Layer(experts, {name: draw(shape) for name, shape in linears.items()})


# -- the two arms ------------------------------------------------------------------------------


def convert_v1(layer: Layer, steps: Any = None) -> tuple[dict[str, tuple[Any, ...]], list[str]]:
    """The first version's outputs and log-line parts for one layer."""
    from vllm_minimax.testing import pow2_requant_v1 as v1

    record = v1.Record()
    kwargs = {} if steps is None else {"steps": steps}
    outputs: dict[str, tuple[Any, ...]] = {}
    if layer.experts is not None:
        outputs["moe"] = v1.requantize_moe(*layer.experts, record, **kwargs)
    for name, (weight, scale) in layer.linears.items():
        outputs[name] = v1.requantize_linear(weight, scale, f"linear {name}", record, **kwargs)
    return outputs, record.summaries()


def _patched() -> SimpleNamespace:
    """The patched vLLM's conversion code, or a UsageError naming what is missing."""
    try:
        from vllm.model_executor.layers.quantization import modelopt
        from vllm.model_executor.layers.quantization.online import fp8, pow2_requant
        from vllm.model_executor.layers.quantization.utils import quant_utils
    except ImportError as error:
        raise UsageError(f"vLLM with this checkout's series does not import: {error}") from None
    if not hasattr(pow2_requant, "requantize_power_of_two"):
        raise UsageError(
            "the vLLM python imports has patch 0008 without the chunked requantization: "
            "apply this checkout's series (scripts/ensure-series-applied DIR)"
        )
    return SimpleNamespace(modelopt=modelopt, fp8=fp8, pow2=pow2_requant, quant=quant_utils)


def _moe_module(experts: tuple[Any, Any, Any, Any], shapes_hidden: int, inter: int) -> Any:
    import torch

    module = torch.nn.Module()
    for name, tensor in zip(
        ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"), experts, strict=True
    ):
        module.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
    module.local_num_experts = experts[0].shape[0]
    module.expert_map_manager = SimpleNamespace(num_fused_shared_experts=0)
    module.moe_config = SimpleNamespace(
        hidden_dim_unpadded=shapes_hidden,
        hidden_dim=shapes_hidden,
        intermediate_size_per_partition_unpadded=inter,
        intermediate_size_per_partition=inter,
    )
    return module


def convert_current(layer: Layer) -> tuple[dict[str, tuple[Any, ...]], list[str]]:
    """The patched vLLM's outputs and log-line parts for one layer: the MoE through
    `Fp8PtpcOnlineMoEMethod._requantize_power_of_two` over `ModelOptMxFp8FusedMoE`'s
    `dequantize_weight` (MoE TP size 1, no padding), each projection through
    `ModelOptLinearMethod.dequantize_weight`, `weight_amax` and `requantize_power_of_two`, as the
    per-channel linear method runs them."""
    vllm = _patched()
    vllm.pow2._errors.clear()
    outputs: dict[str, tuple[Any, ...]] = {}
    if layer.experts is not None:
        w13 = layer.experts[0]
        method = object.__new__(vllm.fp8.Fp8PtpcOnlineMoEMethod)
        method.requantization_source = object.__new__(vllm.modelopt.ModelOptMxFp8FusedMoE)
        method.moe = SimpleNamespace(tp_size=1, w13_num_shards=2)
        module = _moe_module(layer.experts, w13.shape[-1], w13.shape[-2] // 2)
        outputs["moe"] = method._requantize_power_of_two(module)
    source = SimpleNamespace(wkey=SimpleNamespace(key=vllm.quant.kMxfp8Static))
    for name, (weight, scale) in layer.linears.items():
        linear = SimpleNamespace(weight=weight, weight_scale=scale)
        dequantized = vllm.modelopt.ModelOptLinearMethod.dequantize_weight(source, linear)
        amax = vllm.quant.weight_amax(dequantized, dim=-1, keepdim=True)
        outputs[name] = vllm.pow2.requantize_power_of_two(dequantized, amax, f"linear {name}")
    return outputs, vllm.pow2.requantization_error_summaries()


CONVERTERS: dict[str, Callable[[Layer], tuple[dict[str, tuple[Any, ...]], list[str]]]] = {
    "v1": convert_v1,
    "current": convert_current,
}


# -- checks ------------------------------------------------------------------------------------


def _bits(tensor: Any) -> Any:
    import torch

    if tensor.dtype == torch.float32:
        return tensor.contiguous().view(torch.int32)
    return tensor.contiguous().view(torch.uint8)


def _differ(want: Any, got: Any) -> Any:
    """Where two tensors' bits differ, a NaN in both counting as the same (its sign and
    payload depend on the conversion that made it: fp32 -> e4m3 keeps the sign, bf16 -> e4m3
    does not on a CPU)."""
    both_nan = want.float().isnan() & got.float().isnan()
    return (_bits(want) != _bits(got)) & ~both_nan


def mismatches(
    reference: tuple[dict[str, tuple[Any, ...]], list[str]],
    candidate: tuple[dict[str, tuple[Any, ...]], list[str]],
) -> list[str]:
    """Where ``candidate`` differs from ``reference``: tensor by tensor (dtype, shape, then bits;
    see `_differ` for NaN), then the log line's parts; empty when they are the same."""
    import torch

    found: list[str] = []
    ref_out, ref_log = reference
    cand_out, cand_log = candidate
    if sorted(ref_out) != sorted(cand_out):
        found.append(f"outputs {sorted(cand_out)} where the reference has {sorted(ref_out)}")
    for name in sorted(set(ref_out) & set(cand_out)):
        if len(ref_out[name]) != len(cand_out[name]):
            found.append(f"{name}: {len(cand_out[name])} tensors, not {len(ref_out[name])}")
            continue
        for index, (want, got) in enumerate(zip(ref_out[name], cand_out[name], strict=True)):
            where = f"{name}[{index}]"
            if want.dtype != got.dtype or tuple(want.shape) != tuple(got.shape):
                found.append(
                    f"{where}: {got.dtype} {tuple(got.shape)}, not {want.dtype} {tuple(want.shape)}"
                )
                continue
            differ = int(torch.count_nonzero(_differ(want, got)))
            if differ:
                found.append(f"{where}: {differ} of {want.numel()} elements differ in bits")
    if ref_log != cand_log:
        found.append(f"log line {cand_log} where the reference logs {ref_log}")
    return found


# -- timing ------------------------------------------------------------------------------------


class Clock:
    """Elapsed ms of a call on the benchmark's device: CUDA events (``cuda``, default
    ``torch.cuda``, a stand-in in the CPU tests) on a CUDA device, else the host clock."""

    def __init__(self, device: Any, cuda: Any = None) -> None:
        if device.type == "cuda" and cuda is None:
            import torch

            cuda = torch.cuda
        self.cuda = cuda if device.type == "cuda" else None

    def sync(self) -> None:
        if self.cuda is not None:
            self.cuda.synchronize()

    def _events(self) -> tuple[Any, Any]:
        assert self.cuda is not None
        return self.cuda.Event(enable_timing=True), self.cuda.Event(enable_timing=True)

    def time(self, fn: Callable[[], object]) -> float:
        self.sync()
        if self.cuda is not None:
            start, end = self._events()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1000.0

    @contextlib.contextmanager
    def steps(self, totals: dict[str, float]) -> Iterator[Callable[[str], Any]]:
        """A ``steps`` hook for `pow2_requant_v1` adding each step's ms to ``totals`` (read
        from the events after one sync at the end, on a CUDA device)."""
        marks: list[tuple[str, Any, Any]] = []

        @contextlib.contextmanager
        def step(name: str) -> Iterator[None]:
            if self.cuda is not None:
                start, end = self._events()
                start.record()
                yield
                end.record()
                marks.append((name, start, end))
            else:
                began = time.perf_counter()
                yield
                totals[name] = totals.get(name, 0.0) + (time.perf_counter() - began) * 1000.0

        yield step
        self.sync()
        for name, start, end in marks:
            totals[name] = totals.get(name, 0.0) + float(start.elapsed_time(end))


def copy_gbps(clock: Clock, device: Any, elements: int = 1 << 28) -> float:
    """Device-memory copy bandwidth (bytes read plus written per second, GB/s) of a bf16 copy."""
    import torch

    src = torch.empty(elements, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = statistics.median(clock.time(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() * src.element_size() / (ms / 1000.0) / 1e9


def floor_bytes(shapes: LayerShapes, kind: str) -> int:
    """What any conversion must move: read the e4m3 values and e8m0 scales once, write the FP8
    values once (the fp32 row scales are noise)."""
    elements = shapes.sparse_elements if kind == "sparse" else shapes.dense_elements
    return elements * 2 + elements // GROUP


class Traffic:
    """Counts, while active, what every ATen operator moves: the bytes of the tensors it reads
    and writes (views move nothing; an in-place operator reads and writes its tensor; ``copy_``
    reads the source and writes the destination; ``out=`` is written once), the operators run
    (kernel launches on a GPU) and the host syncs (``.item()``, copies to the host)."""

    def __init__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        aten = torch.ops.aten
        counter = self
        self.bytes = 0
        self.ops = 0
        self.syncs = 0
        unread = {aten.empty_like.default, aten.empty_strided.default, aten.new_empty.default}
        unread |= {aten.empty.memory_format}

        def tensors(values: Any) -> list[Any]:
            found: list[Any] = []
            for value in values if isinstance(values, (list, tuple)) else (values,):
                if isinstance(value, torch.Tensor):
                    found.append(value)
                elif isinstance(value, (list, tuple)):
                    found.extend(tensors(value))
            return found

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
                kwargs = kwargs or {}
                result = func(*args, **kwargs)
                if func.is_view:
                    return result
                counter.ops += 1
                if func is aten._local_scalar_dense.default:
                    counter.syncs += 1
                    return result
                if func in unread:
                    return result
                outputs = tensors(result)
                if func is aten.copy_.default:
                    moved = [args[1], args[0]]
                else:
                    moved = (
                        tensors(list(args))
                        + tensors([v for k, v in kwargs.items() if k != "out"])
                        + outputs
                    )
                counter.bytes += sum(t.numel() * t.element_size() for t in moved)
                if any(t.device.type == "cpu" for t in outputs) and any(
                    t.device.type != "cpu" for t in tensors(list(args))
                ):
                    counter.syncs += 1
                return result

        self._mode = Mode()

    def __enter__(self) -> Traffic:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


def profile_round(fn: Callable[[], object], device: Any, top: int = 12) -> list[dict[str, Any]]:
    """The top operators of one call by self time on the device (the host on a CPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)
    return [
        {"op": e.key, "calls": e.count, "self_ms": round(getattr(e, key, 0.0) / 1000.0, 3)}
        for e in rows[:top]
    ]


# -- the run -----------------------------------------------------------------------------------


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def _device(name: str) -> Any:
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device")
    return torch.device(name)


def identity_check(device: Any, seed: int) -> list[str]:
    """The two arms on small layers with extreme inputs: every mismatch, named by case."""
    found: list[str] = []
    shapes = tiny_shapes(experts=5)
    for spread in EXTREME_SPREADS:
        for kind in ("sparse", "dense"):
            layer = make_layer(shapes, kind, spread, seed + spread, device, extremes=True)
            for problem in mismatches(convert_v1(layer), convert_current(layer)):
                found.append(f"extreme {kind} spread {spread}: {problem}")
    return found


def _convert_timed(clock: Clock, arm: str, layer: Layer) -> float:
    return clock.time(partial(CONVERTERS[arm], layer))


def _peak_memory(device: Any, fn: Callable[[], object]) -> float | None:
    """GiB ``fn`` allocates on a CUDA device beyond what was allocated before it (None on a
    CPU)."""
    if device.type != "cuda":
        return None
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2**30, 3)


def measure_layer(
    layer: Layer, elements: int, clock: Clock, args: argparse.Namespace, device: Any
) -> tuple[dict[str, Any], list[str]]:
    """One layer of ``elements`` weights: an untimed call per arm (the identity check), each
    arm's traffic (`Traffic`) and peak memory, the timed rounds, and the breakdown and
    profile if asked. Returns the result and the arms' mismatches."""
    results = {arm: CONVERTERS[arm](layer) for arm in ARMS}
    found = mismatches(results["v1"], results["current"])
    del results
    traffic: dict[str, dict[str, Any]] = {}
    for arm in ARMS:
        peak = _peak_memory(device, partial(CONVERTERS[arm], layer))
        with Traffic() as counted:
            CONVERTERS[arm](layer)
        traffic[arm] = {
            "gb": round(counted.bytes / 1e9, 3),
            "bytes_per_element": round(counted.bytes / elements, 2),
            "ops": counted.ops,
            "host_syncs": counted.syncs,
            "peak_extra_gib": peak,
        }
    samples = timing.alternated_rounds(
        {arm: partial(_convert_timed, clock, arm, layer) for arm in ARMS}, args.rounds
    )
    result: dict[str, Any] = {
        "ms": {arm: asdict(timing.Spread.of(samples[arm])) for arm in ARMS},
        "samples_ms": samples,
        "ratio_current_over_v1": timing.median_ratio(samples["current"], samples["v1"]),
        "traffic": traffic,
    }
    if args.breakdown:
        totals: dict[str, float] = {}
        with clock.steps(totals) as steps:
            convert_v1(layer, steps=steps)
        result["v1_steps_ms"] = {name: round(ms, 3) for name, ms in totals.items()}
    if args.profile:
        result["profile"] = {
            arm: profile_round(partial(CONVERTERS[arm], layer), device) for arm in ARMS
        }
    return result, found


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    device = _device(args.device)
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    _patched()
    clock = Clock(device)
    shapes = GEOMETRIES[args.geometry](args.experts)
    layers = {
        kind: make_layer(shapes, kind, args.spread, args.seed + index, device)
        for index, kind in enumerate(("sparse", "dense"))
    }
    problems = identity_check(device, args.seed)

    per_layer: dict[str, dict[str, Any]] = {}
    for kind, layer in layers.items():
        elements = shapes.sparse_elements if kind == "sparse" else shapes.dense_elements
        per_layer[kind], found = measure_layer(layer, elements, clock, args, device)
        per_layer[kind]["floor_bytes"] = floor_bytes(shapes, kind)
        problems += [f"{kind} layer: {problem}" for problem in found]

    counts = {"sparse": SPARSE_LAYERS, "dense": DENSE_LAYERS}
    per_start = {
        arm: sum(per_layer[k]["ms"][arm]["median"] * counts[k] for k in per_layer) / 1000.0
        for arm in ARMS
    }
    bandwidth = copy_gbps(clock, device) if device.type == "cuda" else None
    floor_s = (
        sum(per_layer[k]["floor_bytes"] * counts[k] for k in per_layer) / (bandwidth * 1e9)
        if bandwidth
        else None
    )
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "commit": args.commit or _commit(),
        "geometry": args.geometry,
        "experts": shapes.experts,
        "spread": args.spread,
        "rounds": args.rounds,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "layers": per_layer,
        "per_start_s": per_start,
        "per_start_saving_s": per_start["v1"] - per_start["current"],
        "copy_gbps": bandwidth,
        "floor_per_start_s": floor_s,
        "mismatches": problems,
        "identical": not problems,
    }


def table(summary: dict[str, Any]) -> str:
    """The run as a few lines of text, printed last."""
    lines = [
        f"{summary['device']} ({summary['geometry']}, {summary['experts']} experts, spread "
        f"{summary['spread']}, {summary['rounds']} rounds): ms per layer, median (min..max)"
    ]
    for kind, result in summary["layers"].items():
        cells = [f"{arm} {timing.Spread(**result['ms'][arm]).text(2)}" for arm in ARMS]
        lines.append(
            f"  {kind:6} "
            + "  ".join(cells)
            + f"  current/v1 {result['ratio_current_over_v1']:.3f}"
        )
        lines.append(
            "    traffic (B/weight, host syncs): "
            + "  ".join(
                f"{arm} {t['bytes_per_element']} B, {t['host_syncs']}"
                for arm, t in result["traffic"].items()
            )
        )
        for arm, rows in result.get("profile", {}).items():
            lines.append(
                f"    top ops {arm}: " + "; ".join(f"{r['op']} {r['self_ms']}" for r in rows[:6])
            )
        if "v1_steps_ms" in result:
            lines.append(f"    v1 steps ms: {result['v1_steps_ms']}")
    start = summary["per_start_s"]
    lines.append(
        f"  per start ({SPARSE_LAYERS} sparse + {DENSE_LAYERS} dense layers): "
        f"v1 {start['v1']:.2f} s, current {start['current']:.2f} s, "
        f"saving {summary['per_start_saving_s']:.2f} s"
    )
    if summary["floor_per_start_s"] is not None:
        lines.append(
            f"  floor at the copy bandwidth ({summary['copy_gbps']:.0f} GB/s): "
            f"{summary['floor_per_start_s']:.3f} s"
        )
    lines.append(
        "  outputs identical (bytes, scales, log line): "
        + ("yes" if summary["identical"] else f"NO ({len(summary['mismatches'])} mismatches)")
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="rank")
    parser.add_argument("--experts", type=int, help="routed experts (default: the geometry's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--spread", type=int, default=6, help="binades of scale spread in a row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    parser.add_argument("--breakdown", action="store_true", help="the first version by step")
    parser.add_argument("--profile", action="store_true", help="top operators of each arm")
    parser.add_argument("--out", type=Path, help=f"directory for {RESULT_FILE}")
    parser.add_argument("--commit", help="the commit measured (default: git's HEAD, if any)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds}: at least 1")
    if args.experts is not None and args.experts < 1:
        raise UsageError(f"--experts {args.experts}: at least 1")
    if not 0 <= args.spread <= 100:
        raise UsageError(f"--spread {args.spread}: 0 to 100 binades")
    if args.threads < 0:
        raise UsageError(f"--threads {args.threads}: 0 (torch's default) or more")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        summary = run(args)
    except UsageError as error:
        print(f"requant_cost: {error}", file=sys.stderr)
        return 2
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / RESULT_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    print(table(summary))
    for problem in summary["mismatches"]:
        print(f"mismatch: {problem}", file=sys.stderr)
    return 0 if summary["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
