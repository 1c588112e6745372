"""``draftsmith eval``: a drafter in the built-in decoder over a prompt set, with metrics on disk.

:func:`run_eval_recipe` is the whole command (the CLI and the demo call it);
:func:`evaluate` decodes a prompt set with a loaded target and drafter (training-time
evaluation and the benchmarks call it).

Writes to the run folder: ``config.yaml`` (resolved recipe), ``eval_outputs.jsonl``
(one line per prompt: tokens, text, per-prompt stats) and ``eval_metrics.json``
(aggregate stats; τ counts the bonus token, as the file says).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from tqdm import tqdm

from ..decode.chain import DecodeResult, check_prompt, speculative_decode
from ..decode.protocol import Drafter
from ..decode.stats import DecodeStats
from ..decode.tree import tree_decode
from ..errors import ConfigError, DraftsmithError
from ..files import atomic_path, write_json
from ..schema import save_recipe, to_dict
from ..target import Target, describe, load_target
from .config import DecodeConfig
from .prompts import Question, load_questions
from .reference import target_greedy


def evaluate(
    target: Target,
    drafter: Drafter,
    questions: list[Question],
    decode: DecodeConfig,
    check_identity: bool = False,
    progress: bool = True,
) -> tuple[DecodeStats, list[dict[str, Any]]]:
    """Decode the first turn of each question; return merged stats and per-prompt records."""
    if check_identity and not decode.warp.greedy:
        raise ConfigError("eval.check_identity needs greedy decoding (decode.temperature=0)")
    decode.validate()
    prompts = [target.render_chat([{"role": "user", "content": q.turns[0]}]) for q in questions]
    for q, prompt in zip(questions, prompts):  # fail before decoding anything, not at prompt 70 of 80
        try:
            check_prompt(target, prompt, decode.max_new_tokens)
        except DraftsmithError as e:
            raise DraftsmithError(f"prompt {q.id}: {e}") from e
    total = DecodeStats(k=decode.depth)
    records = []
    for q, prompt in tqdm(list(zip(questions, prompts)), desc="eval", unit="prompt", disable=not progress):
        result = decode_prompt(target, drafter, prompt, decode)
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
        if check_identity:
            ref = target_greedy(target, prompt, decode.max_new_tokens)
            rec["identical_to_target"] = ref == result.tokens
            if ref != result.tokens:
                first = next((i for i, (a, b) in enumerate(zip(ref, result.tokens)) if a != b), min(len(ref), len(result.tokens)))
                raise DraftsmithError(
                    f"prompt {q.id}: speculative output differs from the target's greedy output at new token {first}"
                )
        records.append(rec)
    return total, records


def decode_prompt(target: Target, drafter: Drafter, prompt: list[int], decode: DecodeConfig) -> DecodeResult:
    """One prompt through the decoder the recipe's decode section names: chains of k, or trees."""
    shape = decode.tree_shape()
    if shape is None:
        return speculative_decode(target, drafter, prompt, k=decode.k, max_new_tokens=decode.max_new_tokens,
                                  warp=decode.warp, seed=decode.seed)
    return tree_decode(target, drafter, prompt, tree=shape, max_new_tokens=decode.max_new_tokens, warp=decode.warp,
                       seed=decode.seed)


def write_eval(run_dir: str, target: Target, stats: DecodeStats, records: list[dict[str, Any]], extra: dict[str, Any]) -> None:
    os.makedirs(run_dir, exist_ok=True)
    with atomic_path(os.path.join(run_dir, "eval_outputs.jsonl")) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    write_json(os.path.join(run_dir, "eval_metrics.json"), {"target": describe(target), **extra, **stats.summary()})


def run_eval_recipe(recipe: Any) -> int:
    """``draftsmith eval``: load the recipe's target and drafter, decode its prompts, write and print the metrics."""
    save_recipe(recipe)
    t0 = time.perf_counter()
    target = load_target(recipe.target)
    drafter = recipe.drafter.build(target)
    print(f"target {target.name} ({target.num_layers} layers, {target.dtype}, {target.device}) loaded in "
          f"{time.perf_counter() - t0:.1f}s; drafter {recipe.drafter.type}")
    questions = load_questions(recipe.eval.prompts, recipe.eval.num_prompts)
    stats, records = evaluate(target, drafter, questions, recipe.decode, recipe.eval.check_identity)
    write_eval(recipe.run_dir, target, stats, records, {"drafter": to_dict(recipe.drafter), "decode": to_dict(recipe.decode)})
    s = stats.summary()
    print(f"{len(records)} prompts, {s['new_tokens']} new tokens in {s['wall_s']:.1f}s ({s['tokens_per_s']:.1f} tok/s)")
    print(f"tau (tokens per target forward, bonus token counted) = {s['tau_with_bonus']:.3f}; "
          f"acceptance rate {s['acceptance_rate']:.3f}; per position {s['acceptance_at_position']}")
    if recipe.eval.check_identity:
        print("greedy output token-identical to the target's own greedy decoding on every prompt")
    print(f"wrote {os.path.join(recipe.run_dir, 'eval_metrics.json')}")
    return 0
