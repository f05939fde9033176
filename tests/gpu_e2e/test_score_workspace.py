"""The FlashInfer indexer's score buffer is reserved in the profiled peak, and a
long-context engine near its memory limit prefills its first long prompt.

`workspace_run.py` starts one engine (max_model_len 1M, 16384 tokens a step, the
caching allocator capped at the engine's own budget) and prefills a prompt of
nearly 1M tokens. Checked here:

- vLLM's workspace holds at least the largest score buffer of every FlashInfer
  layer (4 heads x 8192 pages x 16384 rows x 4 bytes = 2 GiB at TP1), from the
  profiling run on, and never grows after it;
- the non-KV memory the profiler counted (`total_consumed`) includes it;
- the prompt was prefilled and decoded without an out-of-memory error.

With `VLLM_MINIMAX_E2E_SAVED=DIR` the saved `DIR/score-workspace.json` is read
instead (a missing one fails).
"""

from __future__ import annotations

# The run's max_model_len (conftest.WORKSPACE_MAX_MODEL_LEN): 8192 pages of 128.
MAX_MODEL_LEN = 1 << 20
SCORE_BYTES = 4 * (MAX_MODEL_LEN // 128) * 16384 * 4


def test_every_sparse_layer_runs_the_flashinfer_indexer(workspace_result):
    assert "error" not in workspace_result, workspace_result.get("error")
    impls = set(workspace_result["impls"].values())
    assert impls == {"MiniMaxM3IndexerFlashInferImpl"}, impls


def test_the_profiled_workspace_holds_the_largest_score_buffer(workspace_result):
    assert "error" not in workspace_result, workspace_result.get("error")
    assert workspace_result["max_model_len"] == MAX_MODEL_LEN
    assert workspace_result["expected_bytes"] == SCORE_BYTES
    assert workspace_result["workspace_bytes"] >= SCORE_BYTES
    # Reserved at profiling: the long prefill did not grow it.
    assert workspace_result["workspace_bytes_after"] == workspace_result["workspace_bytes"]
    assert workspace_result["non_kv_bytes"] >= SCORE_BYTES


def test_the_first_long_prefill_does_not_run_out_of_memory(workspace_result):
    assert "error" not in workspace_result, workspace_result.get("error")
    assert workspace_result["prompt_tokens"] == MAX_MODEL_LEN - 64
    assert workspace_result["generated_tokens"] == 4
