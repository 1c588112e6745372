"""End to end on the real SmolLM2 target (fp32): the model-free drafters and the hybrid reproduce the
target's greedy output token for token on MT-bench and the copy-heavy set, and ``draftsmith eval``
reports the model-free baselines."""

from __future__ import annotations

import json
import os

import pytest

from draftsmith.config import load_recipe
from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.stats import DecodeStats
from draftsmith.decode.tree import DynamicTree, tree_decode
from draftsmith.measure.prompts import load_questions
from draftsmith.decode.reference import target_greedy

pytestmark = pytest.mark.e2e

MAX_NEW = 48
K = 5


@pytest.fixture(scope="module", params=["mtbench", "copyheavy"])
def prompt_set(request, smollm2):
    prompts = [smollm2.render_chat([{"role": "user", "content": q.turns[0]}]) for q in load_questions(request.param, 2)]
    return request.param, prompts, [target_greedy(smollm2, p, MAX_NEW) for p in prompts]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Earlier texts for the suffix drafter's corpus: two other copy-heavy prompts, as JSONL 'text' lines."""
    path = tmp_path_factory.mktemp("corpus") / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": q.turns[0]}) + "\n" for q in load_questions("copyheavy", 4)[2:]))
    return str(path)


@pytest.mark.parametrize("overrides", [
    ["drafter.type=prompt_lookup"],
    ["drafter.type=suffix", "drafter.corpus={corpus}"],
    ["drafter.type=hybrid", "drafter.drafter.type=eagle3", "drafter.lookup.type=suffix"],
], ids=["prompt_lookup", "suffix", "hybrid"])
def test_greedy_identical_to_target(smollm2, prompt_set, corpus, overrides):
    name, prompts, refs = prompt_set
    drafter = load_recipe(None, [o.format(corpus=corpus) for o in overrides]).drafter.build(smollm2)
    total = DecodeStats(k=K)
    for p, ref in zip(prompts, refs):
        res = speculative_decode(smollm2, drafter, p, k=K, max_new_tokens=MAX_NEW)
        assert res.tokens == ref
        total = total.merge(res.stats)
    assert total.accepted > 0 and total.accepted < total.drafted  # drafts were accepted and rejected
    if name == "copyheavy":
        assert sum(total.accept_hist[2:]) > 0  # multi-token copies were accepted


def test_the_hybrid_grafting_its_parts_into_one_tree_is_identical_to_target(smollm2, prompt_set, corpus):
    """The default hybrid in tree decoding (combine: both, the head at depth 1, the suffix chain grafted on)."""
    name, prompts, refs = prompt_set
    recipe = load_recipe(None, ["drafter.type=hybrid", "drafter.drafter.type=eagle3", "drafter.lookup.type=suffix",
                                f"drafter.lookup.corpus={corpus}"])
    assert (recipe.drafter.combine, recipe.drafter.model_depth) == ("both", 1)
    drafter = recipe.drafter.build(smollm2)
    for p, ref in zip(prompts, refs):
        res = tree_decode(smollm2, drafter, p, tree=DynamicTree(depth=3, top_k=3, budget=3), max_new_tokens=MAX_NEW,
                          min_confidence=0.1)
        assert res.tokens == ref
    if name == "copyheavy":
        assert drafter.counts.rounds["lookup"] > 0  # chains were grafted onto the head's trees


def test_eval_reports_model_free_baselines(smollm2, tmp_path):
    from draftsmith.eval.run import run_eval_recipe

    recipe = load_recipe("smollm2-135m-layerskip", [
        f"run_dir={tmp_path}", "eval.prompts=copyheavy", "eval.num_prompts=1", "eval.check_identity=true",
        "decode.max_new_tokens=16", "drafter.num_layers=4", "eval.baselines=[prompt_lookup, suffix]"])
    returned = run_eval_recipe(recipe)
    with open(os.path.join(tmp_path, "eval_metrics.json"), encoding="utf-8") as f:
        metrics = json.load(f)
    assert json.loads(json.dumps(returned)) == metrics  # the runner returns what it wrote (JSON keys are strings)
    assert set(metrics["baselines"]) == {"prompt_lookup", "suffix"}
    for row in metrics["baselines"].values():
        assert row["new_tokens"] == metrics["new_tokens"]
        # τ counts what was emitted: every token after each prompt's prefill token, spread over the rounds
        assert row["tau_with_bonus"] * row["verify_rounds"] == pytest.approx(row["new_tokens"] - row["sequences"], abs=1e-3)
        assert row["drafter"]["type"] in ("prompt_lookup", "suffix")
