"""Per-run decoding metrics.

τ (tau) is the mean number of tokens emitted per verification forward of the target,
**counting the bonus/resampled token** (so τ ≥ 1, and τ = k+1 means every draft was
accepted). The prefill forward, which emits the first token without drafting, is
counted in ``target_forwards`` but not in τ.

Trees use the same fields: k is the tree's depth, a round "proposes position i" when its tree
reaches depth i, the accepted length is the accepted path's, and ``drafted`` counts tree nodes
(``tree_size_histogram``: rounds that verified a tree of n nodes; a chain's tree is its k' drafts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DecodeStats:
    k: int
    """Draft tokens asked for per round."""
    new_tokens: int = 0
    target_forwards: int = 0
    """Including the prefill forward."""
    rounds: int = 0
    """Verification forwards (draft + verify cycles)."""
    drafted: int = 0
    accepted: int = 0
    proposed_at: list[int] = field(default_factory=list)
    """[k] rounds in which draft position i (0-based) was proposed."""
    accepted_at: list[int] = field(default_factory=list)
    """[k] rounds in which draft position i was accepted."""
    accept_hist: list[int] = field(default_factory=list)
    """[k+1] rounds that accepted exactly n drafts."""
    tree_sizes: dict[int, int] = field(default_factory=dict)
    """Drafted tokens (tree nodes) verified per round → rounds."""
    wall_s: float = 0.0
    sequences: int = 0

    def __post_init__(self) -> None:
        self.proposed_at = self.proposed_at or [0] * self.k
        self.accepted_at = self.accepted_at or [0] * self.k
        self.accept_hist = self.accept_hist or [0] * (self.k + 1)

    def record_round(self, proposed: int, accepted: int, nodes: int | None = None) -> None:
        """proposed: drafts on the longest path (a tree's depth); accepted: on the accepted path;
        nodes: drafted tokens verified (a tree's size; default = proposed, a chain)."""
        nodes = proposed if nodes is None else nodes
        self.rounds += 1
        self.target_forwards += 1
        self.drafted += nodes
        self.tree_sizes[nodes] = self.tree_sizes.get(nodes, 0) + 1
        self.accepted += accepted
        for i in range(proposed):
            self.proposed_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1
        self.accept_hist[accepted] += 1

    def merge(self, other: DecodeStats) -> DecodeStats:
        if other.k != self.k:
            raise ValueError("cannot merge stats of different k")
        out = DecodeStats(k=self.k)
        for name in ("new_tokens", "target_forwards", "rounds", "drafted", "accepted", "wall_s", "sequences"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        for name in ("proposed_at", "accepted_at", "accept_hist"):
            setattr(out, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name))])
        out.tree_sizes = {n: self.tree_sizes.get(n, 0) + other.tree_sizes.get(n, 0)
                          for n in sorted(set(self.tree_sizes) | set(other.tree_sizes))}
        return out

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification forward, bonus token counted."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """JSON-able summary; field names say what they count."""
        return {
            "tau_with_bonus": round(self.tau, 4),
            "tau_note": "mean tokens emitted per target verification forward, counting the bonus/resampled token",
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_at_position": [round(a / p, 4) if p else None for a, p in zip(self.accepted_at, self.proposed_at)],
            "acceptance_at_position_note": "position (tree depth) i: share of the rounds that proposed draft i in "
                                           "which drafts 1..i were all accepted",
            "accepted_length_histogram": self.accept_hist,
            "tree_size_histogram": {str(n): r for n, r in sorted(self.tree_sizes.items())},
            "drafted_per_round": round(self.drafted / self.rounds, 3) if self.rounds else 0.0,
            "k": self.k,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "verify_rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "sequences": self.sequences,
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
        }
