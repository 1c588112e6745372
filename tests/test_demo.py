"""The main job: every stage's overrides form valid recipes, and a tiny demo runs the real pipeline."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import replace

import pytest

from draftsmith.config import load_recipe
from draftsmith.demo import DRAFTERS, SIZES, STAGE_RECIPES, DemoSize, demo_stages, run_demo


@pytest.mark.parametrize("size", sorted(SIZES))
def test_every_stage_is_a_valid_recipe_writing_under_the_demo_folder(tmp_path, size):
    stages = demo_stages(str(tmp_path), SIZES[size])
    assert set(stages) == set(STAGE_RECIPES)
    run_dirs = set()
    for name, overrides in stages.items():
        recipe = load_recipe(STAGE_RECIPES[name], overrides)
        assert recipe.run_dir.startswith(str(tmp_path))
        run_dirs.add(recipe.run_dir)
    assert len(run_dirs) == len(stages)  # no stage overwrites another's outputs
    ev = load_recipe(STAGE_RECIPES["eval"], stages["eval"])
    # speed in bf16 against the target alone, identity audited (in fp32, by run_eval_recipe)
    assert ev.drafter.type == "saved" and ev.eval.check_identity and ev.eval.time_target
    assert ev.drafter.path == os.path.join(str(tmp_path), "eagle3", "drafter-best")  # the best head, as the README says
    assert ev.target.dtype == "bfloat16" and ev.decode.k == SIZES[size].k
    assert ev.decode.min_confidence == SIZES[size].min_confidence > 0  # the gate: lossless, and it pays on a CPU
    if SIZES[size].tree is not None:  # a gated dynamic tree of the size's shape
        shape = ev.decode.tree_shape()
        assert ev.decode.tree == "dynamic" and (shape.depth, shape.top_k, shape.budget) == SIZES[size].tree


@pytest.mark.parametrize("size", sorted(SIZES))
def test_the_dflash_demo_trains_the_dflash_recipe_offline_and_decodes_whole_blocks(tmp_path, size):
    from draftsmith.demo import DFLASH, stage_recipes

    dsize = replace(SIZES[size], drafter="dflash")
    stages, recipes = demo_stages(str(tmp_path), dsize), stage_recipes(dsize)
    assert recipes == {"prepare": "smollm2-135m-prepare", "train": "smollm2-135m-dflash", "eval": "smollm2-135m-dflash"}
    tr = load_recipe(recipes["train"], stages["train"])
    assert tr.drafter.type == "dflash" and tr.drafter.feature_layers == DFLASH["feature_layers"] == [1, 14, 26]
    assert tr.train.features.endswith("features") and tr.run_dir == f"{tmp_path}/dflash"  # offline, beside eagle3/
    assert tr.train.dflash.weighting == "dpace"  # measured better than the reference's decay (RESULTS "dflash")
    ev = load_recipe(recipes["eval"], stages["eval"])
    assert ev.drafter.path == f"{tmp_path}/dflash/drafter-best" and ev.decode.k == DFLASH["block_size"] - 1
    assert ev.decode.tree == "none"  # chains: DFlash drafts no tree
    assert stage_recipes(SIZES[size])["train"] == "smollm2-135m-eagle3"  # the default demo is unchanged
    assert tr.drafter.draft_vocab == ""  # the full vocabulary unless the lead switches the draft vocabulary on


def test_the_dflash_demo_can_read_prepares_draft_vocabulary(tmp_path, monkeypatch):
    from draftsmith.demo import DFLASH

    monkeypatch.setitem(DFLASH, "draft_vocab", True)
    dsize = replace(SIZES["default"], drafter="dflash")
    tr = load_recipe("smollm2-135m-dflash", demo_stages(str(tmp_path), dsize)["train"])
    assert tr.drafter.draft_vocab == f"{tmp_path}/prepare/data/draft_vocab.safetensors"


@pytest.mark.parametrize("name", [name for name in DRAFTERS if name != "eagle3"])
def test_every_demo_drafter_is_a_cli_choice_training_its_recipe_on_the_demos_data(tmp_path, monkeypatch, capsys, name):
    """``demo --drafter`` takes every family of ``demo.DRAFTERS`` (the one list: the CLI's choices and help are built
    from it): its own recipe, trained offline from the demo's feature cache (the EAGLE-3 layers), evaluated in chains of
    the drafts one forward makes, and in llama.cpp exactly where llama.cpp serves the family. Nothing runs: run_demo
    is replaced by a recorder."""
    from draftsmith import demo
    from draftsmith.cli import main
    from draftsmith.engines.llamacpp import SPEC_TYPES

    runs = []
    monkeypatch.setattr(demo, "run_demo", lambda run_dir, size, check: runs.append((run_dir, size)) or {"passed": True})
    assert main(["demo", "--drafter", name, "--run-dir", str(tmp_path)]) == 0
    [(run_dir, size)] = runs
    stages, recipes = demo_stages(run_dir, size), demo.stage_recipes(size)
    assert recipes["train"] == recipes["eval"] == f"smollm2-135m-{name}"
    tr, ev = (load_recipe(recipes[stage], stages[stage]) for stage in ("train", "eval"))
    assert tr.drafter.type == name and tr.run_dir == f"{tmp_path}/{name}"
    assert tr.train.features == f"{tmp_path}/prepare/data/features" and tr.drafter.feature_layers == [1, 14, 26]
    assert ev.drafter.path == f"{tmp_path}/{name}/drafter-best"
    assert ev.decode.k == DRAFTERS[name].per_forward > 1 and ev.decode.tree == "none"
    assert (ev.eval.engine == "llamacpp") == (name in SPEC_TYPES) and (ev.eval.engine_k == [ev.decode.k]) == (
        name in SPEC_TYPES)
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    folded = "".join(capsys.readouterr().out.split())  # argparse wraps anywhere, at hyphens too (P-EAGLE)
    assert all("".join(f"{other}, {d.what}".split()) in folded for other, d in DRAFTERS.items())


def test_the_full_size_is_larger_than_the_default():
    d, f = SIZES["default"], SIZES["full"]
    assert f.conversations > d.conversations and f.steps > d.steps and f.prompts >= d.prompts
    assert (d.min_speedup, d.min_tau) == (1.0, 0.0) and (f.min_speedup, f.min_tau) == (1.5, 2.0)  # issue 9's bars


def test_sizes_fit_the_pipeline_dtype_and_explicit_figures_win(monkeypatch):
    """Sized for native bf16; an fp32 pipeline (AVX2-only CPU) runs FP32_SHARE of the data and steps."""
    from draftsmith import demo

    monkeypatch.setattr(demo, "pipeline_dtype", lambda size: "bfloat16")
    assert demo.sized("default") == SIZES["default"]
    monkeypatch.setattr(demo, "pipeline_dtype", lambda size: "float32")
    small = demo.sized("default")
    assert (small.conversations, small.steps) == (160, 100)  # the fp32 default measured at 17-18 min
    assert demo.sized("default", steps=7, conversations=None).steps == 7
    stages = demo_stages("/tmp/x", replace(SIZES["default"], dtype="float32"))
    assert "target.dtype=float32" in stages["prepare"] and "target.dtype=float32" in stages["train"]


@pytest.mark.parametrize("size", sorted(SIZES))
def test_the_demo_regenerates_through_a_llama_server_on_request(tmp_path, size):
    """``--regenerate server``: prepare's answers come from a llama-server started on the target's F32 GGUF, with
    the slots and threads of ``demo.REGENERATE_SERVER`` (as many requests in flight as slots); the default stays
    in-process generation, with the recipe's settings untouched."""
    from draftsmith.demo import REGENERATE_SERVER
    from draftsmith.errors import ConfigError

    default = load_recipe(STAGE_RECIPES["prepare"], demo_stages(str(tmp_path), SIZES[size])["prepare"])
    assert SIZES[size].regenerate_method == "generate" and default.data.regenerate.method == "generate"
    assert not any("data.regenerate.server" in o for o in demo_stages(str(tmp_path), SIZES[size])["prepare"])
    served = load_recipe(STAGE_RECIPES["prepare"],
                         demo_stages(str(tmp_path), replace(SIZES[size], regenerate_method="server"))["prepare"])
    r, srv = served.data.regenerate, served.data.regenerate.server
    assert r.method == "server" and "regenerate" in served.data.stages
    assert (srv.launch, srv.url, srv.gguf_type) == ("llamacpp", "", REGENERATE_SERVER["gguf_type"]) == (
        "llamacpp", "", "bf16")
    assert (srv.slots, srv.threads, srv.concurrency) == (REGENERATE_SERVER["slots"], REGENERATE_SERVER["threads"],
                                                         REGENERATE_SERVER["slots"]) == (32, 2, 32)
    assert srv.flash_attn  # measured faster with 32 slots (RESULTS "prepare")
    assert (r.max_new_tokens, r.max_turns, r.temperature) == (
        default.data.regenerate.max_new_tokens, default.data.regenerate.max_turns, 0.0)  # the same job otherwise
    with pytest.raises(ConfigError, match="demo regenerate method 'vllm' is not one of: generate, server"):
        demo_stages(str(tmp_path), replace(SIZES[size], regenerate_method="vllm"))


def test_the_cli_flag_picks_the_regeneration_method_and_its_own_run_folder(monkeypatch):
    from draftsmith import demo
    from draftsmith.cli import main

    runs = []
    monkeypatch.setattr(demo, "run_demo", lambda run_dir, size, check: runs.append((run_dir, size)) or {"passed": True})
    assert main(["demo"]) == 0 and main(["demo", "--regenerate", "server"]) == 0
    assert main(["demo", "--size", "full", "--regenerate", "generate"]) == 0
    assert [(d, s.regenerate_method) for d, s in runs] == [("runs/demo", "generate"), ("runs/demo-server", "server"),
                                                           ("runs/demo-full", "generate")]


@pytest.mark.e2e
def test_tiny_demo_prepares_trains_and_evaluates_losslessly(tmp_path):
    run_dir = str(tmp_path / "demo")
    summary = run_demo(run_dir, DemoSize(conversations=6, regenerate=False, answer_tokens=12, steps=2, batch_size=4,
                                         ttt_steps=3, prompts=2, max_new_tokens=8, k=2, min_confidence=0.0, tree=None))

    assert summary["train"]["steps"] == 2
    assert os.path.isfile(os.path.join(run_dir, "eagle3", "drafter", "model.safetensors"))
    alone, head, *baselines = summary["drafters"]
    assert alone["drafter"].startswith("target alone") and alone["speedup_vs_target"] == 1.0
    assert [b["drafter"] for b in baselines] == ["prompt_lookup (model-free baseline)"]  # the free floor
    assert head["drafter"].startswith("EAGLE-3 head, trained 2 steps, drafter-best (step ") and head["k"] == 2
    assert summary["train"]["best"]["step"] in (0, 1, 2)
    assert head["identical_to_target"] == "2/2"  # fp32 audit; a mismatch raises
    assert summary["speed_dtype"] == "bfloat16" and summary["identity_dtype"] == "float32"
    assert summary["pipeline_dtype"] in ("bfloat16", "float32")  # prepare and train: bf16 where native
    with open(os.path.join(run_dir, "demo_summary.json"), encoding="utf-8") as f:
        assert json.load(f)["drafters"] == summary["drafters"]

    # speedup_vs_target is the median of per-prompt ratios of measured speeds, not a made-up figure
    with open(os.path.join(run_dir, "eval-eagle3", "eval_outputs.jsonl"), encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    assert all(r["identical_to_target_fp32"] for r in recs)
    ratios = []
    for r in recs:
        spec = r["stats"]["new_tokens"] / r["stats"]["wall_s"]
        alone_tps = r["target"]["new_tokens"] / r["target"]["wall_s"]
        assert r["target"]["wall_s"] > 0 and r["stats"]["wall_s"] > 0
        assert r["speedup_vs_target"] == pytest.approx(spec / alone_tps, rel=2e-3)
        ratios.append(r["speedup_vs_target"])
    assert head["speedup_vs_target"] == pytest.approx(statistics.median(ratios), rel=1e-3)
    lo, hi = head["speedup_interval_90"]  # the median's bootstrap interval over prompts
    assert min(ratios) - 1e-3 <= lo <= head["speedup_vs_target"] <= hi <= max(ratios) + 1e-3
    assert summary["passed"] == (head["speedup_vs_target"] > 1.0)


def realistic_rows(size: DemoSize, k: int = 1) -> list[dict]:
    """The rows run_demo builds, with the figures of an earlier default-size run (benchmarks/history/2026.md, "demo",
    "The pipeline in native bf16")."""
    acc = [0.37, 0.21, 0.12, 0.06, 0.02][:k]
    return [
        {"name": "target alone", "drafter": "target alone (its own greedy generate)", "k": None, "tau_with_bonus": None,
         "acceptance_at_position": [], "tokens_per_s": 20.5, "speedup_vs_target": 1.0, "predicted_speedup": None,
         "identical_to_target": None},
        {"name": "eagle3 head", "drafter": f"EAGLE-3 head, trained {size.steps} steps, dynamic tree (depth 1, top-3, "
         "3 nodes)", "k": k, "tau_with_bonus": 1.279, "acceptance_at_position": acc, "tokens_per_s": 22.7,
         "speedup_vs_target": 1.109, "speedup_interval_90": [1.073, 1.122], "predicted_speedup": 1.06,
         "identical_to_target": "20/20"},
        {"name": "prompt_lookup", "drafter": "prompt_lookup (model-free baseline)", "k": k, "tau_with_bonus": 1.07,
         "acceptance_at_position": acc, "tokens_per_s": 21.2, "speedup_vs_target": 1.083, "predicted_speedup": None,
         "identical_to_target": None},
        {"name": "suffix_with_a_corpus_of_the_targets_own_answers", "drafter": "suffix (model-free baseline)", "k": k,
         "tau_with_bonus": 1.2, "acceptance_at_position": acc, "tokens_per_s": 1234.5, "speedup_vs_target": 1.2,
         "predicted_speedup": None, "identical_to_target": None},
    ]


@pytest.mark.parametrize("k", [1, 5])
def test_the_closing_table_fits_80_columns_with_a_legend(k):
    """Issue 29: every cell wrapped into 5–15 lines when stdout was not a wide TTY (rich's table)."""
    from draftsmith.demo import format_table

    size = SIZES["full"]
    speed = {"dtype": "bfloat16", "device": "cpu", "threads": 2}
    ident = {"dtype": "float32", "identical": 20, "prompts": 20}
    lines = format_table(realistic_rows(size, k), {"prepare": 1209.4, "train": 1545.2, "eval": 1084.0},
                         "/a/rather/long/run/folder/of/the/user/runs/demo-full", speed, ident, False, size)
    too_long = [ln for ln in lines if len(ln) > 80]
    assert not too_long, too_long
    rows = {ln.split("  ")[0]: ln for ln in lines if "  " in ln}
    head = rows["eagle3 head"]  # one line per drafter: its figures on its own row
    assert head.split()[2:4] == [str(k), "1.279"] and "1.11×" in head and "1.06×" in head and head.endswith("20/20")
    assert "0.37" in head and ("…" in head) == (k > 3)
    cut = [name for name in rows if name.startswith("suffix_with")]  # a long name is cut, its row kept whole
    assert len(cut) == 1 and cut[0].endswith("…") and rows[cut[0]].split()[-1] == "1.20×"
    legend = " ".join(" ".join(lines).split())  # the legend's wrapped lines joined again
    assert "eagle3 head: EAGLE-3 head, trained 600 steps, dynamic tree (depth 1, top-3, 3 nodes)" in legend
    assert "1.073–1.122×" in legend and "stage times: prepare 1209s, train 1545s, eval 1084s" in legend
    assert "and τ ≥ 2 , bfloat16" not in legend and "and τ ≥ 2, bfloat16) with fp32-identical outputs: FAIL" in legend
