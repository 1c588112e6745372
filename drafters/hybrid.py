"""Hybrid drafting: a trained drafter plus a model-free one; per round, one of them drafts.

The rule (stated, and measured in ``benchmarks/model_free.py``): the model-free drafter drafts
when it has a continuation whose confidence — its own estimate that the first draft is accepted
(the suffix drafter: count(child)/count(node) at the matched node; prompt lookup: n/(n+1) for an
n-gram match) — is at least ``min_confidence``; otherwise the trained drafter drafts. So the
trained drafter runs only in rounds it is needed: asking it for its first-token probability would
cost one of its draft steps every round, and on copy-heavy text most rounds are the lookup's.

In tree decoding (``decode.tree``) the same rule picks the part per round: the model-free part drafts
its chain (up to the tree's depth), verified as the degenerate tree, or else the model drafts its own
tree of the decoder's shape (a model without a tree runtime: its chain). With ``combine: both``
(greedy tree decoding only) every round drafts the model's tree and, when the model-free part is
confident, grafts its chain onto it as one more branch from the root (shared where the tokens agree,
:func:`~draftsmith.decode.tree.with_chain`): one verification tries both parts' guesses, and every
round pays the model's draft. Sampled decoding and chains keep the per-round choice (a sampled tree's
children must come from one q per row, which two drafters do not give).

Both parts see every committed token (and the trained part its target features), so either can
draft the next round; the trained part catches up on the rounds it skipped in one forward, as it
does after any round. Each round's q is the q of the part that drafted, so sampling stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import Tensor

from ..decode.protocol import BindsTargetCache, Drafter, Gated, Proposal, TreeDrafter
from ..decode.sampling import Warp
from ..decode.tree import DraftTree, DynamicTree, TreeShape, chain_tree, with_chain
from ..errors import ConfigError
from ..schema import Section, choices
from ..target import Target
from .checkpoint import SavedDrafterConfig
from .model_free import SourceCounts
from .prompt_lookup import PromptLookupConfig

PARTS = {"drafter": "model_drafter", "lookup": "model_free_drafter"}
"""The named drafter sections (defined by ``registry``, which lists this family too) each part may be."""


class HybridDrafter:
    """Drafter protocol: ``lookup`` drafts when confident enough, else ``model``."""

    def __init__(self, model: Drafter, lookup: Any, min_confidence: float, combine: str = "either", model_depth: int = 0):
        self.model, self.lookup, self.min_confidence, self.combine = model, lookup, min_confidence, combine
        self.model_depth = model_depth
        self.feature_layers = tuple(model.feature_layers)
        self.counts = SourceCounts()  # rounds / drafts per part: 'model' or 'lookup'

    def reset(self) -> None:
        self.model.reset()
        self.lookup.reset()

    def set_gate(self, min_confidence: float) -> None:
        """The trained part stops its chain where the decoder's gate would cut it."""
        if isinstance(self.model, Gated):
            self.model.set_gate(min_confidence)

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

    def propose_tree(self, shape: TreeShape, warp: Warp, generator: torch.Generator | None,
                     min_confidence: float = 0.0) -> DraftTree:
        """The rule of :meth:`propose`, per tree round: the lookup's chain, or the model's tree; with
        ``combine == "both"`` in greedy mode, the model's tree with the lookup's chain grafted on."""
        both = self.combine == "both" and warp.greedy
        proposal = self._lookup_round(shape.depth, warp, generator)
        if proposal is not None and not both:
            return chain_tree(proposal)
        tree = self._model_tree(shape, warp, generator, min_confidence)
        self.counts.add("model", tree.size)
        return tree if proposal is None else with_chain(tree, proposal.tokens)

    def _model_tree(self, shape: TreeShape, warp: Warp, generator: torch.Generator | None,
                    min_confidence: float) -> DraftTree:
        """The model's tree of the decoder's shape, at most ``model_depth`` deep (0: the shape's depth)."""
        depth = min(shape.depth, self.model_depth or shape.depth)
        if isinstance(shape, DynamicTree) and depth < shape.depth:
            shape = replace(shape, depth=depth)  # fewer levels: fewer model forwards
        if not isinstance(self.model, TreeDrafter):
            return chain_tree(self.model.propose(depth, warp, generator))
        return self.model.propose_tree(shape, warp, generator, min_confidence).truncated(depth)


@dataclass
class HybridConfig:
    """hybrid: a trained drafter and a model-free one; the model-free one drafts when it is confident."""

    type: Literal["hybrid"] = "hybrid"
    drafter: Section["model_drafter"] = field(default_factory=SavedDrafterConfig)
    """The trained (or any model) drafter, a drafter section: ``{type: saved, path: runs/…/drafter}``."""
    lookup: Section["model_free_drafter"] = field(default_factory=PromptLookupConfig)
    """The model-free drafter, a drafter section: ``{type: prompt_lookup}`` or ``{type: suffix, …}``."""
    min_confidence: float = 0.1
    """The model-free drafter drafts a round when its confidence in its first draft is at least this. 0.1
    (the suffix drafter's own ``min_prob``: whenever it proposes at all): a model-free draft costs tens of
    µs while the model's costs a share of a target step (its c: benchmarks/RESULTS.md, "c"), so where
    verification is nearly free (a GPU; a CPU with ``cpu_kernels/cpu_linear.py``) a lookup draft that is
    seldom right already pays. At 0.5 the
    hybrid ran below the suffix drafter alone, its model drafting most rounds on MT-bench
    (benchmarks/history/2026.md, "model-free drafters")."""

    combine: Literal["either", "both"] = "both"
    """either: per round, one part drafts (the rule above). both (the default): greedy tree decoding drafts the
    model's tree every round and grafts the model-free chain onto it when that is confident; sampled decoding
    and chains keep "either". In two paired runs with the demo's head at model_depth 1 in a depth-3 tree, both beat
    the better of its parts on MT-bench and on copy-heavy prompts, while either tied the suffix drafter once on
    MT-bench (benchmarks/RESULTS.md, "model-free drafters")."""
    model_depth: int = 1
    """Tree decoding: the model's tree is at most this deep (each level is one model forward), while the
    model-free chain may reach the decoder's depth; 0 = the decoder's depth. 1 (the default): on a CPU each
    level costs the head's c, a share of a target step, and at depth 3 the head's rounds stopped paying (the same
    runs: the graft fell under the model-free drafters on copy-heavy prompts). Where the model's forward is
    cheap against the target's (a large target on a GPU), 0 lets it use the decoder's depth."""

    def validate(self) -> None:
        for name, kind in PARTS.items():  # a YAML section is parsed as its kind; a config built in code is checked here
            part, allowed = getattr(self, name), choices(kind)
            if not isinstance(part, tuple(allowed.values())):
                what = "a model" if name == "drafter" else "model-free"
                raise ConfigError(f"drafter.{name}.type = '{part.type}': the hybrid's {name} must be {what}; "
                                  f"choose one of: {', '.join(allowed)}")
        if self.model_depth < 0:
            raise ConfigError(f"drafter.model_depth = {self.model_depth} must be ≥ 0 (0: the decoder's tree depth)")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ConfigError(f"drafter.min_confidence = {self.min_confidence} must be in [0, 1]")

    def build(self, target: Target) -> HybridDrafter:
        self.validate()
        model = self.drafter.build(target)
        if isinstance(model, BindsTargetCache):
            raise ConfigError("the hybrid's drafter drafts inside the target's cache (layer_skip with share_cache); "
                              "set drafter.drafter.share_cache=false")
        return HybridDrafter(model, self.lookup.build(target), self.min_confidence, self.combine, self.model_depth)
