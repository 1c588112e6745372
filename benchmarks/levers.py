"""Which training levers buy acceptance? One recipe trained with one lever changed at a time, and the table.

    python benchmarks/levers.py train CONFIG OUT [--only a,b] [override ...]   # OUT/<variant>, missing ones
    python benchmarks/levers.py decode RUN [RUN ...] [--prompts 20] [--ks 3,4] [--max-new-tokens 96] \
        [--questions mtbench|copyheavy|FILE.jsonl]            # RUN: a run folder, or a drafter folder in one
    python benchmarks/levers.py table RUN_DIR [RUN_DIR ...]                     # a markdown row per run

``train`` runs ``draftsmith train -c CONFIG run_dir=OUT/<variant>`` for each variant of :data:`VARIANTS` (or those
of ``--only``) whose ``train_summary.json`` is missing (a killed run resumes from its checkpoint), one after
another, each on ``OMP_NUM_THREADS`` threads (1 unless set: no figure here depends on it, and two ``train``
commands side by side use two cores better than one on both); wandb off. Same data, steps, schedule and seed as
CONFIG and the overrides given (e.g. a demo run's ``eagle3/config.yaml``, or the recipe with the demo's train
overrides): only the variant's overrides differ, and they come last, so they win over the given ones (``ttt3``
over a given ``train.ttt_steps=2``); each lever is measured alone at a fixed budget.

``decode`` runs each run's ``drafter-best`` in the built-in decoder, greedy, as plain chains of each k in ``--ks``
(no gate, no tree) on the first ``--prompts`` MT-bench first turns, the target in bf16 (the dtype speed is measured
in; τ in fp32 differs only where bf16 rounding moves a near-tie), and writes ``levers_decode.json`` into the run
folder: τ (bonus counted) and the acceptance by position at each k. The target and prompts are loaded once. Given a
drafter folder inside a run instead (``RUN/drafter-raw``: a run with ``train.ema_decay`` keeps its raw final weights
there, beside the average in ``drafter/`` and ``drafter-best/``), it decodes that one and writes
``levers_decode.<folder>.json`` into the run folder.

``table`` reads each run folder's ``train_summary.json``, ``logs/train.rank0.jsonl`` and, when present,
``levers_decode.json``: held-out sim τ at the end and at its best, held-out top-1 agreement and expected acceptance
per unrolled step, the held-out loss, the training loss at steps 10 / 50 / 100 / last, and the decoded τ; for a run
with ``train.ema_decay`` (whose held-out figures and drafter-best are the moving average's) also the raw weights'
held-out sim τ at the end and at its best, and ``drafter-raw``'s decoded τ where decoded. None of these depends on
the machine's load. Figures: benchmarks/RESULTS.md, "levers" and "EAGLE-3.1 norms".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from draftsmith.tables import markdown_row, markdown_table

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import script_parser  # noqa: E402 — the benchmarks folder is not a package

BEST_HEAD = ["drafter.init_from_layer=-1", "train.loss_positions=all", "drafter.feature_layers=[1,14,28]"]
"""The best head measured at the full budget (init_last+all_tokens+top_layer), the base the later levers add to."""

VARIANTS: dict[str, list[str]] = {
    "base": [],
    # the head's layer starts as the target's: the last one (-1), or the one after the highest fused layer (27 on
    # SmolLM2's 30 layers, fused 1/14/26); fc passes the highest fused layer through (drafters/eagle3.py)
    "init_last": ["drafter.init_from_layer=-1"],
    "init_next": ["drafter.init_from_layer=27"],
    # the lm_head left at the target's rows (fewer trainable weights on little data)
    "frozen_lm_head": ["drafter.freeze_lm_head=true"],
    # decoupled weight decay (AdamW): the recipe has none, and the head overfits a small data set
    "weight_decay": ["train.optimizer.weight_decay=0.1"],
    # a second decoder layer after EAGLE-3's (speculators' num_hidden_layers = 2)
    "layers2": ["drafter.num_layers=2"],
    # the loss: LK losses aim at the acceptance Σ min(p, q) itself (train/losses.py)
    "lk_alpha": ["train.loss.kind=lk_alpha"],
    "lk_hybrid": ["train.loss.kind=lk_hybrid"],
    "tvd": ["train.loss.kind=tvd"],
    # GRIFFIN's token-alignable training: step j trains only rows whose earlier steps kept the target's token in
    # their top 1 (a chain) or top 3 (the demo's tree)
    "align1": ["train.align_top_k=1"],
    "align3": ["train.align_top_k=3"],
    # a deeper training-time test: the head unrolled on its own states for more steps
    "ttt3": ["train.ttt_steps=3"],
    "ttt4": ["train.ttt_steps=4"],
    # the learning-rate schedule
    "constant_lr": ["train.schedule.kind=constant"],
    "linear_lr": ["train.schedule.kind=linear", "train.schedule.min_lr_ratio=0.0"],
    # EAGLE-3.1's norms (fc_norm and norm_before_fc exclude each other)
    "fc_norm": ["drafter.fc_norm=true"],
    "norm_before_fc": ["drafter.norm_before_fc=true"],
    "fc_norm+norm_output": ["drafter.fc_norm=true", "drafter.norm_output=true"],
    # combinations of the levers that won alone
    "init_last+frozen_lm_head": ["drafter.init_from_layer=-1", "drafter.freeze_lm_head=true"],
    "init_last+ttt3": ["drafter.init_from_layer=-1", "train.ttt_steps=3"],
    # EAGLE-1's augmentation: uniform noise U(-0.1, 0.1) on the target features the head reads
    "init_last+noise": ["drafter.init_from_layer=-1", "train.feature_noise=0.1"],
    # the high feature from the last layer llama.cpp can capture (28 of SmolLM2's 30: the input of the last layer; the
    # last layer's own output is no llama.cpp feature, export/conventions.py)
    # instead of EAGLE-3's 26 (drafters/eagle3.py's default_eagle3_layers)
    "init_last+top_layer": ["drafter.init_from_layer=-1", "drafter.feature_layers=[1,14,28]"],
    # every token a training target, the prompt's included (held-out figures stay over answer tokens)
    "init_last+all_tokens": ["drafter.init_from_layer=-1", "train.loss_positions=all"],
    "init_last+all_tokens+top_layer": [*BEST_HEAD],
    # the best head at the full budget with each of the two levers that were level or a little ahead alone
    "init_last+all_tokens+top_layer+noise": [*BEST_HEAD, "train.feature_noise=0.1"],
    "init_last+all_tokens+top_layer+ttt3": [*BEST_HEAD, "train.ttt_steps=3"],
    # both of them together
    "init_last+all_tokens+top_layer+ttt3+noise": [*BEST_HEAD, "train.ttt_steps=3",
                                                  "train.feature_noise=0.1"],
    # CORAL's cross-step representation alignment on the best head: an InfoNCE pulling the head's states at one row
    # together across the unrolled steps (train/losses.py:cross_step_alignment), weight 0.1 and τ 0.07 (the paper's own
    # values could not be read: ours, the term then ~10 % of the objective)
    "init_last+all_tokens+top_layer+coral": [*BEST_HEAD, "train.coral_weight=0.1"],
    # a bias-corrected moving average of the weights (train/ema.py): its drafter and held-out figures beside the raw
    # weights' (drafter-raw, raw/sim_tau) in one run. 0.98 averages about the last 50 steps, under a tenth of the full
    # budget's 600: its lag stays short while held-out figures still rise at the end; 0.99 would lag ~100 steps
    "init_last+all_tokens+top_layer+ema": [*BEST_HEAD, "train.ema_decay=0.98"],
    # HASS's harmonized objective distillation at its defaults: + 1.0 · −Σ over the target's top 10 of p log q
    "init_last+all_tokens+top_layer+hass": [*BEST_HEAD, "train.loss.top_k=10",
                                            "train.loss.top_k_weight=1.0"],
    "init_last+all_tokens+top_layer+hass+ema": [*BEST_HEAD, "train.loss.top_k=10",
                                                "train.loss.top_k_weight=1.0", "train.ema_decay=0.98"],
    # Draft-OPD's on-policy states replayed offline (train/eagle3.py:reached_by_chains): the (row, step) pairs the
    # head's own greedy chains reach when decoding weigh 1 + 2, the rest 1
    "init_last+all_tokens+top_layer+replay": [*BEST_HEAD, "train.replay_weight=2.0"],
    # the peak learning rate doubled (the recipe's 2e-3, cosine to a tenth): every full-budget run was still improving
    # at its last step
    "init_last+all_tokens+top_layer+lr4e-3": [*BEST_HEAD, "train.optimizer.lr=0.004"],
    # on the best head: decoupled weight decay (the `weight_decay` variant above, never run before: AdamW 0.1 on every
    # trainable weight, norms included) against overfitting, and the hard cross-entropy on the target's argmax
    # (DistillSpec's "ce"): greedy decoding accepts the argmax only, the soft CE also pays for the rest of p
    "init_last+all_tokens+top_layer+weight_decay": [*BEST_HEAD, "train.optimizer.weight_decay=0.1"],
    "init_last+all_tokens+top_layer+ce": [*BEST_HEAD, "train.loss.kind=ce"],
    # on the best head: the soft labels at distillation temperature 2 (both distributions softmax(logits / 2) in the
    # loss; greedy drafting reads the argmax, which no temperature moves): more of the target's distribution per row,
    # the classic KD lever for small data; and the unrolled steps weighted 1, 0.5 instead of 1, 0.8 (a third TTT step
    # took acceptance from the first draft, which carries about three times the second's weight in a chain's τ)
    "init_last+all_tokens+top_layer+kd_t2": [*BEST_HEAD, "train.loss.temperature=2.0"],
    "init_last+all_tokens+top_layer+decay0.5": [*BEST_HEAD, "train.loss.step_decay=0.5"],
    "init_last+all_tokens+top_layer+decay0.3": [*BEST_HEAD, "train.loss.step_decay=0.3"],
    # kd_t2 and decay0.5 together
    "init_last+all_tokens+top_layer+kd_t2+decay0.5": [*BEST_HEAD, "train.loss.temperature=2.0",
                                                      "train.loss.step_decay=0.5"],
    # the temperature's trend on the best head: 3 and 1.5 beside 2 (and 1: the best head under RESULTS' overrides)
    "init_last+all_tokens+top_layer+kd_t3": [*BEST_HEAD, "train.loss.temperature=3.0"],
    "init_last+all_tokens+top_layer+kd_t1.5": [*BEST_HEAD, "train.loss.temperature=1.5"],
    # a second seed (the head's random weights, the batch order and the held-out split) of the best head at
    # temperatures 1 and 2: whether temperature 2's gain is larger than what a seed moves
    "init_last+all_tokens+top_layer+kd_t1+seed1": [*BEST_HEAD, "train.loss.temperature=1.0",
                                                   "drafter.seed=1", "train.seed=1"],
    "init_last+all_tokens+top_layer+kd_t2+seed1": [*BEST_HEAD, "train.loss.temperature=2.0",
                                                   "drafter.seed=1", "train.seed=1"],
    # the same two on the recipe's head (the default budget's cache has no layer 28)
    "init_last+all_tokens+replay": ["drafter.init_from_layer=-1", "train.loss_positions=all", "train.replay_weight=2.0"],
    "init_last+all_tokens+lr4e-3": ["drafter.init_from_layer=-1", "train.loss_positions=all", "train.optimizer.lr=0.004"],
    # L2-SP: the trainable weights pulled toward those they started from (the target's layer, fc's pass-through, the
    # target's lm_head rows) instead of toward zero (train/l2sp.py), at five strengths; on the recipe as it is
    "l2sp0.0001": ["train.l2sp_weight=0.0001"],
    "l2sp0.001": ["train.l2sp_weight=0.001"],
    "l2sp0.01": ["train.l2sp_weight=0.01"],
    "l2sp0.1": ["train.l2sp_weight=0.1"],
    "l2sp1": ["train.l2sp_weight=1.0"],
}
"""Variant name → the overrides it adds to the recipe; ``base`` is the recipe itself."""

DECODE_PROMPTS = 20
"""MT-bench first turns ``decode`` runs by default, the count whose figures the table reads."""


def train(config: str, out: str, only: list[str] | None, overrides: list[str]) -> None:
    unknown = sorted(set(only or []) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}; choose from: {', '.join(VARIANTS)}")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    for name in only or list(VARIANTS):
        run_dir = os.path.join(out, name)
        if os.path.isfile(os.path.join(run_dir, "train_summary.json")):
            continue
        os.makedirs(out, exist_ok=True)
        cmd = [sys.executable, "-m", "draftsmith.cli", "train", "-c", config, f"run_dir={run_dir}",
               "train.logging.wandb=disabled", "train.logging.progress=false", *overrides, *VARIANTS[name]]  # the lever wins
        print(" ".join(cmd), flush=True)
        with open(os.path.join(out, f"{name}.log"), "a") as log:
            subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def decode_source(path: str) -> tuple[str, str, str]:
    """(run folder, drafter folder, its name) of a ``decode`` argument: a run folder decodes its ``drafter-best``, a
    drafter folder inside a run (``RUN/drafter-raw``) itself."""
    from draftsmith.train.save import BEST

    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, "config.yaml")):
        return path, os.path.join(path, BEST), BEST
    run_dir = os.path.dirname(path)
    if os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(run_dir, "config.yaml")):
        return run_dir, path, os.path.basename(path)
    raise SystemExit(f"{path} is neither a run folder (config.yaml) nor a drafter folder inside one "
                     f"(config.json, and config.yaml beside it)")


def decode_file(drafter: str, source: str = "mtbench", prompts: int = 0) -> str:
    """The name ``decode`` writes a drafter's figures under in its run folder (module docstring)."""
    from draftsmith.train.save import BEST

    set_name = os.path.splitext(os.path.basename(source))[0]
    base = "levers_decode" if (source, prompts or DECODE_PROMPTS) == ("mtbench", DECODE_PROMPTS) else \
        f"levers_decode-{set_name}{'' if prompts in (0, DECODE_PROMPTS) else prompts}"
    return f"{base}.json" if drafter == BEST else f"{base}.{drafter}.json"


def decode(run_dirs: list[str], prompts: int, ks: list[int], max_new_tokens: int, source: str = "mtbench") -> None:
    """``levers_decode.json`` on :data:`DECODE_PROMPTS` MT-bench prompts; on another prompt set (``--questions``: the
    training data's own held-out prompts, say) or count, ``levers_decode-<set>[<count>].json`` beside it, which the
    table does not read; a drafter folder other than drafter-best: ``.<folder>`` before ``.json``."""
    from dataclasses import replace

    from draftsmith.config import load_recipe
    from draftsmith.files import write_json
    from draftsmith.measure.evaluate import evaluate
    from draftsmith.measure.prompts import load_questions
    from draftsmith.target import load_target

    target, questions = None, load_questions(source, prompts)
    for path in run_dirs:
        run_dir, folder, drafter_name = decode_source(path)
        name = decode_file(drafter_name, source, prompts)
        recipe = load_recipe(os.path.join(run_dir, "config.yaml"), [
            "drafter.type=saved", f"drafter.path={folder}", "target.dtype=bfloat16",
            f"decode.max_new_tokens={max_new_tokens}", "decode.min_confidence=0.0", "decode.tree=none",
            "decode.temperature=0.0"])
        target = target or load_target(recipe.target)
        drafter = recipe.drafter.build(target)
        out: dict[str, Any] = {"questions": source, "prompts": prompts, "max_new_tokens": max_new_tokens, "dtype": "bfloat16", "by_k": {}}
        for k in ks:
            stats = evaluate(target, drafter, questions, replace(recipe.decode, k=k), progress=False).stats.summary()
            out["by_k"][str(k)] = {"tau_with_bonus": stats["tau_with_bonus"],
                                   "acceptance_at_position": stats["acceptance_at_position"]}
            print(f"{path}: k={k} tau {stats['tau_with_bonus']:.3f} acceptance "
                  + " ".join(f"{a:.3f}" for a in stats["acceptance_at_position"]), flush=True)
        write_json(os.path.join(run_dir, name), out)


def row(run_dir: str) -> str:
    """The run's line of the table (:data:`COLUMNS`)."""
    return markdown_row(cells(run_dir))


def cells(run_dir: str) -> list[str]:
    """The run's cells under :data:`COLUMNS`, from its train_summary.json, train log and decode files."""
    from draftsmith.train.save import BEST, RAW_DRAFTER

    summary = json.load(open(os.path.join(run_dir, "train_summary.json")))
    losses: dict[int, float] = {}
    with open(os.path.join(run_dir, "logs", "train.rank0.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec:
                losses[rec["step"]] = rec["loss"]  # a resumed run logs a step again: the later record wins
    held, best, last = summary["heldout"], summary["best"], summary["steps"]
    steps = sorted(k[len("heldout/top1_step"):] for k in held if k.startswith("heldout/top1_step"))
    top1 = " / ".join(f"{held[f'heldout/top1_step{s}']:.3f}" for s in steps)
    accept = " / ".join(f"{held[f'heldout/expected_accept_step{s}']:.3f}" for s in steps)
    curve = " / ".join(f"{losses[s]:.2f}" if s in losses else "–" for s in (10, 50, 100, last))
    raw = "–"
    if "raw/sim_tau" in held:  # train.ema_decay: the figures above are the average's, these the raw weights'
        points = [p for p in summary["sim_tau_curve"] if "raw_sim_tau" in p]
        top = max(reversed(points), key=lambda p: p["raw_sim_tau"])
        raw = f"{held['raw/sim_tau']:.4f}, best {top['raw_sim_tau']:.4f} (step {top['step']})"
        if os.path.isfile(os.path.join(run_dir, decode_file(RAW_DRAFTER))):
            raw += f"; decoded {decoded_taus(run_dir, RAW_DRAFTER)}"
    return [os.path.basename(os.path.normpath(run_dir)), f"**{held['sim_tau']:.4f}**",
            f"{best['sim_tau']:.4f} (step {best['step']})", top1, accept, f"{held['heldout/loss']:.2f}", curve,
            decoded_taus(run_dir, BEST), raw]


def decoded_taus(run_dir: str, drafter: str) -> str:
    """τ at each decoded k of ``drafter``'s :func:`decode_file` on the default prompts, or – when not decoded."""
    path = os.path.join(run_dir, decode_file(drafter))
    if not os.path.isfile(path):
        return "–"
    by_k = json.load(open(path))["by_k"]
    return " / ".join(f"{by_k[k]['tau_with_bonus']:.3f}" for k in sorted(by_k, key=int))


COLUMNS = ("run", "held-out sim τ", "best (step)", "top-1 per step", "expected acceptance per step", "held-out loss",
           "train loss at 10 / 50 / 100 / last", "τ decoded, chain of k (bf16)",
           "raw weights of an EMA run: held-out sim τ, best; decoded")
"""The cells of :func:`row`, in order: the one home of the table's header (``data_curve.py table`` extends it)."""


def table(run_dirs: list[str]) -> None:
    print("\n".join(markdown_table(COLUMNS, [])))
    for run_dir in run_dirs:
        print(row(run_dir))


def main(argv: list[str] | None = None) -> None:
    parser = script_parser(__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the variants of a recipe")
    t.add_argument("config")
    t.add_argument("out")
    t.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    t.add_argument("overrides", nargs="*")
    d = sub.add_parser("decode", help="decode each run's drafter-best as chains")
    d.add_argument("run_dirs", nargs="+")
    d.add_argument("--prompts", type=int, default=DECODE_PROMPTS)
    d.add_argument("--ks", default="3,4")
    d.add_argument("--max-new-tokens", type=int, default=96)
    d.add_argument("--questions", default="mtbench", help="mtbench, copyheavy or a JSONL of prompts (measure/prompts.py)")
    s = sub.add_parser("table", help="a markdown row per run")
    s.add_argument("run_dirs", nargs="+")
    args, extra = parser.parse_known_args(argv)  # overrides may follow --only
    if extra and args.command != "train":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "train":
        train(args.config, args.out, [x for x in args.only.split(",") if x] or None, args.overrides + extra)
    elif args.command == "decode":
        decode(args.run_dirs, args.prompts, [int(k) for k in args.ks.split(",")], args.max_new_tokens, args.questions)
    else:
        table(args.run_dirs)


if __name__ == "__main__":
    main()
