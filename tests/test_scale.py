"""The real-scale recipes (Llama-3.1-8B-Instruct, Qwen3-8B): their drafters built from the targets'
published config.json alone (tests/archs/, meta device, no weights), parameter counts equal to the
table of docs/drafters.md, feature layer ids in both conventions, and the paper estimates of
benchmarks/scale.py equal to what the recipes' headers and docs/scale.md say."""

from __future__ import annotations

import os
import re
import sys

import pytest

from draftsmith.config import CONFIG_DIR, load_recipe
from draftsmith.drafters.eagle3 import Eagle3Config
from draftsmith.drafters.params import TARGETS, count, meta_module, parameter_rows, target_parameters
from draftsmith.target import default_eagle3_layers

from .conftest import benchmark_script

ROOT = os.path.dirname(CONFIG_DIR)
ARCHS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "archs")
# recipe → (its target's config.json folder, the docs / params label of its drafter)
RECIPES = {
    "llama3.1-8b-eagle3": ("Llama-3.1-8B", "llama-3.1-8b-instruct", "eagle3: draft vocabulary 32,000"),
    "llama3.1-8b-draftlm": ("Llama-3.1-8B", "llama-3.1-8b-instruct", "draft_lm: first 4 layers, frozen embedding/lm_head"),
    "qwen3-8b-eagle3": ("Qwen3-8B", "qwen3-8b", "eagle3: draft vocabulary 32,000"),
    "qwen3-8b-draftlm": ("Qwen3-8B", "qwen3-8b", "draft_lm: first 4 layers, frozen embedding/lm_head"),
}


def arch(folder: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.path.join(ARCHS, folder))


def docs_rows() -> dict[tuple[str, str], tuple[str, str, str]]:
    """(target, drafter label) → (trainable, frozen, stored) cells of the parameter table in docs/drafters.md."""
    with open(os.path.join(ROOT, "docs", "drafters.md"), encoding="utf-8") as f:
        text = f.read()
    rows = {}
    for m in re.finditer(r"^\| ([^|]+?) \| ([^|]+?) \| ([\d,.]+M) \| ([\d,.]+M) \| ([\d,.]+M) \|$", text, re.M):
        target = m.group(1).split(" (")[0]
        rows[(target, m.group(2))] = (m.group(3), m.group(4), m.group(5))
    return rows


def millions(n: int) -> str:
    return f"{n / 1e6:,.1f}M"


def test_embedded_architectures_equal_the_shipped_config_files():
    from draftsmith.drafters.params import arch_config

    for name, folder in (("Llama-3.1-8B", "llama-3.1-8b-instruct"), ("Qwen3-8B", "qwen3-8b")):
        real, ours = arch(folder), arch_config(TARGETS[name])
        for key in TARGETS[name]:
            assert getattr(ours, key) == getattr(real, key), (name, key)
    assert target_parameters(arch("llama-3.1-8b-instruct")) == 8_030_261_248  # Meta's published 8.03B
    assert target_parameters(arch("qwen3-8b")) == 8_190_735_360  # Qwen's published 8.2B


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_drafter_from_the_architecture_alone_matches_the_docs(name):
    target, folder, label = RECIPES[name]
    recipe = load_recipe(name)
    config = arch(folder)
    counts = count(recipe.drafter, config)
    assert (millions(counts["trainable"]), millions(counts["frozen"]), millions(counts["stored"])) == \
        docs_rows()[(target, label)]
    # and draftsmith drafters --params prints the same (from the embedded architecture values)
    row = next(r for r in parameter_rows() if r["target"] == target and r["drafter"] == label.replace("32,000", "32000"))
    assert {k: row[k] for k in counts} == counts
    module = meta_module(recipe.drafter, config)
    assert all(p.device.type == "meta" for p in module.parameters())  # nothing was allocated


@pytest.mark.parametrize("name", ["llama3.1-8b-eagle3", "qwen3-8b-eagle3"])
def test_eagle3_recipes_feature_layers_and_vocab(name):
    target, folder, _ = RECIPES[name]
    config = arch(folder)
    recipe = load_recipe(name)
    n = config.num_hidden_layers
    resolved = recipe.drafter.resolve_for(n, config.vocab_size)
    assert tuple(resolved.feature_layers) == default_eagle3_layers(n)
    assert resolved.feature_layers == {"Llama-3.1-8B": [1, 15, 28], "Qwen3-8B": [1, 17, 32]}[target]
    # SGLang / vLLM count "inputs of layer i" = our id + 1: EAGLE-3's published 2, N/2, N-3
    assert [i + 1 for i in resolved.feature_layers] == [2, n // 2, n - 3]
    head = meta_module(recipe.drafter, config)
    assert head.fc.in_features == 3 * config.hidden_size
    assert head.midlayer.self_attn.head_dim == config.head_dim == 128
    assert head.rotary_emb.config.rope_parameters == config.rope_parameters  # llama3 scaling / theta 1e6
    assert head.lm_head.out_features == recipe.drafter.draft_vocab_size == 32000
    prepare = load_recipe(name.replace("-eagle3", "-prepare"))
    assert prepare.target.name == recipe.target.name
    assert prepare.data.vocab.size == recipe.drafter.draft_vocab_size
    assert recipe.drafter.draft_vocab == os.path.join(prepare.run_dir, "data", "draft_vocab.safetensors")
    assert recipe.train.dataset == os.path.join(prepare.run_dir, "data", "tokenized")


# the DFlash recipes: (target's config.json folder, docs / params label, the mask token -1 resolves to)
DFLASH_RECIPES = {
    "llama3.1-8b-dflash": ("Llama-3.1-8B", "llama-3.1-8b-instruct", "dflash: 5 layers, block 16", 128255),
    "qwen3-8b-dflash": ("Qwen3-8B", "qwen3-8b", "dflash: 5 layers, block 16 (z-lab/Qwen3-8B-DFlash-b16's shape)", 151935),
}


@pytest.mark.parametrize("name", sorted(DFLASH_RECIPES))
def test_dflash_recipes_follow_the_reference_rule_and_match_the_docs(name):
    from draftsmith.drafters.dflash import default_target_layers

    target, folder, label, mask = DFLASH_RECIPES[name]
    config = arch(folder)
    recipe = load_recipe(name)
    resolved = recipe.drafter.resolve_for(config.num_hidden_layers, config.vocab_size)
    # the layers written in the recipe are the reference's rule for 5 draft layers, so [] would give the same
    assert resolved.feature_layers == default_target_layers(config.num_hidden_layers, 5)
    assert resolved.feature_layers == {"Llama-3.1-8B": [1, 8, 15, 22, 29], "Qwen3-8B": [1, 9, 17, 25, 33]}[target]
    assert resolved.mask_token_id == mask == config.vocab_size - 1
    assert recipe.decode.k == resolved.block_size - 1 == 15
    counts = count(recipe.drafter, config)
    assert (millions(counts["trainable"]), millions(counts["frozen"]), millions(counts["stored"])) == \
        docs_rows()[(target, label)]
    prepare = load_recipe(name.replace("-dflash", "-prepare"))
    assert prepare.target.name == recipe.target.name
    assert recipe.train.dataset == os.path.join(prepare.run_dir, "data", "tokenized")
    with open(os.path.join(CONFIG_DIR, name + ".yaml"), encoding="utf-8") as f:
        header = f.read().split("\ntarget:")[0]
    for command in (f"deepspeed --num_gpus 8 $(which draftsmith) train -c {name}",
                    f"torchrun --nproc_per_node 8 $(which draftsmith) train -c {name}", "prepare -c", "--to dflash"):
        assert command in header, command


def test_a_target_layer_count_that_does_not_fit_is_refused():
    from draftsmith.errors import ConfigError

    with pytest.raises(ConfigError, match=r"drafter.feature_layers\[2\] = 28 is out of range: the target has 24 layers"):
        Eagle3Config(feature_layers=[1, 15, 28]).resolve_for(24, 128256)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_headers_hold_launch_commands(name):
    with open(os.path.join(CONFIG_DIR, name + ".yaml"), encoding="utf-8") as f:
        header = f.read().split("\ntarget:")[0]
    for command in (f"deepspeed --num_gpus 8 $(which draftsmith) train -c {name}",
                    f"torchrun --nproc_per_node 8 $(which draftsmith) train -c {name}",
                    f"deepspeed --hostfile hostfile $(which draftsmith) train -c {name}",
                    "--nnodes N --node_rank R", "--rdzv_endpoint NODE0:29500", "ZeRO-2", "prepare -c"):
        assert command in header, command


# ---------------------------------------------------------------- benchmarks/scale.py


@pytest.fixture(scope="module")
def scale():
    yield benchmark_script("scale")
    del sys.modules["draftsmith_bench_scale"]


def test_state_bytes_per_zero_stage(scale):
    t, f, n = 1000, 500, 8
    assert scale.zero_state_bytes(t, f, 0, n) == 2 * 1500 + 2 * 1000 + 12 * 1000
    assert scale.zero_state_bytes(t, f, 1, n) == 2 * 1500 + 2 * 1000 + 12 * 1000 / 8
    assert scale.zero_state_bytes(t, f, 2, n) == 2 * 1500 + (2 + 12) * 1000 / 8
    assert scale.zero_state_bytes(t, f, 3, n) == 16 * 1000 / 8 + 2 * 500 / 8


def test_scale_estimates_match_the_recipes_and_the_docs(scale):
    rows = [scale.estimate(name) for name in scale.RECIPES]
    assert sorted(scale.RECIPES) == sorted(RECIPES)
    by = {r.recipe: r for r in rows}
    eagle = by["llama3.1-8b-eagle3"]
    assert eagle.cache_bytes_per_token == 4 * 4096 * 2  # 3 fused layers + the last, bf16
    assert eagle.target_gib == pytest.approx(2 * 8_030_261_248 / 2**30)
    assert 0.3 < eagle.target_share_of_flops < 0.7  # the target forward is a large share: a cache would pay off
    for r in rows:
        with open(os.path.join(CONFIG_DIR, r.recipe + ".yaml"), encoding="utf-8") as f:
            assert scale.memory_line(r) in f.read()
        assert r.total_gib < 80  # every recipe fits an 80 GB GPU at its batch and length
    with open(os.path.join(ROOT, "docs", "scale.md"), encoding="utf-8") as f:
        assert scale.format_tables(rows) in f.read()  # docs/scale.md kept in sync: python benchmarks/scale.py
