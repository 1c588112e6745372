"""c: the cost of one draft step of each drafter family, relative to one one-token target step.

Each drafter (untrained: cost does not depend on the weights) decodes a few MT-bench first turns
at k drafts per round in the built-in decoder; :class:`~draftsmith.measure.costs.TimedDrafter` adds
up the seconds spent in ``propose`` + ``update``, divided by the draft tokens proposed, and by the
median one-token target forward timed right after that drafter's runs (so a machine whose speed drifts
moves both sides of the ratio together; the step is printed per row). ``c per round`` divides by the
rounds instead: what all k drafts of a round cost together — k·c for a chain drafter, one forward
for DFlash, whose whole block (k = block_size − 1 = 7) is one forward:

    python benchmarks/draft_cost.py --dtype bfloat16 --k 4 --prompts 3
    python benchmarks/draft_cost.py --dtype bfloat16 --k 7 --prompts 3 --only "eagle3 (full,dflash"
    python benchmarks/draft_cost.py --dtype bfloat16 --k 7 --prompts 3 --only "dflash (3"   # with and without a draft vocab

With c and the verification cost v(k) the speedup a drafter can give is τ(k) / (v(k) + k·c)
(``draftsmith eval`` prints that prediction beside the measured speedup).
"""

from __future__ import annotations

import os
import sys

import torch

from draftsmith.decode.rounds import speculative_decode
from draftsmith.drafters import DraftLMConfig, Eagle1Config, Eagle3Config, LayerSkipConfig, MedusaConfig
from draftsmith.drafters.dflash import DFlashConfig
from draftsmith.measure.costs import TimedDrafter, target_step_seconds, verify_costs
from draftsmith.measure.prompts import load_questions
from draftsmith.files import write_json
from draftsmith.tables import markdown_row, markdown_table
from draftsmith.target import describe, load_target

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import first_turns, script_parser, set_threads  # noqa: E402 — the benchmarks folder is not a package


def reduced(config, size: int):
    """A drafter of ``config`` (EAGLE-3 or DFlash) over the first ``size`` token ids (cost does not depend on which ids)."""
    def build(target):
        cfg = config.resolve(target)
        d2t = torch.zeros(size, dtype=torch.long)
        t2d = torch.arange(target.vocab_size) < size
        return cfg.runtime(cfg.build_module(target, vocab=(d2t, t2d)), target)
    return build


def eagle3(size: int):
    return reduced(Eagle3Config(draft_vocab_size=size), size)


def dflash(size: int):
    return reduced(DFlashConfig(num_layers=3, block_size=8, draft_vocab_size=size), size)


def families(target) -> dict:
    """Family label → builder, the labels written from this target's own sizes."""
    n, vocab = target.num_layers, target.vocab_size
    return {
        "eagle3 (draft vocab 4,096)": eagle3(4096),
        "eagle3 (draft vocab 8,192)": eagle3(8192),
        "eagle3 (draft vocab 16,384)": eagle3(16384),
        f"eagle3 (full vocab {vocab:,})": lambda t: Eagle3Config(draft_vocab_size=0).build(t),
        "eagle1": lambda t: Eagle1Config().build(t),
        "medusa (4 heads)": lambda t: MedusaConfig(num_heads=4).build(t),
        "draft_lm (4 target layers)": lambda t: DraftLMConfig(num_layers=4).build(t),
        f"layer_skip ({n - 2} of {n} layers, in the target's cache)": lambda t: LayerSkipConfig(num_layers=n - 2).build(t),
        "dflash (3 layers, block 8: one forward per round)": lambda t: DFlashConfig(num_layers=3, block_size=8).build(t),
        "dflash (3 layers, block 8, draft vocab 8,192)": dflash(8192),
        "dflash (3 layers, block 8, draft vocab 16,384)": dflash(16384),
        "dflash (3 layers, block 8, draft vocab 32,768)": dflash(32768),
        "dflash (5 layers, block 16: one forward per round)": lambda t: DFlashConfig(num_layers=5, block_size=16).build(t),
    }


def main() -> None:
    ap = script_parser(__doc__, target=True, threads=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--only", default="", help="comma-separated substrings of family names to run")
    ap.add_argument("--out", default="benchmarks/out/draft_cost.json")
    args = ap.parse_args()
    set_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype)
    prompts = first_turns(target, load_questions("mtbench", args.prompts + 1))
    v = verify_costs(target, prompts[0], [args.k])[args.k]
    rows = []
    print(f"target {args.dtype}, {torch.get_num_threads()} threads, v({args.k}) = {v:.2f}")
    print("\n".join(markdown_table(["drafter", "c (draft step / target step)", "c per round (its k drafts)",
                                   "ms per draft token", "target step ms", "bound τ/(v+kc) at τ=k+1"], [])))
    for name, make in families(target).items():
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        drafter = TimedDrafter(make(target))
        speculative_decode(target, drafter, prompts[0], k=args.k, max_new_tokens=8)  # warm-up
        drafter.seconds, drafter.drafted = 0.0, 0
        rounds = 0
        for p in prompts[1:]:
            rounds += speculative_decode(target, drafter, p, k=args.k, max_new_tokens=args.max_new_tokens).stats.rounds
        step = target_step_seconds(target, prompts[0])  # c's unit timed next to the drafter, not once at the start
        per_token = drafter.seconds / max(drafter.drafted, 1)
        c, c_round = per_token / step, drafter.seconds / max(rounds, 1) / step
        rows.append({"drafter": name, "c": round(c, 4), "c_per_round": round(c_round, 4),
                     "ms_per_draft_token": round(per_token * 1e3, 3),
                     "target_step_ms": round(step * 1e3, 3), "drafted": drafter.drafted, "rounds": rounds})
        print(markdown_row([name, f"{c:.3f}", f"{c_round:.3f}", f"{per_token * 1e3:.2f}", f"{step * 1e3:.2f}",
                            f"{(args.k + 1) / (v + args.k * c):.2f}×"]), flush=True)
    write_json(args.out, {"target": describe(target), "threads": torch.get_num_threads(), "k": args.k,
                          "verify_cost": v, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
