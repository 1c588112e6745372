"""``draftsmith eval``: a drafter in the built-in decoder over a prompt set, with metrics on disk.

Writes to the run folder: ``config.yaml`` (resolved recipe), ``eval_outputs.jsonl``
(one line per prompt: tokens, text, per-prompt stats) and ``eval_metrics.json``
(aggregate stats; τ counts the bonus token, as the file says).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from ..drafters.base import Drafter
from ..errors import ConfigError, DraftsmithError
from ..files import atomic_path, write_json
from ..target import Target, describe
from .decoder import DecodeConfig, check_prompt, speculative_decode
from .metrics import DecodeStats
from .prompts import Question
from .reference import target_greedy


@dataclass
class EvalConfig:
    prompts: str = "mtbench"
    """"mtbench" (first turns of the 80 MT-bench questions) or a JSONL path with 'turns' or 'prompt'."""
    num_prompts: int = 10
    """How many prompts to decode (from the start of the set)."""
    check_identity: bool = False
    """Greedy only: also decode each prompt with the target alone and fail on any token difference."""

    def validate(self) -> None:
        if self.num_prompts < 1:
            raise ConfigError(f"eval.num_prompts = {self.num_prompts} must be at least 1")


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
    total = DecodeStats(k=decode.k)
    records = []
    for q, prompt in tqdm(list(zip(questions, prompts)), desc="eval", unit="prompt", disable=not progress):
        result = speculative_decode(target, drafter, prompt, decode)
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


def write_eval(run_dir: str, target: Target, stats: DecodeStats, records: list[dict[str, Any]], extra: dict[str, Any]) -> None:
    os.makedirs(run_dir, exist_ok=True)
    with atomic_path(os.path.join(run_dir, "eval_outputs.jsonl")) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    write_json(os.path.join(run_dir, "eval_metrics.json"), {"target": describe(target), **extra, **stats.summary()})
