"""A drafter in the built-in decoder over a prompt set, timed against the target alone.

:func:`evaluate` is the measurement that ``draftsmith eval`` (``eval/run.py``), ``draftsmith report``,
training-time evaluation (``train/heldout.py``) and the benchmarks share: it decodes each prompt with the
drafter (and any baselines) and, paired per prompt, with the target's own greedy decoding, and returns the
stats, one record per prompt and the speed with its cost model (:mod:`draftsmith.measure.costs`).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..progress import progress_bar
from ..decode.rounds import DecodeResult, check_prompt, speculative_decode
from ..decode.protocol import Drafter, common_prefix
from ..decode.reference import target_greedy
from ..decode.stats import DecodeStats
from ..decode.tree import tree_decode
from ..errors import ConfigError, DraftsmithError
from ..cpu_kernels import cpu_linear
from ..target import Target
from .config import DecodeConfig
from .costs import TimedDrafter, median_interval, predicted_speedup, target_step_seconds, verify_costs
from .paired import paired_runs
from .prompts import Question


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
    bar = progress_bar(list(zip(questions, prompts)), desc="eval", unit="prompt", disable=not progress)
    for i, (q, prompt) in enumerate(bar):
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
                       seed=decode.seed, min_confidence=decode.min_confidence)


def speed_summary(target: Target, timed: TimedDrafter, stats: DecodeStats, records: list[dict[str, Any]],
                  prompt: list[int], k: int, tree_size: int = 0, repeats: int = 1) -> dict[str, Any]:
    """speedup_vs_target and the cost model that predicts it (see :mod:`draftsmith.measure.costs`).

    tree_size: the decode drafted trees of at most this many nodes (0: chains). The chain model
    τ(k) / (v(k) + k c) does not describe trees, so no prediction by k is made (c is then the
    drafter's seconds per drafted tree node); the model over the rounds as decoded still holds, with
    v(n) for the n nodes each round verified."""
    tree = tree_size > 0
    spec_s = sum(r["stats"]["wall_s"] for r in records)
    target_s = sum(r["target"]["wall_s"] for r in records)
    step = target_step_seconds(target, prompt)
    v = verify_costs(target, prompt, range(1, (tree_size if tree else k) + 1))
    # c's unit is one token of the target alone in the same paired runs, which interleave with the drafter's, so a
    # load change hits both alike (prefill included: c is understated by about prefill / new tokens). The isolated
    # step above is timed once, after the runs: dividing the run's drafting seconds by it made c anything on a
    # loaded machine (7.7 for a layer-skip drafter on Gemma-3-270M).
    target_tokens = sum(r["target"]["new_tokens"] for r in records)
    unit = target_s / target_tokens if target_tokens and target_s else step
    c = (timed.seconds / timed.drafted) / unit if timed.drafted else 0.0
    alpha = list(itertools.takewhile(lambda a: a is not None, stats.conditional_acceptance_at_position))
    by_k = {} if tree else {kk: round(predicted_speedup(alpha, kk, v[kk], c), 3) for kk in range(1, len(alpha) + 1)}
    # the same model over the rounds as they were decoded: a round that verified n drafts costs v(n) (v(0) = 1),
    # plus what drafting cost per round; with the confidence gate most rounds verify fewer than k drafts
    as_decoded = None
    if stats.rounds:
        verify = sum(count * (v[n] if n else 1.0) for n, count in stats.tree_sizes.items()) / stats.rounds
        drafting = timed.seconds / unit / stats.rounds
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
            "c_note": "seconds the drafter spends per draft token (propose + update) / seconds per token of the "
                      "target alone in the same paired runs (prefill included)",
            "target_step_ms": round(step * 1e3, 3),
            "target_token_ms_in_run": round(unit * 1e3, 3),
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

