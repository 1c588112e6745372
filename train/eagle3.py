"""EAGLE-3 recipe (Li et al. 2025): training-time test over a reduced draft vocabulary.

The head fuses three target layers (low, mid, high) and is unrolled on its own outputs
for ``train.ttt_steps`` steps (default 7), as it will run when drafting: step j, row t
reads the true token x_{t+j+1} and, for j ≥ 1, the head's own step-(j-1) state instead
of a target feature; it predicts x_{t+j+2}, whose target distribution is the target's
output at position t+j+1. Step j's loss is weighted ``step_decay**j`` (EAGLE-3: 0.8^j).
The loss of a step is Σ_j w_j Σ_rows loss, divided by the rows that count at step 0 over the
whole optimizer step (``step.py``): every answer token weighs the same.

Over the reduced vocabulary the target's p is renormalized onto the draft ids, and a
position whose target argmax is outside the draft vocabulary is masked (the head could
never propose it). There is no feature regression: EAGLE-3 drops it.

With ``train.align_top_k`` = k ≥ 1 (GRIFFIN's token-alignable training, Hu et al. 2025), a row counts at step
j ≥ 1 only while the target's token was among the head's top k at every earlier step of that row: a chain (k = 1)
or a top-k tree never drafts past a miss, so those rows are never reached when decoding, and their loss only pulls
the head towards inputs it will not see. Held-out figures are over every row, as without it.

With ``train.replay_weight`` = λ > 0 (Draft-OPD's on-policy states, Lei et al. 2026, replayed offline), the (row, step)
pairs that greedy chains of the head's own drafts would reach when the record is decoded weigh 1 + λ, the others 1
(:func:`reached_by_chains`): a round starts after the target's token, drafts until its first miss (drafted and
rejected too: the error position) or ``ttt_steps`` drafts, and the next round starts after the tokens it took.
Decoding asks for a first draft only at round starts, which are harder than the average row (a token after an
accepted draft is predicted by a later step of the round instead); the weighting trains most where decoding looks.
The pairs follow the head as it trains (its own argmax at each step, against the target's). Logged as
``replay/step{j}``: the share of step j's counted rows that chains reach. The held-out loss stays unweighted.

With ``train.coral_weight`` = w > 0 (CORAL's cross-step representation alignment, Weng et al. 2025), the objective
adds w · Σ_rows an InfoNCE that pulls the state the head passes on at row t (``unroll``'s hidden, before the lm_head)
together across the steps whose token loss counts row t, the sequence's other counted states being the negatives
(``losses.cross_step_alignment``): step j ≥ 1 reads the head's own state where step 0 read the target's feature, and
CORAL asks the head to produce the same representation either way. It is normalized with the token loss (by the
step-0 rows), and logged as ``loss/coral`` per row with two counted steps or more.

Held-out metrics per unrolled step j: expected acceptance Σ min(p, q) of the head's q
(zero outside the draft vocabulary) against the target's full p, and top-1 agreement
(see ``heldout.heldout_metrics`` for the summary figures derived from them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..drafters.common import shift_left
from . import heldout, losses, save, setup, step, target_side
from .config import TrainRecipe
from .data import Batch
from .distributed import World


@dataclass
class Targets:
    """The target's side of a batch, at the rows the loss reads: positions u whose next token is an
    answer token (``loss_mask[u + 1]``), N of them."""

    logits: Tensor
    """[N, V] the target's logits at those positions."""
    index: Tensor
    """[B, S] long: the row of position u in ``logits`` (valid where u is one of them)."""
    keep: list[Tensor]
    """Per unrolled step j, [B, S] bool: the head's rows t whose logits step j kept (x_{t+j+2} is an
    answer token)."""

    def at(self, j: int) -> Tensor:
        """[N_j] long: the target's row (position t+j+1) for each row t kept at step j."""
        return target_side.rows_ahead(self.index, j + 1, self.keep[j])


@torch.no_grad()
def still_aligned(alive: Tensor, rows: Tensor, logits: Tensor, draft_ids: Tensor, target_ids: Tensor, k: int) -> Tensor:
    """GRIFFIN's token-alignable mask after one unrolled step: ``alive`` [B, S] bool with each row of ``rows`` [B, S]
    (N of them, row-major) kept only where the target's token ``target_ids`` [N] is among the top ``k`` of the
    step's ``logits`` [N, Vd] (draft ids, mapped to target ids by ``draft_ids`` [Vd]). Rows outside ``rows`` keep
    their value. Returns a new tensor."""
    top = draft_ids[logits.topk(min(k, logits.shape[-1]), dim=-1).indices]  # [N, k] target ids
    out = alive.clone()
    out[rows] &= (top == target_ids.unsqueeze(-1)).any(-1)
    return out

@torch.no_grad()
def reached_by_chains(correct: list[Tensor]) -> list[Tensor]:
    """The (row, step) pairs greedy chains of K = ``len(correct)`` drafts reach when a record is decoded.

    Row t at unrolled step j is the chain started at row t after j drafts (it predicts x_{t+j+2}). ``correct[j]``
    [B, S] bool: that draft is the target's token (its argmax at position t + j + 1; False where no loss counts the
    row). A round starts at row s = 0 of each sequence and drafts (s, step i) for i = 0, 1, … while every earlier
    draft of the round was accepted, at most K: its first miss is drafted (and rejected) too. Accepting a drafts,
    the target adds its own token and the next round starts at row s + a + 1. Returns per step j, [B, S] bool: the
    pairs drafted."""
    ok = torch.stack(correct).tolist()  # [K][B][S]: a plain walk along each sequence, cheap beside a step
    k, (b_size, s_size) = len(correct), correct[0].shape
    reached = [[[False] * s_size for _ in range(b_size)] for _ in range(k)]
    for b in range(b_size):
        s = 0
        while s < s_size:
            accepted = 0
            for i in range(k):
                reached[i][b][s] = True
                if not ok[i][b][s]:
                    break
                accepted += 1
            s += accepted + 1
    return list(torch.tensor(reached, dtype=torch.bool, device=correct[0].device).unbind(0))

READS = ("ttt_steps", "align_top_k", "feature_noise", "coral_weight", "coral_temperature", "replay_weight",
         "loss.step_decay")


def train(recipe: TrainRecipe, world: World, resume: str | None = None) -> dict[str, Any]:
    cfg = recipe.train
    run, config, head = setup.begin(recipe, world)
    layers, draft_ids = tuple(config.feature_layers), head.draft_ids.clone()
    weights = losses.decayed_weights(cfg.ttt_steps, cfg.loss.step_decay)
    engine = setup.engine_for(run, head, resume)

    def unroll(batch: Batch, noise: float) -> tuple[list[tuple[Tensor, Tensor]], Targets]:
        """The head's steps, with logits only at the rows a loss or metric reads, and the target's side."""
        need = shift_left(batch.loss_mask, 1, fill=False)  # positions whose next token is an answer token
        features, target_logits = target_side.features_and_logits(run, batch, layers, rows=need)  # [N, V]
        features = target_side.uniform_noise(features, noise).to(run.dtype)
        keep = [shift_left(batch.loss_mask, j + 2, fill=False) for j in range(cfg.ttt_steps)]
        steps = engine(lambda h: h.unroll(batch.input_ids, features, steps=cfg.ttt_steps,
                                          attention_mask=batch.attention_mask, logits_rows=keep))
        index = (need.flatten().long().cumsum(0) - 1).view(need.shape)  # [B, S]: row of position u in the [N] rows
        return steps, Targets(target_logits, index, keep)

    def rows(batch: Batch) -> Tensor:
        """[B, S] bool: row t counts when x_{t+2} is a loss-masked token (the step-0 prediction)."""
        return shift_left(batch.loss_mask, 2, fill=False)

    def objective(steps: list[tuple[Tensor, Tensor]], t: Targets, batch: Batch,
                  replay: float = 0.0) -> tuple[Tensor, heldout.Metrics]:
        """Σ_j w_j · (step j's token loss summed over its rows, the pairs chains reach weighing 1 + ``replay``), plus
        CORAL's term summed over its rows when on; parts: each step's unweighted (sum, rows), ``loss/coral``'s, and
        with ``replay`` each step's (rows chains reach, rows)."""
        # p over the draft vocabulary, and where the target's argmax is in it, once for all steps
        p_draft, in_vocab = losses.restrict_to_draft_vocab(t.logits, draft_ids, t.logits.new_ones(len(t.logits), dtype=torch.bool))
        total, parts, counted = None, {}, []
        alive = torch.ones_like(batch.loss_mask, dtype=torch.bool)  # [B, S]: rows whose earlier steps were in the top k
        target_ids = t.logits.argmax(-1) if replay or cfg.align_top_k else None  # [N]: once, not per step
        if replay:  # Draft-OPD's states: where the head's own greedy chains go, judged against the target's argmax
            hits = [draft_ids[logits.argmax(-1)] == target_ids[t.at(j)] for j, (_, logits) in enumerate(steps)]
            reached = reached_by_chains([torch.zeros_like(alive).masked_scatter(t.keep[j], hit)
                                         for j, hit in enumerate(hits)])
        for j, (_, logits) in enumerate(steps):  # logits: [N_j, Vd] at the rows of t.keep[j]
            at = t.at(j)  # the target's row at t+j+1 for each of them
            ok = in_vocab[at] & alive[t.keep[j]]
            if cfg.coral_weight:  # [B, S]: the rows step j's token loss counts
                counted.append(torch.zeros_like(alive).masked_scatter(t.keep[j], ok))
            if cfg.align_top_k:  # GRIFFIN: step j+1 trains only the rows this step kept within its top k
                alive = still_aligned(alive, t.keep[j], logits, draft_ids, target_ids[at], cfg.align_top_k)
            if replay:  # per row, the rows chains reach weighing 1 + replay
                each = cfg.loss.token_loss(logits[ok], p_draft[at][ok], ok[ok], reduction="none")  # [rows]
                chained = reached[j][t.keep[j]][ok]
                step_sum, weighed = each.sum(), (each * (1.0 + replay * chained.float())).sum()
                parts[f"replay/step{j}"] = (float(chained.sum()), float(ok.sum()))
            else:
                step_sum = weighed = cfg.loss.token_loss(logits[ok], p_draft[at][ok], ok[ok],
                                                         reduction="sum")  # 0 past short sequences' ends
            total = weights[j] * weighed if total is None else total + weights[j] * weighed
            parts[f"loss/step{j}"] = (step_sum.item(), float(ok.sum()))
        if cfg.coral_weight:  # CORAL: the head's states at one row pulled together across the steps that count it
            views = torch.stack(counted)  # [K, B, S]
            coral = losses.cross_step_alignment(torch.stack([h for h, _ in steps]), views, cfg.coral_temperature,
                                                reduction="sum")
            total = total + cfg.coral_weight * coral
            parts["loss/coral"] = (coral.item(), float((views.sum(0) >= 2).sum()))
        return total, parts

    def evaluate(engine: Any, batch: Batch) -> heldout.Metrics:
        steps, t = unroll(batch, 0.0)
        out: heldout.Metrics = {"loss": (float(objective(steps, t, batch)[0]), float(rows(batch).sum()))}
        for j, (_, logits) in enumerate(steps):  # q = 0 outside the draft vocabulary; no [N, V] copy is made
            accept, top1 = losses.draft_vocab_agreement(logits, t.logits, draft_ids, rows=t.at(j))
            every = torch.ones(len(logits), dtype=torch.bool, device=logits.device)
            out[f"expected_accept_step{j}"] = heldout.masked_metric(lambda: losses.masked_mean(accept, every), every)
            out[f"top1_step{j}"] = heldout.masked_metric(lambda: losses.masked_mean(top1, every), every)
        return out

    save.baseline(run, engine, evaluate)
    for micro in step.step_batches(run, rows):  # the micro-batches of one optimizer step, their valid rows counted
        step.optimizer_step(run, engine, micro,
                            lambda batch: objective(*unroll(batch, cfg.feature_noise), batch, cfg.replay_weight))
        step.after_step(run, engine, evaluate)
    return save.finish(run, engine, evaluate)
