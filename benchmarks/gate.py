"""k and the confidence gate for one saved drafter: τ and speedup vs the target alone, in one process.

    python benchmarks/gate.py runs/demo/eagle3/drafter --prompts 5 --max-new-tokens 64 \\
        --settings 1:0,1:0.3,1:0.5,2:0.4 [--dtype bfloat16]

Each setting ``k:min_confidence`` is one ``measure.evaluate.evaluate`` over the same MT-bench first turns,
which times the target alone per prompt, interleaved (so every row has its own target figure). The
gate (``decode.min_confidence``) is lossless; this measures whether it pays. Figures: RESULTS.md.
"""

from __future__ import annotations

import json
import os
import sys

from draftsmith.config import load_recipe
from draftsmith.measure.config import DecodeConfig
from draftsmith.measure.prompts import load_questions
from draftsmith.measure.evaluate import evaluate
from draftsmith.target import load_target

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import script_parser  # noqa: E402 — the benchmarks folder is not a package


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("drafter", help="a saved drafter folder (draftsmith train's drafter/ or drafter-best/)")
    ap.add_argument("--prompts", type=int, default=5, help="timed MT-bench first turns, after one warm-up")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--settings", default="1:0,1:0.3,1:0.5,2:0.4", help="comma list of k:min_confidence")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    recipe = load_recipe("smollm2-135m-eagle3", ["drafter.type=saved", f"drafter.path={args.drafter}",
                                                 f"target.dtype={args.dtype}"])
    target = load_target(recipe.target)
    drafter = recipe.drafter.build(target)
    questions = load_questions("mtbench", args.prompts + 1)
    for setting in args.settings.split(","):
        k, threshold = setting.split(":")
        decode = DecodeConfig(k=int(k), max_new_tokens=args.max_new_tokens, min_confidence=float(threshold))
        ev = evaluate(target, drafter, questions, decode, time_target=True, progress=False)
        s, speed = ev.stats.summary(), ev.speed
        print(json.dumps({"k": int(k), "min_confidence": float(threshold), "tau": round(s["tau_with_bonus"], 3),
                          "acceptance_at_position": s["acceptance_at_position"], "drafted": s["drafted"],
                          "speedup_vs_target": speed["speedup_vs_target"], "tokens_per_s": speed["tokens_per_s"],
                          "target_tokens_per_s": speed["target_tokens_per_s"], "dtype": speed["dtype"],
                          "threads": speed["threads"], "c": speed["cost_model"]["draft_cost_c"],
                          "v": speed["cost_model"]["verify_cost_by_k"]}), flush=True)


if __name__ == "__main__":
    main()
