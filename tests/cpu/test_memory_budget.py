"""`vllm_minimax.memory_budget`: MiniMax M3's per-GPU weights by checkpoint layout agree with
the parameter counts the rank-geometry probe checks against vLLM's own build, its KV bytes a
token agree with what vLLM 0.34.0 allotted on the H200 rank slice, and every serving config
with a budget (the SM90 ones and 8 x RTX PRO 6000) states one that names its checkpoint,
restates the computed weights and fits ``gpu-memory-utilization`` x the card; on 4 x RTX PRO
6000 no known checkpoint fits, as that file says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_minimax.m3_geometry import M3_TEXT_CONFIG, parameter_counts, rank_text_config
from vllm_minimax.memory_budget import (
    CARDS,
    CHECKPOINTS,
    DRAFTS,
    GIB,
    BudgetError,
    Parallelism,
    check_serving_config,
    draft_bytes_per_gpu,
    kv_bytes_per_token,
    parameters_per_gpu,
    read_stated_budget,
    weight_bytes_per_gpu,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "configs" / "serve"
# Hopper configs: the H100 and H200 ones.
SM90_CONFIGS = sorted(path for path in CONFIG_DIR.glob("h[12]00-*.yaml"))
RTX_4X = CONFIG_DIR / "rtx-pro-6000-4x.yaml"
# Configs that state a memory budget: the Hopper ones and the 8-card RTX PRO 6000 box.
BUDGETED_CONFIGS = [*SM90_CONFIGS, CONFIG_DIR / "rtx-pro-6000-8x.yaml"]
MXFP8 = CHECKPOINTS["MiniMaxAI/MiniMax-M3-MXFP8"]
BF16 = CHECKPOINTS["MiniMaxAI/MiniMax-M3"]
LINEAR_PARTS = ("attention", "dense_mlp", "shared_expert", "routed_experts")
SLICE_LOG = REPO / "results" / "h200" / "m3-tp8-rank" / "2026-12-04-profile" / "log.txt"
# Where the serving configs are launched from: `vllm serve MODEL --config .../FILE` (and the
# image's `... vllm-minimax:TAG MODEL --config ...`), `eval ab --config .../FILE --model MODEL`.
LAUNCH_DOCS = [
    REPO / "README.md",
    CONFIG_DIR / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *BUDGETED_CONFIGS,
    RTX_4X,
]
# A config as the docs name it: its file under configs/serve/, `"$(vllm-minimax config path
# NAME)"`, or a bare shipped NAME (what doctor, eval ab and warmup take).
CONFIG_REF = (
    r"(?:\S*configs/serve/(?P<file>[\w.-]+)\.yaml"
    r"|\"\$\(vllm-minimax config path (?P<path_name>[\w.-]+)\)\""
    r"|(?P<bare>[a-z0-9][\w-]*-\d+x[\w-]*)(?=\s))"
)
MODEL_THEN_CONFIG = re.compile(
    r"(?<![\w/.-])(?P<model>[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)\s+--config\s+" + CONFIG_REF
)
CONFIG_THEN_MODEL = re.compile(r"--config\s+" + CONFIG_REF + r"\s+--model\s+(?P<model>\S+)")


def _config_file(match: re.Match[str]) -> str:
    return (match["file"] or match["path_name"] or match["bare"]) + ".yaml"


def test_full_model_is_the_tiny_models_parameter_count():
    """At TP 1 the parts add up to what ``parameter_counts`` (checked against vLLM's build
    by the rank-geometry probe) counts, part for part."""
    parts = parameters_per_gpu(Parallelism())
    counts = parameter_counts(M3_TEXT_CONFIG)
    assert sum(parts[name] for name in LINEAR_PARTS) == counts["linear"]
    assert {name: parts[name] for name in ("router", "embedding", "norm")} == {
        name: counts[name] for name in ("router", "embedding", "norm")
    }


@pytest.mark.parametrize("size", [2, 4, 8])
def test_tensor_parallel_rank_is_the_rank_configs_count(size):
    """A TP-N rank holds what the rank slice's config holds at TP 1, except the embedding
    rows vLLM pads again when it builds the slice (vocab / N padded to 64)."""
    parts = parameters_per_gpu(Parallelism(tensor_parallel_size=size))
    counts = parameter_counts(rank_text_config(size))
    assert sum(parts[name] for name in LINEAR_PARTS) == counts["linear"]
    assert (parts["router"], parts["norm"]) == (counts["router"], counts["norm"])
    assert parts["embedding"] == 2 * (200064 // size) * 6144 <= counts["embedding"]


def test_expert_parallel_rank_holds_16_whole_experts():
    ep = parameters_per_gpu(Parallelism(tensor_parallel_size=8, enable_expert_parallel=True))
    tp = parameters_per_gpu(Parallelism(tensor_parallel_size=8))
    assert ep["routed_experts"] == 57 * 16 * 3 * 3072 * 6144 == tp["routed_experts"]
    two_nodes = Parallelism(8, data_parallel_size=2, enable_expert_parallel=True)
    assert parameters_per_gpu(two_nodes)["routed_experts"] == 57 * 8 * 3 * 3072 * 6144
    # Without EP a second data-parallel engine holds every expert again.
    assert parameters_per_gpu(Parallelism(8, 2, False))["routed_experts"] == tp["routed_experts"]


def test_whole_checkpoints_match_their_published_sizes():
    """Text model only (the published checkpoints add a ~1.3 GB bf16 vision tower): BF16
    ~852 GB of ~854 published; MXFP8 ~442 GB of ~444 published, which needs the attention
    quantized too (bf16 attention would add ~6.6 GB)."""
    bf16 = sum(weight_bytes_per_gpu(BF16, Parallelism()).values()) / 1e9
    mxfp8 = weight_bytes_per_gpu(MXFP8, Parallelism())
    assert 851 < bf16 < 854
    assert 441 < sum(mxfp8.values()) / 1e9 < 444
    assert 6.5e9 < mxfp8["attention"] * (2 - 33 / 32) < 6.8e9


def test_mxfp8_stores_one_scale_byte_per_32_weights():
    parallelism = Parallelism(tensor_parallel_size=8, enable_expert_parallel=True)
    mxfp8 = weight_bytes_per_gpu(MXFP8, parallelism)
    counts = parameters_per_gpu(parallelism)
    assert mxfp8["routed_experts"] == counts["routed_experts"] * 33 / 32
    assert mxfp8["embedding"] == 2 * counts["embedding"]
    assert mxfp8["router"] == 4 * counts["router"]


def test_kv_bytes_per_token_is_what_vllm_allotted_on_the_h200_slice():
    """The TP-8 rank slice (bf16 KV cache, fp8 index cache, no MTP) logged its KV cache's
    tokens and GiB; 38016 bytes a token reproduces the GiB it logged."""
    log = SLICE_LOG.read_text()
    tokens = int(re.search(r"GPU KV cache size: ([0-9,]+) tokens", log)[1].replace(",", ""))
    logged_gib = float(re.search(r"KV cache blocks \(([0-9.]+) GiB\) fit", log)[1])
    assert "indexer_kv_dtype='fp8'" in log and "kv_cache_dtype=auto" in log
    per_token = kv_bytes_per_token(Parallelism(tensor_parallel_size=8), "auto", "fp8")
    assert per_token == 60 * 2 * 128 * 2 + 57 * 128 == 38016
    assert round(tokens * per_token / GIB, 2) == logged_gib


def test_each_mtp_module_adds_one_sparse_layers_kv_and_index_key():
    tp8 = Parallelism(tensor_parallel_size=8)
    added = kv_bytes_per_token(tp8, "auto", "fp8", mtp_modules=1) - kv_bytes_per_token(
        tp8, "auto", "fp8"
    )
    assert added == 1 * 128 * 2 * 2 + 128  # K and V of one KV head in bf16, one fp8 index key


EAGLE3 = DRAFTS["Inferact/MiniMax-M3-EAGLE3"]


def test_the_draft_adds_its_weights_and_its_kv():
    """The EAGLE3 head on one GPU at TP 8: its ~3.3 B bf16 parameters split 8 ways but fc
    (3 x 6144 -> 6144) whole, and K and V of its one 6144-wide layer split 8 ways."""
    tp8 = Parallelism(tensor_parallel_size=8, enable_expert_parallel=True)
    without = weight_bytes_per_gpu(MXFP8, tp8)
    with_draft = weight_bytes_per_gpu(MXFP8, tp8, draft=EAGLE3)
    fc = 3 * 6144 * 6144
    added = sum(with_draft.values()) - sum(without.values())
    assert added == pytest.approx(((3_300_000_000 - fc) / 8 + fc) * 2)
    assert 0.9 < added / GIB < 1.0
    kv_added = kv_bytes_per_token(tp8, "auto", "fp8", draft=EAGLE3) - kv_bytes_per_token(
        tp8, "auto", "fp8"
    )
    assert kv_added == 1 * (6144 // 8) * 2 * 2


@pytest.mark.parametrize("config", BUDGETED_CONFIGS, ids=lambda path: path.name)
def test_the_budget_counts_the_draft_the_config_serves(config):
    """A config that serves an EAGLE3 draft budgets that draft and no MTP modules; one that
    serves method mtp budgets the modules the checkpoint declares and no draft."""
    import yaml

    speculative = yaml.safe_load(config.read_text()).get("speculative-config") or {}
    budget = read_stated_budget(config.read_text(), config.name)
    if speculative.get("method") == "eagle3":
        assert budget.draft is not None and budget.draft.name == speculative["model"]
        assert budget.mtp_modules == 0
    elif speculative.get("method") == "mtp":
        assert budget.draft is None and budget.mtp_modules > 0
    else:
        assert budget.draft is None and budget.mtp_modules == 0


def test_there_are_sm90_configs():
    names = {path.name for path in SM90_CONFIGS}
    assert {"h100-8x.yaml", "h200-8x.yaml", "h100-16x-2node.yaml"} <= names


@pytest.mark.parametrize("config", BUDGETED_CONFIGS, ids=lambda path: path.name)
def test_config_fits_its_checkpoint(config):
    check = check_serving_config(config)
    assert check.fits, (
        f"{config.name}: weights {check.weights_gib:.2f} + KV {check.kv_gib:.2f} + reserve"
        f" {check.budget.reserve_gib} = {check.used_gib:.2f} GiB >"
        f" {check.gpu_memory_utilization} x {check.budget.card.total_gib} GiB"
    )
    assert check.budget.weights_gib == pytest.approx(check.weights_gib, abs=0.005), (
        f"{config.name} states {check.budget.weights_gib} GiB of weights; they are"
        f" {check.weights_gib:.2f}"
    )
    assert check.budget.card.name.split("-")[0].lower() == config.name.split("-")[0]


@pytest.mark.parametrize("config", SM90_CONFIGS, ids=lambda path: path.name)
def test_h100_configs_are_for_mxfp8_and_bf16_only_with_its_own_file(config):
    """The BF16 checkpoint does not fit an H100; on the H200 it is offered only by a config
    whose name says so (its budget states its KV room)."""
    checkpoint = read_stated_budget(config.read_text(), config.name).checkpoint
    if config.name.startswith("h100"):
        assert checkpoint == MXFP8
    assert (checkpoint == BF16) == ("bf16" in config.name)


def test_bf16_does_not_fit_an_h100(tmp_path):
    """The arithmetic refuses what the issue found: BF16 on 8 x H100."""
    h100 = (CONFIG_DIR / "h100-8x.yaml").read_text()
    planted = tmp_path / "h100-8x-bf16.yaml"
    planted.write_text(h100.replace(MXFP8.name, BF16.name))
    check = check_serving_config(planted)
    assert check.weights_gib > 100 and not check.fits


def test_a_kv_budget_past_the_card_does_not_fit(tmp_path):
    h200 = (CONFIG_DIR / "h200-8x.yaml").read_text()
    stated = read_stated_budget(h200).kv_tokens
    planted = tmp_path / "h200-8x.yaml"
    planted.write_text(h200.replace(f"{stated:,} tokens", f"{2 * stated:,} tokens", 1))
    assert read_stated_budget(planted.read_text()).kv_tokens == 2 * stated
    assert check_serving_config(planted).fits is False


def test_the_reserve_counts_against_the_card(tmp_path):
    """Weights, KV cache and reserve must fit together: a reserve larger than the headroom
    the other two leave does not."""
    h100 = (CONFIG_DIR / "h100-8x.yaml").read_text()
    check = check_serving_config(CONFIG_DIR / "h100-8x.yaml")
    assert check.fits
    headroom = check.limit_gib - check.weights_gib - check.kv_gib
    planted = tmp_path / "h100-8x.yaml"
    planted.write_text(
        re.sub(r"(?m)^#   reserve: .*$", f"#   reserve: {headroom + 1:.2f} GiB", h100)
    )
    grown = check_serving_config(planted)
    assert grown.used_gib == pytest.approx(
        grown.weights_gib + grown.kv_gib + headroom + 1, abs=0.01
    )
    assert not grown.fits


def test_the_configs_kv_cache_dtype_is_read(tmp_path):
    """No shipped config sets kv-cache-dtype (bf16 KV); one that asks for fp8 stores K and V
    at one byte an element: each token costs one byte less per element of its K and V rows
    on every attention and MTP layer (one KV head a rank at TP 8), the index keys unchanged."""
    h100 = (CONFIG_DIR / "h100-8x.yaml").read_text()
    assert re.search(r"(?m)^kv-cache-dtype:", h100) is None
    bf16 = check_serving_config(CONFIG_DIR / "h100-8x.yaml")
    planted = tmp_path / "h100-8x.yaml"
    planted.write_text(h100 + "\nkv-cache-dtype: fp8\n")
    fp8 = check_serving_config(planted)
    layers = M3_TEXT_CONFIG["num_hidden_layers"] + bf16.budget.mtp_modules
    k_and_v = layers * 1 * M3_TEXT_CONFIG["head_dim"] * 2
    draft = bf16.budget.draft
    assert draft is not None  # the draft's K and V take the target's dtype too
    k_and_v += draft.layers * draft.kv_width // 8 * 2
    assert bf16.kv_bytes_per_token - fp8.kv_bytes_per_token == k_and_v
    assert fp8.kv_gib == pytest.approx(
        bf16.kv_gib * fp8.kv_bytes_per_token / bf16.kv_bytes_per_token
    )


def test_a_lower_gpu_memory_utilization_is_read(tmp_path):
    h100 = (CONFIG_DIR / "h100-8x.yaml").read_text()
    planted = tmp_path / "h100-8x.yaml"
    planted.write_text(h100 + "\ngpu-memory-utilization: 0.8\n")
    check = check_serving_config(planted)
    assert check.limit_gib == pytest.approx(0.8 * 79.19) and not check.fits


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda text: text.replace("# Memory budget per GPU", "# Memory"), "no '# Memory budget"),
        (lambda text: re.sub(r"(?m)^#\s+reserve:.*\n", "", text), "lacks reserve"),
        (lambda text: text.replace("gpu: H100-80GB", "gpu: A100-80GB"), "unknown gpu"),
        (lambda text: text.replace("MiniMaxAI/MiniMax-M3-MXFP8", "x/y"), "unknown checkpoint"),
        (lambda text: re.sub(r"(?m)^#\s+draft:.*\n", "", text), "lacks draft"),
        (lambda text: text.replace("draft: Inferact/", "draft: Nobody/"), "unknown draft"),
    ],
    ids=[
        "no-block",
        "missing-field",
        "unknown-gpu",
        "unknown-checkpoint",
        "no-draft-field",
        "unknown-draft",
    ],
)
def test_a_malformed_budget_is_refused(edit, message):
    text = edit((CONFIG_DIR / "h100-8x.yaml").read_text())
    with pytest.raises(BudgetError, match=re.escape(message)):
        read_stated_budget(text, "h100-8x.yaml")


def _launches() -> list[tuple[Path, str, str]]:
    found = []
    for doc in LAUNCH_DOCS:
        text = doc.read_text().replace("\\\n", " ")
        for pattern in (MODEL_THEN_CONFIG, CONFIG_THEN_MODEL):
            found += [(doc, _config_file(m), m["model"]) for m in pattern.finditer(text)]
    return found


def test_every_launch_of_a_budgeted_config_names_its_checkpoint():
    sm90 = {path.name: path for path in BUDGETED_CONFIGS}
    launches = [(doc, name, model) for doc, name, model in _launches() if name in sm90]
    wrong = [
        f"{doc.relative_to(REPO)}: {model} --config {name}"
        for doc, name, model in launches
        if not _names(model, read_stated_budget(sm90[name].read_text()).checkpoint.name)
    ]
    assert not wrong, wrong
    # Each is launched where users look, not only in its own header.
    documented = {name for doc, name, _ in launches if doc.suffix == ".md"}
    assert documented == set(sm90)


def _names(model: str, checkpoint: str) -> bool:
    """``model`` is the checkpoint's hub name, or a local copy of it under its own name."""
    if model.startswith("/"):
        return Path(model).name == checkpoint.split("/")[1]
    return model == checkpoint


def test_no_known_checkpoint_fits_four_rtx_pro_6000():
    """At TP 4 + EP 4 neither published checkpoint whose layout is known fits a 96 GB card,
    with or without the file's EAGLE3 draft; the file says so with these figures and launches
    no known checkpoint."""
    import yaml

    text = RTX_4X.read_text()
    keys = yaml.safe_load(text)
    parallelism = Parallelism(
        keys["tensor-parallel-size"], enable_expert_parallel=keys["enable-expert-parallel"]
    )
    card = CARDS["RTX-PRO-6000-96GB"]
    assert keys["speculative-config"]["model"] == EAGLE3.name
    draft = draft_bytes_per_gpu(EAGLE3, keys["tensor-parallel-size"])
    for checkpoint in CHECKPOINTS.values():
        for with_draft in (False, True):
            weights = sum(weight_bytes_per_gpu(checkpoint, parallelism, 0).values())
            weights += draft if with_draft else 0.0
            assert weights / GIB > card.total_gib
            stated = f"{weights / GIB:.2f} GiB"
            if checkpoint == BF16 and not with_draft:
                continue  # the file states BF16 with the draft only
            assert stated in text.replace("\n# ", " "), (checkpoint.name, with_draft, stated)
    assert f"({card.total_gib} GiB) a card" in text
    assert "No checkpoint whose layout this project has read fits this box" in text
    assert not [model for _, name, model in _launches() if name == RTX_4X.name]
    assert "vllm serve NVFP4_CHECKPOINT --config configs/serve/rtx-pro-6000-4x.yaml" in text
