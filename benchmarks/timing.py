"""How noisy is one speedup figure on this machine, and does pairing with repeats tame it?

    python benchmarks/timing.py runs/demo/eagle3/drafter --prompts 10 --max-new-tokens 64 --repeats 3

One ``evaluate`` (bf16, the demo's decode: gated dynamic tree, depth 1, top-3) times on each MT-bench
first turn, ``--repeats`` times in a rotating order: the target alone, the saved drafter, prompt lookup,
and a **null drafter** that never drafts (every round one plain target step, so its true speed is the
target's; whatever its ratio shows beyond 1.0 is the loop's overhead plus noise). From the seconds of
every run (``wall_s_runs``) it scores three estimators of each method's per-prompt speedup: the first run
alone (what ``eval.repeats=1`` measures), the fastest of the first two (the default, ``eval.repeats=2``)
and the fastest of all. For each it prints the median over prompts, the 90 % bootstrap interval of that
median, and the spread of the null drafter's per-prompt ratios, which would be 1.0 everywhere on a
machine without noise. Figures: RESULTS.md, "timing".
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from draftsmith.config import load_recipe
from draftsmith.decode.protocol import Proposal
from draftsmith.drafters.registry import model_free_config
from draftsmith.files import write_json
from draftsmith.measure.costs import median_interval
from draftsmith.measure.prompts import load_questions
from draftsmith.measure.evaluate import MAIN, TARGET, evaluate
from draftsmith.target import load_target

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import script_parser  # noqa: E402 — the benchmarks folder is not a package


class NullDrafter:
    """Never drafts: every round of the decoder is one target step."""

    feature_layers: tuple[int, ...] = ()

    def reset(self) -> None:
        pass

    def update(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        pass

    def propose(self, k: int, warp, generator) -> Proposal:
        return Proposal(torch.empty(0, dtype=torch.long), None)


def estimators(runs: list[float]) -> dict[str, float]:
    """seconds under each estimator: the first run, the fastest of two, the fastest of all."""
    return {"first run": runs[0], "fastest of 2": min(runs[:2]), f"fastest of {len(runs)}": min(runs)}


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("drafter", help="a saved drafter folder (draftsmith train's drafter/)")
    ap.add_argument("--prompts", type=int, default=10, help="timed MT-bench first turns, after one warm-up")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    recipe = load_recipe("smollm2-135m-eagle3", [
        "drafter.type=saved", f"drafter.path={args.drafter}", f"target.dtype={args.dtype}",
        f"decode.max_new_tokens={args.max_new_tokens}", "decode.min_confidence=0.1", "decode.tree=dynamic",
        "decode.tree_depth=1", "decode.tree_top_k=3", "decode.tree_budget=3"])
    target = load_target(recipe.target)
    questions = load_questions("mtbench", args.prompts + 1)  # the first is the warm-up
    t0 = time.perf_counter()
    ev = evaluate(target, recipe.drafter.build(target), questions[1:], recipe.decode, progress=True, time_target=True,
                  repeats=args.repeats, warmup=1,
                  baselines={"null": NullDrafter(), "prompt_lookup": model_free_config("prompt_lookup").build(target)})
    seconds = time.perf_counter() - t0
    tokens = {MAIN: [len(r["tokens"]) for r in ev.records], TARGET: [r["target"]["new_tokens"] for r in ev.records]}
    for name, side in ev.baselines.items():
        tokens[name] = [len(r["tokens"]) for r in side.records]
    names = [MAIN, "prompt_lookup", "null"]
    table: dict[str, dict[str, object]] = {}
    for est in estimators([0.0] * args.repeats):
        row: dict[str, object] = {}
        for name in names:
            ratios = []
            for i, rec in enumerate(ev.records):
                runs = rec["wall_s_runs"]
                own = tokens[name][i] / estimators(runs[name])[est]
                alone = tokens[TARGET][i] / estimators(runs[TARGET])[est]
                ratios.append(own / alone)
            lo, hi = median_interval(ratios)
            row[name] = {"median": round(statistics.median(ratios), 4), "interval_90": [round(lo, 4), round(hi, 4)],
                         "per_prompt_min": round(min(ratios), 4), "per_prompt_max": round(max(ratios), 4),
                         "per_prompt_stdev": round(statistics.stdev(ratios), 4) if len(ratios) > 1 else 0.0}
        table[est] = row
    print(f"{args.prompts} prompts x {args.max_new_tokens} new tokens, {args.repeats} paired runs per method, "
          f"{str(target.dtype).replace('torch.', '')}, {torch.get_num_threads()} threads, {seconds:.0f} s")
    for est, row in table.items():
        print(f"{est:>14}: " + "; ".join(
            f"{name} {r['median']:.3f}x [{r['interval_90'][0]:.3f}-{r['interval_90'][1]:.3f}]"
            + (f" (per prompt {r['per_prompt_min']:.3f}-{r['per_prompt_max']:.3f}, sd {r['per_prompt_stdev']:.3f})"
               if name == "null" else "") for name, r in row.items()))
    print(f"tau: drafter {ev.stats.tau:.3f}, prompt_lookup {ev.baselines['prompt_lookup'].stats.tau:.3f}, "
          f"null {ev.baselines['null'].stats.tau:.3f}")
    if args.out:
        write_json(args.out, {"args": vars(args), "seconds": round(seconds, 1), "estimators": table,
                              "tau": {MAIN: ev.stats.tau, **{n: s.stats.tau for n, s in ev.baselines.items()}},
                              "wall_s_runs": [r["wall_s_runs"] for r in ev.records], "tokens": tokens})


if __name__ == "__main__":
    main()
