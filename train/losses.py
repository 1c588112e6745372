"""Distillation losses: pure functions over masked positions.

Every function takes logits (never probabilities) shaped ``[..., V]`` and a boolean
``mask`` shaped ``[...]`` (True = the position counts), computes in float32, and
returns the **mean over valid positions** (sum over valid positions / their count), or
with ``reduction="sum"`` the sum over them: the training step normalizes sums by the valid
tokens of a whole optimizer step (``train/step.py``), so every token weighs the same
whatever micro-batch or rank it falls in.
p is the target's distribution, q the drafter's; both are ``softmax(logits / T)``.

The token losses are DistillSpec's set (Zhou et al. 2023): forward KL(p‖q), reverse
KL(q‖p), generalized JSD(β) and total variation distance, plus cross-entropy on the
target's argmax and soft cross-entropy −Σ p log q (EAGLE's classification loss), and the
LK losses (Samarin et al. 2026) that aim at the acceptance rate α = Σ min(p, q) itself:
−log α, and the hybrid λ·KL(p‖q) + (1 − λ)·TV with λ = exp(−η·sg[α]), and HASS's top-K distillation
−Σ_{x ∈ top-K(p)} p log q (Zhang et al. 2025), which :func:`token_loss` also adds beside any other loss
(``train.loss.top_k``, ``top_k_weight``); optionally over a
reduced draft vocabulary. :data:`TOKEN_LOSS_FNS` is their one table (name → function). :func:`smooth_l1` is EAGLE's feature
regression; :func:`cross_step_alignment` is CORAL's InfoNCE between the head's states at the unrolled steps of
EAGLE-3's training-time test. :func:`expected_acceptance` Σ_x min(p, q) is the probability that one
sampled draft token is accepted by speculative sampling (= 1 − TVD); it is a metric.

A mean whose mask selects no position raises :class:`EmptyBatchError`: a mean over
nothing is not a number, and silently returning 0 would hide a data bug. A sum over
nothing is 0 (still on the autograd graph, so a backward through it gives zero gradients).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import DraftsmithError

Reduction = Literal["mean", "sum", "none"]


class EmptyBatchError(DraftsmithError):
    """The mask selects no position: there is nothing to average."""


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` [...] over positions where ``mask`` [...] is True."""
    mask = mask.bool()
    count = int(mask.sum())
    if count == 0:
        raise EmptyBatchError(
            f"no valid (loss-masked) positions in a batch of shape {tuple(mask.shape)}: every position is padding "
            f"or prompt. Check the data's loss_mask (assistant tokens) and train.max_length"
        )
    return values.float().masked_fill(~mask, 0.0).sum() / count


def masked_reduce(values: Tensor, mask: Tensor, reduction: Reduction = "mean") -> Tensor:
    """Mean (:func:`masked_mean`) or sum of ``values`` [...] over positions where ``mask`` [...] is True, or
    (``none``) the values themselves [...] in float32, 0 where the mask is False (a caller weighs each)."""
    if reduction == "mean":
        return masked_mean(values, mask)
    if reduction not in ("sum", "none"):
        raise DraftsmithError(f"unknown loss reduction '{reduction}'; choose mean, sum or none")
    kept = values.float().masked_fill(~mask.bool(), 0.0)
    return kept.sum() if reduction == "sum" else kept


def _log_probs(logits: Tensor, temperature: float) -> Tensor:
    if temperature <= 0:
        raise DraftsmithError(f"loss temperature must be > 0, got {temperature}")
    return F.log_softmax(logits.float() / temperature, dim=-1)


def _kl_terms(log_a: Tensor, log_b: Tensor) -> Tensor:
    """Σ a (log a − log b) over the last axis, with 0·log 0 = 0 (logits may be −inf)."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def forward_kl(draft_logits: Tensor, target_logits: Tensor, mask: Tensor, temperature: float = 1.0,
               reduction: Reduction = "mean") -> Tensor:
    """KL(p‖q) = Σ p (log p − log q): mode-covering; the usual KD loss."""
    log_q, log_p = _log_probs(draft_logits, temperature), _log_probs(target_logits, temperature)
    return masked_reduce(_kl_terms(log_p, log_q), mask, reduction)


def reverse_kl(draft_logits: Tensor, target_logits: Tensor, mask: Tensor, temperature: float = 1.0,
               reduction: Reduction = "mean") -> Tensor:
    """KL(q‖p) = Σ q (log q − log p): mode-seeking."""
    log_q, log_p = _log_probs(draft_logits, temperature), _log_probs(target_logits, temperature)
    return masked_reduce(_kl_terms(log_q, log_p), mask, reduction)


def jsd(draft_logits: Tensor, target_logits: Tensor, mask: Tensor, beta: float = 0.5, temperature: float = 1.0,
        reduction: Reduction = "mean") -> Tensor:
    """Generalized JSD(β) = β KL(p‖m) + (1−β) KL(q‖m), m = β p + (1−β) q.

    β → 0 behaves like forward KL / β, β → 1 like reverse KL / (1−β) (DistillSpec, GKD);
    β = 0.5 is the symmetric Jensen–Shannon divergence.
    """
    if not 0.0 < beta < 1.0:
        raise DraftsmithError(f"JSD beta must be in (0, 1), got {beta}")
    log_q, log_p = _log_probs(draft_logits, temperature), _log_probs(target_logits, temperature)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1 - beta))
    return masked_reduce(beta * _kl_terms(log_p, log_m) + (1 - beta) * _kl_terms(log_q, log_m), mask, reduction)


def tvd(draft_logits: Tensor, target_logits: Tensor, mask: Tensor, temperature: float = 1.0,
               reduction: Reduction = "mean") -> Tensor:
    """Total variation distance ½ Σ |p − q| (= 1 − expected acceptance)."""
    q, p = _log_probs(draft_logits, temperature).exp(), _log_probs(target_logits, temperature).exp()
    return masked_reduce(0.5 * (p - q).abs().sum(-1), mask, reduction)


def hard_ce(draft_logits: Tensor, target_ids: Tensor, mask: Tensor, temperature: float = 1.0,
               reduction: Reduction = "mean") -> Tensor:
    """Cross-entropy −log q(y) on given token ids ``target_ids`` [...] (e.g. the target's argmax)."""
    log_q = _log_probs(draft_logits, temperature)
    picked = log_q.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    return masked_reduce(-picked, mask, reduction)


def soft_ce(draft_logits: Tensor, target_logits: Tensor, mask: Tensor, temperature: float = 1.0,
               reduction: Reduction = "mean") -> Tensor:
    """Soft cross-entropy −Σ p log q against the target's full distribution (= KL(p‖q) + H(p))."""
    log_q, log_p = _log_probs(draft_logits, temperature), _log_probs(target_logits, temperature)
    p = log_p.exp()
    return masked_reduce(-torch.where(p > 0, p * log_q, torch.zeros_like(p)).sum(-1), mask, reduction)


ACCEPT_EPS = 1e-5
"""Floor of α inside −log α (the reference trainer's): a row with no overlap at all gives a finite loss."""


def _acceptance(draft_logits: Tensor, target_logits: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """(α [...] = Σ min(p, q), log q [..., V], log p [..., V]) in float32."""
    log_q, log_p = _log_probs(draft_logits, temperature), _log_probs(target_logits, temperature)
    return torch.minimum(log_p.exp(), log_q.exp()).sum(-1), log_q, log_p


def lk_alpha(draft_logits: Tensor, target_logits: Tensor, mask: Tensor, temperature: float = 1.0,
             reduction: Reduction = "mean") -> Tensor:
    """LK^α: −log Σ min(p, q), the negative log acceptance. Its gradient is TV's scaled by 1/α, so it does not
    vanish where the overlap is small; with a one-hot p it is cross-entropy on p's token."""
    alpha, _, _ = _acceptance(draft_logits, target_logits, temperature)
    return masked_reduce(-alpha.clamp_min(ACCEPT_EPS).log(), mask, reduction)


def lk_hybrid(draft_logits: Tensor, target_logits: Tensor, mask: Tensor, temperature: float = 1.0,
              eta: float = 3.0, reduction: Reduction = "mean") -> Tensor:
    """LK^λ: λ·KL(p‖q) + (1 − λ)·TV(p, q) per position with λ = exp(−η·α), α = Σ min(p, q) held constant
    (no gradient through λ): KL's strong gradient while the overlap is small, the acceptance itself as it grows.
    η = 3 is the paper's best setting (and the reference trainer's default)."""
    alpha, log_q, log_p = _acceptance(draft_logits, target_logits, temperature)
    lam = torch.exp(-eta * alpha.detach())
    return masked_reduce(lam * _kl_terms(log_p, log_q) + (1 - lam) * (1 - alpha), mask, reduction)


def top_k_ce(draft_logits: Tensor, target_logits: Tensor, mask: Tensor, k: int, temperature: float = 1.0,
             reduction: Reduction = "mean") -> Tensor:
    """HASS's harmonized objective distillation (Zhang et al., ICLR 2025, "Learning Harmonized Representations for
    Speculative Sampling", its Top-K loss): −Σ_{x ∈ Ω_K} p(x) log q(x), Ω_K the target's K most likely tokens —
    soft cross-entropy over those K alone, p neither renormalized over them nor divided by K (as the paper and its
    code write it). The drafter is pulled to rank the tokens a tree or a sampled draft tries first as the target
    does. Over a reduced vocabulary ``target_logits`` are already the draft vocabulary's (:func:`restrict_to_draft_vocab`),
    so Ω_K is the top K of p renormalized there."""
    if k < 1:
        raise DraftsmithError(f"the top-K loss needs K ≥ 1 (train.loss.top_k), got {k}")
    log_q, log_p = _log_probs(draft_logits, temperature), _log_probs(target_logits, temperature)
    top = log_p.topk(min(k, log_p.shape[-1]), dim=-1).indices  # [..., K]
    p, log_q = log_p.gather(-1, top).exp(), log_q.gather(-1, top)
    return masked_reduce(-torch.where(p > 0, p * log_q, torch.zeros_like(p)).sum(-1), mask, reduction)


TOKEN_LOSS_FNS: dict[str, Callable[..., Tensor]] = {
    "forward_kl": lambda d, t, m, temperature, beta, eta, k, reduction: forward_kl(d, t, m, temperature, reduction),
    "reverse_kl": lambda d, t, m, temperature, beta, eta, k, reduction: reverse_kl(d, t, m, temperature, reduction),
    "jsd": lambda d, t, m, temperature, beta, eta, k, reduction: jsd(d, t, m, beta, temperature, reduction),
    "tvd": lambda d, t, m, temperature, beta, eta, k, reduction: tvd(d, t, m, temperature, reduction),
    "ce": lambda d, t, m, temperature, beta, eta, k, reduction: hard_ce(d, t.argmax(-1), m, temperature, reduction),
    "soft_ce": lambda d, t, m, temperature, beta, eta, k, reduction: soft_ce(d, t, m, temperature, reduction),
    "lk_alpha": lambda d, t, m, temperature, beta, eta, k, reduction: lk_alpha(d, t, m, temperature, reduction),
    "lk_hybrid": lambda d, t, m, temperature, beta, eta, k, reduction: lk_hybrid(d, t, m, temperature, eta, reduction),
    "top_k_ce": lambda d, t, m, temperature, beta, eta, k, reduction: top_k_ce(d, t, m, k, temperature, reduction),
}
"""The token losses by name (``train.loss.kind``): each takes (draft logits, target logits, mask, temperature,
JSD β, LK η, top-K's K, reduction). ``ce`` is cross-entropy on the target's argmax; ``top_k_ce`` is HASS's term
alone, which :func:`token_loss` adds beside the others."""

TOKEN_LOSSES: tuple[str, ...] = tuple(TOKEN_LOSS_FNS)
TokenLoss = Literal[TOKEN_LOSSES]  # type: ignore[valid-type]  # the config's choices, from the table


def restrict_to_draft_vocab(target_logits: Tensor, draft_ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Map the target's logits onto a reduced draft vocabulary (EAGLE-3).

    target_logits: [..., V]; draft_ids: [Vd] long, the target id of each draft-vocab entry;
    mask: [...]. Returns (logits [..., Vd] — softmax of these is p renormalized over the
    draft vocabulary — and the mask with positions whose target argmax lies outside the
    draft vocabulary removed: the drafter could never propose that token).
    """
    in_vocab = torch.zeros(target_logits.shape[-1], dtype=torch.bool, device=target_logits.device)
    in_vocab[draft_ids] = True
    keep = in_vocab[target_logits.argmax(-1)]
    return target_logits.index_select(-1, draft_ids.to(target_logits.device)), mask.bool() & keep


def token_loss(
    kind: str,
    draft_logits: Tensor,
    target_logits: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    beta: float = 0.5,
    reduction: Reduction = "mean",
    eta: float = 3.0,
    top_k: int = 0,
    top_k_weight: float = 1.0,
) -> Tensor:
    """The token loss ``kind`` of :data:`TOKEN_LOSS_FNS` (β: JSD's, η: LK hybrid's), plus, with ``top_k`` = K ≥ 1,
    HASS's objective: ``top_k_weight`` · :func:`top_k_ce` over the same positions (``kind`` = ``top_k_ce`` is that
    term alone, with K = ``top_k``). ``top_k`` = 0 adds nothing."""
    fn = TOKEN_LOSS_FNS.get(kind)
    if fn is None:
        raise DraftsmithError(f"unknown token loss '{kind}'; choose one of: {', '.join(TOKEN_LOSSES)}")
    loss = fn(draft_logits, target_logits, mask, temperature, beta, eta, top_k, reduction)
    if top_k and kind != "top_k_ce":
        loss = loss + top_k_weight * top_k_ce(draft_logits, target_logits, mask, top_k, temperature, reduction)
    return loss


def smooth_l1(pred: Tensor, target: Tensor, mask: Tensor, beta: float = 1.0, reduction: Reduction = "mean") -> Tensor:
    """EAGLE's feature regression: smooth-L1 per element, mean over the feature axis, mean (or sum) over valid positions.

    pred, target: [..., H]; mask: [...].
    """
    per_elem = F.smooth_l1_loss(pred.float(), target.float(), reduction="none", beta=beta)
    return masked_reduce(per_elem.mean(-1), mask, reduction)


CORAL_TEMPERATURE = 0.07
"""τ of :func:`cross_step_alignment`'s InfoNCE: the usual contrastive default (MoCo, SupCon); CORAL's own value
could not be read (see there)."""

_NOT_A_PAIR = -1e9
"""A similarity/τ that exp() takes to 0 in float32: the pairs an anchor may not pick (itself, uncounted views).
Finite, unlike −inf, so an anchor with no valid pair gives finite values and zero gradients, never NaN."""


def cross_step_alignment(states: Tensor, mask: Tensor, temperature: float = CORAL_TEMPERATURE,
                         reduction: Reduction = "sum") -> Tensor:
    """CORAL's cross-step representation alignment (CSRA; Weng et al., ACL 2025, arXiv 2502.16880): an InfoNCE loss
    that makes the head's state at one position the same whichever unrolled step produced it.

    states: [K, B, S, H], the state the head passes on at each of K unrolled steps (the hidden it hands the next
    step, before the lm_head); mask: [K, B, S] bool, the views that count (step k, row t): the rows whose token loss
    counts at step k. Each counted view (k, t) of sequence b is an anchor; its positives are the counted views of
    the same row t at the other steps, and every other counted view of the same sequence (any step, any row) is a
    negative. With cosine similarity s and temperature τ, an anchor's loss is SupCon's
    −(1/|P|) Σ_{p∈P} log(exp(s_ap/τ) / Σ_{c≠a} exp(s_ac/τ)), which for two steps (one positive) is the paper's
    −log(exp(sim(q, f⁺)/τ) / Σ_{f∈F} exp(sim(q, f)/τ)). A row's loss is the mean over its anchors; rows with fewer
    than two counted views (nothing to align) give none. Returns the mean over the rows that have one, or their sum
    (``reduction="sum"``: the EAGLE-3 recipe normalizes by the step's rows). Computed in float32; no side is
    detached (the paper's positives are symmetric views, as in SimCLR): every counted view gets a gradient, the
    others none. Memory: B · (K·S)² similarities.

    From the paper (through its abstract and published summaries; its method section could not be read here):
    the features aligned are the draft model's outputs per training step, F_t ∈ R^{B×S×D}; same position across
    steps = positive pairs, other positions = negatives; InfoNCE with cosine similarity and a temperature. Ours, as
    the most plausible reading: negatives from the same sequence (a per-sequence loss, whatever the micro-batch),
    SupCon's average over several positives for K > 2, one loss per row (the mean of its anchors), τ =
    :data:`CORAL_TEMPERATURE`, and only the views the token loss counts taking part.
    """
    if temperature <= 0:
        raise DraftsmithError(f"cross-step alignment temperature must be > 0, got {temperature}")
    k, b, s, _ = states.shape
    z = F.normalize(states.float(), dim=-1).permute(1, 0, 2, 3).reshape(b, k * s, -1)  # [B, K·S, H]: view k·S + t
    counted = mask.bool().permute(1, 0, 2).reshape(b, k * s)  # [B, K·S]
    row = torch.arange(s, device=states.device).repeat(k)  # [K·S]: the row of each view
    pair = counted.unsqueeze(2) & counted.unsqueeze(1) & ~torch.eye(k * s, dtype=torch.bool, device=states.device)
    sim = (z @ z.transpose(1, 2) / temperature).masked_fill(~pair, _NOT_A_PAIR)  # [B, K·S, K·S]
    log_p = sim - sim.logsumexp(-1, keepdim=True)  # [B, K·S, K·S]: log of the anchor's softmax over its pairs
    positive = pair & (row.unsqueeze(1) == row.unsqueeze(0))  # same row, another step
    n_pos = positive.sum(-1)  # [B, K·S]
    anchor = -log_p.masked_fill(~positive, 0.0).sum(-1) / n_pos.clamp_min(1)  # [B, K·S]; 0 where no positive
    is_anchor = (n_pos > 0).view(b, k, s)
    per_row = anchor.view(b, k, s).sum(1) / is_anchor.sum(1).clamp_min(1)  # [B, S]
    return masked_reduce(per_row, is_anchor.any(1), reduction)


@torch.no_grad()
def expected_acceptance(draft_logits: Tensor, target_logits: Tensor, mask: Tensor, temperature: float = 1.0) -> Tensor:
    """Σ_x min(p(x), q(x)) averaged over valid positions: the chance one sampled draft is accepted."""
    q, p = _log_probs(draft_logits, temperature).exp(), _log_probs(target_logits, temperature).exp()
    return masked_mean(torch.minimum(p, q).sum(-1), mask)


@torch.no_grad()
def top1_accuracy(draft_logits: Tensor, target_ids: Tensor, mask: Tensor) -> Tensor:
    """Fraction of valid positions where the drafter's argmax equals ``target_ids`` (greedy acceptance)."""
    return masked_mean((draft_logits.argmax(-1) == target_ids).float(), mask)


@torch.no_grad()
def draft_vocab_agreement(draft_logits: Tensor, target_logits: Tensor, draft_ids: Tensor, rows: Tensor | None = None,
                          chunk_rows: int = 256) -> tuple[Tensor, Tensor]:
    """Per row, [N] each: Σ_x min(p(x), q(x)) and whether the drafter's argmax is the target's — q the softmax of
    ``draft_logits`` [N, Vd] over the draft vocabulary (target ids ``draft_ids`` [Vd], ascending; q = 0 elsewhere),
    p the softmax of ``target_logits`` [N, V] (or of its rows ``rows`` [N]) over the whole vocabulary. The same figures as
    :func:`expected_acceptance` and :func:`top1_accuracy` on the draft logits scattered to [N, V], without building
    them: p is read at the draft ids through its log-normalizer, ``chunk_rows`` rows at a time, so no full-vocabulary
    tensor exceeds that many rows (a 262k vocabulary made [N, V] fp32 copies many GiB)."""
    ids = draft_ids.to(target_logits.device)
    accept, top1 = [], []
    for s in range(0, len(draft_logits), chunk_rows):
        t = (target_logits[s:s + chunk_rows] if rows is None else target_logits[rows[s:s + chunk_rows]]).float()
        p = (t.index_select(-1, ids) - t.logsumexp(-1, keepdim=True)).exp()  # [n, Vd]
        q = draft_logits[s:s + chunk_rows].float().softmax(-1)
        accept.append(torch.minimum(p, q).sum(-1))
        top1.append(ids[q.argmax(-1)] == t.argmax(-1))
    empty = draft_logits.new_zeros(0)
    return (torch.cat(accept) if accept else empty.float()), (torch.cat(top1) if top1 else empty.bool())


def decayed_weights(n: int, decay: float) -> list[float]:
    """[1, d, d², …] — EAGLE-3's per-step and Medusa's per-head weights (d = 0.8 in both papers)."""
    return [decay**i for i in range(n)]


__all__ = [
    "TOKEN_LOSSES",
    "TOKEN_LOSS_FNS",
    "CORAL_TEMPERATURE",
    "EmptyBatchError",
    "cross_step_alignment",
    "decayed_weights",
    "draft_vocab_agreement",
    "expected_acceptance",
    "forward_kl",
    "hard_ce",
    "jsd",
    "lk_alpha",
    "lk_hybrid",
    "masked_mean",
    "masked_reduce",
    "restrict_to_draft_vocab",
    "reverse_kl",
    "smooth_l1",
    "soft_ce",
    "token_loss",
    "top1_accuracy",
    "top_k_ce",
    "tvd",
]
