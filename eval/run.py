"""``draftsmith eval``: a drafter in the built-in decoder over a prompt set, with metrics on disk.

:func:`run_eval_recipe` is the whole command (the CLI and the demo call it);
:func:`evaluate` decodes a prompt set with a loaded target and drafter (training-time
evaluation and the benchmarks call it).

Writes to the run folder: ``config.yaml`` (resolved recipe), ``eval_outputs.jsonl``
(one line per prompt: tokens, text, per-prompt stats) and ``eval_metrics.json``
(aggregate stats; τ counts the bonus token, as the file says; ``baselines``: the model-free drafters
of ``eval.baselines`` on the same prompts, see ``baselines.py``).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from tqdm import tqdm

from ..decode.chain import DecodeResult, check_prompt, speculative_decode
from ..decode.protocol import Drafter, common_prefix
from ..decode.stats import DecodeStats
from ..decode.tree import tree_decode
from ..errors import ConfigError, DraftsmithError
from ..files import atomic_path, write_json
from ..kernels import cpu_linear
from ..schema import save_recipe, to_dict
from ..tables import WIDTH, wrapped
from ..target import Target, describe, load_target
from .baselines import baseline_configs, baseline_lines, baseline_rows
from .config import DecodeConfig
from .costs import TimedDrafter, median_interval, predicted_speedup, target_step_seconds, verify_costs
from .paired import paired_runs
from .prompts import Question, fields_note, load_questions
from .reference import target_greedy


@dataclass
class Evaluation:
    """What :func:`evaluate` measured: the decoder's stats, one record per prompt, and the speed
    of the speculative decoder against the target alone (when timed)."""

    stats: DecodeStats
    records: list[dict[str, Any]]
    speed: dict[str, Any] | None = None
    """tokens_per_s, target_tokens_per_s, speedup_vs_target (median of per-prompt ratios), the
    cost model (c, v(k), predicted speedup) and the dtype / device / threads they were measured in."""
    baselines: dict[str, "Evaluation"] = field(default_factory=dict)
    """name → the stats and records of each baseline drafter decoded beside the main one."""


def evaluate(
    target: Target,
    drafter: Drafter,
    questions: list[Question],
    decode: DecodeConfig,
    check_identity: bool = False,
    progress: bool = True,
    time_target: bool = False,
    warmup: int = 1,
    repeats: int = 1,
    baselines: dict[str, Drafter] | None = None,
) -> Evaluation:
    """Decode the first turn of each question (after its ``history``, if any) with the drafter.

    time_target: also decode every prompt with the target alone (its own greedy ``generate``,
    same process, dtype and threads) and report ``speedup_vs_target``. The timing is paired per
    prompt: after ``warmup`` untimed prompts of every method, each prompt is decoded ``repeats``
    times by every method (the target alone, the drafter, each of ``baselines``) in an order that
    rotates from run to run, and each method's fastest run counts (on a shared CPU a slow stretch
    of a second or two lands on one run; the minimum discards it, as ``timeit`` does). All runs'
    seconds stay in the record (``wall_s_runs``). baselines: name → a drafter decoded the same way
    (``Evaluation.baselines``; its records carry ``speedup_vs_target`` against the same prompt's
    target-alone time). check_identity (greedy only): compare every output with the target's own
    greedy output and raise on the first difference — a guarantee in fp32 only (bf16 kernels of
    other shapes round differently), so :func:`run_eval_recipe` checks it in fp32.
    """
    if check_identity and not decode.warp.greedy:
        raise ConfigError("eval.check_identity needs greedy decoding (decode.temperature=0)")
    if repeats < 1:
        raise ConfigError(f"eval.repeats = {repeats} must be at least 1")
    decode.validate()
    prompts = [target.render_chat(q.messages()) for q in questions]
    for q, prompt in zip(questions, prompts):  # fail before decoding anything, not at prompt 70 of 80
        try:
            check_prompt(target, prompt, decode.max_new_tokens)
        except DraftsmithError as e:
            raise DraftsmithError(f"prompt {q.id}: {e}") from e
    timed = TimedDrafter(drafter)
    others = dict(baselines or {})

    def spec(d: Drafter) -> Callable[[list[int]], tuple[DecodeResult, float]]:
        def run(prompt: list[int]) -> tuple[DecodeResult, float]:
            result = decode_prompt(target, d, prompt, decode)
            return result, result.stats.wall_s
        return run

    def alone(prompt: list[int]) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        tokens = target_greedy(target, prompt, decode.max_new_tokens)
        return tokens, time.perf_counter() - t0

    methods: dict[str, Callable[[list[int]], tuple[Any, float]]] = {MAIN: spec(timed)}
    methods.update({name: spec(d) for name, d in others.items()})
    if time_target or check_identity:
        methods[TARGET] = alone
    if time_target:
        for prompt in prompts[:warmup]:
            for run in methods.values():
                run(prompt)
        timed.seconds, timed.drafted = 0.0, 0
    total = DecodeStats(k=decode.depth)
    side = {name: (DecodeStats(k=decode.depth), []) for name in others}
    runs = repeats if time_target else 1  # untimed: one decode per method (identity, baselines' stats)
    records = []
    for i, (q, prompt) in enumerate(tqdm(list(zip(questions, prompts)), desc="eval", unit="prompt", disable=not progress)):
        out = paired_runs(methods, prompt, runs, start=i * runs)
        result = out[MAIN][0][0]
        total = total.merge(result.stats)
        rec = {
            "id": q.id,
            "category": q.category,
            "prompt_tokens": len(prompt),
            "tokens": result.tokens,
            "text": target.tokenizer.decode(result.tokens, skip_special_tokens=True),
            "finish_reason": result.finish_reason,
            "stats": result.stats.summary(),
        }
        ref = out[TARGET][0] if TARGET in out else None
        if ref is not None:
            ref_tokens, ref_s = ref
            rec["identical_to_target"] = ref_tokens == result.tokens
            if time_target:
                rec["target"] = {"new_tokens": len(ref_tokens), "wall_s": round(ref_s, 4),
                                 "tokens_per_s": round(len(ref_tokens) / ref_s, 3)}
                rec["speedup_vs_target"] = round(result.stats.tokens_per_s / (len(ref_tokens) / ref_s), 4)
                rec["wall_s_runs"] = {name: [round(x, 4) for x in runs] for name, (_, runs) in out.items()}
            if check_identity and ref_tokens != result.tokens:
                first = common_prefix(ref_tokens, result.tokens)
                raise DraftsmithError(
                    f"prompt {q.id}: speculative output differs from the target's greedy output at new token {first} "
                    f"(target {ref_tokens[first:first + 1]}, speculative {result.tokens[first:first + 1]}; "
                    f"{str(target.dtype).replace('torch.', '')})"
                )
        records.append(rec)
        for name in others:
            b = out[name][0][0]
            stats, recs = side[name]
            side[name] = (stats.merge(b.stats), recs)
            brec = {"id": q.id, "tokens": b.tokens, "stats": b.stats.summary()}
            if time_target:
                brec["speedup_vs_target"] = round(b.stats.tokens_per_s / rec["target"]["tokens_per_s"], 4)
            recs.append(brec)
    speed = None
    if time_target:
        shape = decode.tree_shape()
        speed = speed_summary(target, timed, total, records, prompts[0], decode.k,
                              tree_size=0 if shape is None else shape.size, repeats=repeats)
    return Evaluation(total, records, speed, {name: Evaluation(s, r) for name, (s, r) in side.items()})


MAIN, TARGET = "drafter", "target"
"""The method names of :func:`evaluate`'s timed runs (``wall_s_runs``); a baseline's name is its own."""


def decode_prompt(target: Target, drafter: Drafter, prompt: list[int], decode: DecodeConfig) -> DecodeResult:
    """One prompt through the decoder the recipe's decode section names: chains of k, or trees."""
    shape = decode.tree_shape()
    if shape is None:
        return speculative_decode(target, drafter, prompt, k=decode.k, max_new_tokens=decode.max_new_tokens,
                                  warp=decode.warp, seed=decode.seed, min_confidence=decode.min_confidence)
    return tree_decode(target, drafter, prompt, tree=shape, max_new_tokens=decode.max_new_tokens, warp=decode.warp,
                       seed=decode.seed)


def speed_summary(target: Target, timed: TimedDrafter, stats: DecodeStats, records: list[dict[str, Any]],
                  prompt: list[int], k: int, tree_size: int = 0, repeats: int = 1) -> dict[str, Any]:
    """speedup_vs_target and the cost model that predicts it (see :mod:`draftsmith.eval.costs`).

    tree_size: the decode drafted trees of at most this many nodes (0: chains). The chain model
    τ(k) / (v(k) + k c) does not describe trees, so no prediction by k is made (c is then the
    drafter's seconds per drafted tree node); the model over the rounds as decoded still holds, with
    v(n) for the n nodes each round verified."""
    tree = tree_size > 0
    spec_s = sum(r["stats"]["wall_s"] for r in records)
    target_s = sum(r["target"]["wall_s"] for r in records)
    step = target_step_seconds(target, prompt)
    v = verify_costs(target, prompt, range(1, (tree_size if tree else k) + 1))
    c = (timed.seconds / timed.drafted) / step if timed.drafted else 0.0
    alpha = list(itertools.takewhile(lambda a: a is not None, stats.conditional_acceptance_at_position))
    by_k = {} if tree else {kk: round(predicted_speedup(alpha, kk, v[kk], c), 3) for kk in range(1, len(alpha) + 1)}
    # the same model over the rounds as they were decoded: a round that verified n drafts costs v(n) (v(0) = 1),
    # plus what drafting cost per round; with the confidence gate most rounds verify fewer than k drafts
    as_decoded = None
    if stats.rounds:
        verify = sum(count * (v[n] if n else 1.0) for n, count in stats.tree_sizes.items()) / stats.rounds
        drafting = timed.seconds / step / stats.rounds
        as_decoded = round(stats.tau / (verify + drafting), 3)
    return {
        "dtype": str(target.dtype).replace("torch.", ""),
        "device": str(target.device),
        "threads": torch.get_num_threads(),
        "linear_kernel": cpu_linear.describe(target.model),
        "tokens_per_s": round(stats.new_tokens / spec_s, 3) if spec_s else 0.0,
        "target_tokens_per_s": round(sum(r["target"]["new_tokens"] for r in records) / target_s, 3),
        "speedup_vs_target": round(statistics.median(r["speedup_vs_target"] for r in records), 4),
        "speedup_interval_90": [round(x, 4) for x in median_interval([r["speedup_vs_target"] for r in records])],
        "interval_note": "90 % percentile-bootstrap interval of the median over prompts (resampled, fixed seed)",
        "speedup_note": "median over prompts of per-prompt tok/s ratios; the target alone is its own greedy generate "
                        "in the same process, dtype and threads, paired per prompt after a warm-up: each prompt run "
                        "`timing_repeats` times by every method in a rotating order, the fastest run of each counted",
        "timing_repeats": repeats,
        "cost_model": {
            "draft_cost_c": round(c, 4),
            "c_note": "seconds the drafter spends per draft token (propose + update) / one one-token target forward",
            "target_step_ms": round(step * 1e3, 3),
            "verify_cost_by_k": {kk: round(x, 3) for kk, x in v.items()},
            "conditional_acceptance": [round(a, 4) for a in alpha],
            "predicted_speedup": by_k.get(k),
            "predicted_speedup_by_k": by_k,
            "best_k": max(by_k, key=by_k.get) if by_k else None,
            "as_decoded_speedup": as_decoded,
            "as_decoded_note": "the measured tau over the mean cost of a round as decoded: v(n) for the n drafts it "
                               "verified (v(0) = 1) plus the drafting seconds per round / a target step; unlike "
                               "predicted_speedup it holds behind the confidence gate (rounds verify fewer drafts)",
            "note": "predicted = tau(k) / (v(k) + k c): tau from the measured acceptance by position (greedy: exact for "
                    "every k up to the one decoded), v(k) the verification forward over k+1 tokens / a one-token "
                    "forward; the decoder's own per-round overhead is not in the model" if not tree else
                    "tree decoding: the chain model by k does not apply (no prediction by k); as_decoded_speedup "
                    "prices each round's n nodes at v(n), the chain forward over n+1 tokens (a tree's forward "
                    "differs only in its attention mask); speedup_vs_target is measured",
        },
    }


def write_eval(run_dir: str, target_info: dict[str, Any], result: Evaluation, extra: dict[str, Any]) -> dict[str, Any]:
    """Write eval_outputs.jsonl and eval_metrics.json (atomically); return the metrics.

    target_info: :func:`~draftsmith.target.describe` of the target the speed was measured on."""
    os.makedirs(run_dir, exist_ok=True)
    with atomic_path(os.path.join(run_dir, "eval_outputs.jsonl")) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in result.records:
                f.write(json.dumps(rec) + "\n")
    metrics: dict[str, Any] = {"target": target_info, **extra, **result.stats.summary()}
    if result.speed is not None:
        metrics["target_tokens_per_s"] = result.speed["target_tokens_per_s"]
        metrics["speedup_vs_target"] = result.speed["speedup_vs_target"]
        metrics["speed"] = result.speed
    write_json(os.path.join(run_dir, "eval_metrics.json"), metrics)
    return metrics


def run_eval_recipe(recipe: Any) -> int:
    """``draftsmith eval``: decode the recipe's prompts with its drafter and with the target alone in the
    recipe's dtype (speed), check greedy identity in fp32 (``eval.check_identity``), write and print the metrics.

    When the recipe's dtype is not fp32 the identity audit is a second pass: the target reloaded in fp32,
    the drafter rebuilt for it, every prompt decoded speculatively and by the target alone, compared token
    for token (in bf16 outputs drift after tens of tokens, so identity is checked where it is exact).
    """
    import gc

    save_recipe(recipe)
    t0 = time.perf_counter()
    target = load_target(recipe.target)
    drafter = recipe.drafter.build(target)
    dtype = str(target.dtype).replace("torch.", "")
    print(f"target {target.name} ({target.num_layers} layers, {dtype}, {target.device}) loaded in "
          f"{time.perf_counter() - t0:.1f}s; drafter {recipe.drafter.type}")
    questions = load_questions(recipe.eval.prompts, recipe.eval.num_prompts)
    print(fields_note(recipe.eval.prompts, questions))
    exact = target.dtype == torch.float32
    configs = baseline_configs(recipe.eval.baselines)
    result = evaluate(target, drafter, questions, recipe.decode, recipe.eval.check_identity and exact,
                      time_target=recipe.eval.time_target, repeats=recipe.eval.repeats,
                      baselines={name: config.build(target) for name, config in configs.items()})
    identity, described = None, describe(target)
    baselines = baseline_rows(result, configs, recipe.decode, check_identity=recipe.eval.check_identity and exact)
    if recipe.eval.check_identity:
        if exact:
            identity = {"dtype": "float32", "identical": sum(r["identical_to_target"] for r in result.records)}
        else:
            del drafter, target
            gc.collect()
            print(f"identity audit: reloading the target in float32 (speed was measured in {dtype})")
            target = load_target(replace(recipe.target, dtype="float32"))
            audit = evaluate(target, recipe.drafter.build(target), questions, recipe.decode, check_identity=True)
            identity = {"dtype": "float32", "identical": sum(r["identical_to_target"] for r in audit.records),
                        "tau_with_bonus": round(audit.stats.tau, 4)}
            for rec, checked in zip(result.records, audit.records):
                rec["identical_to_target_fp32"] = checked["identical_to_target"]
        identity["prompts"] = len(result.records)
    extra: dict[str, Any] = {"drafter": to_dict(recipe.drafter), "decode": to_dict(recipe.decode), "baselines": baselines}
    if identity is not None:
        extra["identity"] = identity
    metrics = write_eval(recipe.run_dir, described, result, extra)
    print_eval(metrics)
    print("\n".join(line for entry in baseline_lines(baselines) for line in wrapped(entry))
          or "no baselines (eval.baselines=[])")
    print(f"wrote {os.path.join(recipe.run_dir, 'eval_metrics.json')}")
    return 0


def eval_lines(m: dict[str, Any], width: int = WIDTH) -> list[str]:
    """The figures a user reads first, as lines of at most ``width`` columns: speed against the target
    alone, then τ and acceptance, then identity (everything else is in eval_metrics.json)."""
    out = [f"{m['sequences']} prompts, {m['new_tokens']} new tokens, k={m['k']}"]
    speed = m.get("speed")
    if speed:
        cm = speed["cost_model"]
        out.append(f"speed ({speed['dtype']}, {speed['device']}, {speed['threads']} threads): "
                   f"{speed['tokens_per_s']:.1f} tok/s vs the target alone {speed['target_tokens_per_s']:.1f} tok/s -> "
                   f"speedup_vs_target {speed['speedup_vs_target']:.3f}x" + (
                       f" [90% interval over prompts {speed['speedup_interval_90'][0]:.3f}-"
                       f"{speed['speedup_interval_90'][1]:.3f}]" if "speedup_interval_90" in speed else ""))
        if cm["predicted_speedup"] is not None:
            out.append(f"cost model: predicted {cm['predicted_speedup']}x from c={cm['draft_cost_c']:.3f}, "
                       f"v(k)={cm['verify_cost_by_k'].get(str(m['k']), cm['verify_cost_by_k'].get(m['k']))}; "
                       f"best k by the cost model: {cm['best_k']}")
        elif cm.get("as_decoded_speedup") is not None:
            out.append(f"cost model over the rounds as decoded: {cm['as_decoded_speedup']}x, "
                       f"c={cm['draft_cost_c']:.3f}")
    out.append(f"tau (tokens per target forward, bonus token counted) = {m['tau_with_bonus']:.3f}; "
               f"acceptance rate {m['acceptance_rate']:.3f}; by position: cumulative {m['acceptance_at_position']}, "
               f"conditional {m['conditional_acceptance_at_position']}")
    ident = m.get("identity")
    if ident:
        out.append(f"identity ({ident['dtype']}): greedy output token-identical to the target's own greedy "
                   f"decoding on {ident['identical']}/{ident['prompts']} prompts")
    return [line for entry in out for line in wrapped(entry, width)]


def print_eval(m: dict[str, Any]) -> None:
    print("\n".join(eval_lines(m)))
