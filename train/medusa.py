"""Medusa recipe (Cai et al. 2024): K heads on the target's last feature, distilled per head.

Head k at row t reads the target's last-layer feature f_t and predicts x_{t+k+2}; its
target distribution is the target's own output at position t+k+1 (self-distillation, as
Medusa-2 does to keep the heads faithful to the target rather than to the data). A row
counts when x_{t+k+2} is a loss-masked token. Head k's loss is weighted
``step_decay**k`` (Medusa: 0.8^k); the sum over heads and rows is divided by head 0's rows
over the whole optimizer step (``step.py``). Logits are computed only for the rows that count,
one head at a time, so memory stays at (valid rows × V) per head.

Held-out: expected acceptance Σ min(p, q) and top-1 agreement per head
(``expected_accept_step{k}``, ``top1_step{k}``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..drafters.common import shift_left
from . import heldout, losses, save, setup, step, target_side
from .config import TrainRecipe
from .data import Batch
from .distributed import World

READS = ("loss.step_decay",)


def train(recipe: TrainRecipe, world: World, resume: str | None = None) -> dict[str, Any]:
    cfg = recipe.train
    run, _, heads = setup.begin(recipe, world)
    num_heads, last_layer = heads.num_heads, (run.target.num_layers - 1,)
    weights = losses.decayed_weights(num_heads, cfg.loss.step_decay)
    run.max_drafts = num_heads  # the heads are all the drafts a round gets (the simulated τ's cap)
    engine = setup.engine_for(run, heads, resume)

    def per_head(batch: Batch) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """For each head k: (its logits at the rows that count [N_k, V], the target's there, the row mask)."""
        features, target_logits = target_side.features_and_logits(run, batch, last_layer)
        masks = [shift_left(batch.loss_mask, k + 2, fill=False) for k in range(num_heads)]
        logits = engine(lambda m: head_rows(m, features.to(run.dtype), masks))
        targets = [target_side.rows_ahead(target_logits, k + 1, mask) for k, mask in enumerate(masks)]
        return logits, targets, masks

    def objective(logits: list[Tensor], targets: list[Tensor], masks: list[Tensor]) -> tuple[Tensor, heldout.Metrics]:
        """Σ_k w_k · (head k's token loss summed over its rows); parts: each head's (sum, rows)."""
        total, parts = None, {}
        for k, (q, p, mask) in enumerate(zip(logits, targets, masks)):
            head_sum = cfg.loss.token_loss(q, p, mask[mask], reduction="sum")  # 0 where sequences are too short for the far heads
            total = weights[k] * head_sum if total is None else total + weights[k] * head_sum
            parts[f"loss/head{k}"] = (head_sum.item(), float(mask.sum()))
        return total, parts

    def evaluate(engine: Any, batch: Batch) -> heldout.Metrics:
        logits, targets, masks = per_head(batch)
        out: heldout.Metrics = {"loss": (float(objective(logits, targets, masks)[0]), float(masks[0].sum()))}
        for k, (q, p, mask) in enumerate(zip(logits, targets, masks)):
            rows = mask[mask]
            out[f"expected_accept_step{k}"] = heldout.masked_metric(lambda: losses.expected_acceptance(q, p, rows), rows)
            out[f"top1_step{k}"] = heldout.masked_metric(lambda: losses.top1_accuracy(q, p.argmax(-1), rows), rows)
        return out

    save.baseline(run, engine, evaluate)
    # the micro-batches of one optimizer step, normalized by head 0's rows (x_{t+2} loss-masked)
    for micro in step.step_batches(run, lambda batch: shift_left(batch.loss_mask, 2, fill=False)):
        step.optimizer_step(run, engine, micro, lambda batch: objective(*per_head(batch)))
        step.after_step(run, engine, evaluate)
    return save.finish(run, engine, evaluate)


def head_rows(heads: nn.Module, features: Tensor, masks: list[Tensor]) -> list[Tensor]:
    """Head k's logits [N_k, V] at the rows of ``masks[k]`` [B, S] only; features [B, S, H]."""
    normed = heads.normalize(features)  # [B, S, H]
    return [heads.head_logits(k, normed[mask]) for k, mask in enumerate(masks)]
