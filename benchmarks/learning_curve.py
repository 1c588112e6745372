"""τ and speedup against training tokens: what more training buys an EAGLE-3 head.

    python benchmarks/learning_curve.py RUN_DIR [RUN_DIR ...] --prompts 5 --max-new-tokens 64 \\
        --k 1 --min-confidence 0.4 --png benchmarks/out/learning_curve.png

Each RUN_DIR is a ``draftsmith train`` run folder (``logs/train.rank0.jsonl`` and ``drafter/``). Two
kinds of figure, kept apart on the plot:

* **held-out, during training** (no decoding): at every held-out evaluation of each run, the head's
  top-1 agreement with the target at the first draft and ``sim_tau`` (τ simulated at the recipe's k from
  the per-position held-out acceptance), against the target tokens the run had trained on by then;
* **measured, at the end** (with ``--prompts > 0``): each run's final drafter decodes the same MT-bench
  first turns in one process, through ``measure.evaluate.evaluate``, which times the target alone per prompt
  (interleaved, after a warm-up): τ (bonus counted) and ``speedup_vs_target``, in ``--dtype`` (bf16 by
  default: the speed dtype).

Writes the PNG and a JSON of every point (``--json``). Figures: benchmarks/RESULTS.md, "learning curve".
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import script_parser  # noqa: E402 — the benchmarks folder is not a package


def heldout_points(run_dir: str) -> list[dict]:
    """[{step, tokens, top1, expected_accept, sim_tau}] of one run, from its rank-0 log."""
    path = os.path.join(run_dir, "logs", "train.rank0.jsonl")
    tokens_at: dict[int, int] = {0: 0}
    held: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "tokens" in rec:
                tokens_at[rec["step"]] = rec["tokens"]
            if "sim_tau" in rec:
                held[rec["step"]] = rec  # a resumed run logs its last step again: the later record wins
    known = sorted(tokens_at)
    out = []
    for step in sorted(held):
        rec = held[step]
        # tokens are logged every logging.every steps: interpolate between the nearest two
        lo = max(s for s in known if s <= step)
        hi = min((s for s in known if s >= step), default=lo)
        tokens = tokens_at[lo] if hi == lo else tokens_at[lo] + (tokens_at[hi] - tokens_at[lo]) * (step - lo) / (hi - lo)
        out.append({"step": step, "tokens": int(tokens), "top1": rec.get("heldout/top1_step0"),
                    "expected_accept": rec.get("heldout/expected_accept_step0"), "sim_tau": rec["sim_tau"]})
    return out


def run_name(run_dir: str) -> str:
    """A run's label: its folder, or the demo's folder for a demo's ``…/eagle3`` stage."""
    path = os.path.normpath(run_dir)
    return os.path.basename(os.path.dirname(path)) if os.path.basename(path) == "eagle3" else os.path.basename(path)


def measure(run_dirs: list[str], args: argparse.Namespace) -> list[dict]:
    from draftsmith.config import load_recipe
    from draftsmith.measure.config import DecodeConfig
    from draftsmith.measure.prompts import load_questions
    from draftsmith.measure.evaluate import evaluate
    from draftsmith.target import load_target

    base = load_recipe("smollm2-135m-eagle3", [f"target.dtype={args.dtype}"])
    target = load_target(base.target)
    questions = load_questions("mtbench", args.prompts + 1)
    decode = DecodeConfig(k=args.k, max_new_tokens=args.max_new_tokens, min_confidence=args.min_confidence)
    out = []
    for run_dir in run_dirs:
        recipe = load_recipe("smollm2-135m-eagle3", ["drafter.type=saved", f"drafter.path={run_dir}/drafter",
                                                     f"target.dtype={args.dtype}"])
        drafter = recipe.drafter.build(target)
        ev = evaluate(target, drafter, questions, decode, time_target=True, progress=False)
        s, speed = ev.stats.summary(), ev.speed
        with open(os.path.join(run_dir, "train_summary.json")) as f:
            tokens = json.load(f)["tokens"]
        row = {"run": run_dir, "tokens": tokens, "tau": round(s["tau_with_bonus"], 3),
               "acceptance_at_position": s["acceptance_at_position"],
               "speedup_vs_target": speed["speedup_vs_target"], "tokens_per_s": speed["tokens_per_s"],
               "target_tokens_per_s": speed["target_tokens_per_s"], "dtype": speed["dtype"], "threads": speed["threads"],
               "c": speed["cost_model"]["draft_cost_c"], "v": speed["cost_model"]["verify_cost_by_k"],
               "predicted": speed["cost_model"].get("predicted_speedup"),
               "as_decoded": speed["cost_model"].get("as_decoded_speedup")}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def plot(curves: dict[str, list[dict]], measured: list[dict], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in curves.items():
        x = [p["tokens"] / 1e3 for p in points]
        line = left.plot(x, [p["sim_tau"] for p in points], marker="o", label=f"{name}: sim_tau (held-out)")[0]
        left.plot(x, [1 + (p["top1"] or 0) for p in points], ls="--", color=line.get_color(),
                  label=f"{name}: 1 + top-1 at draft 1 (held-out)")
    left.set_xlabel("target tokens trained on (thousands)")
    left.set_ylabel("tokens per round")
    left.set_title("held-out, during training")
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    if measured:
        x = [m["tokens"] / 1e3 for m in measured]
        right.plot(x, [m["tau"] for m in measured], "o", label=f"τ measured (k={args.k}, gate {args.min_confidence})")
        right.plot(x, [m["speedup_vs_target"] for m in measured], "s", label=f"speedup vs target alone ({measured[0]['dtype']})")
        for m in measured:
            right.annotate(run_name(m["run"]), (m["tokens"] / 1e3, m["speedup_vs_target"]),
                           fontsize=7, xytext=(4, -10), textcoords="offset points")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_xlabel("target tokens trained on (thousands)")
    right.set_ylabel("τ (bonus counted) / speedup (×)")
    right.set_title(f"measured at the end, MT-bench, {args.prompts} prompts")
    right.grid(alpha=0.3)
    if measured:
        right.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
    tmp = args.png + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, args.png)


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("runs", nargs="+", help="draftsmith train run folders")
    ap.add_argument("--prompts", type=int, default=5, help="timed MT-bench first turns per drafter (0: held-out only)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--min-confidence", type=float, default=0.4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--png", default="benchmarks/out/learning_curve.png")
    ap.add_argument("--json", default="benchmarks/out/learning_curve.json")
    ap.add_argument("--replot", action="store_true", help="redraw the PNG from --json without measuring")
    args = ap.parse_args()
    if args.replot:
        with open(args.json) as f:
            saved = json.load(f)
        plot(saved["heldout"], saved["measured"], argparse.Namespace(**{**saved["settings"], "png": args.png}))
        print(f"wrote {args.png}")
        return
    curves = {run_name(r): heldout_points(r) for r in args.runs}
    for name, points in curves.items():
        print(name, json.dumps(points[-1]), flush=True)
    measured = measure(args.runs, args) if args.prompts > 0 else []
    plot(curves, measured, args)
    from draftsmith.files import write_json

    write_json(args.json, {"heldout": curves, "measured": measured, "settings": vars(args)})
    print(f"wrote {args.png} and {args.json}")


if __name__ == "__main__":
    main()
