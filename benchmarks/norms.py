"""Do the EAGLE-3.1 norms help? The same recipe trained with only the norm flags changed, and the table.

    python benchmarks/norms.py train runs/demo/eagle3/config.yaml OUT [override ...]   # OUT/<variant>, missing ones
    python benchmarks/norms.py table RUN_DIR [RUN_DIR ...]                               # a markdown row per run

``train`` runs ``draftsmith train -c CONFIG run_dir=OUT/<variant>`` for each variant of :data:`VARIANTS` whose
``train_summary.json`` is missing (a killed run resumes from its checkpoint), one after another, each on
``OMP_NUM_THREADS`` threads (1 unless set: the figures below do not depend on it, and two runs side by side
use two cores better than one on both); wandb off. Same data, steps and seed as CONFIG: only the flags differ.

``table`` reads each run folder's ``train_summary.json`` and ``logs/train.rank0.jsonl``: the held-out sim τ at
the end and at its best, the held-out top-1 agreement and expected acceptance per unrolled step, the held-out
loss, and the training loss at steps 10 / 50 / 100 / last (the curve's shape). None of these depends on the
machine's load. Figures: benchmarks/RESULTS.md, "EAGLE-3.1 norms".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

VARIANTS = {
    "base": [],
    "fc_norm": ["drafter.fc_norm=true"],
    "norm_before_fc": ["drafter.norm_before_fc=true"],
    "fc_norm+norm_output": ["drafter.fc_norm=true", "drafter.norm_output=true"],
}
"""Variant name → the overrides it adds to the recipe. fc_norm and norm_before_fc exclude each other."""


def train(config: str, out: str, overrides: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    for name, flags in VARIANTS.items():
        run_dir = os.path.join(out, name)
        if os.path.isfile(os.path.join(run_dir, "train_summary.json")):
            continue
        os.makedirs(out, exist_ok=True)
        cmd = [sys.executable, "-m", "draftsmith.cli", "train", "-c", config, f"run_dir={run_dir}",
               "train.logging.wandb=disabled", "train.logging.progress=false", *flags, *overrides]
        print(" ".join(cmd), flush=True)
        with open(os.path.join(out, f"{name}.log"), "a") as log:
            subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def row(run_dir: str) -> str:
    summary = json.load(open(os.path.join(run_dir, "train_summary.json")))
    losses: dict[int, float] = {}
    with open(os.path.join(run_dir, "logs", "train.rank0.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec:
                losses[rec["step"]] = rec["loss"]  # a resumed run logs a step again: the later record wins
    held, best, last = summary["heldout"], summary["best"], summary["steps"]
    steps = sorted(k[len("heldout/top1_step"):] for k in held if k.startswith("heldout/top1_step"))
    top1 = " / ".join(f"{held[f'heldout/top1_step{s}']:.3f}" for s in steps)
    accept = " / ".join(f"{held[f'heldout/expected_accept_step{s}']:.3f}" for s in steps)
    curve = " / ".join(f"{losses[s]:.1f}" if s in losses else "–" for s in (10, 50, 100, last))
    return (f"| {os.path.basename(os.path.normpath(run_dir))} | **{held['sim_tau']:.4f}** | {best['sim_tau']:.4f} "
            f"(step {best['step']}) | {top1} | {accept} | {held['heldout/loss']:.2f} | {curve} |")


def table(run_dirs: list[str]) -> None:
    print("| run | held-out sim τ | best (step) | top-1 per step | expected acceptance per step | held-out loss "
          "| train loss at 10 / 50 / 100 / last |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for run_dir in run_dirs:
        print(row(run_dir))


def main() -> None:
    if len(sys.argv) >= 4 and sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif len(sys.argv) >= 3 and sys.argv[1] == "table":
        table(sys.argv[2:])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
