"""Standalone draft LM recipe: knowledge distillation of the target into a small causal LM.

Row t of both models' logits predicts x_{t+1}; a row counts when x_{t+1} is a
loss-masked token. The token loss (``train.loss.kind``: forward/reverse KL, JSD(β), TVD —
DistillSpec's set — or CE / soft CE) compares the drafter's q with the target's p there.

Where the sequences come from (DistillSpec, Zhou et al. 2023):

* a **fixed dataset** — ``train.dataset`` as ``draftsmith prepare`` rendered it;
* the **target's regenerated responses** — the same, prepared with the ``regenerate``
  stage (the drafter then learns the target's own outputs);
* **on-policy** — with probability ``train.on_policy.fraction`` a micro-batch keeps only
  its prompts, the drafter samples ``max_new_tokens`` itself (at ``temperature``), and the
  target scores those samples. DistillSpec finds on-policy data gives the best acceptance.

Held-out: expected acceptance Σ min(p, q) and top-1 agreement on the dataset's held-out split.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import Tensor, nn

from ..drafters.common import shift_left
from . import heldout, losses, save, setup, step, target_side
from .config import TrainRecipe
from .data import Batch, collate
from .distributed import World

READS = ("on_policy",)


def train(recipe: TrainRecipe, world: World, resume: str | None = None) -> dict[str, Any]:
    cfg = recipe.train
    run, _, module = setup.begin(recipe, world)
    engine = setup.engine_for(run, module, resume)
    eos, pad = sorted(run.target.eos_token_ids), setup.pad_id(run.target)

    def scored(batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """(drafter logits [B,S,V], target logits [B,S,V], row mask [B,S]) — row t predicts x_{t+1}."""
        target_logits = target_side.target_forward(run, batch).logits
        logits = engine(lambda m: m(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits)
        return logits, target_logits, shift_left(batch.loss_mask, 1, fill=False)

    def objective(logits: Tensor, target_logits: Tensor, mask: Tensor) -> tuple[Tensor, heldout.Metrics]:
        """The token loss summed over the rows of ``mask``."""
        return cfg.loss.token_loss(logits[mask], target_logits[mask], mask[mask], reduction="sum"), {}

    def on_policy(batch: Batch) -> Batch:
        """The micro-batch trained on: with probability on_policy.fraction, the drafter's own samples."""
        if on_policy_now(cfg.seed, run.state.micro_step, cfg.on_policy.fraction):
            return sample_on_policy(engine.module.drafter, batch, cfg.on_policy.max_new_tokens,
                                    cfg.on_policy.temperature, eos, pad)
        return batch

    def evaluate(engine: Any, batch: Batch) -> heldout.Metrics:
        logits, p, mask = scored(batch)
        return {
            "loss": (float(objective(logits, p, mask)[0]), float(mask.sum())),
            "acceptance": heldout.masked_metric(lambda: losses.expected_acceptance(logits, p, mask), mask),
            "top1": heldout.masked_metric(lambda: losses.top1_accuracy(logits, p.argmax(-1), mask), mask),
        }

    save.baseline(run, engine, evaluate)
    # the micro-batches of one optimizer step (sampled first when on-policy), their valid rows counted
    for micro in step.step_batches(run, lambda batch: shift_left(batch.loss_mask, 1, fill=False), on_policy):
        step.optimizer_step(run, engine, micro, lambda batch: objective(*scored(batch)))
        step.after_step(run, engine, evaluate)
    return save.finish(run, engine, evaluate)


def on_policy_now(seed: int, micro_step: int, fraction: float) -> bool:
    """Whether micro-batch ``micro_step`` is sampled on-policy: a pure function, so resuming repeats it."""
    return fraction > 0 and random.Random(seed * 1_000_003 + micro_step).random() < fraction


@torch.no_grad()
def sample_on_policy(
    model: nn.Module, batch: Batch, max_new_tokens: int, temperature: float, eos: list[int], pad_id: int
) -> Batch:
    """Keep each row's prompt (the tokens before its first loss-masked one), let the drafter sample
    ``max_new_tokens`` after it, and mark the samples (up to the first EOS) as the tokens to learn.

    Every row samples exactly ``max_new_tokens`` (EOS does not stop it early) so that all ranks
    run the same number of forwards — ZeRO-3 gathers weights collectively in each.
    """
    from transformers import DynamicCache

    device = batch.input_ids.device
    prompts = []
    for ids, mask, attn in zip(batch.input_ids, batch.loss_mask, batch.attention_mask):
        first = int(mask.nonzero()[0]) if mask.any() else int(attn.sum())
        prompts.append(ids[: max(first, 1)])
    width = max(p.numel() for p in prompts)
    b = len(prompts)
    ids = torch.zeros(b, width, dtype=torch.long, device=device)
    attn = torch.zeros(b, width, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):  # left-padded, so every row's next token is at the same column
        ids[i, width - p.numel() :], attn[i, width - p.numel() :] = p, 1
    was_training = model.training
    model.eval()
    cache = DynamicCache(config=getattr(model, "config", None))
    positions = (attn.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=positions, cache=cache, use_cache=True).logits[:, -1]
    sampled = []
    for i in range(max_new_tokens):
        token = torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1)  # [B, 1]
        sampled.append(token)
        if i + 1 == max_new_tokens:
            break
        attn = torch.cat([attn, attn.new_ones(b, 1)], dim=1)
        positions = positions[:, -1:] + 1
        logits = model(input_ids=token, attention_mask=attn, position_ids=positions, cache=cache, use_cache=True).logits[:, -1]
    model.train(was_training)
    new = torch.cat(sampled, dim=1)  # [B, N]
    rows = []
    for p, n in zip(prompts, new):
        is_eos = torch.isin(n, torch.tensor(eos, device=device)) if eos else torch.zeros_like(n, dtype=torch.bool)
        keep = int(is_eos.nonzero()[0]) + 1 if is_eos.any() else n.numel()
        seq = torch.cat([p, n[:keep]])
        rows.append({"input_ids": seq.cpu(), "loss_mask": torch.cat([torch.zeros_like(p), torch.ones(keep, dtype=torch.long, device=device)]).cpu()})
    return collate(rows, pad_id, width + max_new_tokens).to(device)
