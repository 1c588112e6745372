"""Per-run decoding metrics.

τ (tau) is the mean number of tokens emitted per verification forward of the target,
**counting the bonus/resampled token** (so τ ≥ 1, and τ = k+1 means every draft was
accepted). The prefill forward, which emits the first token without drafting, is
counted in ``target_forwards`` but not in τ.

Trees use the same fields: k is the tree's depth, a round "proposes position i" when its tree
reaches depth i, the accepted length is the accepted path's, and ``drafted`` counts tree nodes
(``tree_size_histogram``: rounds that verified a tree of n nodes; a chain's tree is its k' drafts).

**Only what is emitted counts.** When an accepted draft is EOS the sequence ends there: the drafts
the target also accepted after it, and the bonus token, are never emitted. Such a round is recorded
with the drafts up to and including that EOS as both proposed and accepted (the positions after it
were never decided for the output) and without a bonus token (``eos_rounds``), so that
τ · rounds = new tokens − one prefill token per sequence, exactly.

**Two acceptances by position, not to be compared with each other.** ``acceptance_at_position`` is
*cumulative*: P(drafts 1..i all accepted | the round proposed draft i). ``conditional_acceptance_at_position``
is α_i = P(draft i accepted | drafts 1..i−1 accepted): the quantity training's held-out per-step
figures (``heldout/expected_accept_step{j}``, ``heldout/top1_step{j}``) estimate, and what
:func:`tau_from_acceptance` takes. τ(k) = 1 + Σ_{i≤k} Π_{j≤i} α_j.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence
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
    reached_at: list[int] = field(default_factory=list)
    """[k] rounds that proposed draft position i and accepted drafts 1..i−1: the denominator of the
    conditional acceptance at position i."""
    accept_hist: list[int] = field(default_factory=list)
    """[k+1] rounds that accepted exactly n drafts."""
    tree_sizes: dict[int, int] = field(default_factory=dict)
    """Drafted tokens (tree nodes) verified per round → rounds."""
    eos_rounds: int = 0
    """Rounds that ended on an accepted EOS draft: they emit no bonus token."""
    wall_s: float = 0.0
    sequences: int = 0

    def __post_init__(self) -> None:
        self.proposed_at = self.proposed_at or [0] * self.k
        self.accepted_at = self.accepted_at or [0] * self.k
        self.reached_at = self.reached_at or [0] * self.k
        self.accept_hist = self.accept_hist or [0] * (self.k + 1)

    def record_round(self, proposed: int, accepted: int, nodes: int | None = None, bonus: bool = True) -> None:
        """proposed: drafts on the longest path (a tree's depth); accepted: on the accepted path;
        nodes: drafted tokens verified (a tree's size; default = proposed, a chain); bonus: the round
        emitted its bonus/resampled token (False when it ended on an accepted EOS draft: then proposed
        and accepted both count the drafts up to and including that EOS — see the module docstring)."""
        nodes = proposed if nodes is None else nodes
        if not 0 <= accepted <= proposed <= self.k:
            raise ValueError(f"a round accepted {accepted} of {proposed} drafts (k = {self.k})")
        self.rounds += 1
        self.eos_rounds += not bonus
        self.target_forwards += 1
        self.drafted += nodes
        self.tree_sizes[nodes] = self.tree_sizes.get(nodes, 0) + 1
        self.accepted += accepted
        for i in range(proposed):
            self.proposed_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1
        for i in range(min(proposed, accepted + 1)):
            self.reached_at[i] += 1
        self.accept_hist[accepted] += 1

    def merge(self, other: DecodeStats) -> DecodeStats:
        if other.k != self.k:
            raise ValueError("cannot merge stats of different k")
        out = DecodeStats(k=self.k)
        for name in ("new_tokens", "target_forwards", "rounds", "drafted", "accepted", "wall_s", "sequences",
                     "eos_rounds"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        for name in ("proposed_at", "accepted_at", "reached_at", "accept_hist"):
            setattr(out, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name))])
        out.tree_sizes = {n: self.tree_sizes.get(n, 0) + other.tree_sizes.get(n, 0)
                          for n in sorted(set(self.tree_sizes) | set(other.tree_sizes))}
        return out

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification forward, bonus token counted (a round that ended on an
        accepted EOS emitted none)."""
        return (self.accepted + self.rounds - self.eos_rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_at_position(self) -> list[float | None]:
        """[k] cumulative: of the rounds that proposed draft i, the share that accepted drafts 1..i."""
        return [a / p if p else None for a, p in zip(self.accepted_at, self.proposed_at)]

    @property
    def conditional_acceptance_at_position(self) -> list[float | None]:
        """[k] conditional α_i: of the rounds that proposed draft i and accepted drafts 1..i−1, the share
        that accepted draft i too."""
        return [a / r if r else None for a, r in zip(self.accepted_at, self.reached_at)]

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
            "acceptance_at_position": [_round(a) for a in self.acceptance_at_position],
            "acceptance_at_position_note": "CUMULATIVE. position (tree depth) i: share of the rounds that proposed "
                                           "draft i in which drafts 1..i were all accepted",
            "conditional_acceptance_at_position": [_round(a) for a in self.conditional_acceptance_at_position],
            "conditional_acceptance_at_position_note": "CONDITIONAL. position i: share of the rounds that proposed "
                                                       "draft i and accepted drafts 1..i-1 in which draft i was "
                                                       "accepted too (alpha_i; tau = 1 + sum_i prod_{j<=i} alpha_j); "
                                                       "what training's heldout per-step acceptance estimates",
            "accepted_length_histogram": self.accept_hist,
            "tree_size_histogram": {str(n): r for n, r in sorted(self.tree_sizes.items())},
            "drafted_per_round": round(self.drafted / self.rounds, 3) if self.rounds else 0.0,
            "k": self.k,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "verify_rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "eos_rounds": self.eos_rounds,
            "sequences": self.sequences,
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def first_eos(tokens: Sequence[int], eos: set[int]) -> int | None:
    """Index of the first EOS in ``tokens``, or None."""
    return next((i for i, t in enumerate(tokens) if t in eos), None)


def tau_from_acceptance(conditional: Sequence[float], k: int) -> float:
    """τ(k) = 1 + Σ_{i≤k} Π_{j≤i} α_j, bonus counted, from conditional acceptances α_1..α_k."""
    tau, run = 1.0, 1.0
    for a in list(conditional)[:k]:
        run *= a
        tau += run
    return tau


def conditional_acceptance(cumulative: Sequence[float | None]) -> list[float]:
    """α_i = P(draft i accepted | drafts 1..i−1 accepted) from the decoder's cumulative
    ``acceptance_at_position`` (share of rounds proposing draft i where drafts 1..i were all accepted).
    Exact when every round proposed every position; :attr:`DecodeStats.conditional_acceptance_at_position`
    is exact always."""
    out, prev = [], 1.0
    for c in cumulative:
        if c is None:
            break
        out.append(c / prev if prev > 0 else 0.0)
        prev = c
    return out
