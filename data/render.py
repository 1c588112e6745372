"""Chat template rendering and the assistant-only loss mask.

The mask is found the way the template itself draws the line, never by a regex on
special tokens: for each assistant message i the conversation is rendered twice,

* ``prompt_i`` = messages[:i] with the generation prompt (what the server sends the model),
* ``turn_i``   = messages[:i+1] without it (the history once the model has answered),

and the assistant's tokens are those of ``turn_i`` from the first place where the two
renders diverge to the end of ``turn_i``, cut just after the last end-of-turn token
(the model stops there; what the template adds after it, ChatML's newline, is never
generated). A turn listed in ``open_turns`` (an answer cut at a token limit) ends just
*before* its end-of-turn token: the model did not choose to stop there. ``turn_i`` must
be a prefix of the full render, which is tokenized once; a template that rewrites
history (e.g. drops earlier reasoning) is reported, not guessed.

The renders are compared as text and mapped to tokens through the tokenizer's offsets
(one tokenization per conversation instead of two per turn; the two compared in
benchmarks/history/2026.md, "prepare"); a token that straddles the divergence point belongs to the
assistant. Truncation to ``max_length`` cuts ``input_ids`` and ``loss_mask`` at the same
token, so every kept mask bit still sits on its own token; a conversation left with no
assistant token is skipped and counted.

``loss_mask[t] == 1`` means token t is an assistant token to be predicted (from position
t-1): training code shifts, the mask does not.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

_ASSISTANT = "assistant"


def render_conversation(
    tokenizer: Any,
    messages: list[dict[str, str]],
    max_length: int,
    last_turn_only: bool = False,
    stop_ids: Sequence[int] = (),
    open_turns: Sequence[int] = (),
) -> tuple[list[int], list[int]] | str:
    """(input_ids, loss_mask) of one conversation, or a skip reason.

    stop_ids: end-of-turn token ids (the tokenizer's and generation config's EOS); the
    mask of a turn ends right after the last of them inside the turn, or right before it
    for the message indices in ``open_turns``.
    """
    try:
        full = _render_text(tokenizer, messages, add_generation_prompt=False)
        spans = []
        turns = [i for i, m in enumerate(messages) if m["role"] == _ASSISTANT and i > 0]
        if last_turn_only:
            turns = turns[-1:]
        for i in turns:
            prompt = _render_text(tokenizer, messages[:i], add_generation_prompt=True)
            turn = _render_text(tokenizer, messages[: i + 1], add_generation_prompt=False)
            if not full.startswith(turn):
                return "template_not_prefix_stable"
            spans.append((_common_prefix(prompt, turn), len(turn), i in open_turns))
    except Exception:  # jinja raises TemplateError, ValueError, TypeError… for conversations it refuses
        return "template_error"
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    ends = [end for _, end in enc["offset_mapping"]]
    starts = [start for start, _ in enc["offset_mapping"]]
    stops = set(stop_ids)
    mask = [0] * len(ids)
    for char_start, char_end, is_open in spans:
        first = bisect.bisect_right(ends, char_start)  # first token ending after the divergence point
        last = bisect.bisect_left(starts, char_end)  # first token starting at/after the turn's end
        inside = [t for t in range(first, last) if ids[t] in stops]
        if inside:
            last = inside[-1] + (0 if is_open else 1)
        for t in range(first, last):
            mask[t] = 1
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        return "no_loss_tokens_in_max_length"
    return ids, mask


def _render_text(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the longest equal prefix
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def render_batch(
    batch: dict[str, list[Any]],
    tokenizer: Any,
    max_length: int,
    last_turn_only: bool,
    stop_ids: Sequence[int],
) -> dict[str, list[Any]]:
    """`datasets.map` function: adds input_ids, loss_mask and skip ('' when kept) to a batch."""
    out: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "skip": []}
    open_turns = batch.get("truncated_turns") or [()] * len(batch["messages"])
    for messages, truncated in zip(batch["messages"], open_turns):
        result = render_conversation(tokenizer, messages, max_length, last_turn_only, stop_ids, truncated or ())
        if isinstance(result, str):
            out["input_ids"].append([])
            out["loss_mask"].append([])
            out["skip"].append(result)
        else:
            out["input_ids"].append(result[0])
            out["loss_mask"].append(result[1])
            out["skip"].append("")
    return out


def stop_token_ids(tokenizer: Any, folder: str | None = None) -> list[int]:
    """End-of-turn ids: the tokenizer's EOS plus the generation config's in ``folder`` (Llama-3 style eot
    ids) — the target's end-of-sequence set (:func:`~draftsmith.target.end_of_sequence_ids`), read
    without loading the model."""
    from ..target import end_of_sequence_ids  # here: rendering alone needs no torch

    generation = None
    if folder:
        try:
            from transformers import GenerationConfig

            generation = GenerationConfig.from_pretrained(folder)
        except (OSError, ValueError):
            pass  # no generation config there: the tokenizer's EOS alone
    return sorted(end_of_sequence_ids(tokenizer, generation))
