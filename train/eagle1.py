"""EAGLE-1 recipe (Li et al. 2024): feature regression + soft cross-entropy, teacher-forced.

Row t of the head pairs the target's last-layer feature f_t with token x_{t+1}; it
predicts f_{t+1} (smooth-L1 against the target's real feature) and, read out through
the target's frozen norm and lm_head, the distribution of x_{t+2} (token loss against
the target's own distribution at position t+1). A row counts when x_{t+2} is a
loss-masked (assistant) token. Optional uniform noise on the input features makes the
head robust to its own errors at decoding time (EAGLE: U(−0.1, 0.1)).

Loss = feature_weight · smooth_l1 + token_weight · token_loss (EAGLE-1: 1.0 and 0.1, soft_ce),
summed over the rows and divided by the rows of the whole optimizer step (``step.py``).
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

READS = ("feature_noise", "loss.token_weight", "loss.feature_weight")


def train(recipe: TrainRecipe, world: World, resume: str | None = None) -> dict[str, Any]:
    cfg = recipe.train
    run, _, module = setup.begin(recipe, world)
    engine = setup.engine_for(run, module, resume)
    last_layer = (run.target.num_layers - 1,)

    def objective(pred: Tensor, logits: Tensor, mask: Tensor, features: Tensor, target_logits: Tensor) -> tuple[Tensor, heldout.Metrics]:
        """feature_weight · smooth-L1 + token_weight · token loss, summed over the rows of ``mask``."""
        regression = losses.smooth_l1(pred, shift_left(features, 1), mask, reduction="sum")
        token = cfg.loss.token_loss(logits[mask], target_side.rows_ahead(target_logits, 1, mask), mask[mask],
                                    reduction="sum")
        loss = cfg.loss.feature_weight * regression + cfg.loss.token_weight * token
        n = float(mask.sum())
        return loss, {"loss/feature": (regression.item(), n), "loss/token": (token.item(), n)}

    def loss_fn(batch: Batch) -> tuple[Tensor, heldout.Metrics]:
        features, target_logits = target_side.features_and_logits(run, batch, last_layer)
        noisy = target_side.uniform_noise(features, cfg.feature_noise)
        return objective(*forward(engine, batch, noisy, run.dtype), features, target_logits)

    def evaluate(engine: Any, batch: Batch) -> heldout.Metrics:
        features, target_logits = target_side.features_and_logits(run, batch, last_layer)
        pred, logits, mask = forward(engine, batch, features, run.dtype)
        p_logits = shift_left(target_logits, 1)
        loss, parts = objective(pred, logits, mask, features, target_logits)
        return {
            "loss": (float(loss), float(mask.sum())),
            "feature_loss": parts["loss/feature"],
            "acceptance": heldout.masked_metric(lambda: losses.expected_acceptance(logits, p_logits, mask), mask),
            "top1": heldout.masked_metric(lambda: losses.top1_accuracy(logits, p_logits.argmax(-1), mask), mask),
        }

    save.baseline(run, engine, evaluate)
    for micro in step.step_batches(run, rows):  # the micro-batches of one optimizer step, their valid rows counted
        step.optimizer_step(run, engine, micro, loss_fn)
        step.after_step(run, engine, evaluate)
    return save.finish(run, engine, evaluate)


def rows(batch: Batch) -> Tensor:
    """[B, S] bool: row t counts when x_{t+2} is a loss-masked token."""
    return shift_left(batch.loss_mask, 2, fill=False)


def forward(engine: Any, batch: Batch, features: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Teacher-forced head over a batch: (predicted features [B,S,H], logits [B,S,V], row mask [B,S]).

    Row t gets f_t and x_{t+1}; it counts when x_{t+2} is a loss-masked token.
    """
    ids, features = shift_left(batch.input_ids, 1), features.to(dtype)
    pred, logits = engine(lambda head: head(ids, features, attention_mask=batch.attention_mask))
    return pred, logits, rows(batch)
