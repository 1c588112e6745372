"""llama-server flags for saved drafters, screened in one paired run against llama.cpp's target alone.

Each ``--row NAME=HEAD:K:P_MIN[:FLAGS]`` serves saved drafter number HEAD of ``--drafters`` (0-based, exported here
to GGUF at its stored dtype, as ``eval.engine`` serves it) at draft length K behind the gate P_MIN, with FLAGS
(llama-server options, space-separated, after draftsmith's own: a later option wins) — the drafter's threads
(``-td 1 -tbd 1``), draft sampling in ggml's graph (``--spec-draft-backend-sampling``), … All rows and the target
alone go through ``measure.engine.measure_methods``: the same prompts, the order rotating, each row's fastest of
``--repeats`` runs, speedup = median of per-prompt ratios to the target alone [90 % bootstrap]. Rows of one K are
also compared with each other, paired per prompt: what a flag alone changes (one HEAD), or a head (one set of
FLAGS).

    python benchmarks/engine_flags.py --drafters OUT/eagle3-2400/drafter-best --target-type f32 \\
        --row "k2=0:2:0.5" --row "k2 td1=0:2:0.5:-td 1 -tbd 1" --prompts 20 --max-new-tokens 128 --threads 2

Time it on a quiet machine, as ``engine.py``; the JSON goes to --out.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import save_result, script_parser  # noqa: E402 — the benchmarks folder is not a package

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_row(text: str) -> tuple[str, int, int, float, tuple[str, ...]]:
    """``NAME=HEAD:K:P_MIN[:FLAGS]`` → (name, head, k, p_min, flags)."""
    name, sep, spec = text.partition("=")
    parts = spec.split(":", 3)
    if not sep or not name or len(parts) < 3:
        raise SystemExit(f"--row {text!r}: expected NAME=HEAD:K:P_MIN[:FLAGS]")
    flags = tuple(parts[3].split()) if len(parts) == 4 else ()
    return name, int(parts[0]), int(parts[1]), float(parts[2]), flags


def paired(rows: list[tuple], methods: dict[str, dict]) -> dict[str, list]:
    """Each two rows of one k: ``"A / B"`` → [median of A's per-prompt speedups over B's, its 90 % interval]."""
    from draftsmith.measure.costs import median_interval

    pairs = {}
    for i, (a, _, ka, *_) in enumerate(rows):
        for b, _, kb, *_ in rows[i + 1:]:
            if ka == kb:
                ratios = [x / y for x, y in zip(methods[a]["per_prompt_speedup"], methods[b]["per_prompt_speedup"])]
                lo, hi = median_interval(ratios)
                pairs[f"{a} / {b}"] = [round(statistics.median(ratios), 4), [round(lo, 4), round(hi, 4)]]
    return pairs


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__, target=True)
    p.add_argument("--drafters", required=True, help="saved drafter folders, comma-separated (HEAD counts from 0)")
    p.add_argument("--row", action="append", default=[], help="NAME=HEAD:K:P_MIN[:FLAGS] (repeatable)")
    p.add_argument("--target-type", default="f32", help="the target's GGUF type")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "out", "engine_flags.json"))
    args = p.parse_args(argv)
    rows = [parse_row(r) for r in args.row]
    if not rows:
        p.error("give at least one --row")

    from draftsmith.engines import llamacpp
    from draftsmith.engines.targets import target_gguf_for
    from draftsmith.export import export, gguf
    from draftsmith.measure.engine import TARGET, Method, measure_methods
    from draftsmith.measure.prompts import load_questions
    from draftsmith.target import load_target

    target = load_target(args.target, "float32", "cpu")
    prompts = [target.render_chat(q.messages()) for q in load_questions("mtbench", args.prompts)]
    heads = [h for h in args.drafters.split(",") if h]
    drafts, families = [], []
    for i, head in enumerate(heads):
        out = os.path.join(HERE, "out", "engine_flags", str(i))
        info = export(head, "gguf", out, target=args.target, force=True, gguf_type="auto")
        drafts.append(os.path.join(out, gguf.DRAFT_FILE))
        families.append(info["source"]["family"])
    model = target_gguf_for(args.target, args.target_type, target)
    todo = [Method(TARGET, llamacpp.ServerSpec(model=model, threads=args.threads))]
    for name, head, k, p_min, flags in rows:
        spec = llamacpp.ServerSpec(model=model, threads=args.threads, draft=drafts[head],
                                   spec_type=llamacpp.SPEC_TYPES[families[head]], n_max=k, p_min=p_min, extra=flags)
        todo.append(Method(name, spec, k))
    t0 = time.time()
    result = measure_methods(todo, prompts, args.max_new_tokens, args.repeats)
    result.update(command=" ".join(sys.argv), date=time.strftime("%Y-%m-%d"), seconds=round(time.time() - t0, 1),
                  load_after=os.getloadavg(), drafters=heads, target_gguf=model,
                  rows={name: {"head": head, "k": k, "p_min": p_min, "flags": list(flags)}
                        for name, head, k, p_min, flags in rows})
    methods = result["methods"]
    print(f"target alone: {methods[TARGET]['tokens_per_s']:.1f} tok/s ({args.target_type}, {args.threads} threads)")
    for name, *_ in rows:
        r = methods[name]
        print(f"{name}: {r['speedup']:.3f}x [{r['interval'][0]:.3f}-{r['interval'][1]:.3f}], tau {r.get('tau')}, "
              f"round cost {r.get('round_cost_steps')} target steps, acceptance {r.get('acceptance_at_position')}, "
              f"identical {r['identical_to_target']}/{len(prompts)}")
    result["paired"] = paired(rows, methods)
    for pair, (median, (lo, hi)) in result["paired"].items():
        print(f"paired {pair}: {median:.3f} [{lo:.3f}-{hi:.3f}]")
    save_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
