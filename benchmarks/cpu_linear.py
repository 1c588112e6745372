"""draftsmith's CPU linears (``cpu_kernels/cpu_linear.py``) against torch's own ``F.linear``, side by side in one run.

    python benchmarks/cpu_linear.py --prompts 3 --max-new-tokens 48                  # bf16: our AVX2 kernel / packed oneDNN
    python benchmarks/cpu_linear.py --dtype float32 --prompts 3 --max-new-tokens 48  # fp32: oneDNN vs MKL
    python benchmarks/cpu_linear.py --target /tmp/gemma/gemma-3-270m-q4_k_m.gguf --chat-template plain \
        --threads 1 --cpu-time --repeats 5 --prompts 3 --max-new-tokens 32           # Gemma-3, CPU seconds (under load)

Three tables, each interleaving torch's kernel (inside ``cpu_linear.disabled()``) and ours:

1. one linear of each of the target's shapes at 1 / 2 / 4 / 8 / 16 rows (median ms);
2. the whole target forward over 1 / 2 / 3 / 5 / 9 new tokens on a 100-token cache, and v(k) — the cost
   of verifying k drafts relative to a one-token step, which sets what speculative decoding can win;
3. the target alone (its own greedy ``generate``) in tokens/s on MT-bench first turns: the kernel is in
   the target-alone baseline too, so ``speedup_vs_target`` never credits speculation with it.

bf16 runs our kernel on AVX2 without a bf16 GEMM and oneDNN on packed weights where oneDNN has a bf16 path
(AVX512-BF16, AMX); fp32 runs oneDNN wherever torch has it. ``--cpu-time`` times by ``time.process_time``
(robust to other processes on the machine; with ``--threads 1`` it is the work done). Figures: RESULTS.md,
"cpu_linear", "fp32 linears on oneDNN" and "gemma-3".
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.measure.prompts import load_questions
from draftsmith.decode.reference import target_greedy
from draftsmith.cpu_kernels import cpu_linear
from draftsmith.tables import markdown_row, markdown_table
from draftsmith.target import crop_cache, load_target

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import first_turns, script_parser, set_threads  # noqa: E402 — the benchmarks folder is not a package

NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


clock = time.perf_counter  # time.process_time with --cpu-time


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


def linears(model: nn.Module, repeats: int, dtype: torch.dtype) -> None:
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)})
    rows = [1, 2, 3, 4, 5, 8, 16, 256]  # 256: a prefill or a feature-capture batch
    kind = cpu_linear.route(dtype)
    print("\n" + "\n".join(markdown_table([f"linear [N, K] ({NAMES[dtype]})",
                                           *(f"{r} rows: torch / ours ms" for r in rows)], [])))
    for n, k in shapes:
        w = torch.randn(n, k).to(dtype)
        packed = cpu_linear.pack(w) if kind == "packed" else None
        ours = {"bf16": lambda x: cpu_linear.linear(x, w), "packed": lambda x: cpu_linear.packed_linear(x, packed),
                "onednn": lambda x: cpu_linear.onednn_linear(x, w)}[kind]
        cells = []
        for r in rows:
            x = torch.randn(r, k).to(dtype)
            a = median_ms(lambda: F.linear(x, w), repeats)
            b = median_ms(lambda: ours(x), repeats)
            cells.append(f"{a:.2f} / {b:.2f} ({a / b:.1f}×)")
        print(markdown_row([f"[{n}, {k}]", *cells]), flush=True)


def forwards(target, repeats: int) -> None:
    dtype = NAMES[target.dtype]
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
                    t0 = clock()
                    target.forward(ids, cache)
                    ms[side][n].append((clock() - t0) * 1e3)
                crop_cache(cache, 100)
    rows = []
    for side in ("torch", "ours"):
        med = {n: statistics.median(ms[side][n]) for n in news}
        rows.append([side, *(f"{med[n]:.1f} ms" for n in news), *(f"{med[n] / med[1]:.2f}" for n in (2, 3, 5, 9))])
    print("\n" + "\n".join(markdown_table([f"target forward on a 100-token cache ({dtype})", *(f"{n} new" for n in news),
                                           "v(1)", "v(2)", "v(4)", "v(8)"], rows)), flush=True)


def alone(target, prompts: list[list[int]], max_new: int) -> None:
    rates: dict[str, list[float]] = {"torch": [], "ours": []}
    target_greedy(target, prompts[0], 8)  # warm-up
    for i, p in enumerate(prompts):
        for side in (("torch", "ours") if i % 2 == 0 else ("ours", "torch")):
            with (cpu_linear.disabled() if side == "torch" else contextlib.nullcontext()):
                t0 = clock()
                out = target_greedy(target, p, max_new)
                rates[side].append(len(out) / (clock() - t0))
    ratio = statistics.median(o / t for o, t in zip(rates["ours"], rates["torch"]))
    unit = "CPU tok/s" if clock is time.process_time else "tok/s"
    print(f"\ntarget alone (its own greedy generate, {NAMES[target.dtype]}, {len(prompts)} prompts × {max_new} tokens, {unit}): torch "
          f"{statistics.median(rates['torch']):.1f} tok/s, ours {statistics.median(rates['ours']):.1f} tok/s, "
          f"median per-prompt ratio {ratio:.2f}×")


def main() -> None:
    ap = script_parser(__doc__, target=True, threads=True)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--chat-template", default="auto", help="target.chat_template (plain for a base model)")
    ap.add_argument("--cpu-time", action="store_true", help="time by CPU seconds of this process, not wall seconds")
    args = ap.parse_args()
    global clock
    set_threads(args.threads)
    if args.cpu_time:
        clock = time.process_time
    dtype = getattr(torch, args.dtype)
    if cpu_linear.route(dtype) is None:
        raise SystemExit(f"no draftsmith route for {args.dtype} linears on this CPU (bf16 needs AVX2 or oneDNN's "
                         f"bf16 path; fp32 needs a torch built with oneDNN)")
    target = load_target(args.target, dtype=args.dtype, device="cpu", chat_template=args.chat_template)
    print(f"{target.name}, {args.dtype}, {torch.get_num_threads()} threads, "
          f"{cpu_linear.installed(target.model)} linears on {cpu_linear.describe(target.model)}")
    with torch.inference_mode():
        linears(target.model, args.repeats * 4, dtype)
        forwards(target, args.repeats)
        questions = load_questions("mtbench", args.prompts)
        prompts = first_turns(target, questions)
        alone(target, prompts, args.max_new_tokens)


if __name__ == "__main__":
    main()
