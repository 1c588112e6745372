"""Decode speed: draftsmith's speculative decoder vs HF assisted generation vs plain greedy.

    python benchmarks/decode.py --dtypes float32,bfloat16 --prompts 10 --sweep-layers 8,16,20,24,28

Figures and commands are in RESULTS.md.

All run on the same target in one process, batch 1, on MT-bench first turns:

* ``draftsmith`` — :func:`speculative_decode` with the layer-skip drafter (first N layers),
  self-speculative: drafting inside the target's KV cache, drafted states reused in verification;
* ``draftsmith_own_cache`` — the same drafter as a truncated HF model with its own cache (the
  runtime HF uses), to show what the decoder alone gains;
* ``hf_assisted`` — ``target.generate(..., assistant_model=<the same truncated model>)`` with a
  constant ``num_assistant_tokens = k`` (no heuristic schedule, no confidence early stop);
* ``greedy`` — the target's own ``generate`` (the reference for token identity).

Per prompt the methods are run back to back in a rotating order (interleaved, so a load
change on the machine hits all of them alike) after one warm-up round; we report
medians of per-prompt tokens/s, the median of the per-prompt ratios, and ratios of total
CPU time (steadier when the machine is shared).
Every speculative method is also checked for token identity with plain greedy.

``acceptance_sweep`` measures how well a plain early exit at several depths drafts
(per-position acceptance, τ with the bonus token counted, speed relative to greedy),
which is how the default depth and k of the layer-skip recipe were chosen.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from draftsmith.config import load_recipe
from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.stats import DecodeStats
from draftsmith.drafters.layer_skip import layer_skip_drafter, truncated_model
from draftsmith.files import write_json
from draftsmith.measure.forwards import ForwardCounter
from draftsmith.measure.prompts import load_questions
from draftsmith.decode.reference import hf_generate, target_greedy
from draftsmith.tables import markdown_table
from draftsmith.target import Target, describe, load_target

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import first_turns, script_parser, set_threads  # noqa: E402 — the benchmarks folder is not a package


def hf_assistant(target: Target, num_layers: int, k: int) -> torch.nn.Module:
    """The layer-skip model set up for HF assisted generation with exactly k drafts per round."""
    model = truncated_model(target.model, num_layers)
    gc = model.generation_config
    gc.num_assistant_tokens = k
    gc.num_assistant_tokens_schedule = "constant"  # no +2/−1 heuristic
    gc.assistant_confidence_threshold = 0.0  # 0 disables the confidence early stop (and its sklearn ROC tuning)
    return model


def hf_assisted(target: Target, assistant: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers assisted generation (greedy), new tokens only."""
    return hf_generate(target, prompt_ids, max_new_tokens, assistant_model=assistant)


SPECULATIVE = ("draftsmith", "draftsmith_own_cache", "hf_assisted")


def _timed(fn: Callable[[], list[int]]) -> tuple[list[int], float, float]:
    """(result, wall seconds, process CPU seconds). CPU time is steadier on a shared machine."""
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = fn()
    return tokens, time.perf_counter() - t0, time.process_time() - c0


def bench_decode(
    target: Target,
    prompts: list[list[int]],
    num_layers: int,
    k: int,
    max_new_tokens: int,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time the three methods interleaved per prompt; return per-prompt rows and a summary.

    prompts: token ids (chat template applied); the first ``warmup`` are run once each and
    not recorded.
    """
    drafter = layer_skip_drafter(target.model, num_layers, share_cache=True)
    own_cache = layer_skip_drafter(target.model, num_layers, share_cache=False)
    assistant = hf_assistant(target, num_layers, k)
    stats = DecodeStats(k=k)
    last_stats: dict[str, DecodeStats] = {}

    def ours(name: str, d: Any) -> Callable[[list[int]], list[int]]:
        def run(p: list[int]) -> list[int]:
            res = speculative_decode(target, d, p, k=k, max_new_tokens=max_new_tokens)
            last_stats[name] = res.stats
            return res.tokens

        return run

    methods: dict[str, Callable[[list[int]], list[int]]] = {
        "draftsmith": ours("draftsmith", drafter),
        "draftsmith_own_cache": ours("draftsmith_own_cache", own_cache),
        "hf_assisted": lambda p: hf_assisted(target, assistant, p, max_new_tokens),
        "greedy": lambda p: target_greedy(target, p, max_new_tokens),
    }
    names = list(methods)
    counter = ForwardCounter(target.model)
    try:
        for p in prompts[:warmup]:
            for fn in methods.values():
                fn(p)
        last_stats.clear()
        counter.take()
        rows = []
        for i, p in enumerate(prompts[warmup:]):
            row: dict[str, Any] = {"prompt_tokens": len(p)}
            order = names[i % len(names) :] + names[: i % len(names)]  # rotate who goes first
            outputs = {}
            for name in order:
                tokens, secs, cpu = _timed(lambda: methods[name](p))
                outputs[name] = tokens
                hooked, _, _ = counter.take()  # the self-speculative verify bypasses the module: count from stats
                forwards = last_stats[name].target_forwards if name in last_stats else hooked
                row[name] = {"new_tokens": len(tokens), "wall_s": secs, "cpu_s": cpu, "tokens_per_s": len(tokens) / secs,
                             "target_forwards": forwards}
            for name in SPECULATIVE:
                row[name]["identical_to_greedy"] = outputs[name] == outputs["greedy"]
            s = last_stats.pop("draftsmith")
            last_stats.clear()
            row["draftsmith"]["tau_with_bonus"] = s.tau
            stats = stats.merge(s)
            rows.append(row)
            if progress:
                progress(_row_line(len(rows), row))
    finally:
        counter.close()
    return {"num_layers": num_layers, "k": k, "max_new_tokens": max_new_tokens, "rows": rows,
            "summary": _summary(rows, names), "draftsmith_stats": stats.summary()}


def _row_line(i: int, row: dict[str, Any]) -> str:
    parts = [f"{n} {row[n]['tokens_per_s']:.2f}" for n in (*SPECULATIVE, "greedy")]
    same = "/".join("=" if row[n]["identical_to_greedy"] else "≠" for n in SPECULATIVE)
    return f"prompt {i} tok/s: " + ", ".join(parts) + f"  identical to greedy: {same}"


def _summary(rows: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    def med(name: str, key: str) -> float:
        return statistics.median(r[name][key] for r in rows)

    def ratio(a: str, b: str) -> float:
        return statistics.median(r[a]["tokens_per_s"] / r[b]["tokens_per_s"] for r in rows)

    def cpu_ratio(a: str, b: str) -> float:  # speed ratio by total CPU time: a/b tokens per CPU second
        return (sum(r[b]["cpu_s"] for r in rows) / sum(r[b]["new_tokens"] for r in rows)) / (
            sum(r[a]["cpu_s"] for r in rows) / sum(r[a]["new_tokens"] for r in rows))

    out: dict[str, Any] = {"prompts": len(rows)}
    for n in names:
        out[n] = {
            "median_tokens_per_s": med(n, "tokens_per_s"),
            "aggregate_tokens_per_s": sum(r[n]["new_tokens"] for r in rows) / sum(r[n]["wall_s"] for r in rows),
            "target_forwards": sum(r[n]["target_forwards"] for r in rows),
            "new_tokens": sum(r[n]["new_tokens"] for r in rows),
        }
    for n in SPECULATIVE:
        out[n]["identical_to_greedy"] = sum(r[n]["identical_to_greedy"] for r in rows)
    for a, b in (("draftsmith", "hf_assisted"), ("draftsmith_own_cache", "hf_assisted"), ("draftsmith", "greedy"),
                 ("hf_assisted", "greedy")):
        out[f"ratio_{a}_over_{b}"] = ratio(a, b)
        out[f"cpu_ratio_{a}_over_{b}"] = cpu_ratio(a, b)
    return out


@torch.inference_mode()
def acceptance_sweep(
    target: Target, prompts: list[list[int]], depths: list[int], k: int, max_new_tokens: int, k_max: int = 4
) -> list[dict[str, Any]]:
    """Greedy acceptance of the self-speculative layer-skip drafter at several depths.

    Acceptance is measured with ``k_max`` drafts per round; in greedy mode the first k' < k_max
    positions behave exactly as with k' drafts, so the histogram also gives τ for every
    smaller k: τ(k') = 1 + Σ_{i ≤ k'} P(accepted ≥ i). Speed is measured at ``k`` drafts per
    round, relative to plain greedy on the same prompts, by CPU time (steadier on a shared
    machine) and wall time.
    """
    k_max = max(k, k_max)
    drafters = {n: layer_skip_drafter(target.model, n, share_cache=True) for n in depths}
    totals = {n: DecodeStats(k=k_max) for n in depths}
    spent = {n: [0.0, 0.0, 0] for n in depths}  # wall, cpu, tokens at k
    greedy = [0.0, 0.0, 0]
    speculative_decode(target, drafters[depths[0]], prompts[0], k=k, max_new_tokens=8)  # warm-up
    for p in prompts:
        tokens, wall, cpu = _timed(lambda: target_greedy(target, p, max_new_tokens))
        greedy = [greedy[0] + wall, greedy[1] + cpu, greedy[2] + len(tokens)]
        for n in depths:
            res = speculative_decode(target, drafters[n], p, k=k_max, max_new_tokens=max_new_tokens)
            totals[n] = totals[n].merge(res.stats)
            tokens, wall, cpu = _timed(lambda: speculative_decode(target, drafters[n], p, k=k, max_new_tokens=max_new_tokens).tokens)
            spent[n] = [spent[n][0] + wall, spent[n][1] + cpu, spent[n][2] + len(tokens)]
    out = []
    for n in depths:
        st = totals[n]
        at_least = [sum(st.accept_hist[i:]) / st.rounds for i in range(1, k_max + 1)]  # P(accepted ≥ i)
        wall, cpu, toks = spent[n]
        out.append({
            "num_layers": n,
            "acceptance_at_position": st.summary()["acceptance_at_position"],
            "tau_with_bonus_by_k": {kk: round(1 + sum(at_least[:kk]), 3) for kk in range(1, k_max + 1)},
            "k_timed": k,
            "speed_over_greedy_wall": (toks / wall) / (greedy[2] / greedy[0]),
            "speed_over_greedy_cpu": (toks / cpu) / (greedy[2] / greedy[1]),
        })
    return out


# ------------------------------------------------------------------ the script


def run_bench_decode(
    target_name: str,
    dtypes: list[str],
    num_layers: int,
    k: int,
    num_prompts: int,
    max_new_tokens: int,
    sweep_layers: list[int],
    threads: int,
    out_path: str,
) -> dict[str, Any]:
    """Load the target per dtype, run :func:`bench_decode` (and the sweep), print tables, write JSON."""
    set_threads(threads)
    questions = load_questions("mtbench", num_prompts + 1)  # +1: the warm-up prompt
    report: dict[str, Any] = {"threads": torch.get_num_threads(), "results": {}, "sweep": None}
    for dtype in dtypes:
        target = load_target(target_name, dtype=dtype)
        prompts = first_turns(target, questions)
        print(f"\n== {target.name} {dtype} on {target.device}: layer-skip {num_layers}/{target.num_layers} layers, "
              f"k={k}, {num_prompts} MT-bench prompts, max_new_tokens={max_new_tokens}, "
              f"{torch.get_num_threads()} threads")
        res = bench_decode(target, prompts, num_layers, k, max_new_tokens, progress=print)
        res["target"] = describe(target)
        report["results"][dtype] = res
        print(format_summary(res["summary"], res["draftsmith_stats"]))
        if sweep_layers and dtype == dtypes[0]:
            print(f"\n== acceptance of a plain early exit by depth ({dtype}, greedy; speed timed at k={k})")
            report["sweep"] = acceptance_sweep(target, prompts[1:], sweep_layers, k, max_new_tokens)
            print(format_sweep(report["sweep"]))
        write_json(out_path, report)
    print(f"\nwrote {out_path}")
    return report


def format_summary(s: dict[str, Any], ds: dict[str, Any]) -> str:
    lines = markdown_table(
        ["method", "median tok/s", "aggregate tok/s", "target forwards", "identical to greedy"],
        [[n, f"{s[n]['median_tokens_per_s']:.2f}", f"{s[n]['aggregate_tokens_per_s']:.2f}", s[n]["target_forwards"],
          f"{s[n]['identical_to_greedy']}/{s['prompts']}" if n != "greedy" else "(reference)"]
         for n in (*SPECULATIVE, "greedy")])
    lines += [""] + markdown_table(
        ["speed ratio", "median of per-prompt tok/s ratios", "by total CPU time"],
        [[f"{a} / {b}", f"{s[f'ratio_{a}_over_{b}']:.3f}×", f"{s[f'cpu_ratio_{a}_over_{b}']:.3f}×"]
         for a, b in (("draftsmith", "hf_assisted"), ("draftsmith_own_cache", "hf_assisted"), ("draftsmith", "greedy"),
                      ("hf_assisted", "greedy"))])
    lines.append(f"draftsmith: tau (bonus token counted) = {ds['tau_with_bonus']:.3f}, acceptance "
                 f"{ds['acceptance_rate']:.3f}, per position (cumulative) {ds['acceptance_at_position']}")
    return "\n".join(lines)


def format_sweep(rows: list[dict[str, Any]]) -> str:
    ks = list(rows[0]["tau_with_bonus_by_k"])
    kt = rows[0]["k_timed"]
    header = ["layers", "acceptance at position 1..k (cumulative)", *(f"τ k={kk}" for kk in ks),
              f"speed / greedy at k={kt} (CPU)", "(wall)"]
    return "\n".join(markdown_table(header, [
        [r["num_layers"], ", ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_at_position"]),
         *(f"{r['tau_with_bonus_by_k'][kk]:.2f}" for kk in ks), f"{r['speed_over_greedy_cpu']:.2f}×",
         f"{r['speed_over_greedy_wall']:.2f}×"] for r in rows], left=2))


def main(argv: list[str] | None = None) -> int:
    ap = script_parser(__doc__, target=True, threads=True)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes to run (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=None, help="layer-skip depth (default: the layer-skip recipe's)")
    ap.add_argument("--k", type=int, default=None, help="draft tokens per round (default: the layer-skip recipe's)")
    ap.add_argument("--prompts", type=int, default=10, help="timed MT-bench prompts, after 1 warm-up (default: 10)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sweep-layers", default="", help="also measure acceptance at these depths, e.g. 8,16,24")
    ap.add_argument("--out", default="benchmarks/out/decode.json", help="where the JSON results go")
    args = ap.parse_args(argv)
    recipe = load_recipe("smollm2-135m-layerskip")
    layers = args.layers if args.layers is not None else recipe.drafter.num_layers
    k = args.k if args.k is not None else recipe.decode.k
    if k < 1 or args.prompts < 1 or args.max_new_tokens < 1:
        ap.error("--k, --prompts and --max-new-tokens must be at least 1")
    try:
        sweep = [int(x) for x in args.sweep_layers.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sweep-layers must be comma-separated integers, got '{args.sweep_layers}'")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    run_bench_decode(args.target, dtypes, layers, k, args.prompts, args.max_new_tokens, sweep, args.threads, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
