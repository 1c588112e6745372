"""The built-in speculative decoder: the round skeleton chain and tree decoding share, and the chain.

One round (gpt-fast style): the drafter proposes d_1..d_k after the last committed
token t; the target runs once over [t, d_1..d_k] and gives p at k+1 positions; the
pure accept rule (``sampling.py``) keeps n drafts and emits one more token; both KV
caches drop what was not kept. The target's cache always holds every committed token
but the last (t is fed at the start of the next round), so no accepted token is ever
recomputed.

:func:`decode_rounds` is that loop, written once: prefill, then rounds until EOS or the token
limit, each one a :data:`Round` (draft → verify forward → accept → cut the target's cache) followed
by the EOS cut, the stats and the drafter's ``update``. A chain round (:func:`speculative_decode`)
and a tree round (``tree.py:tree_decode``) differ only inside the :data:`Round`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..errors import DraftsmithError
from ..target import Target, crop_cache
from .protocol import BindsTargetCache, Drafter, Gated
from .sampling import Warp, greedy_accept, speculative_accept
from .stats import DecodeStats, first_eos


@dataclass
class DecodeResult:
    tokens: list[int]
    """New tokens only (the prompt excluded), ending with EOS if one was produced."""
    finish_reason: Literal["eos", "length"]
    stats: DecodeStats


@dataclass
class Verified:
    """One round's outcome, the target's cache already cut to it."""

    kept: list[int]
    """The accepted drafts (a tree: the tokens of the accepted path)."""
    token: int
    """The token after them: resampled at the first rejection, or the bonus token."""
    features: Tensor | None
    """[n+1, F] the target's features at t and the n kept drafts, or None."""
    depth: int
    """Drafts on the longest path verified (a chain: its length)."""
    nodes: int
    """Drafts verified (a tree's size; a chain: its length)."""


Round = Callable[[int, int, int], Verified]
"""round(token, committed, room) → :class:`Verified`: draft at most ``room`` tokens after the last committed
``token``, verify them in one target forward after the ``committed`` tokens in the cache (every committed token
but ``token``), and leave the cache holding those, ``token`` and the accepted drafts."""


def decode_rounds(
    target: Target, drafter: Drafter, prompt_ids: list[int], round_: Round, *, cache: object,
    generator: torch.Generator, warp: Warp, depth: int, max_new_tokens: int, min_confidence: float,
) -> DecodeResult:
    """The speculative loop both decoders run: at most ``depth`` drafts a round, ``max_new_tokens`` in all.

    The drafter is reset, bound to ``cache`` if it drafts inside it (:class:`BindsTargetCache`) and given
    ``min_confidence``, the confidence gate the round applies to its chains (:class:`Gated`), before the prefill.
    """
    if max_new_tokens < 1:
        raise DraftsmithError(f"max_new_tokens = {max_new_tokens} must be at least 1")
    check_prompt(target, prompt_ids, max_new_tokens)
    eos = target.eos_token_ids
    stats = DecodeStats(k=depth, sequences=1)
    start = time.perf_counter()

    drafter.reset()
    if isinstance(drafter, BindsTargetCache):
        drafter.bind(cache)
    if isinstance(drafter, Gated):
        drafter.set_gate(min_confidence)
    token = prefill(target, drafter, prompt_ids, cache, warp, generator, stats)
    tokens = [token]

    while token not in eos and len(tokens) < max_new_tokens:
        room = min(depth, max_new_tokens - len(tokens) - 1)  # a round emits at most room + 1 tokens
        committed = len(prompt_ids) + len(tokens) - 1  # in the cache: every committed token but the last
        out = round_(token, committed, room)
        cut = first_eos(out.kept, eos)
        if cut is not None:  # an accepted draft was EOS: the sequence ends there, and only what is emitted counts
            stats.record_round(cut + 1, cut + 1, nodes=out.nodes, bonus=False)
            tokens.extend(out.kept[: cut + 1])
            break
        emitted = out.kept + [out.token]
        stats.record_round(out.depth, len(out.kept), nodes=out.nodes)
        tokens.extend(emitted)
        token = out.token
        drafter.update(torch.tensor(emitted, device=target.device), out.features)

    tokens, reason = finish(tokens, eos, max_new_tokens)
    stats.new_tokens = len(tokens)
    stats.wall_s = time.perf_counter() - start
    return DecodeResult(tokens=tokens, finish_reason=reason, stats=stats)


@torch.inference_mode()
def speculative_decode(
    target: Target, drafter: Drafter, prompt_ids: list[int], *, k: int, max_new_tokens: int,
    warp: Warp = Warp(), seed: int = 0, min_confidence: float = 0.0,
) -> DecodeResult:
    """Decode one prompt speculatively, k drafts per round, at most max_new_tokens new tokens.

    warp: temperature / top-k / top-p applied to target and drafter alike (greedy by default:
    then the output is the target's own greedy output); seed seeds the sampler.
    min_confidence: the confidence gate — keep the drafts d_1..d_j whose running product of the
    drafter's own confidences (``Proposal.confidence``) is ≥ min_confidence, drop the rest (a round
    may verify no draft at all: a plain target step). The rule reads only the drafter's state, before
    the target sees the drafts, so the output law is unchanged (lossless; greedy: token-identical).
    It pays where verification is not free: a draft is worth verifying when its chance of acceptance
    exceeds the extra verification cost, v(1) − 1 (measured per kernel: benchmarks/RESULTS.md, "cpu_linear"),
    plus the drafting cost c.
    """
    if k < 1:
        raise DraftsmithError(f"k = {k}: the number of draft tokens per round must be at least 1")
    device = target.device
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = target.new_cache()
    # a self-speculative drafter's verification forward reuses its drafting work
    verify = drafter.verify if isinstance(drafter, BindsTargetCache) else None
    no_draft = torch.empty(0, dtype=torch.long, device=device)

    def chain_round(token: int, committed: int, room: int) -> Verified:
        proposal = drafter.propose(room, warp, gen) if room > 0 else None
        draft = proposal.tokens[:room] if proposal is not None else no_draft  # [k'] — a drafter may propose fewer
        if min_confidence > 0 and proposal is not None and proposal.confidence is not None:
            draft = draft[: gate(proposal.confidence[: draft.shape[0]], min_confidence)]
        verify_ids = torch.cat([torch.tensor([token], device=device), draft])[None]  # [1, k'+1]
        if verify is not None:
            out = verify(verify_ids)
        else:
            out = target.forward(verify_ids, cache, drafter.feature_layers)
        logits = out.logits[0]  # [k'+1, V]
        if warp.greedy:
            n, token = greedy_accept(logits.argmax(-1), draft)
        else:
            q = _draft_probs(proposal, draft, logits.shape[-1])
            n, token = speculative_accept(warp.probs(logits), q, draft, gen)
        crop_cache(cache, committed + 1 + n)  # keep t, d_1..d_n; the new token is fed next round
        k_verified = draft.shape[0]
        return Verified(draft[:n].tolist(), token, first_features(out.features, n + 1), k_verified, k_verified)

    return decode_rounds(target, drafter, prompt_ids, chain_round, cache=cache, generator=gen, warp=warp, depth=k,
                         max_new_tokens=max_new_tokens, min_confidence=min_confidence)


def gate(confidence: Tensor, threshold: float) -> int:
    """How many leading drafts keep their running confidence product ≥ threshold ([k'] → int)."""
    return int((torch.cumprod(confidence.float(), 0) >= threshold).cumprod(0).sum())


def prefill(
    target: Target, drafter: Drafter, prompt_ids: list[int], cache: object, warp: Warp,
    generator: torch.Generator | None, stats: DecodeStats,
) -> int:
    """The prompt's forward into ``cache``; returns the first new token (chosen with ``warp``) after
    handing the drafter the prompt, that token and the prompt's features."""
    device = target.device
    prompt = torch.tensor([prompt_ids], device=device)  # [1, S]
    out = target.forward(prompt, cache, drafter.feature_layers, logits_to_keep=1)
    stats.target_forwards += 1
    token, _ = warp.choose(out.logits[0, -1], generator)
    drafter.update(torch.tensor(prompt_ids + [token], device=device), first_features(out.features))
    return token


def _draft_probs(proposal, draft: Tensor, vocab: int) -> Tensor:
    """The drafter's q for the drafts kept, [k', V]; a clear error when a drafter breaks the contract."""
    if draft.shape[0] == 0:
        return torch.zeros(0, vocab, device=draft.device)
    q = proposal.probs
    if q is None or q.shape[0] < draft.shape[0] or q.shape[-1] != vocab:
        shape = None if q is None else tuple(q.shape)
        raise DraftsmithError(
            f"drafter returned probs of shape {shape} for {draft.shape[0]} drafts; sampling needs [k', {vocab}] "
            f"warped distributions over the target's vocabulary"
        )
    return q[: draft.shape[0]]


def check_prompt(target: Target, prompt_ids: list[int], max_new_tokens: int) -> None:
    if not prompt_ids:
        raise DraftsmithError("the prompt is empty")
    need = len(prompt_ids) + max_new_tokens
    if need > target.max_positions:
        raise DraftsmithError(
            f"prompt of {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} = {need} exceeds the target's "
            f"context of {target.max_positions} positions; shorten the prompt or lower decode.max_new_tokens"
        )


def first_features(features: Tensor | None, n: int | None = None) -> Tensor | None:
    """Features of the first n positions of batch row 0 ([n, F]), or None."""
    if features is None:
        return None
    return features[0] if n is None else features[0, :n]


def finish(tokens: list[int], eos: set[int], max_new: int) -> tuple[list[int], Literal["eos", "length"]]:
    """Cut after the first EOS and at max_new tokens (a safeguard: the loops stop at both)."""
    for i, t in enumerate(tokens[:max_new]):
        if t in eos:
            return tokens[: i + 1], "eos"
    return tokens[:max_new], "length"
