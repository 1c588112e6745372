"""How acceptance grows with data: one recipe trained on nested subsets of one prepared dataset, and the table.

    python benchmarks/data_curve.py train CONFIG OUT --records 196,825,2500,0 [--epochs 4 --min-steps 150] [override ...]
    python benchmarks/levers.py decode OUT/r196 OUT/r825 ...            # τ decoded in the built-in decoder
    python benchmarks/data_curve.py table OUT/r196 OUT/r825 ...         # a markdown row per point

``train`` runs ``draftsmith train -c CONFIG run_dir=OUT/r<N> train.max_records=N`` for each N of ``--records``
(0 = every record) whose ``train_summary.json`` is missing, largest first (on a time-limited machine the point
that matters most is made first; a killed run resumes from its checkpoint). ``train.max_records`` keeps the
held-out split of the whole dataset and trains on the first N records of the rest, so every point is scored on
the same held-out records and each subset holds the smaller ones. Steps grow with the data: ``--epochs`` passes
over the subset at the recipe's batch size (``train.batch_size`` among the overrides), at least ``--min-steps``;
checkpoints and held-out evaluations every tenth of the run, ``drafter-best`` by held-out sim τ. Give the
overrides that name the data (``train.dataset``, ``drafter.draft_vocab``) and the budget's batch and learning rate.

``table`` adds to :mod:`levers`' row the records and answer tokens (loss-mask tokens) each point trained on.
Figures: benchmarks/RESULTS.md, "data curve" (the H200 run; the CPU run: benchmarks/history/2026.md, "data curve");
"GPU check" says why the first run at scale was void.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from draftsmith.tables import markdown_row, markdown_table

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import script_parser  # noqa: E402 — the benchmarks folder is not a package
from levers import COLUMNS, cells  # noqa: E402


def _value(overrides: list[str], key: str, default: str) -> str:
    found = [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")]
    return found[-1] if found else default


def subset_sizes(dataset: str, heldout: int, seed: int, records: list[int]) -> dict[int, tuple[int, int]]:
    """Each N → (records, answer tokens) it trains on: the split ``train.max_records`` makes."""
    from datasets import load_from_disk

    from draftsmith.train.data import split_heldout

    mask = load_from_disk(dataset)["loss_mask"]
    out = {}
    for n in records:
        ids = split_heldout(len(mask), heldout, seed, n).train
        out[n] = (len(ids), sum(int(sum(mask[i])) for i in ids))
    return out


def train(config: str, out: str, records: list[int], epochs: float, min_steps: int, overrides: list[str]) -> None:
    from draftsmith.files import write_json

    dataset = _value(overrides, "train.dataset", "")
    heldout = int(_value(overrides, "train.eval.heldout", "32"))
    batch = int(_value(overrides, "train.batch_size", "4"))
    sizes = subset_sizes(dataset, heldout, int(_value(overrides, "train.seed", "0")), records)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    os.makedirs(out, exist_ok=True)
    for n in sorted(records, key=lambda n: -sizes[n][0]):
        run_dir = os.path.join(out, f"r{n}" if n else "rall")
        if os.path.isfile(os.path.join(run_dir, "train_summary.json")):
            continue
        steps = max(min_steps, math.ceil(epochs * sizes[n][0] / batch))
        every = max(10, steps // 10)
        cmd = [sys.executable, "-m", "draftsmith.cli", "train", "-c", config, f"run_dir={run_dir}",
               "train.logging.wandb=disabled", "train.logging.progress=false", *overrides,
               f"train.max_records={n}", f"train.steps={steps}", f"train.checkpoint.every={every}",
               f"train.eval.every={every}", f"train.schedule.warmup_steps={max(5, steps // 50)}"]
        print(" ".join(cmd), flush=True)
        os.makedirs(run_dir, exist_ok=True)
        write_json(os.path.join(run_dir, "data_curve.json"), {
            "max_records": n, "records": sizes[n][0], "answer_tokens": sizes[n][1], "steps": steps, "epochs": epochs,
            "batch_size": batch})
        with open(f"{run_dir}.log", "a") as log:
            subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def table(run_dirs: list[str]) -> None:
    print("\n".join(markdown_table(["point", "records", "answer tokens", "steps", *COLUMNS[1:]], [])))
    for run_dir in run_dirs:
        point = json.load(open(os.path.join(run_dir, "data_curve.json")))
        name, *figures = cells(run_dir)  # the point's sizes go after the name
        print(markdown_row([name, f"{point['records']:,}", f"{point['answer_tokens']:,}", point["steps"], *figures]))


def main(argv: list[str] | None = None) -> None:
    parser = script_parser(__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train one head per subset size")
    t.add_argument("config")
    t.add_argument("out")
    t.add_argument("--records", required=True, help="comma-separated subset sizes in records (0 = all)")
    t.add_argument("--epochs", type=float, default=4.0)
    t.add_argument("--min-steps", type=int, default=150)
    t.add_argument("overrides", nargs="*")
    s = sub.add_parser("table", help="a markdown row per point")
    s.add_argument("run_dirs", nargs="+")
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "train":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "train":
        train(args.config, args.out, [int(n) for n in args.records.split(",")], args.epochs, args.min_steps,
              args.overrides + extra)
    else:
        table(args.run_dirs)


if __name__ == "__main__":
    main()
