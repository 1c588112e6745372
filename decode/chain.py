"""The built-in speculative decoder: chain drafting, batch size 1, lossless.

One round (gpt-fast style): the drafter proposes d_1..d_k after the last committed
token t; the target runs once over [t, d_1..d_k] and gives p at k+1 positions; the
pure accept rule (``sampling.py``) keeps n drafts and emits one more token; both KV
caches drop what was not kept. The target's cache always holds every committed token
but the last (t is fed at the start of the next round), so no accepted token is ever
recomputed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..errors import DraftsmithError
from ..target import Target, crop_cache
from .protocol import Drafter
from .sampling import Warp, greedy_accept, speculative_accept
from .stats import DecodeStats, first_eos


@dataclass
class DecodeResult:
    tokens: list[int]
    """New tokens only (the prompt excluded), ending with EOS if one was produced."""
    finish_reason: Literal["eos", "length"]
    stats: DecodeStats


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
    exceeds the extra verification cost, v(1) − 1 (≈ 0.05–0.2 of a step in bf16 on a 2-core AVX2 CPU with
    ``kernels/cpu_linear.py``, ≈ 0.35 without it), plus the drafting cost c.
    """
    if k < 1:
        raise DraftsmithError(f"k = {k}: the number of draft tokens per round must be at least 1")
    if max_new_tokens < 1:
        raise DraftsmithError(f"max_new_tokens = {max_new_tokens} must be at least 1")
    check_prompt(target, prompt_ids, max_new_tokens)
    device = target.device
    gen = torch.Generator(device=device).manual_seed(seed)
    eos = target.eos_token_ids
    stats = DecodeStats(k=k, sequences=1)
    start = time.perf_counter()

    cache = target.new_cache()
    drafter.reset()
    bind = getattr(drafter, "bind", None)  # optional: self-speculative drafters share the target's cache
    if bind is not None:
        bind(cache)
    set_gate = getattr(drafter, "set_gate", None)  # optional: stop drafting where the gate would cut
    if set_gate is not None:
        set_gate(min_confidence)
    verify = getattr(drafter, "verify", None)  # optional: their verification forward reuses drafting work
    token = prefill(target, drafter, prompt_ids, cache, warp, gen, stats)
    tokens = [token]
    no_draft = torch.empty(0, dtype=torch.long, device=device)

    while token not in eos and len(tokens) < max_new_tokens:
        # never draft past max_new_tokens: the round emits at most k_round + 1 tokens
        k_round = min(k, max_new_tokens - len(tokens) - 1)
        proposal = drafter.propose(k_round, warp, gen) if k_round > 0 else None
        draft = proposal.tokens[:k_round] if proposal is not None else no_draft  # [k'] — a drafter may propose fewer
        if min_confidence > 0 and proposal is not None and proposal.confidence is not None:
            draft = draft[: gate(proposal.confidence[: draft.shape[0]], min_confidence)]
        committed = len(prompt_ids) + len(tokens) - 1  # in the cache: every committed token but the last
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
        kept = draft[:n].tolist()
        cut = first_eos(kept, eos)
        if cut is not None:  # an accepted draft was EOS: the sequence ends there, and only what is emitted counts
            stats.record_round(cut + 1, cut + 1, nodes=draft.shape[0], bonus=False)
            tokens.extend(kept[: cut + 1])
            break
        emitted = kept + [token]
        stats.record_round(draft.shape[0], n)
        tokens.extend(emitted)
        drafter.update(torch.tensor(emitted, device=device), first_features(out.features, n + 1))

    tokens, reason = finish(tokens, eos, max_new_tokens)
    stats.new_tokens = len(tokens)
    stats.wall_s = time.perf_counter() - start
    return DecodeResult(tokens=tokens, finish_reason=reason, stats=stats)


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
