"""The decoder's ceiling: an oracle drafter (the decoder's own greedy continuation, free) at k = 1…8
against the target's own greedy ``generate``, beside the bound (k+1)/v(k) measured in the same run.

    python benchmarks/ceiling.py --dtypes bfloat16,float32 --prompts 5 --max-new-tokens 64

The project's bar is ≥ 85 % of the bound in bf16 at k = 4; rerun after every change to the decoder.
The decoder's ceiling is what a drafter that is always right and free gives: τ = k + 1, c = 0, so
``bound(k) = (k + 1) / v(k)`` (the cost model of ``draftsmith/measure/costs.py``). :class:`OracleDrafter`
is that drafter: it proposes the continuation the decoder will emit (its own greedy fixed point, computed
untimed before the timed run), so the measured speedup of the oracle against the target's own ``generate``
shows how much of the bound the decoder loop keeps. Figures and the command are in RESULTS.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.protocol import Proposal
from draftsmith.decode.sampling import Warp
from draftsmith.files import write_json
from draftsmith.measure.costs import verify_costs
from draftsmith.measure.prompts import load_questions
from draftsmith.decode.reference import target_greedy
from draftsmith.tables import markdown_table
from draftsmith.target import Target, describe, load_target

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import first_turns, script_parser, set_threads  # noqa: E402 — the benchmarks folder is not a package


class OracleDrafter:
    """Proposes a known continuation at no cost (greedy only): the decoder's ceiling.

    ``reference`` is the full sequence (prompt + new tokens) the decoder is expected to emit;
    after each update the drafter proposes the next k tokens of it that follow the committed
    sequence, or nothing once the committed sequence has left the reference.
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(self, reference: Sequence[int]):
        self.reference = list(reference)
        self.reset()

    def reset(self) -> None:
        self.length = 0
        self.on_track = True

    def update(self, tokens: Tensor, features: Tensor | None = None) -> None:
        new = tokens.tolist()
        if self.on_track and self.reference[self.length : self.length + len(new)] != new:
            self.on_track = False
        self.length += len(new)

    def propose(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal:
        if not warp.greedy:
            raise ValueError("the oracle drafter proposes a greedy continuation only")
        drafts = self.reference[self.length : self.length + k] if self.on_track else []
        return Proposal(tokens=torch.tensor(drafts, dtype=torch.long), probs=None)


def oracle_reference(target: Target, prompt: list[int], k: int, max_new_tokens: int, tries: int = 4) -> list[int]:
    """The decoder's own greedy output under an oracle, iterated to a fixed point (untimed).

    In fp32 the target's ``generate`` output is already the fixed point. In bf16 a block
    verification rounds differently from one-token steps, so the oracle first proposes the
    decoder's previous output and is refined until the decoder emits exactly what it proposes.
    """
    new = target_greedy(target, prompt, max_new_tokens)
    for _ in range(tries):
        out = speculative_decode(target, OracleDrafter(prompt + new), prompt, k=k, max_new_tokens=max_new_tokens).tokens
        if out == new:
            break
        new = out
    return prompt + new


def bench_ceiling(
    target: Target,
    prompts: list[list[int]],
    ks: Sequence[int],
    max_new_tokens: int,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The oracle drafter at every k against the target's own greedy ``generate``, and the bound.

    Per prompt (after ``warmup`` untimed prompts): the target alone, the oracle at each k (the
    order rotates per prompt), the target alone again; a prompt's target speed is the mean of
    its two runs. The oracle's reference is computed untimed before (:func:`oracle_reference`).
    The bound (k+1)/v(k) comes from :func:`verify_costs` measured in the same run.

    The bound counts decoding rounds only, while both sides also pay the prompt's prefill — on a CPU a
    sizeable share of a short decode (benchmarks/RESULTS.md, "ceiling"). So each
    row also gives the **decode-phase** speedup, (t_alone − P) / (t_oracle − P), with P the prompt's
    prefill (one forward over it into a fresh cache, median of 3, same process), and its share of
    the bound: the loop's own efficiency, which the end-to-end figure dilutes toward 1.

    And the **end-to-end bound**, the bound with the prefill counted as the target alone pays it:
    t_alone / (P + (t_alone − P) · v(k) / (k+1)) per prompt — the fastest any decoder could run
    that prompt end to end, since no drafter shortens the prompt's forward. The oracle's end-to-end
    speedup over it is the share that compares like with like; (k+1)/v(k) itself holds only as the
    answers grow long next to the prompt.
    """
    def prefill_s(prompt: list[int]) -> float:
        ids, times = torch.tensor([prompt], device=target.device), []
        for _ in range(3):
            cache = target.new_cache()
            t0 = time.perf_counter()
            target.forward(ids, cache, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def oracle_run(prompt: list[int], k: int) -> tuple[float, float, int]:
        ref = oracle_reference(target, prompt, k, max_new_tokens)
        res = speculative_decode(target, OracleDrafter(ref), prompt, k=k, max_new_tokens=max_new_tokens)
        return res.stats.tokens_per_s, res.stats.tau, res.stats.new_tokens

    def alone(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        n = len(target_greedy(target, prompt, max_new_tokens))
        return n / (time.perf_counter() - t0)

    for p in prompts[:warmup]:
        alone(p)
        oracle_run(p, max(ks))
    rows: dict[int, list[dict[str, float]]] = {k: [] for k in ks}
    for i, p in enumerate(prompts[warmup:]):
        before = alone(p)
        order = list(ks)[i % len(ks):] + list(ks)[: i % len(ks)]
        runs = {k: oracle_run(p, k) for k in order}
        base = (before + alone(p)) / 2
        prefill = prefill_s(p)
        for k, (tps, tau, n) in runs.items():
            t_alone, t_oracle = n / base, n / tps  # both emit the same n in fp32 (and almost always in bf16)
            rows[k].append({"tokens_per_s": tps, "target_tokens_per_s": base, "speedup": tps / base, "tau": tau,
                            "new_tokens": n, "prefill_s": prefill,
                            "decode_speedup": (t_alone - prefill) / max(t_oracle - prefill, 1e-9),
                            "prefill_share": min(prefill / t_alone, 1.0)})  # f: the end-to-end bound's share
        if progress:
            progress(f"prompt {i + 1}: target {base:.1f} tok/s; oracle speedup "
                     + ", ".join(f"k={k} {runs[k][0] / base:.2f}x" for k in ks))
    v = verify_costs(target, prompts[0], ks)
    table = []
    for k in ks:
        speedup = statistics.median(r["speedup"] for r in rows[k])
        decode = statistics.median(r["decode_speedup"] for r in rows[k])
        bound = (k + 1) / v[k]
        # per prompt: the bound with the prefill (share f of the target's time) paid on both sides
        e2e_bounds = [1 / (r["prefill_share"] + (1 - r["prefill_share"]) / bound) for r in rows[k]]
        e2e = statistics.median(e2e_bounds)
        share_e2e = statistics.median(r["speedup"] / b for r, b in zip(rows[k], e2e_bounds))
        table.append({"k": k, "verify_cost": round(v[k], 3), "bound": round(bound, 3),
                      "oracle_speedup": round(speedup, 3), "share_of_bound": round(speedup / bound, 3),
                      "end_to_end_bound": round(e2e, 3), "share_of_end_to_end_bound": round(share_e2e, 3),
                      "decode_phase_speedup": round(decode, 3), "decode_phase_share_of_bound": round(decode / bound, 3),
                      "prefill_s": round(statistics.median(r["prefill_s"] for r in rows[k]), 4),
                      "oracle_tau": round(statistics.median(r["tau"] for r in rows[k]), 3),
                      "target_tokens_per_s": round(statistics.median(r["target_tokens_per_s"] for r in rows[k]), 2),
                      "oracle_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rows[k]), 2)})
    return {"max_new_tokens": max_new_tokens, "prompts": len(prompts) - warmup, "table": table}


def format_ceiling(res: dict[str, Any], dtype: str) -> str:
    header = [f"k ({dtype})", "v(k)", "bound (k+1)/v(k)", "oracle speedup vs target alone", "share of bound",
              "end-to-end bound (prefill paid)", "share of it", "decode phase (prefill out)", "its share of bound",
              "oracle τ"]
    rows = [[r["k"], f"{r['verify_cost']:.2f}", f"{r['bound']:.2f}×", f"{r['oracle_speedup']:.2f}×",
             f"{100 * r['share_of_bound']:.0f}%", f"{r['end_to_end_bound']:.2f}×",
             f"{100 * r['share_of_end_to_end_bound']:.0f}%", f"{r['decode_phase_speedup']:.2f}×",
             f"{100 * r['decode_phase_share_of_bound']:.0f}%", f"{r['oracle_tau']:.2f}"] for r in res["table"]]
    return "\n".join(markdown_table(header, rows, left=0))


def main() -> None:
    ap = script_parser(__doc__, target=True, threads=True)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--prompts", type=int, default=5, help="timed MT-bench first turns, after one warm-up")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/out/ceiling.json")
    args = ap.parse_args()
    set_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    questions = load_questions("mtbench", args.prompts + 1)
    report = {"threads": torch.get_num_threads(), "results": {}}
    for dtype in args.dtypes.split(","):
        target = load_target(args.target, dtype=dtype)
        prompts = first_turns(target, questions)
        print(f"\n== {target.name} {dtype}, {torch.get_num_threads()} threads, {args.prompts} prompts")
        res = bench_ceiling(target, prompts, ks, args.max_new_tokens, progress=print)
        res["target"] = describe(target)
        report["results"][dtype] = res
        print(format_ceiling(res, dtype))
        write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
