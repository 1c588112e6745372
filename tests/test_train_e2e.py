"""The real thing, small: an EAGLE-3 head trained on SmolLM2-135M over ShareGPT data from
``draftsmith prepare``, through the shipped recipe (the lighter version of
``benchmarks/train.py short-run``, which also measures decoder τ)."""

from __future__ import annotations

import json
import os

import pytest

from draftsmith.config import load_recipe
from draftsmith.train.run import run_training

pytestmark = pytest.mark.e2e


def test_eagle3_on_smollm2_raises_heldout_acceptance(tmp_path, smollm2_folder):
    from draftsmith.data.prepare import PreparedPaths, run_prepare

    prep = load_recipe("smollm2-135m-prepare", ["data.stages=[tokenize,vocab]", "data.max_conversations=60",
                                                "data.render.max_length=96", "data.render.num_proc=1",
                                                "data.vocab.size=2048", f"run_dir={tmp_path / 'prep'}"])
    run_prepare(prep, progress=False)
    data = PreparedPaths.at(prep.data.resolve_out_dir(prep.run_dir))
    recipe = load_recipe("smollm2-135m-eagle3", [  # a random head (the recipe starts it from the target's last layer)
        "drafter.init_from_layer=null",
        f"drafter.draft_vocab={data.vocab}", f"train.dataset={data.tokenized}", "train.steps=6",
        "train.batch_size=4", "train.max_length=96", "train.ttt_steps=2", "train.optimizer.lr=0.003",
        "train.schedule.warmup_steps=0", "train.eval.every=6", "train.eval.heldout=8",
        "train.eval.decoder_at_end=false", "train.checkpoint.every=0", "train.logging.wandb=disabled",
        "train.logging.progress=false", f"run_dir={tmp_path / 'run'}",
    ])
    summary = run_training(recipe)
    with open(os.path.join(tmp_path, "run", "logs", "train.rank0.jsonl")) as f:
        heldout = [r for r in map(json.loads, f) if "heldout/acceptance" in r]
    before, after = heldout[0], heldout[-1]
    assert before["step"] == 0 and after["step"] == 6
    # the untrained head's q is nearly uniform over 2048 ids: Σ min(p, q) ≈ 0.005
    assert after["heldout/acceptance"] > 2 * before["heldout/acceptance"]
    assert after["heldout/loss"] < before["heldout/loss"]
    assert summary["drafter"] and os.path.isfile(os.path.join(summary["drafter"], "model.safetensors"))
