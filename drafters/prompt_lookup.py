"""Prompt lookup decoding: copy what followed the last n tokens the previous time they appeared.

For n from ``max_ngram`` down to ``min_ngram``, the last n tokens of (prompt + output so far) are
looked up among the earlier n-grams of the same sequence; the first n that matches drafts up to
k tokens that followed the match, cut before any EOS. With ``match: earliest`` (default) the match
is the earliest occurrence, exactly what HF transformers' ``PromptLookupCandidateGenerator``
(``generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=max_ngram)``) picks, so the two
propose the same drafts; ``latest`` takes the most recent one instead.

The n-grams are indexed as tokens arrive (a dict per n from n-gram to where its continuation
starts), so ``update`` costs O(max_ngram) per token and ``propose`` O(max_ngram + k), where HF
re-scans the whole sequence every round. q is a point mass on each draft (sampling stays exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..decode.protocol import Proposal
from ..decode.sampling import Warp
from ..errors import ConfigError
from ..target import Target
from .model_free import Continuation, SourceCounts, to_proposal


class PromptLookupDrafter:
    """The drafter protocol over an incremental n-gram index of the current sequence."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, eos: set[int], max_ngram: int = 3, min_ngram: int = 1,
                 match: Literal["earliest", "latest"] = "earliest", device: torch.device | str = "cpu"):
        self.vocab_size, self.eos, self.match, self.device = vocab_size, set(eos), match, torch.device(device)
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.counts = SourceCounts()
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        # n → {n-gram: index where the continuation after its earliest (or latest) occurrence starts}
        self._at: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._before: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}  # 'latest': the one before

    def update(self, tokens: Tensor, features: Tensor | None = None) -> None:
        seq = self.tokens
        for t in tokens.tolist():
            seq.append(t)
            end = len(seq)
            for n in self.sizes:
                if end < n:
                    continue
                gram = tuple(seq[end - n:])
                at = self._at[n]
                if self.match == "earliest":
                    at.setdefault(gram, end)
                else:
                    if gram in at:
                        self._before[n][gram] = at[gram]
                    at[gram] = end

    def continuations(self, k: int, warp: Warp | None = None, generator: torch.Generator | None = None) -> list[Continuation]:
        """The continuation after the longest matching n-gram (at most one), up to k tokens, cut before EOS."""
        seq, end = self.tokens, len(self.tokens)
        for n in self.sizes:
            if n > end - 1:
                continue
            gram = tuple(seq[end - n:])
            start = self._at[n].get(gram)
            if start == end:  # the only occurrence (earliest) / the newest one (latest) is the suffix itself
                start = None if self.match == "earliest" else self._before[n].get(gram)
            if start is None:
                continue
            drafts = seq[start: min(start + k, end)]
            for i, t in enumerate(drafts):
                if t in self.eos:
                    drafts = drafts[:i]
                    break
            if not drafts:  # HF stops here too: a match whose continuation is EOS drafts nothing
                return []
            conf = n / (n + 1)
            return [Continuation(drafts, confidence=conf, score=conf * len(drafts), source=f"ngram:{n}", match_length=n)]
        return []

    def propose(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal:
        found = self.continuations(k)
        best = found[0] if found else None
        if best is not None:
            self.counts.add(best.source, len(best.tokens))
        return to_proposal(best, self.vocab_size, warp.greedy, self.device)


@dataclass
class PromptLookupConfig:
    """prompt lookup: draft what followed the last n-gram match in prompt + output (no weights)."""

    type: Literal["prompt_lookup"] = "prompt_lookup"
    max_ngram: int = 3
    """Longest n-gram tried (HF: max_matching_ngram_size, default 2 there)."""
    min_ngram: int = 1
    """Shortest n-gram tried (HF: always 1)."""
    match: Literal["earliest", "latest"] = "earliest"
    """Which earlier occurrence to copy from: HF's choice (earliest) or the most recent."""

    def validate(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(f"drafter.min_ngram = {self.min_ngram}, max_ngram = {self.max_ngram}: need "
                              f"1 ≤ min_ngram ≤ max_ngram")

    def build(self, target: Target) -> PromptLookupDrafter:
        self.validate()
        return PromptLookupDrafter(target.vocab_size, target.eos_token_ids, self.max_ngram, self.min_ngram,
                                   self.match, target.device)
