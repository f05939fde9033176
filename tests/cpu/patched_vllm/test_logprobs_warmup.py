"""Patch 0009's warm-up compiles every variant of the sampler's logprobs kernel that a request
asking for logprobs can reach, and only those.

The reference is Triton itself: `_topk_log_softmax_kernel`'s launches are intercepted and each
launch's compile key is what Triton's own argument binder (`create_function_from_signature`
over the kernel's signature, the kernel being the one of the vLLM under test) makes of the
arguments: each pointer's dtype and 16-byte alignment, each integer's type and 1 /
divisible-by-16 class, the constexprs. The intercepted kernel computes the float32 reference
(log-softmax at the ids), so the requests' results are checked too.

The request side runs what a served step runs, on logits laid out as `compute_logits` returns
them (a view of the padded vocabulary): the sampled-token logprobs (`compute_topk_scores`, as
`Sampler.__call__` calls it) and the prompt logprobs (`compute_prompt_logprobs_with_chunking`)
for every number of logprobs 0 to max_logprobs (-1: the vocabulary), on one row and on
several; in the processed modes also on the fp32 copy `Sampler.apply_sampling_params` makes.
The warm-up side runs `Sampler.warmup_logprobs` on the dummy run's logits. The two key sets
must be equal, and `GPUModelRunner._dummy_sampler_run` must call the warm-up with the logits of
`compute_logits` whenever `kernel_config.enable_jit_warmup` is on.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton
import triton.language
from triton.runtime.jit import JITFunction
from triton_launch_keys import compile_key, kernel_from_module
from vllm.v1.worker.gpu.sample import logprob, prompt_logprob
from vllm.v1.worker.gpu.sample.sampler import Sampler

# name: (vocabulary, padded vocabulary, logits dtype). MiniMax M3's vocabulary is a multiple of
# 64 (no padding); the others have a row stride of another class than their vocabulary.
LAYOUTS = {
    "m3": (200064, 200064, torch.bfloat16),
    "odd-bf16": (1000, 1024, torch.bfloat16),
    "odd-fp32-head": (520, 576, torch.float32),
}


@functools.cache
def _triton_kernel() -> JITFunction:
    return kernel_from_module(logprob, "_topk_log_softmax_kernel")


@contextmanager
def _recorded_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    """The compile keys of the logprobs kernel's launches made inside."""
    keys: set[str] = set()
    kernel = _triton_kernel()

    class LogSoftmaxAtIds:
        def __getitem__(self, grid):
            def launch(out, logits, logits_stride, ids, ids_stride, topk, vocab, **constexprs):
                keys.add(
                    compile_key(
                        kernel,
                        (out, logits, logits_stride, ids, ids_stride, topk, vocab),
                        constexprs,
                    )
                )
                assert grid == (logits.shape[0],) and logits.stride(0) == logits_stride
                rows = torch.log_softmax(logits.float(), dim=-1)
                out.copy_(rows.gather(1, ids[:, :topk]))

            return launch

    class Ranks:
        def __getitem__(self, grid):
            def launch(out, logits, logits_stride, token_ids, vocab, **constexprs):
                picked = logits.gather(1, token_ids.view(-1, 1))
                out.copy_((logits >= picked).sum(dim=1))

            return launch

    with monkeypatch.context() as patch:
        patch.setattr(logprob, "_topk_log_softmax_kernel", LogSoftmaxAtIds())
        patch.setattr(logprob, "_ranks_kernel", Ranks())
        patch.setattr(logprob, "triton", triton)  # compute_token_logprobs rounds with it
        patch.setattr(torch.accelerator, "synchronize", lambda *args: None)
        yield keys


def _model_logits(rows: int, layout: str) -> torch.Tensor:
    """Logits as `compute_logits` returns them: the vocabulary's columns of the padded head."""
    vocab, padded, dtype = LAYOUTS[layout]
    return torch.randn(rows, padded, dtype=dtype)[:, :vocab]


def _processed_copy(logits: torch.Tensor) -> torch.Tensor:
    """The fp32 logits `Sampler.apply_sampling_params` makes for a batch whose requests are all
    processed (its logits processors and sampling states are stand-ins that change nothing)."""
    rows = logits.shape[0]
    idle = SimpleNamespace(apply=lambda *args, **kwargs: None)
    fake = SimpleNamespace(
        needs_logits_processing=np.ones(rows, dtype=bool),
        logits_processors=[],
        thinking_budget_state=idle,
        sampling_states=SimpleNamespace(
            apply_temperature=lambda *args: None, apply_min_p=lambda *args: None
        ),
    )
    mapping = torch.arange(rows)
    processed = Sampler.apply_sampling_params(
        fake,
        logits,
        mapping,
        mapping,
        mapping.numpy(),
        mapping,
        mapping,
        torch.zeros(rows, dtype=torch.int64),
        np.ones(rows),
        skip_top_k_top_p=True,
    )
    assert processed.dtype == torch.float32 and processed is not logits
    return processed


def _request_counts(max_logprobs: int, vocab: int) -> list[int]:
    return list(range(vocab + 1)) if max_logprobs == -1 else list(range(max_logprobs + 1))


def _serve(layout: str, mode: str, max_logprobs: int) -> None:
    """Every number of logprobs a request may ask for, sampled and prompt, one row and four."""
    vocab, padded, dtype = LAYOUTS[layout]
    counts = _request_counts(max_logprobs, vocab)
    for rows in (1, 4):
        logits = _model_logits(rows, layout)
        sampled = torch.randint(vocab, (rows,))
        variants = [logits]
        if mode == "processed_logprobs":
            variants.append(_processed_copy(logits))
        for scored in variants:
            for num_logprobs in counts:
                got = logprob.compute_topk_scores(scored, num_logprobs, sampled)
                ids = got.logprob_token_ids
                expected = torch.log_softmax(scored.float(), dim=-1).gather(1, ids)
                torch.testing.assert_close(got.logprobs, expected)
        # Prompt logprobs are scored on the logits the model returns, in any mode.
        prompt_ids = torch.randint(vocab, (rows + 2,))
        hidden = torch.randn(rows + 2, 8)
        head = torch.randn(8, padded).to(dtype)

        def logits_fn(states: torch.Tensor, head: torch.Tensor = head) -> torch.Tensor:
            return (states.to(head.dtype) @ head)[:, :vocab]

        for num_logprobs in counts + ([-1] if max_logprobs == -1 else []):
            prompt_logprob.compute_prompt_logprobs_with_chunking(
                prompt_ids, hidden, logits_fn, num_logprobs
            )


def _warm(layout: str, mode: str, max_logprobs: int) -> None:
    logits = _model_logits(4, layout)
    before = logits.clone()
    Sampler.warmup_logprobs(SimpleNamespace(logprobs_mode=mode), logits, max_logprobs)
    assert torch.equal(logits, before), "the warm-up wrote the logits"


@pytest.mark.parametrize(
    ("layout", "mode", "max_logprobs"),
    [
        ("m3", "raw_logprobs", 20),  # vLLM's default max_logprobs
        ("odd-bf16", "raw_logprobs", 15),  # 16 ids: the only divisible class below 17
        ("odd-bf16", "processed_logprobs", 20),
        ("odd-fp32-head", "processed_logprobs", 33),
        ("odd-fp32-head", "raw_logprobs", -1),  # up to the vocabulary: past the 1024 cap
    ],
)
def test_warmup_compiles_every_variant_a_logprobs_request_reaches(
    layout, mode, max_logprobs, monkeypatch
):
    torch.manual_seed(0)
    with _recorded_launches(monkeypatch) as reachable:
        _serve(layout, mode, max_logprobs)
    with _recorded_launches(monkeypatch) as warmed:
        _warm(layout, mode, max_logprobs)
    assert reachable - warmed == set(), f"{layout}/{mode}: variants the warm-up misses"
    assert warmed - reachable == set(), f"{layout}/{mode}: the warm-up compiles unreachable ones"


def test_the_logits_modes_launch_nothing_either_way(monkeypatch):
    with _recorded_launches(monkeypatch) as warmed:
        for mode in ("raw_logits", "processed_logits"):
            _warm("odd-bf16", mode, 20)
    assert warmed == set()


def test_warmup_sizes_are_the_smallest_of_each_class():
    sizes = logprob.token_logprobs_warmup_sizes(21)
    assert sizes == [1, 2, 3, 5, 9, 16, 17]
    brute: dict = {}
    for n in range(1, 3000):
        brute.setdefault(logprob.token_logprobs_launch_class(n), n)
    assert logprob.token_logprobs_warmup_sizes(2999) == sorted(brute.values())
    assert logprob.token_logprobs_warmup_sizes(1) == [1]


def _runner(enable_jit_warmup: bool, calls: list) -> tuple[SimpleNamespace, torch.Tensor]:
    logits = _model_logits(3, "odd-bf16")

    class FakeSampler:
        def __call__(self, *args):
            calls.append("sample")

        def add_request(self, *args):
            pass

        def apply_staged_writes(self):
            pass

        def warmup_logprobs(self, got, max_logprobs):
            calls.append(("warmup_logprobs", got, max_logprobs))

    runner = SimpleNamespace(
        sampler=FakeSampler(),
        model=SimpleNamespace(compute_logits=lambda hidden: logits),
        model_state=SimpleNamespace(dummy_sampler_run=lambda *args: False),
        input_buffers=None,
        vllm_config=SimpleNamespace(
            kernel_config=SimpleNamespace(enable_jit_warmup=enable_jit_warmup)
        ),
        model_config=SimpleNamespace(max_logprobs=17),
    )
    return runner, logits


@pytest.mark.parametrize("enable_jit_warmup", [True, False])
def test_the_dummy_sampler_run_warms_the_logprobs_of_compute_logits(enable_jit_warmup, monkeypatch):
    from vllm.v1.worker.gpu import model_runner

    monkeypatch.setattr(model_runner.InputBatch, "make_dummy", lambda *args: None)
    monkeypatch.setattr(model_runner, "current_platform", SimpleNamespace(is_cpu=lambda: False))
    calls: list = []
    runner, logits = _runner(enable_jit_warmup, calls)
    model_runner.GPUModelRunner._dummy_sampler_run(runner, torch.zeros(3, 8))
    warmups = [call for call in calls if call != "sample"]
    if enable_jit_warmup:
        assert len(warmups) == 1 and warmups[0][1] is logits and warmups[0][2] == 17
    else:
        assert warmups == []
    assert calls.count("sample") == 2  # vLLM's own two passes still run
