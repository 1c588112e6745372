"""Hybrid drafting: a trained drafter plus a model-free one; per round, one of them drafts.

The rule (stated, and measured in ``benchmarks/model_free.py``): the model-free drafter drafts
when it has a continuation whose confidence — its own estimate that the first draft is accepted
(the suffix drafter: count(child)/count(node) at the matched node; prompt lookup: n/(n+1) for an
n-gram match) — is at least ``min_confidence``; otherwise the trained drafter drafts. So the
trained drafter runs only in rounds it is needed: asking it for its first-token probability would
cost one of its draft steps every round, and on copy-heavy text most rounds are the lookup's.

In tree decoding (``decode.tree``) the same rule picks the part per round: the model-free part drafts
its chain (up to the tree's depth), verified as the degenerate tree, or else the model drafts its own
tree of the decoder's shape (a model without a tree runtime: its chain).

Both parts see every committed token (and the trained part its target features), so either can
draft the next round; the trained part catches up on the rounds it skipped in one forward, as it
does after any round. Each round's q is the q of the part that drafted, so sampling stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from ..decode.protocol import Drafter, Proposal
from ..decode.sampling import Warp
from ..decode.tree import DraftTree, TreeShape, chain_tree
from ..errors import ConfigError
from ..target import Target
from .checkpoint import SavedDrafterConfig
from .model_free import SourceCounts
from .prompt_lookup import PromptLookupConfig

DrafterConfig: Any = None
"""The recipe's drafter union, set by ``registry`` (which lists this family too): the two parts'
sections are drafter sections themselves."""


class HybridDrafter:
    """Drafter protocol: ``lookup`` drafts when confident enough, else ``model``."""

    def __init__(self, model: Drafter, lookup: Any, min_confidence: float):
        self.model, self.lookup, self.min_confidence = model, lookup, min_confidence
        self.feature_layers = tuple(model.feature_layers)
        self.counts = SourceCounts()  # rounds / drafts per part: 'model' or 'lookup'

    def reset(self) -> None:
        self.model.reset()
        self.lookup.reset()

    def set_gate(self, min_confidence: float) -> None:
        """The trained part stops its chain where the decoder's gate would cut it."""
        set_gate = getattr(self.model, "set_gate", None)
        if set_gate is not None:
            set_gate(min_confidence)

    def update(self, tokens: Tensor, features: Tensor | None) -> None:
        self.model.update(tokens, features)
        self.lookup.update(tokens, None)

    def _lookup_round(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal | None:
        """The lookup's drafts when it is confident enough and proposes any, else None (the model drafts)."""
        found = self.lookup.continuations(k)
        if found and found[0].confidence >= self.min_confidence:
            proposal = self.lookup.propose(k, warp, generator)
            if proposal.tokens.numel():
                self.counts.add("lookup", int(proposal.tokens.numel()))
                return proposal
        return None

    def propose(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal:
        proposal = self._lookup_round(k, warp, generator)
        if proposal is not None:
            return proposal
        proposal = self.model.propose(k, warp, generator)
        self.counts.add("model", int(proposal.tokens.numel()))
        return proposal

    def propose_tree(self, shape: TreeShape, warp: Warp, generator: torch.Generator | None) -> DraftTree:
        """The rule of :meth:`propose`, per tree round: the lookup's chain, or the model's tree."""
        proposal = self._lookup_round(shape.depth, warp, generator)
        if proposal is not None:
            return chain_tree(proposal)
        model_tree = getattr(self.model, "propose_tree", None)
        tree = model_tree(shape, warp, generator) if model_tree else chain_tree(self.model.propose(shape.depth, warp, generator))
        self.counts.add("model", tree.size)
        return tree


@dataclass
class HybridConfig:
    """hybrid: a trained drafter and a model-free one; the model-free one drafts when it is confident."""

    type: Literal["hybrid"] = "hybrid"
    drafter: DrafterConfig = field(default_factory=SavedDrafterConfig)
    """The trained (or any model) drafter, a drafter section: ``{type: saved, path: runs/…/drafter}``."""
    lookup: DrafterConfig = field(default_factory=PromptLookupConfig)
    """The model-free drafter, a drafter section: ``{type: prompt_lookup}`` or ``{type: suffix, …}``."""
    min_confidence: float = 0.1
    """The model-free drafter drafts a round when its confidence in its first draft is at least this. 0.1
    (the suffix drafter's own ``min_prob``: whenever it proposes at all): a model-free draft costs tens of
    µs while the model's costs c ≈ 0.07 of a target step, so where verification is nearly free (a GPU; a
    CPU with ``kernels/cpu_linear.py``) a lookup draft right 10 % of the time already pays. At 0.5 the
    hybrid ran below the suffix drafter alone on MT-bench and copy-heavy prompts, its model drafting 189
    of 347 rounds on MT-bench (RESULTS.md, "model-free drafters")."""

    def validate(self) -> None:
        from .registry import spec_of, specs

        free = [n for n, s in specs().items() if s.model_free]
        if not spec_of(self.lookup).model_free:
            raise ConfigError(f"drafter.lookup.type = '{self.lookup.type}' is not model-free; choose one of: {', '.join(free)}")
        if spec_of(self.drafter).model_free or self.drafter.type == "hybrid":
            raise ConfigError(f"drafter.drafter.type = '{self.drafter.type}': the hybrid's drafter must be a model "
                              f"(saved, eagle3, layer_skip, …), not {', '.join(free + ['hybrid'])}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ConfigError(f"drafter.min_confidence = {self.min_confidence} must be in [0, 1]")

    def build(self, target: Target) -> HybridDrafter:
        self.validate()
        model = self.drafter.build(target)
        if hasattr(model, "bind") or hasattr(model, "verify"):
            raise ConfigError("the hybrid's drafter drafts inside the target's cache (layer_skip with share_cache); "
                              "set drafter.drafter.share_cache=false")
        return HybridDrafter(model, self.lookup.build(target), self.min_confidence)
