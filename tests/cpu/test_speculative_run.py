"""The speculative serving run's readers (`vllm_minimax.testing.speculative_run`) and the tiny
EAGLE3 draft's layout (`vllm_minimax.tiny_eagle3`), on texts and files made here. vLLM's own
parsing of the draft is checked in tests/cpu/patched_vllm/test_serve_configs.py."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from vllm_minimax import tiny_eagle3
from vllm_minimax.testing import speculative_run
from vllm_minimax.testing.engine_runs import logprobs_kernel_warmed


def metrics_text(drafts: int, tokens: int, accepted: list[int], engines: int = 1) -> str:
    """A /metrics page as prometheus_client writes vLLM's counters (per engine, with the
    ``_created`` samples a counter also has)."""
    lines = []
    for engine in range(engines):
        labels = f'engine="{engine}",model_name="tiny"'
        for name, value in (
            ("vllm:spec_decode_num_drafts", drafts),
            ("vllm:spec_decode_num_draft_tokens", tokens),
            ("vllm:spec_decode_num_accepted_tokens", sum(accepted)),
        ):
            lines += [
                f"# HELP {name}_total something",
                f"# TYPE {name}_total counter",
                f"{name}_total{{{labels}}} {float(value)}",
                f"{name}_created{{{labels}}} 1.7651e+09",
            ]
        for position, value in enumerate(accepted):
            name = "vllm:spec_decode_num_accepted_tokens_per_pos"
            lines.append(f'{name}_total{{{labels},position="{position}"}} {float(value)}')
            lines.append(f'{name}_created{{{labels},position="{position}"}} 1.7651e+09')
    lines.append('vllm:num_requests_running{engine="0",model_name="tiny"} 0.0')
    return "\n".join(lines) + "\n"


def test_counters_are_summed_and_rated() -> None:
    rng = random.Random(63)
    drafts = rng.randint(5, 50)
    accepted = [rng.randint(0, drafts) for _ in range(3)]
    counters = speculative_run.spec_decode_counters(metrics_text(drafts, 3 * drafts, accepted, 2))
    assert counters["drafts"] == 2 * drafts
    assert counters["draft_tokens"] == 6 * drafts
    assert counters["accepted_tokens"] == 2 * sum(accepted)
    assert counters["per_position"] == [2.0 * a for a in accepted]
    assert counters["acceptance_rate"] == pytest.approx(sum(accepted) / (3 * drafts))
    assert counters["mean_acceptance_length"] == pytest.approx(1 + sum(accepted) / drafts)


def test_a_page_without_the_counters_is_refused() -> None:
    with pytest.raises(ValueError, match="vllm:spec_decode_num_drafts"):
        speculative_run.spec_decode_counters('vllm:num_requests_running{engine="0"} 0.0\n')


LOG = """\
(EngineCore pid=1) INFO 12-06 22:01:02 [cuda.py:550] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLASHINFER', 'TRITON_ATTN'].
(EngineCore pid=1) INFO 12-06 22:01:02 [indexer.py:88] MiniMax M3 indexer: selected FlashInfer [topk_blocks=16, indexer_kv_dtype=fp8]
(EngineCore pid=1) INFO 12-06 22:01:09 [cuda.py:489] Using AttentionBackendEnum.FLASH_ATTN backend.
"""  # noqa: E501
AFTER_READY = """\
(EngineCore pid=1) WARNING 12-06 22:02:00 [jit_monitor.py:143] Triton kernel JIT compilation during inference: _topk_log_softmax_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.
(EngineCore pid=1) WARNING 12-06 22:02:00 [jit_monitor.py:143] Triton kernel JIT compilation during inference: _gqa_sparse_decode_kernel (BLOCK=64). This causes a latency spike; consider extending warmup to cover this shape/config.
(EngineCore pid=1) WARNING 12-06 22:02:01 [jit_monitor.py:143] Triton kernel JIT compilation during inference: eagle_prepare_inputs_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.
(EngineCore pid=1) INFO 12-06 22:02:02 [jit.py:1] Building JIT module cake_hopper_msa_decode_q4
"""  # noqa: E501


def test_backends_chosen_and_picked_are_told_apart() -> None:
    assert speculative_run.configured_backends(LOG) == ["FLASH_ATTN"]
    assert speculative_run.picked_backends(LOG) == ["FLASH_ATTN"]
    assert speculative_run.configured_backends(LOG.splitlines()[0]) == []


def test_compiles_after_ready_sorted_into_series_and_other() -> None:
    compiled = speculative_run.compiled_after_ready(AFTER_READY, {"_gqa_sparse_decode_kernel"})
    assert compiled["series"] == ["_gqa_sparse_decode_kernel"]
    assert compiled["other"] == ["eagle_prepare_inputs_kernel"]  # the sampler's is vLLM's
    assert len(compiled["flashinfer"]) == 1 and "cake_hopper_msa" in compiled["flashinfer"][0]
    assert speculative_run.compiled_after_ready("", {"x"}) == {
        "flashinfer": [],
        "series": [],
        "other": [],
    }


def test_m3_triton_kernels_are_read_off_the_tree(tmp_path: Path) -> None:
    ops = tmp_path / "vllm" / "models" / "minimax_m3" / "nvidia" / "ops"
    ops.mkdir(parents=True)
    (ops / "a.py").write_text(
        "import triton\n@triton.jit\ndef _one(x):\n    pass\n\n"
        "@triton.jit(do_not_specialize=['n'])\n@other\ndef _two(x):\n    pass\n\n"
        "def not_a_kernel():\n    pass\n"
    )
    (tmp_path / "vllm" / "other.py").write_text("@triton.jit\ndef _elsewhere():\n    pass\n")
    assert speculative_run.m3_triton_kernels(tmp_path) == {"_one", "_two"}


def _sampler_tree(root: Path, warmed: bool) -> Path:
    sample = root / "vllm" / "v1" / "worker" / "gpu" / "sample"
    sample.mkdir(parents=True)
    warmup = "def warmup_token_logprobs(logits, max_num_token_ids):\n    pass\n" if warmed else ""
    (sample / "logprob.py").write_text("def compute_token_logprobs(x):\n    pass\n\n" + warmup)
    return root


def test_the_sampler_kernel_is_the_series_where_0009_warms_it(tmp_path: Path) -> None:
    """A served log's logprobs kernel counts as the series' once the tree warms it (patch 0009),
    and is reported as vLLM's own on a tree without the warm-up (stock, or an older series)."""
    warmed = _sampler_tree(tmp_path / "warmed", warmed=True)
    stock = _sampler_tree(tmp_path / "stock", warmed=False)
    assert speculative_run.series_triton_kernels(warmed) == {"_topk_log_softmax_kernel"}
    assert speculative_run.series_triton_kernels(stock) == set()
    kernels = speculative_run.series_triton_kernels(warmed) | {"_gqa_sparse_decode_kernel"}
    compiled = speculative_run.compiled_after_ready(AFTER_READY, kernels)
    assert compiled["series"] == ["_topk_log_softmax_kernel", "_gqa_sparse_decode_kernel"]
    assert compiled["other"] == ["eagle_prepare_inputs_kernel"]


def test_the_patched_tree_warms_the_sampler_kernel(tmp_path: Path) -> None:
    """The installed vLLM 0.34.0 is stock; with the series applied (as the GPU scripts do) its
    logprob.py carries 0009's warm-up, which the check finds."""
    import importlib.util
    import shutil

    from vllm_minimax import patchset

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    installed = Path(spec.origin).parents[1]
    assert not logprobs_kernel_warmed(installed)
    rel = Path("vllm/v1/worker/gpu/sample/logprob.py")
    (tmp_path / rel).parent.mkdir(parents=True)
    shutil.copy(installed / rel, tmp_path / rel)
    series = patchset.read_series(
        patchset.require_series_dir(patchset.read_vllm_version(installed))
    )
    sampler_patch = [patch for patch in series if str(rel) in patch.paths]
    assert len(sampler_patch) == 1, "one patch of the series changes logprob.py"
    subprocess.run(
        ["git", "apply", "--include", str(rel), str(sampler_patch[0].path)],
        cwd=tmp_path,
        check=True,
    )
    assert logprobs_kernel_warmed(tmp_path)


def test_the_installed_m3_tree_has_kernels() -> None:
    """vLLM 0.34.0's MiniMax M3 defines its sparse decode and indexer kernels with Triton."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    kernels = speculative_run.m3_triton_kernels(Path(spec.origin).parents[1])
    assert {"_gqa_sparse_decode_kernel", "_topk_index_kernel"} <= kernels


# --- the tiny EAGLE3 draft -----------------------------------------------------------


def tiny_target(directory: Path, wrapper: bool = False) -> Path:
    directory.mkdir(parents=True)
    text = {"hidden_size": 256, "vocab_size": 544, "num_hidden_layers": 4, "bos_token_id": 1}
    config = {"model_type": "minimax_m3_vl", "text_config": text} if wrapper else text
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("wrapper", [False, True], ids=["flat", "minimax_m3_vl"])
def test_draft_layout_is_what_llama_eagle3_loads(tmp_path: Path, wrapper: bool) -> None:
    from safetensors import safe_open

    target = tiny_target(tmp_path / "target", wrapper)
    made = tiny_eagle3.make_tiny_eagle3_draft(target, tmp_path / "draft", kv_heads=2, seed=5)
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["hidden_size"] == config["target_hidden_size"] == 256
    assert config["vocab_size"] == config["draft_vocab_size"] == 544
    assert config["num_hidden_layers"] == 1 and config["num_key_value_heads"] == 2
    layers = config["eagle_aux_hidden_state_layer_ids"]
    assert len(set(layers)) == 3 and all(0 <= i <= 4 for i in layers)
    with safe_open(str(tmp_path / "draft" / "model.safetensors"), "pt") as handle:
        names = handle.keys()  # safe_open is not iterable
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in names}
        fc = handle.get_tensor("fc.weight").float()
    assert shapes == tiny_eagle3.draft_shapes(config)
    assert made["tensors"] == len(shapes)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (4 * 128, 2 * 256)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (2 * 128, 2 * 256)
    assert shapes["fc.weight"] == (256, 3 * 256)
    assert not any("embed_tokens" in name for name in shapes)  # shared from the target
    assert 0.01 < fc.std().item() < 0.03  # random, not zeros


def test_the_draft_passes_doctors_eagle3_row(tmp_path: Path) -> None:
    from vllm_minimax.checkpoint_weights import Outcome, check

    target = tiny_target(tmp_path / "target")
    tiny_eagle3.make_tiny_eagle3_draft(target, tmp_path / "draft")
    row = check({"method": "eagle3", "model": str(tmp_path / "draft")}, str(target))
    assert row.outcome is Outcome.PRESENT, row


def test_aux_layers_are_vllms_default_where_it_is_distinct() -> None:
    assert tiny_eagle3.aux_layer_ids(60) == [2, 30, 57]  # what the published head uses
    assert tiny_eagle3.aux_layer_ids(4) == [2, 3, 4]


def test_command_refuses_a_directory_without_a_target(tmp_path: Path, capsys) -> None:
    assert tiny_eagle3.main([str(tmp_path / "nothing"), str(tmp_path / "draft")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "draft").exists()
    target = tiny_target(tmp_path / "target")
    assert tiny_eagle3.main([str(target), str(tmp_path / "d2"), "--kv-heads", "3"]) == 2
    assert "does not divide" in capsys.readouterr().err


# --- method mtp on a checkpoint without the tensors ----------------------------------


def test_the_loaders_message_is_read() -> None:
    names = ["model.layers.0.eh_proj.weight", "model.layers.0.enorm.weight"]
    message = (
        f"ValueError: {speculative_run.NOT_INITIALIZED}: {{'{names[1]}', '{names[0]}'}}\n"
        "  later: {'not', 'these'}"
    )
    assert speculative_run.not_initialized(message) == names
    assert speculative_run.not_initialized("ValueError: something else {'x'}") == []


def test_the_published_layout_declares_a_module_and_carries_none(tmp_path: Path) -> None:
    """The demonstration's checkpoint: the tiny model's tensors under `language_model.`, data
    unchanged, in the minimax_m3_vl wrapper with the VL architecture declaring one MTP
    module; doctor says its tensors are absent; the target directory is left as it was."""
    import torch
    from safetensors.torch import load_file, save_file

    from vllm_minimax.checkpoint_weights import Outcome, check
    from vllm_minimax.tiny_model import VL_ARCHITECTURE, write_tiny_config_files

    target = tmp_path / "tiny"
    write_tiny_config_files(target, mtp_modules=1)  # writes mtp/config.json, left behind
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(3, 5, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(7, dtype=torch.float32),  # a header length not of 8
    }
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    before = (target / "model.safetensors").read_bytes()
    work = speculative_run.published_layout(target, tmp_path / "work")
    config = json.loads((work / "config.json").read_text())
    assert config["model_type"] == "minimax_m3_vl"
    assert config["architectures"] == [VL_ARCHITECTURE]
    assert config["text_config"]["num_mtp_modules"] == 1
    renamed = load_file(str(work / "model.safetensors"))
    assert sorted(renamed) == sorted(f"language_model.{name}" for name in tensors)
    for name, tensor in tensors.items():
        assert torch.equal(renamed[f"language_model.{name}"], tensor)
    assert (target / "model.safetensors").read_bytes() == before
    assert (work / "tokenizer.json").resolve() == (target / "tokenizer.json").resolve()
    assert not (work / "mtp").exists()
    assert json.loads((target / "config.json").read_text())["model_type"] != "minimax_m3_vl"
    row = check({"method": "mtp", "num_speculative_tokens": 2}, str(work))
    assert row.outcome is Outcome.ABSENT and "not initialized" in row.text


def test_the_published_layout_renames_the_index_too(tmp_path: Path) -> None:
    from vllm_minimax.checkpoint_weights import INDEX_FILE
    from vllm_minimax.tiny_model import write_tiny_config_files

    target = tmp_path / "tiny"
    write_tiny_config_files(target)
    index = {"metadata": {"total_size": 4}, "weight_map": {"lm_head.weight": "a.safetensors"}}
    (target / INDEX_FILE).write_text(json.dumps(index))
    work = speculative_run.published_layout(target, tmp_path / "work")
    written = json.loads((work / INDEX_FILE).read_text())
    assert written == {**index, "weight_map": {"language_model.lm_head.weight": "a.safetensors"}}


def _demo_module():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "gpu_e2e" / "mtp_without_tensors.py"
    spec = importlib.util.spec_from_file_location("mtp_without_tensors", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("raised", "expected_exit"),
    [
        (ValueError(f"{speculative_run.NOT_INITIALIZED}: {{'model.layers.0.enorm.weight'}}"), 0),
        (ValueError(f"{speculative_run.NOT_INITIALIZED}: {{'language_model.lm_head.weight'}}"), 1),
        (RuntimeError("CUDA out of memory"), 1),  # stopped, for another reason
        (None, 1),  # started: not what vLLM 0.34.0's loader does
    ],
    ids=["the-loaders-check", "the-target-unloaded", "another-error", "started"],
)
def test_the_demonstration_reports_what_stopped_the_engine(
    tmp_path: Path, monkeypatch, raised, expected_exit
) -> None:
    """The GPU script's own logic with a stand-in `vllm.LLM`: exit 0 only for the loader's
    message naming the MTP module's parameters, with doctor's row absent."""
    import sys
    import types

    from vllm_minimax.tiny_model import write_tiny_config_files

    target = tmp_path / "tiny"
    write_tiny_config_files(target)
    header = json.dumps({"model.layers.0.self_attn.q_proj.weight": {}}).encode()
    (target / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    seen: dict = {}

    def fake_llm(**kwargs):
        seen.update(kwargs)
        if raised is not None:
            raise raised

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=fake_llm))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # restored after main sets 0
    out = tmp_path / "result.json"
    code = _demo_module().main(
        ["--target", str(target), "--work", str(tmp_path / "work"), "--out", str(out)]
    )
    assert code == expected_exit
    result = json.loads(out.read_text())
    assert result["doctor"][0] == "absent"
    assert seen["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert seen["model"] == str(tmp_path / "work")
    assert seen["limit_mm_per_prompt"] == {"image": 0, "video": 0}
    assert result["engine"] == ("started" if raised is None else "stopped")
    if expected_exit == 0:
        assert result["not_initialized"] == ["model.layers.0.enorm.weight"]
