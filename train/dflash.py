"""DFlash recipe (z-lab 2026): blocks of masked positions, each filled in one forward from the target context.

Each sequence gets ``train.dflash.anchors`` blocks at random anchors a — answer positions whose
next token is an answer token too (at decoding time the anchor is the last committed token,
always one the target produced). Block position k (1 … Bs−1) of the block at a predicts the token
at a + k from the target's features of positions < a (``drafters/dflash.py``); its target
distribution is the target's own output at position a + k − 1 (soft labels, as every recipe here
distills the target rather than the data), and it counts when a + k is an answer token inside the
sequence (:func:`block_labels`). All blocks of a batch run in one forward of the drafter.

Position weights (``train.dflash.weighting``): ``decay`` weighs position k by exp(−(k−1)/γ) (the
reference's: an early position is worth more, since every later draft needs it accepted); ``dpace``
(D-PACE, arXiv 2605.18810, as speculators and SpecForge implement it) weighs each row of a block by its
share of the block's expected accepted length under the drafter's current confidences
(:func:`dpace_weights`): early positions dominate while they are unsure, later ones gain weight as the
early ones become reliable. The paper's D-PACE is cross-entropy on the target's token (``train.loss.kind:
ce``); with a soft loss the same weights multiply that loss (the confidence is still the drafter's
probability of the target's argmax), which is not the paper's soft-label variant. Either way the weighted
sum over rows is divided by the valid positions of the whole optimizer step (``step.py``) — not by the sum
of the weights, which would cancel D-PACE's credit mass (the author's point in SpecForge issue 828); a
D-PACE loss is therefore larger than a decay loss (w_1 ≤ Bs − 1 instead of 1). Anchors are drawn from a
generator seeded by (train.seed, step, batch), so counting a batch's positions and computing its loss see
the same blocks; held-out batches always get the same ones.

With a reduced draft vocabulary (``drafter.draft_vocab``) the target's p is renormalized onto the draft
ids and a row whose target argmax lies outside them has no loss (the drafter could never propose it), as
in the EAGLE-3 recipe (``losses.restrict_to_draft_vocab``); held-out metrics read the drafter's q over the
target's whole vocabulary, zero outside the draft vocabulary, against the target's full p.

Held-out metrics per block position k: expected acceptance Σ min(p, q) and top-1 agreement
(``expected_accept_step{k−1}``, ``top1_step{k−1}``: conditional on the true prefix, as Medusa's
heads), and ``block_tau``: 1 + the leading block positions whose argmax is the target's, averaged
over blocks — the greedy acceptance length of a block drafted from a true context.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..drafters.common import shift_left
from . import heldout, losses, save, setup, step, target_side
from .config import TrainRecipe
from .data import Batch
from .distributed import World

READS = ("dflash",)


def sample_anchors(loss_mask: Tensor, num: int, generator: torch.Generator) -> Tensor:
    """Up to ``num`` distinct anchors per sequence, ascending: [B, S] bool → [B, N] long, −1 = none
    (N = min(num, the most eligible positions of a row)). Eligible: a and a + 1 are answer tokens."""
    eligible = loss_mask & shift_left(loss_mask, 1, fill=False)  # [B, S]
    n = min(num, int(eligible.sum(1).max()))
    scores = torch.rand(loss_mask.shape, generator=generator).to(loss_mask.device).masked_fill(~eligible, -1.0)
    top = scores.topk(n, dim=1)
    anchors = torch.where(top.values >= 0, top.indices, loss_mask.shape[1])  # none sorts last
    anchors = anchors.sort(dim=1).values
    return torch.where(anchors < loss_mask.shape[1], anchors, -1)


def block_labels(anchors: Tensor, block_size: int, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """The token each block row predicts and whether it counts.

    anchors [B, N] (−1 = none), loss_mask [B, S] → (label [B, N, Bs] long = anchor + k, valid
    [B, N, Bs] bool: k ≥ 1, a real anchor, label < S and an answer token there). The row's target
    distribution is the target's output at position label − 1."""
    s = loss_mask.shape[1]
    k = torch.arange(block_size, device=anchors.device)
    label = anchors[..., None] + k  # [B, N, Bs]
    inside = (anchors[..., None] >= 0) & (k > 0) & (label < s)
    answer = loss_mask.gather(1, label.clamp(0, s - 1).flatten(1)).view(label.shape)
    return label, inside & answer


def position_weights(block_size: int, gamma: float) -> list[float]:
    """[0, 1, e^{−1/γ}, e^{−2/γ}, …]: block position k ≥ 1 weighs exp(−(k−1)/γ); position 0 (the anchor) 0.
    γ = 0: the reference's defaults (7 for blocks of 16 or more, else 4)."""
    gamma = gamma or (7.0 if block_size >= 16 else 4.0)
    return [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, block_size)]


def dpace_weights(confidence: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """D-PACE's position weights (Eq. 7–8 of the paper), per block, without gradient.

    confidence [..., Bs]: q_k, the drafter's probability of the target's token at block position k (exp of
    minus its cross-entropy); valid [..., Bs] bool: the rows that count (position 0, the anchor, never does).
    → [..., Bs] float32: with q̃_k = (1 − α)·q_k + α on valid rows and 1 elsewhere (an invalid row neither
    gates nor counts), w_k = Σ_{m ≥ k, m valid} Π_{i ≤ m} q̃_i for valid k, else 0. Π_{i ≤ m} q̃_i is the
    (smoothed) chance that drafts 1 … m are all accepted, so w_k is the expected accepted length that rests
    on position k; α keeps later positions from vanishing while early ones are unsure."""
    with torch.no_grad():
        smooth = torch.where(valid, (1.0 - alpha) * confidence.float() + alpha, torch.ones_like(confidence, dtype=torch.float32))
        prefix = smooth.cumprod(-1)
        suffix = (prefix * valid).flip(-1).cumsum(-1).flip(-1)
        return suffix * valid


def batch_anchors(run: setup.Run, batch: Batch, heldout_batch: bool = False) -> Tensor:
    """The batch's anchors [B, N] (``train.dflash.anchors`` per sequence), from a generator seeded by (train.seed,
    step, batch): counting a batch's rows and computing its loss see the same blocks, and a held-out batch always
    gets the same ones."""
    salt = 0 if heldout_batch else run.state.step + 1
    gen = torch.Generator().manual_seed(hash((run.cfg.seed, salt, int(batch.input_ids.sum()))) % (1 << 62))
    return sample_anchors(batch.loss_mask, run.cfg.dflash.anchors, gen)


def block_rows(run: setup.Run, batch: Batch, block_size: int) -> Tensor:
    """[B, N, Bs] bool: the block rows of the batch that count (what a step's loss is divided by)."""
    return block_labels(batch_anchors(run, batch), block_size, batch.loss_mask)[1]


def block_targets(run: setup.Run, batch: Batch, layers: tuple[int, ...], label: Tensor, valid: Tensor
                  ) -> tuple[Tensor, Tensor]:
    """The target's side of the blocks of :func:`block_labels`: (its features [B, S, L·H], its logits p [M, V] at
    each valid row's source position label − 1, in the row-major order of ``valid`` [B, N, Bs])."""
    b = torch.arange(label.shape[0], device=label.device)[:, None, None].expand_as(label)[valid]  # [M]
    source = label[valid] - 1  # the target's position whose output predicts the label
    need = torch.zeros_like(batch.loss_mask)
    need[b, source] = True
    features, p_rows = target_side.features_and_logits(run, batch, layers, rows=need)  # [N', V]
    index = (need.flatten().long().cumsum(0) - 1).view(need.shape)  # [B, S]: row of a position in p_rows
    return features, p_rows[index[b, source]]


def row_losses(run: setup.Run, q: Tensor, p: Tensor, k: Tensor, valid: Tensor, decay: Tensor,
               draft_ids: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Per valid block row [M] (q logits [M, V'], p [M, V], block position k [M]; ``valid`` [B, N, Bs]): (the token
    loss, its weight under ``train.dflash.weighting`` (``decay`` [Bs] or D-PACE from q's confidence), whether it
    counts: with a draft vocabulary (target ids ``draft_ids``), not when the target's argmax lies outside it)."""
    cfg = run.cfg
    ok = torch.ones_like(k, dtype=torch.bool)
    if draft_ids is not None:  # p over the draft vocabulary; a target argmax outside it has no loss
        p, ok = losses.restrict_to_draft_vocab(p, draft_ids, ok)
    row = cfg.loss.token_loss(q, p, ok, reduction="none")  # [M]
    if cfg.dflash.weighting == "dpace":
        confidence = torch.zeros(valid.shape, device=q.device)  # an unreachable target token: confidence 0
        picked = q.float().log_softmax(-1).gather(-1, p.argmax(-1, keepdim=True))[:, 0].exp()
        confidence[valid] = torch.where(ok, picked, 0.0)
        return row, dpace_weights(confidence, valid, cfg.dflash.dpace_alpha)[valid], ok
    return row, decay.to(q.device)[k], ok


def position_parts(name: str, row: Tensor, ok: Tensor, k: Tensor, block_size: int) -> heldout.Metrics:
    """Each block position's unweighted (sum of ``row`` [M], rows that count) as ``{name}/pos{k}``."""
    return {f"{name}/pos{pos}": (row[k == pos].sum().item(), float((ok & (k == pos)).sum())) for pos in range(1, block_size)}


def block_metrics(accept: Tensor, top1: Tensor, k: Tensor, valid: Tensor, anchors: Tensor) -> heldout.Metrics:
    """Held-out figures of the drafts of valid block rows (accept: Σ min(p, q) [M]; top1: the draft is the target's
    argmax [M]; k: block position [M]) per position (``expected_accept_step{k−1}``, ``top1_step{k−1}``), and
    ``block_tau``: 1 + the leading agreeing positions of a block, averaged over the real anchors [B, N]."""
    out: heldout.Metrics = {}
    for pos in range(1, valid.shape[-1]):
        at = k == pos
        out[f"expected_accept_step{pos - 1}"] = heldout.masked_metric(lambda: losses.masked_mean(accept[at], at[at]), at[at])
        out[f"top1_step{pos - 1}"] = heldout.masked_metric(lambda: losses.masked_mean(top1[at], at[at]), at[at])
    agree = torch.zeros_like(valid)
    agree[valid] = top1
    real = anchors >= 0  # [B, N]
    run_length = agree[..., 1:].long().cumprod(-1).sum(-1)  # [B, N] leading agreeing positions
    out["block_tau"] = (float((run_length + 1)[real].sum()), float(real.sum()))
    return out


def train(recipe: TrainRecipe, world: World, resume: str | None = None) -> dict[str, Any]:
    cfg = recipe.train
    run, config, module = setup.begin(recipe, world)
    layers, bs, vocab = tuple(config.feature_layers), config.block_size, run.target.vocab_size
    draft_ids = None if module.draft_ids is None else module.draft_ids.clone()  # a reduced vocabulary's target ids
    decay = torch.tensor(position_weights(bs, cfg.dflash.decay_gamma))
    run.max_drafts = bs - 1  # a round drafts at most the block's masked positions (the simulated τ's cap)
    engine = setup.engine_for(run, module, resume)

    def blocks(batch: Batch, anchors: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(q logits [M, V'] of the valid block rows (V' = Vd with a draft vocabulary), the target's p logits
        there [M, V], their block position [M], valid [B, N, Bs])."""
        label, valid = block_labels(anchors, bs, batch.loss_mask)
        features, p = block_targets(run, batch, layers, label, valid)
        q = engine(lambda m: m.lm_head(m.train_blocks(batch.input_ids, features.to(run.dtype), anchors)[valid]))
        k = torch.arange(bs, device=label.device).expand_as(label)[valid]
        return q, p, k, valid

    def objective(q: Tensor, p: Tensor, k: Tensor, valid: Tensor) -> tuple[Tensor, heldout.Metrics]:
        """Σ_rows w_row · token loss (the recipe's weighting, module docstring); parts: each position's
        unweighted (sum, rows)."""
        row, w, ok = row_losses(run, q, p, k, valid, decay, draft_ids)  # [M] each
        return (w * row).sum(), position_parts("loss", row, ok, k, bs)

    def evaluate(engine: Any, batch: Batch) -> heldout.Metrics:
        anchors = batch_anchors(run, batch, heldout_batch=True)
        q, p, k, valid = blocks(batch, anchors)
        ids = draft_ids if draft_ids is not None else torch.arange(vocab, device=q.device)  # q = 0 outside them
        accept, top1 = losses.draft_vocab_agreement(q, p, ids)  # [M] each, no [M, V] copy of q
        return {"loss": (float(objective(q, p, k, valid)[0]), float(valid.sum())),
                **block_metrics(accept, top1, k, valid, anchors)}

    save.baseline(run, engine, evaluate)
    # the micro-batches of one optimizer step, their valid block rows counted
    for micro in step.step_batches(run, lambda batch: block_rows(run, batch, bs)):
        step.optimizer_step(run, engine, micro, lambda batch: objective(*blocks(batch, batch_anchors(run, batch))))
        step.after_step(run, engine, evaluate)
    return save.finish(run, engine, evaluate)
