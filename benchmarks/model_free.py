"""Model-free drafters against the target alone, against HF's prompt lookup, and the suffix trie's cost.

    python benchmarks/model_free.py [--prompts 6] [--max-new-tokens 96] [--k 8] [--min-confidence 0]
        [--drafter runs/demo/eagle3/drafter] [--corpus runs/demo/prepare/data/regenerated] [--out runs/bench-model-free.json]

Three parts, all in one process:

1. **τ and speedup vs the target alone (bf16)**, on MT-bench and the copy-heavy set: for each prompt
   the target's own greedy ``generate`` and every drafter in the built-in decoder run back to back in
   a rotating order (interleaved, after one warm-up prompt): prompt_lookup, suffix, and, given
   ``--drafter`` (a trained drafter folder, e.g. the demo's EAGLE-3 head, or ``layer_skip:N`` as a
   stand-in), that drafter and the hybrid of it with the suffix drafter (with ``--tree``, also
   ``hybrid_both``: the hybrid with ``combine: both``, the head's tree every round and the suffix
   drafter's chain grafted onto it when confident). With ``--repeats R`` every
   prompt runs R times per method in a rotating order and each method's fastest run counts (as in
   ``draftsmith eval``). Speedup = the median over prompts of the per-prompt tokens/s ratio to the
   target alone, with its 90 % bootstrap interval (``aggregate_speedup``: total time over total time);
   in bf16 outputs may drift from ``generate`` after tens of tokens (block vs single-token kernels),
   counted as "identical".
2. **draftsmith's prompt_lookup vs HF** ``generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=n)``
   (fp32, same k and n, HF's earliest-match rule in both): tokens/s, the median over prompts of the
   per-prompt ratio (``--repeats`` runs each), the target forwards each made and the time each loop
   spends outside them, and token identity with greedy. HF runs twice: on draftsmith's target (the
   same model object, its fp32 linears on oneDNN as ``load_target`` routes them: the loops compared
   alone) and on the stock model (inside ``cpu_linear.disabled()``: torch's ``F.linear``, what
   ``AutoModelForCausalLM`` + ``generate`` give a user); the target alone runs both ways too.
3. **Suffix trie cost per token vs output length**: µs per appended token and per proposal when the
   request already holds L tokens, for growing L (must stay flat: O(max_depth) per token).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from draftsmith.config import load_recipe
from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.sampling import Warp
from draftsmith.decode.stats import DecodeStats
from draftsmith.decode.tree import DynamicTree, tree_decode
from draftsmith.drafters.prompt_lookup import PromptLookupDrafter
from draftsmith.drafters.suffix import SuffixDrafter
from draftsmith.measure.forwards import ForwardCounter
from draftsmith.measure.prompts import load_questions
from draftsmith.decode.reference import hf_generate, target_greedy
from draftsmith.measure.costs import median_interval
from draftsmith.measure.paired import paired_runs
from draftsmith.files import write_json
from draftsmith.cpu_kernels import cpu_linear
from draftsmith.target import Target, load_target

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import first_turns, script_parser  # noqa: E402 — the benchmarks folder is not a package


def prompts_of(target: Target, name: str, n: int) -> list[list[int]]:
    return first_turns(target, load_questions(name, n))


def drafter_overrides(drafter_path: str, corpus: str, both: bool = False, head_depth: int = 0) -> dict[str, list[str]]:
    suffix = ["drafter.type=suffix"] + ([f"drafter.corpus={corpus}"] if corpus else [])
    out = {"prompt_lookup": ["drafter.type=prompt_lookup"], "suffix": suffix}
    if drafter_path:
        if drafter_path.startswith("layer_skip:"):  # a stand-in model drafter when no trained head is at hand
            model = ["type=layer_skip", "share_cache=false", f"num_layers={drafter_path.split(':', 1)[1]}"]
        else:
            model = ["type=saved", f"path={drafter_path}"]
        name = "layer_skip" if drafter_path.startswith("layer_skip:") else "trained"
        out[name] = [f"drafter.{o}" for o in model]
        out["hybrid"] = ["drafter.type=hybrid", *[f"drafter.drafter.{o}" for o in model],
                         "drafter.lookup.type=suffix"] + ([f"drafter.lookup.corpus={corpus}"] if corpus else [])
        # the hybrids' model drafts trees at most head_depth deep (0: the tree's depth); "hybrid" is the
        # per-round choice, "hybrid_both" (tree decoding) the head's tree every round with the suffix chain grafted on
        out["hybrid"] = out["hybrid"] + [f"drafter.model_depth={head_depth}"]
        if both:
            out["hybrid_both"] = out["hybrid"] + ["drafter.combine=both"]
        out["hybrid"].append("drafter.combine=either")
    return out


def interleaved(prompts: list[list[int]], methods: dict[str, Callable[[list[int]], list[int]]],
                warmup: int = 1, repeats: int = 1) -> dict[str, dict[str, Any]]:
    """Run every method on every prompt ``repeats`` times in a rotating order (``measure.paired.paired_runs``: the
    fastest run of each counts); per method: total wall s, new tokens, per-prompt outputs and seconds."""
    names = list(methods)
    for p in prompts[:warmup]:
        for fn in methods.values():
            fn(p)

    def timed(fn: Callable[[list[int]], list[int]]) -> Callable[[list[int]], tuple[list[int], float]]:
        def run(p: list[int]) -> tuple[list[int], float]:
            t0 = time.perf_counter()
            out = fn(p)
            return out, time.perf_counter() - t0
        return run

    rows: dict[str, dict[str, Any]] = {n: {"wall_s": 0.0, "new_tokens": 0, "outputs": [], "prompt_s": []} for n in names}
    for i, p in enumerate(prompts[warmup:]):
        got = paired_runs({name: timed(fn) for name, fn in methods.items()}, p, repeats, start=i * repeats)
        for name, ((out, seconds), _) in got.items():
            rows[name]["wall_s"] += seconds
            rows[name]["new_tokens"] += len(out)
            rows[name]["outputs"].append(out)
            rows[name]["prompt_s"].append(seconds)
    return rows


def speed_vs_target(target: Target, sets: list[str], n: int, k: int, max_new: int, drafter_path: str,
                    corpus: str, min_confidence: float = 0.0, tree: DynamicTree | None = None,
                    repeats: int = 1, head_depth: int = 0) -> dict[str, Any]:
    """tree: decode every method with draft trees of this shape (model-free drafters draft chains of its
    depth; the trained head and the hybrid's model, its gated tree); None: chains of k behind the gate.
    head_depth: the trained head alone, and the hybrids' model, draft trees at most this deep (0: the tree's)."""
    overrides = drafter_overrides(drafter_path, corpus, both=tree is not None, head_depth=head_depth)
    builds = {name: load_recipe(None, ov).drafter.build(target) for name, ov in overrides.items()}
    out: dict[str, Any] = {}
    for set_name in sets:
        prompts = prompts_of(target, set_name, n + 1)
        calls: dict[str, list[DecodeStats]] = {name: [] for name in builds}

        def depth_of(name: str) -> int:
            return head_depth if head_depth and name in ("trained", "layer_skip") else tree.depth

        def ours(name: str) -> Callable[[list[int]], list[int]]:
            def run(p: list[int]) -> list[int]:
                if tree is not None:
                    shape = replace(tree, depth=depth_of(name))
                    res = tree_decode(target, builds[name], p, tree=shape, max_new_tokens=max_new,
                                      min_confidence=min_confidence)
                else:
                    res = speculative_decode(target, builds[name], p, k=k, max_new_tokens=max_new,
                                             min_confidence=min_confidence)
                calls[name].append(res.stats)
                return res.tokens
            return run

        for d in builds.values():
            if hasattr(d, "counts"):
                d.counts.rounds.clear()
                d.counts.drafted.clear()
        methods = {"target": lambda p: target_greedy(target, p, max_new), **{name: ours(name) for name in builds}}
        rows = interleaved(prompts, methods, warmup=1, repeats=repeats)
        base = rows["target"]
        table: dict[str, Any] = {"target": {"tokens_per_s": round(base["new_tokens"] / base["wall_s"], 2)}}
        for name in builds:
            r = rows[name]
            total = DecodeStats(k=k if tree is None else depth_of(name))
            for st in calls[name][1:]:  # the first call was the warm-up prompt
                total = total.merge(st)
            same = sum(a == b for a, b in zip(r["outputs"], base["outputs"]))
            tps = r["new_tokens"] / r["wall_s"]
            ratios = [(len(o) / s_) / (len(b) / bs) for o, s_, b, bs in zip(r["outputs"], r["prompt_s"], base["outputs"],
                                                                           base["prompt_s"])]
            table[name] = {"tau_with_bonus": round(total.tau, 3), "acceptance_rate": round(total.acceptance_rate, 3),
                           "tokens_per_s": round(tps, 2),
                           "speedup_vs_target": round(statistics.median(ratios), 3),
                           "speedup_interval_90": [round(x, 3) for x in median_interval(ratios)],
                           "aggregate_speedup": round(tps / table["target"]["tokens_per_s"], 3),
                           "identical_to_target": f"{same}/{len(base['outputs'])}"}
            counts = getattr(builds[name], "counts", None)
            if counts is not None:  # who drafted (hybrid: model / lookup; suffix: request / corpus), warm-up included
                table[name]["rounds_by_source"] = dict(counts.rounds)
        out[set_name] = {"prompts": n, "rows": table}
        print(set_name, json.dumps(table), flush=True)
    return out


def ratios_over(per_prompt: list[dict[str, dict[str, float]]], total: dict[str, dict[str, float]], ours: str,
                other: str, key: str) -> dict[str, Any]:
    """Tokens/s of ``ours`` over ``other``: the median of per-prompt ratios (repeats summed), the same over each
    method's fastest run with its 90 % interval, and all tokens over all seconds."""
    def rate(acc: dict[str, float], s: str) -> float:
        return acc["new_tokens"] / acc[s]

    ratios = [rate(row[ours], "wall_s") / rate(row[other], "wall_s") for row in per_prompt]
    fastest = [rate(row[ours], "fastest_s") / rate(row[other], "fastest_s") for row in per_prompt]
    return {key: round(statistics.median(ratios), 3),
            f"{key}_per_prompt": [round(x, 3) for x in ratios],
            f"{key}_fastest_runs": round(statistics.median(fastest), 3),
            f"{key}_fastest_interval_90": [round(x, 3) for x in median_interval(fastest)],
            f"{key}_total": round(rate(total[ours], "wall_s") / rate(total[other], "wall_s"), 3)}


def vs_hf_prompt_lookup(target: Target, sets: list[str], n: int, k: int, max_ngram: int, max_new: int,
                        repeats: int = 1) -> dict[str, Any]:
    """draftsmith's prompt lookup against HF's, fp32, paired per prompt.

    Every prompt runs ``repeats`` times per method in a rotating order (after one warm-up prompt);
    the ratio is the median over prompts of draftsmith's tokens/s over HF's on that prompt (the
    repeats summed; ``…_fastest_runs``: each method's fastest run, as eval times), against HF on the
    same model (``draftsmith_over_hf``: the loops alone) and on the stock one (``draftsmith_over_hf_stock``:
    loops and linears). Both propose the same drafts (HF's earliest-match rule), so they also make the
    same target forwards; the seconds outside those forwards are each loop's own overhead."""
    drafter = PromptLookupDrafter(target.vocab_size, target.eos_token_ids, max_ngram=max_ngram, min_ngram=1,
                                  device=target.device)
    def hf_lookup(p: list[int]) -> list[int]:
        return hf_generate(target, p, max_new, prompt_lookup_num_tokens=k, max_matching_ngram_size=max_ngram)

    def stock(fn: Callable[[list[int]], list[int]]) -> Callable[[list[int]], list[int]]:
        def run(p: list[int]) -> list[int]:
            with cpu_linear.disabled():
                return fn(p)
        return run

    methods = {
        "greedy": lambda p: target_greedy(target, p, max_new),
        "draftsmith_prompt_lookup": lambda p: speculative_decode(target, drafter, p, k=k, max_new_tokens=max_new).tokens,
        "hf_prompt_lookup": hf_lookup,
        "hf_prompt_lookup_stock": stock(hf_lookup),
        "greedy_stock": stock(lambda p: target_greedy(target, p, max_new)),
    }
    names = list(methods)
    timer = ForwardCounter(target.model)
    out: dict[str, Any] = {}
    try:
        for set_name in sets:
            prompts = prompts_of(target, set_name, n + 1)
            for fn in methods.values():
                fn(prompts[0])
            zero = {"wall_s": 0.0, "new_tokens": 0, "forward_s": 0.0, "forwards": 0, "tokens_fed": 0}
            per_prompt: list[dict[str, dict[str, float]]] = []
            outputs: dict[str, list[list[int]]] = {m: [] for m in names}
            for i, p in enumerate(prompts[1:]):
                row = {m: dict(zero) for m in names}
                for r in range(repeats):
                    j = (i * repeats + r) % len(names)
                    for name in names[j:] + names[:j]:
                        timer.take()
                        t0 = time.perf_counter()
                        tokens = methods[name](p)
                        wall = time.perf_counter() - t0
                        calls, fed, fs = timer.take()
                        acc = row[name]
                        acc["wall_s"] += wall
                        acc["new_tokens"] += len(tokens)
                        acc["forward_s"] += fs
                        acc["forwards"] += calls
                        acc["tokens_fed"] += fed
                        acc["fastest_s"] = min(acc.get("fastest_s", wall), wall)
                        if r == 0:
                            outputs[name].append(tokens)
                per_prompt.append(row)
            total = {m: {key: sum(row[m][key] for row in per_prompt) for key in zero} for m in names}
            ref = outputs["greedy"]
            out[set_name] = {"prompts": n, "repeats": repeats,
                             "tokens_per_s": {m: round(t["new_tokens"] / t["wall_s"], 2) for m, t in total.items()}}
            for hf, label in (("hf_prompt_lookup", "hf"), ("hf_prompt_lookup_stock", "hf_stock")):
                out[set_name].update(ratios_over(per_prompt, total, "draftsmith_prompt_lookup", hf, f"draftsmith_over_{label}"))
            out[set_name].update({
                "target_forwards": {m: t["forwards"] for m, t in total.items()},
                "tokens_fed_to_target": {m: t["tokens_fed"] for m, t in total.items()},
                "ms_per_forward": {m: round(1e3 * t["forward_s"] / max(t["forwards"], 1), 2) for m, t in total.items()},
                "ms_outside_forward_per_forward": {m: round(1e3 * (t["wall_s"] - t["forward_s"]) / max(t["forwards"], 1), 2)
                                                   for m, t in total.items()},
                "identical_to_greedy": {m: f"{sum(a == b for a, b in zip(outputs[m], ref))}/{len(ref)}"
                                        for m in names if m != "greedy"},
            })
            print(set_name, json.dumps(out[set_name]), flush=True)
    finally:
        timer.close()
    return out


def suffix_cost(target: Target, lengths: list[int], window: int = 2000, proposals: int = 500) -> list[dict[str, Any]]:
    """µs per token of update and per proposal (k = 8) when the request holds L tokens (text: the copy-heavy
    prompts, tokenized and concatenated, repeated as needed, with every 7th token perturbed)."""
    text = "\n".join(q.turns[0] for q in load_questions("copyheavy"))
    base = target.tokenizer.encode(text, add_special_tokens=False)
    need = max(lengths) + window
    stream = [(t + 1) % target.vocab_size if i % 7 == 0 and i >= len(base) else t
              for i, t in enumerate((base * (need // len(base) + 1))[:need])]
    d = SuffixDrafter(target.vocab_size)
    d.reset()
    filled, rows = 0, []
    greedy = Warp()
    for L in lengths:
        d.update(torch.tensor(stream[filled:L]))
        filled = L
        t0 = time.perf_counter()
        for i in range(filled, filled + window, 8):  # 8 tokens per update, as an accepted round brings
            d.update(torch.tensor(stream[i:i + 8]))
        upd = (time.perf_counter() - t0) / window
        filled += window
        t0 = time.perf_counter()
        for _ in range(proposals):
            d.propose(8, greedy, None)
        prop = (time.perf_counter() - t0) / proposals
        rows.append({"length": L, "update_us_per_token": round(upd * 1e6, 2), "propose_us": round(prop * 1e6, 2),
                     "trie_nodes": len(d.request)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = script_parser(__doc__, target=True)
    ap.add_argument("--sets", default="mtbench,copyheavy")
    ap.add_argument("--prompts", type=int, default=6, help="timed prompts per set (one more is the warm-up)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--min-confidence", type=float, default=0.0,
                    help="part 1: the decoder's confidence gate (decode.min_confidence) for every drafter")
    ap.add_argument("--tree", default="", help="part 1: DEPTH,TOP_K,BUDGET of a dynamic draft tree gated at "
                    "--min-confidence (e.g. 3,3,3); empty: chains of k")
    ap.add_argument("--head-depth", type=int, default=0, help="part 1 with --tree: the trained head alone and the "
                    "hybrids' model draft trees at most this deep (model-free chains keep the tree's depth)")
    ap.add_argument("--repeats", type=int, default=1, help="parts 1 and 2: runs of each prompt per method (paired, rotating; "
                    "part 1 counts each method's fastest run)")
    ap.add_argument("--max-ngram", type=int, default=3, help="prompt lookup n-gram size (HF: max_matching_ngram_size)")
    ap.add_argument("--drafter", default="", help="a trained drafter folder (e.g. the demo's EAGLE-3 head), or "
                                                 "layer_skip:N (the target's first N layers, own cache) as a stand-in")
    ap.add_argument("--corpus", default="", help="the suffix drafter's corpus (JSONL or a regenerate folder)")
    ap.add_argument("--lengths", default="1000,4000,16000,64000", help="request lengths for the suffix cost")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: speed,hf,cost")
    ap.add_argument("--out", default="runs/bench-model-free.json")
    args = ap.parse_args(argv)
    sets, skip = args.sets.split(","), set(filter(None, args.skip.split(",")))
    results: dict[str, Any] = {"settings": vars(args)}
    tree = None
    if args.tree:
        depth, top_k, budget = (int(x) for x in args.tree.split(","))
        tree = DynamicTree(depth, top_k, budget)
    if "speed" not in skip:
        bf16 = load_target(args.target, dtype="bfloat16", device="cpu")
        results["bf16_vs_target"] = speed_vs_target(bf16, sets, args.prompts, args.k, args.max_new_tokens,
                                                    args.drafter, args.corpus, args.min_confidence, tree, args.repeats,
                                                    args.head_depth)
        del bf16
    if "hf" not in skip:
        fp32 = load_target(args.target, dtype="float32", device="cpu")
        results["fp32_prompt_lookup_vs_hf"] = vs_hf_prompt_lookup(fp32, sets, args.prompts, args.k, args.max_ngram,
                                                                  args.max_new_tokens, args.repeats)
        print(json.dumps(results["fp32_prompt_lookup_vs_hf"], indent=1))
    if "cost" not in skip:
        t = load_target(args.target, dtype="float32", device="cpu") if "hf" in skip else fp32
        results["suffix_cost"] = suffix_cost(t, [int(x) for x in args.lengths.split(",")])
        print(json.dumps(results["suffix_cost"], indent=1))
    write_json(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
