"""What the model-free drafters (``prompt_lookup``, ``suffix``) share: a drafted continuation and
how it becomes a :class:`~draftsmith.decode.protocol.Proposal`.

A model-free drafter copies tokens it has seen. Its q is the distribution it actually drew each
draft from, over the target's vocabulary: a point mass (prompt lookup; the suffix drafter in
greedy mode) or the empirical next-token distribution at the suffix node it drew from (the suffix
drafter, sampled). The decoder's accept rule is exact for any q, so sampled output keeps the
target's law. ``continuations`` may return several candidates (best first): a chain drafter
proposes the first; a tree decoder can take them as branches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..decode.protocol import Proposal


@dataclass
class Continuation:
    tokens: list[int]
    """The drafted tokens, in order."""
    confidence: float
    """Estimated probability that the first draft is accepted (the hybrid drafter compares it)."""
    score: float = 0.0
    """Expected number of accepted drafts under the drafter's own estimate (ranks candidates)."""
    dists: list[tuple[list[int], list[float]]] | None = None
    """Per draft (ids, weights): the empirical distribution it was sampled from; None = point masses."""
    source: str = ""
    """Where it was found ('request', 'corpus', 'ngram:3', …), for stats."""
    match_length: int = 0
    """Tokens of context matched before the continuation."""


@dataclass
class SourceCounts:
    """How often each source drafted, and how many tokens it proposed (per drafter lifetime)."""

    rounds: dict[str, int] = field(default_factory=dict)
    drafted: dict[str, int] = field(default_factory=dict)

    def add(self, source: str, n: int) -> None:
        self.rounds[source] = self.rounds.get(source, 0) + 1
        self.drafted[source] = self.drafted.get(source, 0) + n


def to_proposal(cont: Continuation | None, vocab_size: int, greedy: bool, device: torch.device) -> Proposal:
    """Tokens [k'] and, unless greedy, q [k', V] float32: one-hot rows, or each draft's empirical distribution."""
    tokens = cont.tokens if cont is not None else []
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    if greedy:
        return Proposal(tokens=ids, probs=None)
    q = torch.zeros(len(tokens), vocab_size, dtype=torch.float32, device=device)  # [k', V]
    if cont is not None and cont.dists is not None:
        for i, (support, weights) in enumerate(cont.dists):
            w = torch.tensor(weights, dtype=torch.float32)
            q[i, torch.tensor(support, dtype=torch.long, device=device)] = (w / w.sum()).to(device)
    elif tokens:
        q[torch.arange(len(tokens), device=device), ids] = 1.0
    return Proposal(tokens=ids, probs=q)
