"""Drafters served in llama.cpp against llama.cpp's target alone, beside draftsmith's built-in decoder.

For each drafter (a saved drafter folder, exported here to GGUF by llama.cpp's own converter) and each target GGUF
type: the drafter at k = 1…4, the drafter mixed with ngram-simple, and llama.cpp's n-gram methods, each against
llama.cpp's target alone on the same MT-bench first turns, in paired rotating runs (``measure/engine.py``). Then the
acceptance by position of the same drafter in draftsmith's chain decoder (fp32 HF target, greedy, same prompts, same
k) beside llama.cpp's on the F32 target: the proof that the served drafter is the trained one.

    python benchmarks/engine.py --drafter default=runs/demo/eagle3/drafter --target-types as-loaded,f32,bf16 \\
        --k 1,2,3,4 --p-min 0,0.5 --prompts 8 --max-new-tokens 128 --threads 2

Time it on a quiet machine (llama.cpp's threads spin: under load its speed collapses); the JSON goes to --out.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import draft_types, save_result, script_parser  # noqa: E402 — the benchmarks folder is not a package

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__, target=True)
    p.add_argument("--drafter", action="append", default=[], help="NAME=DIR of a saved drafter (repeatable)")
    p.add_argument("--target-types", default="as-loaded,f32,bf16", help="target GGUF types (as-loaded = the shipped file)")
    p.add_argument("--draft-types", default="auto", help="the drafter's GGUF types served on each target type, "
                                                         "comma-separated, in the same paired runs (auto: its stored "
                                                         "dtype, as eval.engine and export serve it; matched: BF16 on "
                                                         "a BF16 target, else F32)")
    p.add_argument("--k", default="1,2,3,4")
    p.add_argument("--p-min", default="0", help="llama.cpp's --spec-draft-p-min gates served at each k (e.g. 0,0.5); "
                                                "the fastest (k, p-min) is printed and written under 'best'")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ngram", default=None, help="llama.cpp's n-gram methods served beside the drafters, comma-separated "
                                                 "('' for none; default: all of engines.llamacpp.NGRAM_METHODS)")
    p.add_argument("--builtin-k", type=int, default=0, help="k of the built-in decoder comparison (0: the largest --k)")
    p.add_argument("--out", default=os.path.join(HERE, "out", "engine.json"))
    args = p.parse_args(argv)

    from draftsmith.decode.rounds import speculative_decode
    from draftsmith.decode.stats import DecodeStats
    from draftsmith.drafters import load
    from draftsmith.engines import llamacpp
    from draftsmith.measure.engine import measure, table
    from draftsmith.engines.targets import target_gguf_for
    from draftsmith.measure.prompts import load_questions
    from draftsmith.export import export, gguf
    from draftsmith.target import load_target

    ks = [int(x) for x in args.k.split(",")]
    p_mins = [float(x) for x in args.p_min.split(",")]
    types = [t for t in args.target_types.split(",") if t]
    ngram = list(llamacpp.NGRAM_METHODS) if args.ngram is None else [n for n in args.ngram.split(",") if n]
    target = load_target(args.target, "float32", "cpu")
    prompts = [target.render_chat(q.messages()) for q in load_questions("mtbench", args.prompts)]
    llamacpp.binaries()
    results: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "threads": args.threads,
                     "load_before": os.getloadavg(), "drafters": {}}
    drafters = dict(d.split("=", 1) for d in args.drafter) or {"none": ""}
    for name, path in drafters.items():
        entry: dict = {"path": path, "by_target_type": {}}
        exports, family = {}, None
        for kind in types:
            dtypes = draft_types(args.draft_types, kind)
            drafts = {}
            for dtype in dtypes if path else []:
                if dtype not in exports:
                    out = os.path.join(HERE, "out", "engine", name, dtype)
                    info = export(path, "gguf", out, target=args.target, force=True, gguf_type=dtype)
                    exports[dtype] = os.path.join(out, gguf.DRAFT_FILE)
                    family = info["source"]["family"]
                drafts[dtype] = exports[dtype]
            t0 = time.time()
            r = measure(target_gguf_for(args.target, kind, target), prompts, args.max_new_tokens,
                        draft_gguf=drafts if len(drafts) > 1 else next(iter(drafts.values()), None),
                        family=family if path else None, ks=ks, threads=args.threads, repeats=args.repeats,
                        ngram=ngram, p_mins=p_mins, target_type=kind)
            r["seconds"], r["draft_types"] = round(time.time() - t0, 1), list(drafts)
            entry["by_target_type"][kind] = r
            print(f"\n{name}, target {kind}, drafter {'/'.join(drafts) or '-'}:\n" + table(r), flush=True)
        if path and "f32" in entry["by_target_type"]:
            k = args.builtin_k or max(ks)
            drafter = load(path, target)
            ours = DecodeStats(k=k)
            for ids in prompts:
                ours = ours.merge(speculative_decode(target, drafter, ids, k=k, max_new_tokens=args.max_new_tokens).stats)
            theirs = next((r for n, r in entry["by_target_type"]["f32"]["methods"].items()
                           if n.split(" [")[0] == f"drafter k={k}"), {})  # the first draft type's row
            entry["acceptance_builtin_vs_llamacpp"] = {
                "k": k, "builtin_fp32": [None if a is None else round(a, 4) for a in ours.acceptance_at_position],
                "builtin_tau": round(ours.tau, 4), "builtin_accepted_drafted": [ours.accepted, ours.drafted],
                "llamacpp_f32": theirs.get("acceptance_at_position"), "llamacpp_tau": theirs.get("tau"),
                "llamacpp_accepted_drafted": [theirs.get("accepted"), theirs.get("drafted")]}
            a = entry["acceptance_builtin_vs_llamacpp"]
            print(f"acceptance by position, k = {k}: built-in (fp32 HF) {a['builtin_fp32']} tau {a['builtin_tau']} "
                  f"| llama.cpp (F32) {a['llamacpp_f32']} tau {a['llamacpp_tau']}")
        results["drafters"][name] = entry
    results["load_after"] = os.getloadavg()
    save_result(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
