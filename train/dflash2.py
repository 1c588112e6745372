"""DFlash2 recipe (vLLM speculators 0.9.0's ``dflash2``): DFlash's blocks, plus the candidate selector's K-way loss.

Blocks, anchors, labels and position weights are DFlash's (``train/dflash.py``, set by ``train.dflash``): random
anchors on answer tokens, block position k of the block at a trained on the target's distribution at a + k − 1, all
blocks of a batch in one forward. On top of DFlash's unary loss (the token loss of the lm_head's logits) each valid row
adds ``train.dflash2.selector_alpha`` × the selector's loss, the reference's (``models/dflash2/metrics.py``):

* classes: the row's unary top K (what the runtime reranks; no gradient through the choice), with the target's
  argmax put in the last place when it is not among them (:func:`training_candidates`), so every row has a label
  without scoring the whole vocabulary;
* scores: each class's unary logit plus its transition score from the row's predecessor — the true token before the
  row (the anchor at k = 1), teacher-forced as the runtime's walk is when its earlier drafts were right;
* loss: cross-entropy of the scores against the target's place, weighted per block position as the unary loss
  (decay exp(−(k−1)/γ), or D-PACE from the selector's own confidence exp(−CE), as the reference computes it).

Held-out metrics are those of what the runtime drafts — the selector's q, softmax of its scores over the unary top K
given the true predecessor: ``expected_accept_step{k−1}`` Σ min(p, q), ``top1_step{k−1}``, ``block_tau`` (DFlash's
names, so the simulated τ reads the selector), plus ``candidate_recall`` (the share of rows whose target argmax is in
the unary top K: the selector can draft nothing else) and the unary loss and selector loss per position
(``loss/pos{k}``, ``selector_loss/pos{k}``, training log).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import heldout, save, setup, step
from .config import TrainRecipe
from .data import Batch
from .dflash import (
    batch_anchors,
    block_labels,
    block_metrics,
    block_rows,
    block_targets,
    dpace_weights,
    position_parts,
    position_weights,
    row_losses,
)
from .distributed import World

READS = ("dflash", "dflash2")


def training_candidates(top: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """The selector's classes of each row: top [M, K] the unary top K, target [M] the target's argmax → (classes
    [M, K]: ``top`` with the target put in the last place where it is missing, the target's place [M])."""
    match = top == target[:, None]
    contains = match.any(-1)
    place = torch.where(contains, match.long().argmax(-1), top.shape[-1] - 1)
    classes = top.clone()
    classes[:, -1] = torch.where(contains, top[:, -1], target)
    return classes, place


def candidate_agreement(scores: Tensor, candidates: Tensor, p: Tensor, chunk_rows: int = 256) -> tuple[Tensor, Tensor]:
    """Per row, [M] each: Σ min(p, q) and whether q's argmax is p's — q the softmax of ``scores`` [M, K] over
    ``candidates`` [M, K] (zero elsewhere), p the softmax of the target's logits [M, V] (``chunk_rows`` at a time)."""
    accept, top1 = [], []
    for s in range(0, len(scores), chunk_rows):
        t = p[s : s + chunk_rows].float()
        c = candidates[s : s + chunk_rows]
        p_c = (t.gather(-1, c) - t.logsumexp(-1, keepdim=True)).exp()  # [n, K]
        accept.append(torch.minimum(p_c, scores[s : s + chunk_rows].float().softmax(-1)).sum(-1))
        top1.append(c.gather(-1, scores[s : s + chunk_rows].argmax(-1, keepdim=True))[:, 0] == t.argmax(-1))
    empty = scores.new_zeros(0)
    return (torch.cat(accept) if accept else empty.float()), (torch.cat(top1) if top1 else empty.bool())


def selector_loss(scores: Tensor, place: Tensor, valid: Tensor, w: Tensor, weighting: str, alpha: float
                  ) -> tuple[Tensor, Tensor]:
    """The selector's loss over the valid block rows: (Σ w' · CE, CE [M]). scores [M, K]: its scores of the training
    classes; place [M]: the target's class; valid [B, N, Bs]: where the M rows sit in their blocks; w [M]: the unary
    loss's row weights. w' = w under ``train.dflash.weighting`` decay; under ``dpace``, D-PACE from the selector's own
    confidence exp(−CE), as the reference weighs it (``compute_selector_loss``), not the unary head's."""
    ce = F.cross_entropy(scores.float(), place, reduction="none")  # [M]
    if weighting == "dpace":
        confidence = torch.zeros(valid.shape, device=ce.device)
        confidence[valid] = (-ce.detach()).exp()
        w = dpace_weights(confidence, valid, alpha)[valid]
    return (w * ce).sum(), ce


def train(recipe: TrainRecipe, world: World, resume: str | None = None) -> dict[str, Any]:
    cfg = recipe.train
    run, config, module = setup.begin(recipe, world)
    layers, bs, top_k = tuple(config.feature_layers), config.block_size, config.selector_top_k
    decay = torch.tensor(position_weights(bs, cfg.dflash.decay_gamma))
    run.max_drafts = bs - 1  # a round drafts at most the block's masked positions (the simulated τ's cap)
    engine = setup.engine_for(run, module, resume)

    def blocks(batch: Batch, anchors: Tensor, serving: bool = False) -> tuple[Tensor, ...]:
        """For the valid block rows: (unary logits [M, V], the target's p logits [M, V], block position [M], valid
        [B, N, Bs], the selector's scores of its training classes [M, K], the target's place among them [M]); with
        ``serving`` also (the unary top K [M, K], the selector's scores of them [M, K]), what the runtime drafts from."""
        label, valid = block_labels(anchors, bs, batch.loss_mask)
        features, p = block_targets(run, batch, layers, label, valid)
        b = torch.arange(label.shape[0], device=label.device)[:, None, None].expand_as(label)[valid]  # [M]
        previous = batch.input_ids[b, label[valid] - 1]  # the token before each row: the anchor at k = 1
        target = p.argmax(-1)

        def forward(m: Any) -> tuple[Tensor, ...]:
            hidden = m.train_blocks(batch.input_ids, features.to(run.dtype), anchors)[valid]  # [M, H]
            unary = m.lm_head(hidden)  # [M, V]
            top = unary.topk(top_k, dim=-1).indices  # [M, K]
            classes, place = training_candidates(top, target)
            out = (unary, m.candidate_selector.scores(unary, hidden, previous, classes), place)
            return (*out, top, m.candidate_selector.scores(unary, hidden, previous, top)) if serving else out

        unary, scores, place, *served = engine(forward)
        k = torch.arange(bs, device=label.device).expand_as(label)[valid]
        return unary, p, k, valid, scores, place, *served

    def objective(unary: Tensor, p: Tensor, k: Tensor, valid: Tensor, scores: Tensor, place: Tensor
                  ) -> tuple[Tensor, heldout.Metrics]:
        """Σ_rows w · unary loss + α · Σ_rows w' · selector CE (module docstring); parts: each position's unweighted
        (sum, rows) of both."""
        row, w, ok = row_losses(run, unary, p, k, valid, decay, None)  # [M] each
        selector, ce = selector_loss(scores, place, valid, w, cfg.dflash.weighting, cfg.dflash.dpace_alpha)
        loss = (w * row).sum() + cfg.dflash2.selector_alpha * selector
        return loss, {**position_parts("loss", row, ok, k, bs), **position_parts("selector_loss", ce, ok, k, bs)}

    def evaluate(engine: Any, batch: Batch) -> heldout.Metrics:
        anchors = batch_anchors(run, batch, heldout_batch=True)
        unary, p, k, valid, scores, place, top, served = blocks(batch, anchors, serving=True)
        accept, top1 = candidate_agreement(served, top, p)  # the selector's q, as the runtime drafts
        recall = (top == p.argmax(-1, keepdim=True)).any(-1)
        return {"loss": (float(objective(unary, p, k, valid, scores, place)[0]), float(valid.sum())),
                "candidate_recall": (float(recall.sum()), float(len(recall))),
                **block_metrics(accept, top1, k, valid, anchors)}

    save.baseline(run, engine, evaluate)
    # the micro-batches of one optimizer step, their valid block rows counted
    for micro in step.step_batches(run, lambda batch: block_rows(run, batch, bs)):
        step.optimizer_step(run, engine, micro, lambda batch: objective(*blocks(batch, batch_anchors(run, batch))))
        step.after_step(run, engine, evaluate)
    return save.finish(run, engine, evaluate)
