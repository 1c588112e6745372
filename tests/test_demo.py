"""The main job: every stage's overrides form valid recipes, and a tiny demo runs the real pipeline."""

from __future__ import annotations

import json
import os

import pytest

from draftsmith.config import load_recipe
from draftsmith.demo import DemoSize, demo_stages, run_demo

RECIPES = {"prepare": "smollm2-135m-prepare", "train": "smollm2-135m-eagle3", "eval_trained": "smollm2-135m-eagle3",
           "eval_untrained": "smollm2-135m-eagle3", "eval_layerskip": "smollm2-135m-layerskip"}


def test_every_stage_is_a_valid_recipe_writing_under_the_demo_folder(tmp_path):
    stages = demo_stages(str(tmp_path), DemoSize())
    assert set(stages) == set(RECIPES)
    run_dirs = set()
    for name, overrides in stages.items():
        recipe = load_recipe(RECIPES[name], overrides)
        assert recipe.run_dir.startswith(str(tmp_path))
        run_dirs.add(recipe.run_dir)
    assert len(run_dirs) == len(stages)  # no stage overwrites another's outputs
    trained = load_recipe(RECIPES["eval_trained"], stages["eval_trained"])
    assert trained.drafter.type == "saved" and trained.eval.check_identity


@pytest.mark.e2e
def test_tiny_demo_prepares_trains_and_evaluates_losslessly(tmp_path):
    run_dir = str(tmp_path / "demo")
    summary = run_demo(run_dir, DemoSize(conversations=6, steps=2, prompts=1, max_new_tokens=8))

    assert summary["train"]["steps"] == 2
    assert os.path.isfile(os.path.join(run_dir, "eagle3", "drafter", "model.safetensors"))
    assert [r["drafter"].split(",")[0] for r in summary["drafters"]] == [
        "EAGLE-3 head", "EAGLE-3 head", "layer-skip self-drafter (no training)"]
    for row in summary["drafters"]:
        # identity is enforced by eval.check_identity (a mismatch raises); τ counts the bonus token
        assert row["identical_to_target"] == "1/1"
        assert row["tau_with_bonus"] >= 1.0
        assert 1 <= row["new_tokens"] <= 8  # EOS may come first
    with open(os.path.join(run_dir, "demo_summary.json"), encoding="utf-8") as f:
        assert json.load(f)["drafters"] == summary["drafters"]
    with open(os.path.join(run_dir, "eval-eagle3", "eval_outputs.jsonl"), encoding="utf-8") as f:
        assert all(json.loads(line)["identical_to_target"] for line in f)
