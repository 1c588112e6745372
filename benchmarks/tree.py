"""Tree vs chain decoding: τ and tokens/s of chain, static-tree and dynamic-tree speculative decoding
with one drafter, side by side against the target's own greedy decoding, on MT-bench first turns.

    python benchmarks/tree.py                                     # the demo's trained EAGLE-3 head
    python benchmarks/tree.py --drafter runs/demo/eagle3/drafter --dtypes float32,bfloat16 --prompts 10
    python benchmarks/tree.py --untrained --prompts 2 --max-new-tokens 16   # a quick check, no training
    python benchmarks/tree.py --budgets 8,16,32 --depths 3,4,5    # also sweep the dynamic tree's size

Per dtype, after one warm-up prompt, each prompt is decoded by every method in turn (interleaved, so
load on a shared machine hits all alike): the target's greedy ``generate``, chains of k drafts, the
static tree, the dynamic tree(s). Every greedy output is checked token for token against the target's.
Reports per method: τ (tokens per verification forward, bonus token counted), tokens/s (aggregate
and median per prompt), the speed ratio to the target alone by CPU time (steadier than wall time when
other processes share the cores) and by wall time, and the mean tree size. JSON goes to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

from draftsmith.tables import markdown_table

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import first_turns, script_parser, set_threads  # noqa: E402 — the benchmarks folder is not a package

DEFAULT_DRAFTER = os.path.join("runs", "demo", "eagle3", "drafter")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = script_parser(__doc__, target=True, threads=True)
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, help="a drafter folder from `draftsmith train` "
                   f"(default: the demo's trained EAGLE-3 head, {DEFAULT_DRAFTER})")
    p.add_argument("--untrained", action="store_true", help="use an untrained EAGLE-3 head (a quick check of the script)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=10, help="timed MT-bench prompts after 1 warm-up (default: 10)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="chain: drafts per round (default: 4)")
    p.add_argument("--static", default="default", help="static tree: a named tree (default) or JSON paths")
    p.add_argument("--depth", type=int, default=4, help="dynamic tree depth (default: 4)")
    p.add_argument("--top-k", type=int, default=4, help="dynamic tree: slots expanded per level (default: 4)")
    p.add_argument("--budget", type=int, default=16, help="dynamic tree: nodes per round (default: 16)")
    p.add_argument("--budgets", default="", help="also run dynamic trees of these budgets, e.g. 8,32")
    p.add_argument("--depths", default="", help="with --budgets: and these depths, e.g. 3,5")
    p.add_argument("--gates", default="0", help="confidence gates for the chain and the dynamic trees, e.g. 0,0.2 "
                   "(decode.min_confidence; 0: ungated)")
    p.add_argument("--no-static", action="store_true", help="skip the static tree")
    p.add_argument("--out", default=os.path.join("benchmarks", "out", "tree.json"))
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def methods(args: argparse.Namespace) -> dict[str, Any]:
    """name → (tree shape or None for a chain of k, confidence gate). The static tree runs ungated, once;
    the chain and every dynamic tree once per gate of --gates."""
    import json

    from draftsmith.decode.tree import DynamicTree, StaticTree

    static = args.static if not args.static.strip().startswith("[") else json.loads(args.static)
    dynamic = {(args.depth, args.budget)}
    dynamic |= {(depth, budget) for budget in _ints(args.budgets) for depth in _ints(args.depths) or [args.depth]}
    out: dict[str, Any] = {}
    for gate in _floats(args.gates):
        tag = f" gate {gate:g}" if gate > 0 else ""
        out[f"chain k={args.k}{tag}"] = (None, gate)
        if not out.get(f"static '{args.static}'"):
            out[f"static '{args.static}'"] = (StaticTree.named_or_given(static), 0.0)
        for depth, budget in sorted(dynamic):
            out[f"dynamic d={depth} k={args.top_k} n={budget}{tag}"] = (DynamicTree(depth, args.top_k, budget), gate)
    if args.no_static:
        out.pop(f"static '{args.static}'")
    return out


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()] or [0.0]


def run_dtype(args: argparse.Namespace, dtype: str, questions: list[Any]) -> dict[str, Any]:
    from draftsmith.decode.rounds import speculative_decode
    from draftsmith.decode.stats import DecodeStats
    from draftsmith.decode.tree import tree_decode
    from draftsmith.drafters import Eagle3Config, load
    from draftsmith.decode.reference import target_greedy
    from draftsmith.target import describe, load_target

    target = load_target(args.target, dtype=dtype)
    if args.untrained:
        drafter, label = Eagle3Config(feature_layers=[1, 14, 26]).build(target), "EAGLE-3 head, untrained"
    else:
        drafter, label = load(args.drafter, target), f"drafter {args.drafter}"
    prompts = first_turns(target, questions)
    shapes = methods(args)

    def decode(method: tuple[Any, float], p: list[int]) -> Any:
        shape, gate = method
        if shape is None:
            return speculative_decode(target, drafter, p, k=args.k, max_new_tokens=args.max_new_tokens, min_confidence=gate)
        return tree_decode(target, drafter, p, tree=shape, max_new_tokens=args.max_new_tokens, min_confidence=gate)

    print(f"\n== {target.name} {dtype} on {target.device}, {label}, {len(prompts) - 1} MT-bench prompts, "
          f"max_new_tokens={args.max_new_tokens}, {torch.get_num_threads()} threads")
    for shape in shapes.values():  # warm-up
        decode(shape, prompts[0])
    target_greedy(target, prompts[0], 8)
    stats = {name: DecodeStats(k=args.k if s is None else s.depth) for name, (s, _) in shapes.items()}
    spent = {name: [0.0, 0.0] for name in ["greedy", *shapes]}  # wall, cpu
    rates: dict[str, list[float]] = {name: [] for name in ["greedy", *shapes]}
    identical = {name: 0 for name in shapes}
    greedy_tokens = 0
    for i, p in enumerate(prompts[1:]):
        t0, c0 = time.perf_counter(), time.process_time()
        ref = target_greedy(target, p, args.max_new_tokens)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        spent["greedy"] = [spent["greedy"][0] + wall, spent["greedy"][1] + cpu]
        rates["greedy"].append(len(ref) / wall)
        greedy_tokens += len(ref)
        for name, shape in shapes.items():
            t0, c0 = time.perf_counter(), time.process_time()
            res = decode(shape, p)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            spent[name] = [spent[name][0] + wall, spent[name][1] + cpu]
            rates[name].append(len(res.tokens) / wall)
            stats[name] = stats[name].merge(res.stats)
            identical[name] += res.tokens == ref
        print(f"  prompt {i + 1}/{len(prompts) - 1}: " + ", ".join(
            f"{n} τ {stats[n].tau:.2f}" for n in shapes), flush=True)
    rows = []
    for name in shapes:
        st = stats[name]
        rows.append({
            "method": name, "tau_with_bonus": round(st.tau, 4), "drafted_per_round": st.summary()["drafted_per_round"],
            "acceptance_at_depth": st.summary()["acceptance_at_position"],
            "aggregate_tokens_per_s": round(st.new_tokens / spent[name][0], 3),
            "median_tokens_per_s": round(statistics.median(rates[name]), 3),
            "speedup_vs_target_cpu": round((st.new_tokens / spent[name][1]) / (greedy_tokens / spent["greedy"][1]), 3),
            "speedup_vs_target_wall": round((st.new_tokens / spent[name][0]) / (greedy_tokens / spent["greedy"][0]), 3),
            "identical_to_target": f"{identical[name]}/{len(prompts) - 1}",
        })
    greedy = {"aggregate_tokens_per_s": round(greedy_tokens / spent["greedy"][0], 3),
              "median_tokens_per_s": round(statistics.median(rates["greedy"]), 3)}
    return {"target": describe(target), "drafter": label, "greedy": greedy, "methods": rows}


def format_rows(res: dict[str, Any]) -> str:
    rows = []
    for r in res["methods"]:
        acc = ", ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_at_depth"])
        rows.append([r["method"], f"{r['tau_with_bonus']:.3f}", f"{r['drafted_per_round']:.1f}",
                     f"{r['aggregate_tokens_per_s']:.2f}", f"{r['speedup_vs_target_cpu']:.3f}×",
                     f"{r['speedup_vs_target_wall']:.3f}×", acc, r["identical_to_target"]])
    rows.append(["target greedy alone", "1", "0", f"{res['greedy']['aggregate_tokens_per_s']:.2f}", "1×", "1×", "", ""])
    return "\n".join(markdown_table(["method", "τ (bonus counted)", "tokens verified / round", "tok/s (aggregate)",
                                     "× target (CPU)", "× target (wall)", "acceptance by depth", "identical"], rows))


def main(argv: list[str] | None = None) -> int:
    from draftsmith.errors import DraftsmithError
    from draftsmith.measure.prompts import load_questions
    from draftsmith.files import write_json

    args = parse(argv)
    if not args.untrained and not os.path.isdir(args.drafter):
        print(f"tree.py: no drafter folder at '{args.drafter}'; run `draftsmith demo` (it trains the EAGLE-3 head "
              f"there), give --drafter, or pass --untrained for a quick check", file=sys.stderr)
        return 2
    set_threads(args.threads)
    try:
        questions = load_questions("mtbench", args.prompts + 1)  # +1: the warm-up prompt
        report: dict[str, Any] = {"threads": torch.get_num_threads(), "args": vars(args), "results": {}}
        for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            res = run_dtype(args, dtype, questions)
            report["results"][dtype] = res
            print(format_rows(res))
            write_json(args.out, report)
    except DraftsmithError as e:
        print(f"tree.py: error: {e}", file=sys.stderr)
        return 2
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
