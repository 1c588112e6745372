"""Every stage runner writes its resolved recipe to ``<run_dir>/config.yaml`` and returns its summary, as ``train``
does, so the CLI only parses and calls: prepare, train, eval and report, on tiny models. (Export has no recipe: an
export folder records what it was made from in ``draftsmith_export.json``, tests/test_export.py.)"""

from __future__ import annotations

import json
import os

import pytest

from draftsmith.config import load_recipe
from draftsmith.schema import dump_yaml

pytestmark = pytest.mark.usefixtures("one_thread")


def written_recipe(run_dir: str) -> str:
    with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
        return f.read()


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def as_written(summary: dict) -> dict:
    """The summary as its JSON file holds it (integer keys become strings)."""
    return json.loads(json.dumps(summary))


def test_prepare_writes_its_recipe_and_returns_the_summary(tmp_path, tiny_target_dir):
    from draftsmith.data import run_prepare_recipe

    source = tmp_path / "chats.jsonl"
    chats = [[("human", f"Count to {n}."), ("gpt", " ".join(str(i) for i in range(1, n + 1)))] for n in (3, 5, 7)]
    source.write_text("".join(json.dumps({"conversations": [{"from": f, "value": v} for f, v in c]}) + "\n"
                              for c in chats))
    run_dir = tmp_path / "run"
    recipe = load_recipe("smollm2-135m-prepare", [
        f"target.name={tiny_target_dir}", f"run_dir={run_dir}", f"data.sources=[{{path: {source}}}]",
        "data.stages=[tokenize, vocab]", "data.vocab.size=16", "data.render.num_proc=1"])
    summary = run_prepare_recipe(recipe)
    assert written_recipe(str(run_dir)) == dump_yaml(recipe)
    assert as_written(summary) == read_json(os.path.join(run_dir, "data", "summary.json"))
    rows = {r["stage"]: r for r in summary["stages"]}
    assert list(rows) == ["read", "tokenize", "vocab"] and rows["read"]["kept"] == 3 and rows["tokenize"]["kept"] == 3


def test_train_writes_its_recipe_and_returns_the_summary(tmp_path, tiny_target_dir, tiny_train_data):
    from draftsmith.train.run import run_training

    recipe = load_recipe(None, [
        f"target.name={tiny_target_dir}", "target.dtype=float32", "drafter.type=eagle1", f"train.dataset={tiny_train_data}",
        "train.batch_size=4", "train.max_length=48", "train.eval.heldout=8", "train.steps=2", "train.deepspeed=zero0",
        "train.logging.wandb=disabled", "train.logging.progress=false", f"run_dir={tmp_path}"])
    summary = run_training(recipe)
    assert written_recipe(str(tmp_path)) == dump_yaml(recipe)
    assert summary.pop("rank") == 0  # the file is process 0's
    assert summary["steps"] == 2 and as_written(summary) == read_json(os.path.join(tmp_path, "train_summary.json"))


def test_eval_writes_its_recipe_and_returns_the_metrics(tmp_path, tiny_target_dir, capsys):
    from draftsmith.eval.run import run_eval_recipe

    recipe = load_recipe("smollm2-135m-layerskip", [
        f"target.name={tiny_target_dir}", "target.dtype=float32", f"run_dir={tmp_path}", "eval.prompts=copyheavy",
        "eval.num_prompts=1", "eval.baselines=[]", "eval.repeats=1", "decode.max_new_tokens=4", "drafter.num_layers=1"])
    metrics = run_eval_recipe(recipe)
    assert written_recipe(str(tmp_path)) == dump_yaml(recipe)
    assert as_written(metrics) == read_json(os.path.join(tmp_path, "eval_metrics.json"))
    assert metrics["sequences"] == 1 and metrics["new_tokens"] == 4 and "speedup_vs_target" in metrics
    assert "wrote" in capsys.readouterr().out


def test_report_writes_its_recipe_and_returns_the_report(tmp_path, tiny_target_dir):
    from draftsmith.report.run import run_report

    recipe = load_recipe("smollm2-135m-eagle3", [
        f"target.name={tiny_target_dir}", "target.dtype=float32", "drafter.type=prompt_lookup", f"run_dir={tmp_path}",
        "eval.prompts=copyheavy", "eval.num_prompts=1", "eval.baselines=[]", "eval.repeats=1", "decode.k=2",
        "decode.max_new_tokens=4", "decode.min_confidence=0", "decode.tree=none", "report.seeds=[]", "report.turns=1",
        "report.per_category=0"])
    report = run_report(recipe)
    assert written_recipe(str(tmp_path)) == dump_yaml(recipe)
    assert as_written(report) == read_json(os.path.join(tmp_path, "report", "report.json"))
