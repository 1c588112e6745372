"""Training of an EAGLE-3 head on SmolLM2-135M-Instruct on this machine: throughput and a short real run.

    python benchmarks/train.py throughput          # online vs offline target tokens/s, interleaved rounds
    python benchmarks/train.py throughput --compare dtype   # offline, fp32 vs bf16 engine (and target)
    python benchmarks/train.py throughput --compare order --prepared runs/demo/prepare/data
                                                   # offline, random vs length-grouped micro-batches
    python benchmarks/train.py short-run           # a few minutes of training: held-out acceptance and
                                                   # decoder τ of the untrained vs the trained head

Both first prepare (or reuse) ShareGPT data with ``draftsmith prepare``'s stages tokenize →
features → vocab under ``--data-dir``: the conversations' own answers, cut to ``--max-length``,
EAGLE-3's feature layers plus the last (offline cache), and a reduced draft vocabulary.

throughput
    The same EAGLE-3 recipe (7-step training-time test, the draft vocabulary) trained for
    ``--steps`` optimizer steps with the target **online** (a frozen forward per batch) and
    **offline** (features and logits from the cache: the target's final norm and lm_head on
    its cached last layer), alternating online/offline ``--rounds`` times in one process.
    The figure is target tokens per second of training (all real tokens of the batches, the
    first step of each run left out as warm-up; evaluation, checkpointing and setup are not
    timed). Prints medians per mode and the offline/online ratio of each round. With
    ``--compare dtype`` both runs are offline and differ in precision instead: an fp32 target and
    engine (ZeRO-0) vs a bf16 target and DeepSpeed's bf16 engine (ZeRO-0, fp32 master weights). With
    ``--compare order`` both are offline and differ in the batch order: random micro-batches
    (``train.group_by_length=0``) vs length-grouped ones (the default).

short-run
    ``--steps`` steps of EAGLE-3 training (offline by default), then the trained head and the
    untrained one (same seed) are measured by the same code: held-out expected acceptance
    Σ min(p, q) per unrolled step (``train`` held-out metrics, before the first and after the last
    step) and τ in the built-in speculative decoder (``draftsmith.measure.evaluate.evaluate``, greedy, on
    the first ``--prompts`` MT-bench questions).

Writes ``benchmarks/out/train_<mode>.json``; the figures go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import offline, save_result, script_parser  # noqa: E402 — the benchmarks folder is not a package


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = script_parser(__doc__, threads=True)
    p.add_argument("mode", choices=["throughput", "short-run"])
    p.add_argument("--data-dir", default="benchmarks/out/train-data", help="where the prepared data goes (reused)")
    p.add_argument("--conversations", type=int, default=400, help="ShareGPT conversations to prepare")
    p.add_argument("--max-length", type=int, default=256, help="tokens per training sequence")
    p.add_argument("--vocab", type=int, default=8192, help="draft vocabulary size")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (default: 6 for throughput, 150 short-run)")
    p.add_argument("--rounds", type=int, default=2, help="throughput: online/offline rounds")
    p.add_argument("--compare", choices=["target", "dtype", "order"], default="target",
                   help="throughput: online vs offline target (default), fp32 vs bf16 training (offline), or "
                        "random vs length-grouped micro-batches (offline)")
    p.add_argument("--prepared", default="", help="use this `draftsmith prepare` output folder (e.g. "
                                                 "runs/demo/prepare/data) instead of preparing --data-dir")
    p.add_argument("--lr", type=float, default=1e-3, help="short-run learning rate")
    p.add_argument("--online", action="store_true", help="short-run: run the target online instead of the cache")
    p.add_argument("--prompts", type=int, default=10, help="short-run: MT-bench prompts for τ")
    p.add_argument("--max-new-tokens", type=int, default=64, help="short-run: tokens decoded per prompt")
    p.add_argument("--k", type=int, default=4, help="short-run: draft tokens per round")
    p.add_argument("--out-dir", default="benchmarks/out")
    return p.parse_args(argv)


def prepare_data(args: argparse.Namespace) -> dict[str, str]:
    """Tokenized ShareGPT, the EAGLE-3 + last-layer feature cache and the draft vocabulary (reused if done)."""
    from draftsmith.config import load_recipe
    from draftsmith.data.prepare import PreparedPaths, run_prepare

    if args.prepared:
        paths = PreparedPaths.at(args.prepared)
        return {"tokenized": paths.tokenized, "features": paths.features, "vocab": paths.vocab}

    recipe = load_recipe("smollm2-135m-prepare", [
        "data.stages=[tokenize,features,vocab]", f"data.max_conversations={args.conversations}",
        f"data.render.max_length={args.max_length}", "data.features.layer_ids=[1,14,26,29]",
        f"data.vocab.size={args.vocab}", f"run_dir={args.data_dir}",
    ])
    run_prepare(recipe)
    paths = PreparedPaths.at(recipe.data.resolve_out_dir(recipe.run_dir))
    return {"tokenized": paths.tokenized, "features": paths.features, "vocab": paths.vocab}


def eagle3_recipe(args: argparse.Namespace, data: dict[str, str], run_dir: str, offline: bool, *extra: str):
    from draftsmith.config import load_recipe

    return load_recipe("smollm2-135m-eagle3", [
        f"drafter.draft_vocab={data['vocab']}", f"train.dataset={data['tokenized']}",
        f"train.features={data['features'] if offline else ''}", f"train.batch_size={args.batch_size}",
        f"train.max_length={args.max_length}", f"train.ttt_steps={args.ttt_steps}", "train.logging.every=1",
        "train.logging.wandb=disabled", "train.checkpoint.every=0", "train.eval.decoder_at_end=false",
        "train.schedule.warmup_steps=0", f"run_dir={run_dir}", *extra,
    ])


def step_rates(run_dir: str) -> list[float]:
    """Target tokens/s of each optimizer step after the first (rank 0's log)."""
    with open(os.path.join(run_dir, "logs", "train.rank0.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 1]


def throughput(args: argparse.Namespace, data: dict[str, str]) -> dict:
    import shutil

    from draftsmith.train.run import run_training

    steps = args.steps or 6
    if args.compare == "dtype":
        bf16 = os.path.join(args.out_dir, "zero0_bf16.json")
        os.makedirs(args.out_dir, exist_ok=True)
        with open(bf16, "w", encoding="utf-8") as f:
            json.dump({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}, "gradient_clipping": 1.0}, f)
        modes = {"fp32": (True, ["target.dtype=float32", "train.deepspeed=zero0"]),
                 "bf16": (True, ["target.dtype=bfloat16", f"train.deepspeed={bf16}"])}
    elif args.compare == "order":
        modes = {"random": (True, ["train.group_by_length=0"]), "grouped": (True, [])}
    else:
        modes = {"online": (False, []), "offline": (True, [])}
    first, second = modes
    rates: dict[str, list[float]] = {m: [] for m in modes}
    ratios = []
    for r in range(args.rounds):
        medians = {}
        for mode, (offline, extra) in modes.items():
            run_dir = os.path.join(args.out_dir, f"train-throughput-{mode}")
            shutil.rmtree(run_dir, ignore_errors=True)
            run_training(eagle3_recipe(args, data, run_dir, offline, f"train.steps={steps}", "train.eval.every=0",
                                       "train.eval.heldout=4", "train.logging.progress=false", *extra))
            medians[mode] = statistics.median(step_rates(run_dir))
            rates[mode].append(medians[mode])
            print(f"round {r + 1} {mode:7s}: {medians[mode]:8.1f} target tokens/s (median of {steps - 1} steps)")
        ratios.append(medians[second] / medians[first])
        print(f"round {r + 1} {second}/{first}: {ratios[-1]:.2f}x")
    result = {
        **{f"{m}_tokens_per_s": statistics.median(v) for m, v in rates.items()},
        f"{second}_over_{first}": [round(x, 3) for x in ratios],
        "rounds": rates,
    }
    print(f"\nEAGLE-3 (ttt {args.ttt_steps}, vocab {args.vocab}, batch {args.batch_size}×{args.max_length}) on SmolLM2-135M, "
          f"torch threads {torch.get_num_threads()}:")
    for m in modes:
        print(f"  {m:7s} {result[f'{m}_tokens_per_s']:8.1f} target tokens/s")
    print(f"  {second}/{first} per round {result[f'{second}_over_{first}']}")
    return result


def short_run(args: argparse.Namespace, data: dict[str, str]) -> dict:
    import shutil

    from draftsmith.measure.prompts import load_questions
    from draftsmith.measure.evaluate import evaluate
    from draftsmith.target import load_target
    from draftsmith.train.heldout import step_rates
    from draftsmith.train.run import run_training

    steps = args.steps or 150
    run_dir = os.path.join(args.out_dir, "train-short-run")
    shutil.rmtree(run_dir, ignore_errors=True)
    recipe = eagle3_recipe(args, data, run_dir, not args.online, f"train.steps={steps}", f"train.eval.every={steps}",
                           f"train.optimizer.lr={args.lr}", "train.schedule.min_lr_ratio=0.1", "train.eval.heldout=32",
                           "train.eval.decoder_at_end=true", f"train.eval.decoder_prompts={args.prompts}",
                           f"decode.max_new_tokens={args.max_new_tokens}", f"decode.k={args.k}", "decode.temperature=0")
    target = load_target(recipe.target)
    questions = load_questions(recipe.eval.prompts, args.prompts)
    untrained = evaluate(target, recipe.drafter.build(target), questions, recipe.decode, progress=False).stats
    del target
    t0 = time.perf_counter()
    summary = run_training(recipe)
    wall = time.perf_counter() - t0
    with open(os.path.join(run_dir, "logs", "train.rank0.jsonl"), encoding="utf-8") as f:
        heldout = [r for r in map(json.loads, f) if "heldout/acceptance" in r]
    before, after = heldout[0], heldout[-1]
    trained = summary["decoder"]
    result = {
        "steps": steps,
        "online_target": summary["online_target"],
        "train_wall_s": round(wall, 1),
        "train_tokens": summary["tokens"],
        "heldout_before": {k: round(v, 4) for k, v in before.items() if k.startswith("heldout/")},
        "heldout_after": {k: round(v, 4) for k, v in after.items() if k.startswith("heldout/")},
        "sim_tau_before": round(before["sim_tau"], 4),
        "sim_tau_after": round(after["sim_tau"], 4),
        "best": summary["best"],
        "decoder_untrained": untrained.summary(),
        "decoder_trained": trained,
    }
    print(f"\nEAGLE-3 head on SmolLM2-135M: {steps} steps, {summary['tokens']} target tokens, {wall / 60:.1f} min "
          f"({'offline' if not args.online else 'online'} target)")
    print(f"{'':28s}{'untrained':>12s}{'trained':>12s}")
    rates = [step_rates(r, prefix="heldout/") for r in (before, after)]  # also reads the old key name
    for j in range(args.ttt_steps):
        print(f"  held-out Σmin(p,q) step {j}  {rates[0][j]:12.4f}{rates[1][j]:12.4f}  (conditional, given earlier right)")
    print(f"  sim_tau at k={args.k}            {before['sim_tau']:12.4f}{after['sim_tau']:12.4f}")
    print(f"  held-out drafts/round (impl.) {before['heldout/expected_tokens']:10.4f}{after['heldout/expected_tokens']:12.4f}")
    print(f"  decoder τ (bonus counted)   {untrained.tau:12.3f}{trained['tau_with_bonus']:12.3f}")
    print(f"  decoder acceptance rate     {untrained.acceptance_rate:12.3f}{trained['acceptance_rate']:12.3f}")
    return result


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    offline(args.threads)
    data = prepare_data(args)
    result = throughput(args, data) if args.mode == "throughput" else short_run(args, data)
    result["command"] = "python benchmarks/train.py " + " ".join(argv)
    name = args.mode.replace("-", "_") + ("_dtype" if args.mode == "throughput" and args.compare == "dtype" else "")
    save_result(os.path.join(args.out_dir, f"train_{name}.json"), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
