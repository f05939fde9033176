"""The workspace stand-in of `vllm_minimax.testing.patched_module` against vLLM
0.34.0's `WorkspaceManager`, and the patch's FlashInfer indexer scoring into it
through the shim (the path the GPU tests and benchmarks take)."""

from __future__ import annotations

import torch
from vllm.v1.worker.workspace import WorkspaceManager

from vllm_minimax.testing import patched_module as pm
from vllm_minimax.testing.indexer_cases import IndexerCase, make_batch, patched_run

REQUESTS = [
    (((3, 5, 7), torch.float32),),
    (((100,), torch.float32), ((9, 4), torch.int32)),
    (((2, 1000, 3), torch.float32), ((77,), torch.uint8)),
    (((4, 4), torch.float32),),
]


def test_stand_in_hands_out_the_views_vllms_manager_does():
    ours, theirs = pm.WorkspaceManager("cpu"), WorkspaceManager(torch.device("cpu"))
    for request in REQUESTS:
        got, want = ours.get_simultaneous(*request), theirs.get_simultaneous(*request)
        for g, w in zip(got, want, strict=True):
            assert (g.shape, g.dtype, g.is_contiguous()) == (w.shape, w.dtype, True)
            assert g.data_ptr() - ours.buffer.data_ptr() == (
                w.data_ptr() - theirs._current_workspaces[0].data_ptr()
            )
        assert ours.buffer.numel() == theirs._current_workspaces[0].numel()


def _case() -> IndexerCase:
    # Four MTP K=4 decodes (query length 5: FlashInfer's prefill regime) beside
    # a 300-token chunk.
    return IndexerCase(
        "shim_mtp5_mixed",
        "mixed",
        ((5, None),) * 4 + ((300, 4300),),
        2,
        kv_min=5,
        kv_max=3800,
        tags=("mtp",),
    )


def test_reserve_sizes_the_workspace_from_the_config_and_forward_reuses_it(monkeypatch):
    module = pm.load_patched_module(pm.reference_msa_ops())
    outputs = []
    ref = pm.reference_msa_ops()

    def proxy(*args, output=None, **kwargs):
        outputs.append(output)
        return ref.msa_proxy_score(*args, output=output, **kwargs)

    monkeypatch.setitem(module.__dict__, "msa_proxy_score", proxy)
    batch = make_batch(_case(), "cpu")
    run = patched_run(module, batch)
    manager = pm.current_workspace_manager()
    manager.buffer = None
    # The engine's config at profiling: 4100 tokens of context (33 pages, the
    # last one partial), 512 tokens a step.
    run.impl.vllm_config = pm.VllmConfig(max_model_len=4100, max_num_batched_tokens=512)
    run.impl.reserve_workspace()
    assert manager.buffer.numel() == 2 * 33 * 512 * 4
    reserved = manager.buffer.data_ptr()
    run.forward()
    run.forward()
    assert len(outputs) == 4 and all(o is not None for o in outputs)
    assert {o.data_ptr() for o in outputs} == {reserved}
    assert [c.prefill_regime for c in run.metadata.calls] == [True, True]
