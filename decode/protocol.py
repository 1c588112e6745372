"""The drafter protocol: how the decoder talks to every drafter, and the one draft loop they share.

A drafter sees one growing sequence (batch size 1). The decoder calls

``reset()``
    forget the previous sequence;
``update(tokens, features)``
    append newly *committed* tokens. ``features`` are the target's hidden states
    (its ``feature_layers``, concatenated) for committed positions. Invariant after
    every call: the drafter holds target features for every committed position
    **except the last one** (its target forward has not run yet). So the first call
    passes the prompt plus the first sampled token with features for the prompt
    (n+1 tokens, n features), and each later call passes the accepted drafts plus
    the resampled/bonus token with features for the positions verified and kept
    (m+1 tokens, m+1 features);
``propose(k, warp, generator)``
    return up to k draft tokens that continue the committed sequence, and, unless
    ``warp.greedy``, the warped distributions q they were sampled from, over the
    target's full vocabulary.

Anything a drafter computed speculatively (KV cache entries for drafts that end up
rejected) is its own business to roll back on the next ``update``: it knows what it
proposed and sees what was committed. Drafters never see a config object. A chain drafter's
``propose`` is its own state handling around :func:`draft_chain`, the one draft loop.

**Optional abilities.** Those three methods are the whole required contract. A drafter may also
have an ability, one small protocol each (``ABILITIES``): the decoders ask ``isinstance(drafter,
Ability)`` and use it, else decode without it; a wrapper (``TimedDrafter``) passes on
what the drafter it wraps has (:func:`ability_methods`).

:class:`BindsTargetCache` — ``bind(cache)``, ``verify(input_ids [1, k'+1]) -> TargetOutput``
    a self-speculative drafter that runs *inside the target* (layer skip): ``bind`` is called
    after ``reset()`` and before the prefill with the target's KV cache, which the drafter may
    extend while drafting; ``verify`` is the target's verification forward over (last committed
    token, drafts), replacing ``target.forward``; it must leave every cache layer holding the
    same positions (the decoder then crops them all to the accepted length) and return the
    target's logits. Chain decoding only: tree decoding and the hybrid refuse such a drafter.
:class:`Gated` — ``set_gate(min_confidence)``
    a drafter with a cost per draft step: called after ``reset()`` with the confidence gate the
    decoder applies to its chains (0 = none), it may stop drafting at the first draft whose running
    confidence product falls below it, since the gate drops every draft from there on
    (``draft_chain(stop_below=)``). The output is unchanged; the draft steps that would have been
    dropped are not computed.
:class:`TreeDrafter` — ``propose_tree(shape, warp, generator, min_confidence) -> DraftTree``
    a drafter that drafts trees (``decode/tree.py``: ``build_tree``), behind the decoder's confidence gate;
    tree decoding verifies any other drafter's ``propose`` chain as the one-branch tree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..target import Target, TargetOutput
from .sampling import Warp


@dataclass
class Proposal:
    tokens: Tensor
    """[k'] long, k' ≤ k drafted tokens (k' may be 0)."""
    probs: Tensor | None
    """[k', V] float32 warped draft distributions, or None in greedy mode."""
    confidence: Tensor | None = None
    """[k'] float32: the drafter's top-1 probability at each draft position, given the drafts before
    it (max of its softmax, or of the warped q when sampling), or None. It must be known *before* the
    draft at that position is drawn — never q(d_i) of the token drawn: a gate that looks at the drawn
    token changes the law of the drafts it keeps, and sampling is no longer lossless (the Markov
    test in tests/test_decoder.py fails that way). The decoder's confidence gate
    (``speculative_decode(min_confidence=)``) keeps the drafts whose running product stays above a
    threshold; a drafter without it is never gated."""


@runtime_checkable
class Drafter(Protocol):
    feature_layers: tuple[int, ...]
    """Target layers whose hidden states this drafter needs; () for a standalone LM."""

    def reset(self) -> None: ...

    def update(self, tokens: Tensor, features: Tensor | None) -> None: ...

    def propose(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal: ...


class BuildsDrafter(Protocol):
    """A drafter's config, as a user of the decoder that builds one sees it (every family's config in
    ``drafters/`` is one: ``drafters.registry.FamilyConfig``); data/ regenerates with it."""

    def build(self, target: Target) -> Drafter:
        """The runtime drafter for ``target`` (its device and dtype), speaking this protocol."""
        ...


@runtime_checkable
class BindsTargetCache(Protocol):
    """Optional ability: drafts inside the target's KV cache and replaces its verification forward."""

    def bind(self, cache: Any) -> None: ...

    def verify(self, input_ids: Tensor) -> TargetOutput: ...


@runtime_checkable
class Gated(Protocol):
    """Optional ability: stops drafting where the decoder's confidence gate would cut the chain."""

    def set_gate(self, min_confidence: float) -> None: ...


@runtime_checkable
class TreeDrafter(Protocol):
    """Optional ability: drafts a tree of the decoder's shape.

    ``TreeShape`` and ``DraftTree`` are defined in ``decode/tree.py``, which imports this module, so
    they are named here without an import (annotations are never evaluated)."""

    def propose_tree(self, shape: TreeShape, warp: Warp, generator: torch.Generator | None,  # noqa: F821
                     min_confidence: float = 0.0) -> DraftTree: ...  # noqa: F821


ABILITIES: tuple[type, ...] = (BindsTargetCache, Gated, TreeDrafter)
"""Every optional ability, for wrappers that pass on those of the drafter they wrap."""


def ability_methods(drafter: object) -> dict[str, Callable[..., Any]]:
    """The methods of every optional ability ``drafter`` has, by name (bound to it)."""
    return {name: getattr(drafter, name) for ability in ABILITIES if isinstance(drafter, ability)
            for name in vars(ability) if not name.startswith("_")}


@dataclass(frozen=True)
class ReducedVocab:
    """A drafter's reduced output vocabulary (EAGLE-3's draft vocabulary): the target id of each of its
    V' logits, ascending, on the device (``ids``) and on the host (``host``, read once per request so
    that mapping a greedy draft costs no host read), and the target's vocabulary size V."""

    ids: Tensor
    host: list[int]
    size: int

    @classmethod
    def of(cls, ids: Tensor, size: int) -> ReducedVocab:
        return cls(ids, ids.tolist(), size)


def draft_chain(
    step: Callable[[int], Tensor], first_logits: Tensor, k: int, warp: Warp, generator: torch.Generator | None,
    vocab: ReducedVocab | None = None, stop_below: float = 0.0,
) -> Proposal:
    """Draft k tokens one after another: the draft loop of every chain drafter.

    first_logits: [V] the drafter's logits for the first draft (over the target's vocabulary);
    step(token) feeds one drafted token (a target id) to the drafter and returns its logits for the
    next draft. Each draft is chosen with ``warp`` (argmax when greedy, else sampled from the warped
    q, which is kept); ``step`` runs k − 1 times, never after the last draft.

    A drafter whose logits cover a reduced vocabulary passes them as they are, [V'], with ``vocab``:
    greedy drafts take the argmax and its confidence over the V' entries alone (no [V] tensor; the
    same token, ties included, as over the −inf-filled [V]); sampled drafts scatter them into [V]
    first, since q must be a distribution over the target's vocabulary.

    stop_below: the decoder's confidence gate (``set_gate`` in the module docstring): drafting stops
    after the first draft whose running confidence product is below it (that draft is still returned;
    the gate drops it). Costs one host read of the confidence per draft; 0 = draft all k.
    """
    drafts: list[int] = []
    probs: list[Tensor] = []
    confidence: list[Tensor] = []
    running = 1.0  # product of the confidences so far (read only with stop_below)
    logits = first_logits
    for i in range(k):
        if vocab is not None and not warp.greedy:
            logits = logits.new_full((vocab.size,), float("-inf")).index_copy_(0, vocab.ids, logits)
        token, q = warp.choose(logits, generator)
        if q is not None:
            probs.append(q)
            confidence.append(q.max())  # not q[token]: see Proposal.confidence
        else:  # greedy: p(argmax) = exp(max − logsumexp), no softmax kept
            confidence.append((logits[token].float() - torch.logsumexp(logits.float(), -1)).exp())
            if vocab is not None:
                token = vocab.host[token]
        drafts.append(token)
        if stop_below > 0:
            running *= float(confidence[-1])
            if running < stop_below:
                break
        if i + 1 < k:
            logits = step(token)
    return Proposal(
        tokens=torch.tensor(drafts, device=first_logits.device, dtype=torch.long),
        probs=torch.stack(probs) if probs else None,
        confidence=torch.stack(confidence) if confidence else None,
    )


def draft_block(logits: Tensor, warp: Warp, generator: torch.Generator | None, vocab: ReducedVocab | None = None,
                stop_below: float = 0.0) -> Proposal:
    """Draft m tokens whose logits [m, V] (or [m, V'] with ``vocab``) one forward fixed: a block drafter's (DFlash,
    P-EAGLE). The drafted tokens are not fed back, so choosing each from its own q draws the chain from its law and
    the accept rule stays lossless; otherwise as :func:`draft_chain`."""
    rows = iter(logits[1:])
    return draft_chain(lambda _token: next(rows), logits[0], len(logits), warp, generator, vocab, stop_below)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
