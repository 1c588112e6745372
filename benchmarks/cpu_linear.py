"""The bf16 CPU linear kernel (``kernels/cpu_linear.py``) against torch's own, side by side in one run.

    python benchmarks/cpu_linear.py --prompts 3 --max-new-tokens 48

Three tables, each interleaving torch's kernel (inside ``cpu_linear.disabled()``) and ours:

1. one linear of each of the target's shapes at 1 / 2 / 4 / 8 / 16 rows (median ms);
2. the whole target forward over 1 / 2 / 3 / 5 / 9 new tokens on a 100-token cache, and v(k) — the cost
   of verifying k drafts relative to a one-token step, which sets what speculative decoding can win;
3. the target alone (its own greedy ``generate``) in tokens/s on MT-bench first turns: the kernel is in
   the target-alone baseline too, so ``speedup_vs_target`` never credits speculation with it.

bf16 only (fp32 never uses the kernel). Figures: RESULTS.md, "cpu_linear".
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.eval.prompts import load_questions
from draftsmith.eval.reference import target_greedy
from draftsmith.kernels import cpu_linear
from draftsmith.target import crop_cache, load_target


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def linears(model: nn.Module, repeats: int) -> None:
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)})
    rows = [1, 2, 4, 8, 16]
    print("\n| linear [N, K] (bf16) | " + " | ".join(f"{r} rows: torch / ours ms" for r in rows) + " |")
    print("| --- | " + " | ".join("---:" for _ in rows) + " |")
    for n, k in shapes:
        w = torch.randn(n, k).bfloat16()
        cells = []
        for r in rows:
            x = torch.randn(r, k).bfloat16()
            a = median_ms(lambda: F.linear(x, w), repeats)
            b = median_ms(lambda: cpu_linear.linear(x, w), repeats)
            cells.append(f"{a:.2f} / {b:.2f} ({a / b:.1f}×)")
        print(f"| [{n}, {k}] | " + " | ".join(cells) + " |", flush=True)


def forwards(target, repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (1, 100), generator=g)
    news = [1, 2, 3, 5, 9]
    ms: dict[str, dict[int, list[float]]] = {"torch": {n: [] for n in news}, "ours": {n: [] for n in news}}
    cache = target.new_cache()
    target.forward(prompt, cache)
    for _ in range(repeats):  # interleaved: torch, ours, torch, ours …
        for n in news:
            ids = torch.randint(100, 40000, (1, n), generator=g)
            for side in ("torch", "ours"):
                ctx = cpu_linear.disabled() if side == "torch" else contextlib.nullcontext()
                with ctx:
                    t0 = time.perf_counter()
                    target.forward(ids, cache)
                    ms[side][n].append((time.perf_counter() - t0) * 1e3)
                crop_cache(cache, 100)
    print("\n| target forward on a 100-token cache (bf16) | " + " | ".join(f"{n} new" for n in news) + " | v(1) | v(2) | v(4) | v(8) |")
    print("| --- | " + " | ".join("---:" for _ in news) + " | ---: | ---: | ---: | ---: |")
    for side in ("torch", "ours"):
        med = {n: statistics.median(ms[side][n]) for n in news}
        print(f"| {side} | " + " | ".join(f"{med[n]:.1f} ms" for n in news) + " | "
              + " | ".join(f"{med[n] / med[1]:.2f}" for n in (2, 3, 5, 9)) + " |", flush=True)


def alone(target, prompts: list[list[int]], max_new: int) -> None:
    rates: dict[str, list[float]] = {"torch": [], "ours": []}
    target_greedy(target, prompts[0], 8)  # warm-up
    for i, p in enumerate(prompts):
        for side in (("torch", "ours") if i % 2 == 0 else ("ours", "torch")):
            with (cpu_linear.disabled() if side == "torch" else contextlib.nullcontext()):
                t0 = time.perf_counter()
                out = target_greedy(target, p, max_new)
                rates[side].append(len(out) / (time.perf_counter() - t0))
    ratio = statistics.median(o / t for o, t in zip(rates["ours"], rates["torch"]))
    print(f"\ntarget alone (its own greedy generate, bf16, {len(prompts)} prompts × {max_new} tokens): torch "
          f"{statistics.median(rates['torch']):.1f} tok/s, ours {statistics.median(rates['ours']):.1f} tok/s, "
          f"median per-prompt ratio {ratio:.2f}×")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if not cpu_linear.wanted():
        raise SystemExit("this CPU is not one the kernel is for (it needs AVX2 and no bf16 GEMM in oneDNN)")
    target = load_target(args.target, dtype="bfloat16", device="cpu")
    print(f"{target.name}, bf16, {torch.get_num_threads()} threads, "
          f"{cpu_linear.installed(target.model)} linears on the kernel")
    with torch.inference_mode():
        linears(target.model, args.repeats * 4)
        forwards(target, args.repeats)
        questions = load_questions("mtbench", args.prompts)
        prompts = [target.render_chat([{"role": "user", "content": q.turns[0]}]) for q in questions]
        alone(target, prompts, args.max_new_tokens)


if __name__ == "__main__":
    main()
