"""P-EAGLE recipe (vLLM speculators 0.9.0's ``peagle``): the EAGLE-3 head trained to draft K tokens in one forward.

Each sequence becomes one layout of entries (anchor a, depth d) (``drafters/peagle.py``), drawn by COD sampling (the
reference's ``generate_cod_sample_indices``, :func:`cod_layout`): depth 0 is every row of the sequence (EAGLE-3's
teacher-forced rows), and depth d ≥ 1 keeps a random share max(r^d, r_min) of the rollouts that reached depth d − 1
(``train.peagle.down_sample_ratio`` r = 0.7, ``down_sample_ratio_min`` r_min = 0.2), so a rollout at depth d has all
its depths below. The whole layout runs in ONE forward of the head, under the attention of the drafter's docstring.

Entry (a, d) predicts x_{a+d+2}; its target distribution is the target's output at position a + d + 1, and it counts
when x_{a+d+2} is an answer token (draftsmith's rule for EAGLE-3's rows; the reference masks by the token the row
reads instead, one position earlier). Every counted entry weighs the same, whatever its depth (the reference's mean
over sampled entries; no decay): the loss of a step is their summed token loss over their number (``step.py``).
Rollouts start at answer positions only (``max_anchors`` of them per sequence at most, 0 = all). The layout of a
batch is drawn from a generator seeded by (train.seed, step, batch), so counting and the loss see the same one.

With a reduced draft vocabulary the target's p is renormalized onto the draft ids and a row whose target argmax is
outside them has no loss (as EAGLE-3's recipe). Held-out metrics per depth d: expected acceptance Σ min(p, q) and
top-1 agreement (``expected_accept_step{d}``, ``top1_step{d}``), on a fixed layout per held-out batch; since a
depth-d draft is conditioned on the true context only, they are the chance that draft d + 1 is right given that the
drafts before it were.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..drafters.common import shift_left
from . import heldout, losses, save, setup, step, target_side
from .config import TrainRecipe
from .data import Batch
from .distributed import World

READS = ("feature_noise", "peagle")


def cod_layout(loss_mask: Tensor, attention_mask: Tensor | None, num_depths: int, ratio: float, ratio_min: float,
               max_anchors: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """COD sampling of every sequence of a batch: (anchor [B, T] long, −1 = padding; depth [B, T] long;
    valid [B, T] bool: the entries whose loss counts).

    loss_mask, attention_mask: [B, S]. Row p can be predicted when x_{p+2} is an answer token (``valid`` at depth 0).
    Depth 0 is rows 0 … S−1 (−1 past a sequence's end). Rollout seeds: the valid rows (``max_anchors`` of them drawn
    at random when there are more; 0 = all). Depth d: from the rows p that continue a rollout of depth d − 1
    (at d = 1 the seeds), n_d = ⌊(seeds − d) · max(ratio^d, ratio_min)⌋ drawn at random (all of them when fewer),
    each the entry (p − d, d); the next depth's candidates are p + 1 where valid. Stops at the first empty depth."""
    b, s = loss_mask.shape
    real = torch.ones_like(loss_mask, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    ok = (shift_left(loss_mask, 2, fill=False).bool() & real).cpu()
    rows: list[tuple[Tensor, Tensor, Tensor]] = []
    for i in range(b):
        first = torch.where(real[i].cpu(), torch.arange(s), -1)
        anchors, depths, valid = [first], [torch.zeros(s, dtype=torch.long)], [ok[i].clone()]
        seeds = ok[i].nonzero().flatten()
        if 0 < max_anchors < len(seeds):
            seeds = seeds[torch.randperm(len(seeds), generator=generator)[:max_anchors]].sort().values
        pool = seeds
        for d in range(1, num_depths):
            pool = pool[pool >= d]  # a rollout starts at row p − d ≥ 0
            size = int(max(0, len(seeds) - d) * max(ratio**d, ratio_min))
            if size <= 0 or len(pool) == 0:
                break
            if len(pool) > size:
                pool = pool[torch.randperm(len(pool), generator=generator)[:size]].sort().values
            anchors.append(pool - d)
            depths.append(torch.full((len(pool),), d, dtype=torch.long))
            valid.append(torch.ones(len(pool), dtype=torch.bool))
            pool = pool + 1
            pool = pool[pool < s]
            pool = pool[ok[i, pool]]
        rows.append((torch.cat(anchors), torch.cat(depths), torch.cat(valid)))
    t = max(len(a) for a, _, _ in rows)
    anchor = torch.full((b, t), -1, dtype=torch.long)
    depth = torch.zeros((b, t), dtype=torch.long)
    valid = torch.zeros((b, t), dtype=torch.bool)
    for i, (a, d, v) in enumerate(rows):
        anchor[i, : len(a)], depth[i, : len(d)], valid[i, : len(v)] = a, d, v
    device = loss_mask.device
    return anchor.to(device), depth.to(device), valid.to(device)


def train(recipe: TrainRecipe, world: World, resume: str | None = None) -> dict[str, Any]:
    cfg = recipe.train
    run, config, head = setup.begin(recipe, world)
    layers, depths, draft_ids = tuple(config.feature_layers), config.num_depths, head.draft_ids.clone()
    run.max_drafts = depths  # one forward drafts the K depths (the simulated τ's cap)
    engine = setup.engine_for(run, head, resume)

    def layout(batch: Batch, heldout_batch: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """The batch's (anchor, depth, valid) [B, T]: the same for a batch at a given step (counting and loss agree)."""
        salt = 0 if heldout_batch else run.state.step + 1
        gen = torch.Generator().manual_seed(hash((cfg.seed, salt, int(batch.input_ids.sum()))) % (1 << 62))
        p = cfg.peagle
        return cod_layout(batch.loss_mask, batch.attention_mask, depths, p.down_sample_ratio, p.down_sample_ratio_min,
                          p.max_anchors, gen)

    def rows(batch: Batch) -> Tensor:
        return layout(batch)[2]

    def entries(batch: Batch, layout: tuple[Tensor, Tensor, Tensor], noise: float) -> tuple[Tensor, Tensor, Tensor]:
        """(q logits [M, Vd] of the counted entries of ``layout``, the target's p logits there [M, V], their depth [M])."""
        anchor, depth, valid = layout
        b = torch.arange(anchor.shape[0], device=anchor.device)[:, None].expand_as(anchor)[valid]  # [M]
        source = (anchor + depth + 1)[valid]  # the target's position whose output is the entry's label
        need = torch.zeros_like(batch.loss_mask, dtype=torch.bool)
        need[b, source] = True
        features, p_rows = target_side.features_and_logits(run, batch, layers, rows=need)  # [N', V]
        features = target_side.uniform_noise(features, noise)
        index = (need.flatten().long().cumsum(0) - 1).view(need.shape)  # [B, S]: row of a position in p_rows
        q = engine(lambda h: h.parallel(batch.input_ids, features.to(run.dtype), anchor, depth, logits_rows=valid)[1])
        return q, p_rows[index[b, source]], depth[valid]

    def objective(q: Tensor, p: Tensor, d: Tensor) -> tuple[Tensor, heldout.Metrics]:
        """Σ over counted entries of the token loss; parts: each depth's (sum, entries)."""
        p, ok = losses.restrict_to_draft_vocab(p, draft_ids, torch.ones_like(d, dtype=torch.bool))
        row = cfg.loss.token_loss(q, p, ok, reduction="none")  # [M], 0 where the target's argmax is outside the draft vocab
        parts = {f"loss/depth{k}": (row[d == k].sum().item(), float((ok & (d == k)).sum())) for k in range(depths)}
        return row.sum(), parts

    def evaluate(engine: Any, batch: Batch) -> heldout.Metrics:
        drawn = layout(batch, heldout_batch=True)
        q, p, d = entries(batch, drawn, 0.0)
        out: heldout.Metrics = {"loss": (float(objective(q, p, d)[0]), float(drawn[2].sum()))}
        accept, top1 = losses.draft_vocab_agreement(q, p, draft_ids)  # [M] each; q = 0 outside the draft vocabulary
        for k in range(depths):
            at = d == k
            out[f"expected_accept_step{k}"] = heldout.masked_metric(lambda: losses.masked_mean(accept[at], at[at]), at[at])
            out[f"top1_step{k}"] = heldout.masked_metric(lambda: losses.masked_mean(top1[at], at[at]), at[at])
        return out

    save.baseline(run, engine, evaluate)
    for micro in step.step_batches(run, rows):  # the micro-batches of one optimizer step, their counted entries
        step.optimizer_step(run, engine, micro, lambda batch: objective(*entries(batch, layout(batch), cfg.feature_noise)))
        step.after_step(run, engine, evaluate)
    return save.finish(run, engine, evaluate)
