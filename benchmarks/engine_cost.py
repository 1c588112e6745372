"""What τ a drafter needs to pay in llama.cpp: its speedup against llama.cpp's target alone at a forced τ.

llama.cpp can replace its verification decisions with synthetic ones (``--spec-synth-len L``: a constant
conditional acceptance p with p + p² + … + p^k = L − 1, docs/speculative.md "Synthetic Acceptance"). Everything else
stays real: the drafter drafts with its own forward, the target verifies k + 1 tokens, the cache is rolled back. So
the speedup at L is the speedup a drafter of *this* architecture and size would have at τ = L in this engine, on
this machine — the engine's cost curve, measured instead of modelled. The output is not valid text (accepted drafts
need not match the target); only the timing is used.

For each target GGUF type and each drafter (a saved drafter folder, exported to GGUF by llama.cpp's converter; its
family decides the spec type, a DFlash block is served whole: k = block − 1) and each k: the drafter with its real
acceptance, and at every L ≤ k + 1 of ``--tau``; all against the target alone, paired per prompt in rotating order
(``measure/engine.py``). Per row: the realised τ from the server's per-round log, the median per-prompt speedup, and the
round cost in target steps; per (drafter, k) the break-even τ, interpolated where the speedup crosses 1.0. One more
row, ``no drafts``, serves the drafter behind a gate no draft passes (p-min above 1): the target steps one token at a
time and the drafter still reads every token and runs its first draft step, so its round cost − 1 is the drafter's
fixed cost per round, what a round costs before any draft is verified.

``--forward`` takes the other part of a round apart: the target's own forward over n = 1 … k + 1 tokens (the
verification of n − 1 drafts), timed by llama.cpp's ``llama-bench`` (built into the managed build folder on first
use, beside the tools ``engines/llamacpp.py`` keeps), in target steps (its one-token decode at a short context).

    python benchmarks/engine_cost.py --drafter eagle3=runs/demo/eagle3/drafter-best \\
        --drafter dflash=runs/demo-dflash/dflash/drafter-best --target-types f32,as-loaded --k 1,3 \\
        --tau 1.5,2,3,4,6 --prompts 4 --max-new-tokens 64 --threads 2

Time it on a quiet machine (llama.cpp's threads spin; under load its speed collapses); the JSON goes to --out.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import draft_types, save_result, script_parser  # noqa: E402 — the benchmarks folder is not a package

HERE = os.path.dirname(os.path.abspath(__file__))
NO_DRAFTS = 1.01
"""A p-min no draft passes (a draft probability is at most 1): the ``no drafts`` row's gate."""


def break_even(points: list[tuple[float, float]]) -> float | None:
    """The τ where speedup crosses 1.0, linearly interpolated between measured (τ, speedup) points; None if it
    never does in the range measured."""
    points = sorted(points)
    for (t0, s0), (t1, s1) in zip(points, points[1:]):
        if s0 < 1.0 <= s1:
            return round(t0 + (1.0 - s0) * (t1 - t0) / (s1 - s0), 3)
    return points[0][0] if points and points[0][1] >= 1.0 else None


def forward_costs(runs: list[list[dict]]) -> dict[int, float]:
    """``llama-bench -o json`` runs → {n: the target's forward over n prompt tokens in target steps}: in each run the
    forward's time over the time per token of its decode record (``n_gen``), seconds apart, then the median over the
    runs (this VM's speed drifts between seconds, so each ratio is taken within one run). n = 1 is the one-token
    forward at an empty context."""
    import statistics

    ratios: dict[int, list[float]] = {}
    for records in runs:
        steps = [r["avg_ns"] / r["n_gen"] for r in records if r["n_gen"] > 0 and r["n_prompt"] == 0]
        if len(steps) != 1:
            raise ValueError(f"expected one decode record (n_gen > 0, n_prompt = 0) per run, got {len(steps)}")
        for r in records:
            if r["n_prompt"] > 0 and r["n_gen"] == 0:
                ratios.setdefault(r["n_prompt"], []).append(r["avg_ns"] / steps[0])
    return {n: round(statistics.median(x), 3) for n, x in sorted(ratios.items())}


def llama_bench(model: str, threads: int, batches: list[int], runs: int) -> list[list[dict]]:
    """llama.cpp's ``llama-bench`` on ``model``, ``runs`` times: one forward over each of ``batches`` prompt tokens
    and a 64-token decode per run; built into the managed build on first use (``llamacpp.build_tool``)."""
    import json
    import subprocess

    from draftsmith.engines import llamacpp

    tool = llamacpp.build_tool("llama-bench")
    cmd = [tool, "-m", model, "-t", str(threads), "-p", ",".join(map(str, batches)), "-n", "64", "-r", "1",
           "-o", "json"]
    return [json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout) for _ in range(runs)]


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__, target=True)
    p.add_argument("--drafter", action="append", default=[], help="NAME=DIR of a saved drafter (repeatable)")
    p.add_argument("--target-types", default="f32,as-loaded", help="target GGUF types (as-loaded = the shipped file)")
    p.add_argument("--k", default="1,3", help="draft lengths of chain drafters (a DFlash block is served whole)")
    p.add_argument("--tau", default="1.5,2,3,4,6", help="forced mean acceptance lengths L (bonus counted)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--server-flags", default="", help="extra llama-server flags for every server, e.g. '-fa on'")
    p.add_argument("--draft-type", default="matched", help="the drafter's GGUF type (matched: BF16 on a BF16 target, "
                                                             "else F32; auto: its stored dtype, as eval.engine serves "
                                                             "it; or f32, bf16, q8_0)")
    p.add_argument("--forward", action="store_true",
                   help="also time the target's forward over 1 … k + 1 tokens with llama-bench, per target type")
    p.add_argument("--forward-runs", type=int, default=20, help="llama-bench runs per target type (each: every test once)")
    p.add_argument("--out", default=os.path.join(HERE, "out", "engine_cost.json"))
    args = p.parse_args(argv)
    if "," in args.draft_type:
        p.error("--draft-type takes one type (benchmarks/engine.py --draft-types serves several side by side)")

    from draftsmith.engines import llamacpp
    from draftsmith.measure.engine import TARGET, Method, measure_methods
    from draftsmith.measure.prompts import load_questions
    from draftsmith.export import export, gguf
    from draftsmith.engines.targets import target_gguf_for
    from draftsmith.target import load_target

    ks = [int(x) for x in args.k.split(",")]
    taus = [float(x) for x in args.tau.split(",")]
    flags = tuple(args.server_flags.split())
    target = load_target(args.target, "float32", "cpu")
    prompts = [target.render_chat(q.messages()) for q in load_questions("mtbench", args.prompts)]
    llamacpp.binaries()
    results: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads,
                     "server_flags": args.server_flags, "draft_type": args.draft_type, "load_before": os.getloadavg(),
                     "runs": []}
    drafters = dict(d.split("=", 1) for d in args.drafter)
    for kind in [t for t in args.target_types.split(",") if t]:
        target_file = target_gguf_for(args.target, kind, target)
        if args.forward:
            records = llama_bench(target_file, args.threads, list(range(1, max(ks) + 2)),
                                  args.forward_runs)
            costs = forward_costs(records)
            results.setdefault("forward", {})[kind] = {"target_steps": costs, "llama_bench": records}
            print(f"target {kind}: forward over n tokens in target steps: "
                  + ", ".join(f"{n}: {c:.2f}" for n, c in costs.items()), flush=True)
        for name, path in drafters.items():
            [dtype] = draft_types(args.draft_type, kind)
            out = os.path.join(HERE, "out", "engine_cost", name, dtype)
            info = export(path, "gguf", out, target=args.target, force=True, gguf_type=dtype)
            family = info["source"]["family"]
            draft = os.path.join(out, gguf.DRAFT_FILE)
            base = dict(model=target_file, threads=args.threads, draft=draft, spec_type=llamacpp.SPEC_TYPES[family])
            own_ks = [info["source"]["drafter"]["block_size"] - 1] if family == "dflash" else ks
            for k in own_ks:
                todo = [Method(TARGET, llamacpp.ServerSpec(model=target_file, threads=args.threads, extra=flags)),
                        Method("real", llamacpp.ServerSpec(**base, n_max=k, extra=flags), k),
                        Method("no drafts", llamacpp.ServerSpec(**base, n_max=k, p_min=NO_DRAFTS, extra=flags), k)]
                todo += [Method(f"tau={t:g}", llamacpp.ServerSpec(**base, n_max=k, extra=flags + (
                    "--spec-synth-len", f"{t:g}")), k) for t in taus if 1.0 < t <= k + 1]
                t0 = time.time()
                r = measure_methods(todo, prompts, args.max_new_tokens, repeats=args.repeats)
                rows = r["methods"]
                points = [(rows[m.name]["tau"], rows[m.name]["speedup"]) for m in todo[1:] if "tau" in rows[m.name]]
                run = {"target_type": kind, "drafter": name, "family": family, "k": k, "seconds": round(time.time() - t0, 1),
                       "alone_tok_s": rows[TARGET]["tokens_per_s"], "rows": rows, "break_even_tau": break_even(points)}
                results["runs"].append(run)
                print(f"\n{name} ({family}) k = {k}, target {kind}: alone {run['alone_tok_s']:.1f} tok/s, "
                      f"break-even tau {run['break_even_tau']}")
                print(f"{'row':<10} {'tau':>6} {'speedup':>8} {'round cost':>11}")
                for m in todo[1:]:
                    x = rows[m.name]
                    print(f"{m.name:<10} {x.get('tau', 0):>6.2f} {x['speedup']:>7.2f}x {x.get('round_cost_steps') or 0:>11.2f}",
                          flush=True)
    results["load_after"] = os.getloadavg()
    save_result(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
