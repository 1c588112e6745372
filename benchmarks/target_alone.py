"""Targets alone, side by side: greedy decoding speed of several targets and dtypes, interleaved per prompt.

    python benchmarks/target_alone.py --target smollm2-135m-instruct --target plain:/path/gemma-3-270m.gguf \\
        --dtypes float32,bfloat16 --prompts 6 --max-new-tokens 64

Every (target, dtype) decodes each MT-bench first turn with draftsmith's own target path (``target_greedy``: the
loop the built-in decoder's "target alone" runs), in an order that rotates per prompt, after a warm-up prompt.
Reported per (target, dtype): the median over prompts of new tokens per wall second and per CPU second of this
process (``time.process_time``, all threads: a figure that a loaded machine moves less than the wall clock).
``plain:`` before a target means ``chat_template=plain`` (a base model). Figures: RESULTS.md, "gemma-3".
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from draftsmith.measure.prompts import load_questions
from draftsmith.decode.reference import target_greedy
from draftsmith.tables import markdown_table
from draftsmith.target import load_target

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import script_parser, set_threads  # noqa: E402 — the benchmarks folder is not a package


def main() -> None:
    ap = script_parser(__doc__, threads=True)
    ap.add_argument("--target", action="append", default=[], help="a target spec, plain:SPEC for a base model (repeatable)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    set_threads(args.threads)
    runs = {}
    for spec in args.target or ["smollm2-135m-instruct"]:
        template, name = ("plain", spec[len("plain:"):]) if spec.startswith("plain:") else ("auto", spec)
        for dtype in args.dtypes.split(","):
            runs[f"{name.rsplit('/', 1)[-1]} {dtype}"] = load_target(name, dtype=dtype, chat_template=template)
    questions = [q.turns[0] for q in load_questions("mtbench", args.prompts + 1)]
    rows: dict[str, list[dict]] = {key: [] for key in runs}
    keys = list(runs)
    for i, question in enumerate(questions):
        for key in keys[i % len(keys):] + keys[:i % len(keys)]:
            target = runs[key]
            prompt = target.render_chat([{"role": "user", "content": question}])
            wall, cpu = time.perf_counter(), time.process_time()
            out = target_greedy(target, prompt, args.max_new_tokens)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if i:  # the first prompt warms every target up
                rows[key].append({"new": len(out), "wall_tok_s": len(out) / wall, "cpu_tok_s": len(out) / cpu})
    print(f"{torch.get_num_threads()} threads, {args.prompts} MT-bench first turns × ≤ {args.max_new_tokens} new tokens")
    summary = {}
    for key, rs in rows.items():
        summary[key] = {m: round(statistics.median(r[m] for r in rs), 2) for m in ("wall_tok_s", "cpu_tok_s")}
    print("\n".join(markdown_table(["target, dtype", "wall tok/s", "CPU tok/s"],
                                   [[key, f"{s['wall_tok_s']:.1f}", f"{s['cpu_tok_s']:.1f}"] for key, s in summary.items()])))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
