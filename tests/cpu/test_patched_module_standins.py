"""The loader's stand-ins (`vllm_minimax.testing.patched_module`) against the real vLLM 0.34.0.

The GPU tests and the benchmarks run the patch's module under these stand-ins on machines
where vLLM does not import; if vLLM's classes or `split_decodes_and_prefills` change, the
stand-ins would silently test something else. These tests fail instead.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from vllm.models.minimax_m3.common import indexer as vllm_indexer
from vllm.v1.attention import backend as vllm_backend
from vllm.v1.attention.backends import utils as vllm_utils

from vllm_minimax.testing import patched_module as pm


def _fields(cls: type) -> dict[str, object]:
    return {
        f.name: f.default if f.default is not dataclasses.MISSING else "<required>"
        for f in dataclasses.fields(cls)
    }


@pytest.mark.parametrize(
    ("stand_in", "real"),
    [
        (pm.CommonAttentionMetadata, vllm_backend.CommonAttentionMetadata),
        (pm.MiniMaxM3IndexerMetadata, vllm_indexer.MiniMaxM3IndexerMetadata),
    ],
    ids=["CommonAttentionMetadata", "MiniMaxM3IndexerMetadata"],
)
def test_stand_in_dataclass_fields_are_vllms(stand_in: type, real: type) -> None:
    assert _fields(stand_in) == _fields(real)


def test_stand_in_impl_takes_the_keywords_the_patch_reads() -> None:
    real = set(inspect.signature(vllm_indexer.MiniMaxM3IndexerImpl.__init__).parameters)
    stand_in = set(inspect.signature(pm.MiniMaxM3IndexerImpl.__init__).parameters)
    assert stand_in - {"kv_cache"} <= real


def test_backend_name_is_vllms() -> None:
    assert pm.MiniMaxM3IndexerBackend.get_name() == vllm_indexer.MiniMaxM3IndexerBackend.get_name()


def _batch(query_lens: list[int], cls: type, is_prefilling: list[bool]) -> object:
    lens = torch.tensor(query_lens, dtype=torch.int32)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(lens, 0)
    seq_lens = lens + 300
    return cls(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=seq_lens,
        num_reqs=len(query_lens),
        num_actual_tokens=int(lens.sum()),
        max_query_len=int(lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.zeros(len(query_lens), 8, dtype=torch.int32),
        slot_mapping=torch.zeros(int(lens.sum()), dtype=torch.int64),
        is_prefilling=torch.tensor(is_prefilling),
    )


def test_split_decodes_and_prefills_behaves_as_vllms() -> None:
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(400):
        num_reqs = int(torch.randint(1, 9, (), generator=generator))
        query_lens = torch.randint(0, 7, (num_reqs,), generator=generator)
        query_lens[0] = max(1, int(query_lens[0]))
        lens = query_lens.tolist()
        prefilling = (torch.rand(num_reqs, generator=generator) < 0.2).tolist()
        for threshold in (1, 2, 3, 5):
            for require_uniform in (False, True):
                for short_as_decode in (True, False):
                    kwargs = dict(
                        decode_threshold=threshold,
                        require_uniform=require_uniform,
                        treat_short_extends_as_decodes=short_as_decode,
                    )
                    ours = pm.split_decodes_and_prefills(
                        _batch(lens, pm.CommonAttentionMetadata, prefilling), **kwargs
                    )
                    theirs = vllm_utils.split_decodes_and_prefills(
                        _batch(lens, vllm_backend.CommonAttentionMetadata, prefilling), **kwargs
                    )
                    assert ours == theirs, (lens, prefilling, kwargs)
                    checked += 1
    assert checked == 400 * 16
