"""Held-out metrics during training: the recipe's metrics over the held-out split, and the real decoder.

A recipe's metric function maps (engine, batch) to :data:`Metrics` — sums and counts, so that
the figures of all batches and ranks combine exactly into means over valid positions.

Every held-out evaluation also logs ``sim_tau``, the acceptance length the held-out figures predict
at the recipe's ``decode.k`` (:func:`sim_tau`); the run keeps its best drafter by it (``save.keep_best``).
With ``train.ema_decay`` the figures are the moving average's, and the raw weights' are logged beside
them under :data:`RAW` (``save.evaluate``).
Per-step figures are CONDITIONAL (given correct earlier tokens): ``expected_accept_step{j}`` is
E[Σ min(p, q)] at unrolled step / head j — not the decoder's cumulative ``acceptance_at_position``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..decode.stats import tau_from_acceptance
from . import distributed
from .data import Batch, collate, heldout_batches
from .losses import EmptyBatchError
from .setup import Run, pad_id


Metrics = dict[str, tuple[float, float]]
"""Held-out metric name → (sum over valid positions, number of valid positions)."""


@torch.no_grad()
def heldout_metrics(run: Run, engine: Any, fn: Callable[[Any, Batch], Metrics]) -> dict[str, float]:
    """Average ``fn`` over the held-out split (sharded over ranks, summed over all of them)."""
    pad = pad_id(run.target)
    engine.eval()
    totals: dict[str, list[float]] = {}
    for ids in heldout_batches(run.split.heldout, run.cfg.batch_size, run.world.world_size, run.world.rank):
        batch = collate([run.rows[i] for i in ids], pad, run.cfg.max_length).to(run.world.device)
        for name, (s, n) in fn(engine, batch).items():
            acc = totals.setdefault(name, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + s, acc[1] + n
    engine.train()
    names = sorted(totals)
    summed = distributed.all_sum([x for name in names for x in totals[name]])
    out = {name: summed[2 * i] / summed[2 * i + 1] for i, name in enumerate(names) if summed[2 * i + 1] > 0}
    return with_chain_summary(out)


STEP_KEY = "expected_accept_step"
"""Per-step held-out expected acceptance E[Σ min(p, q)] at unrolled step / head j: ``expected_accept_step{j}``.
CONDITIONAL on the earlier tokens being right — not the decoder's cumulative ``acceptance_at_position``."""
OLD_STEP_KEY = "acceptance_step"
"""The same figure's name before it was renamed (logs and summaries of older runs)."""


def step_rates(metrics: dict[str, float], name: str = STEP_KEY, prefix: str = "") -> list[float]:
    """The per-step figures ``{prefix}{name}{j}`` for j = 0, 1, … (for the expected acceptance, the old
    name ``acceptance_step{j}`` is read too)."""
    names = (name, OLD_STEP_KEY) if name == STEP_KEY else (name,)
    for n in names:
        rates: list[float] = []
        while f"{prefix}{n}{len(rates)}" in metrics:
            rates.append(metrics[f"{prefix}{n}{len(rates)}"])
        if rates:
            return rates
    return []


def with_chain_summary(metrics: dict[str, float]) -> dict[str, float]:
    """For per-step rates ``expected_accept_step{j}`` (EAGLE-3 unroll steps, Medusa heads): add
    ``acceptance`` = step 0's and ``expected_tokens`` = Σ_k Π_{j≤k} α_j, the drafts accepted per
    round that the rates imply for a chain as long as the unroll (each α_j is measured given
    correct earlier tokens, as in a chain whose earlier drafts were accepted)."""
    rates = step_rates(metrics)
    if not rates:
        return metrics
    return {**metrics, "acceptance": rates[0], "expected_tokens": tau_from_acceptance(rates, len(rates)) - 1.0}


def simulated_alpha(metrics: dict[str, float], greedy: bool) -> tuple[list[float], str]:
    """The per-position conditional acceptances α_1, α_2, … that held-out ``metrics`` give, and which figure.

    greedy: a greedy draft is accepted iff it is the target's argmax, so α is the top-1 agreement
    (``top1_step{j}`` / ``top1``); sampling: E[Σ min(p, q)] (``expected_accept_step{j}`` / ``acceptance``,
    exact at temperature 1). Per-step figures come from EAGLE-3's unrolled training-time-test steps (along
    the head's own rollouts: step j reads its own earlier states) and Medusa's heads; EAGLE-1 and the
    draft LM have one teacher-forced figure, which stands for every position.
    """
    name, single = ("top1_step", "top1") if greedy else (STEP_KEY, "acceptance")
    rates = step_rates(metrics, name)
    if rates:
        return rates, f"{name}{{j}}"
    if single in metrics:
        return [metrics[single]], single
    return [], "none"


def sim_tau(metrics: dict[str, float], k: int, greedy: bool, max_drafts: int | None = None) -> float:
    """Simulated acceptance length at k drafts per round: τ = 1 + Σ_{i≤k} Π_{j≤i} α_j, bonus counted,
    with α from :func:`simulated_alpha`. Past the measured positions the last α is repeated (an
    EAGLE-3 head drafts on beyond its unroll; one teacher-forced figure stands for all); a drafter that
    proposes at most ``max_drafts`` per round (Medusa: its heads) is simulated at min(k, max_drafts)."""
    alpha, _ = simulated_alpha(metrics, greedy)
    if not alpha:
        return 1.0
    k = min(k, max_drafts) if max_drafts is not None else k
    alpha = (alpha + [alpha[-1]] * k)[:k]
    return tau_from_acceptance(alpha, k)


def masked_metric(value: Callable[[], Tensor], mask: Tensor) -> tuple[float, float]:
    """(mean · count, count) of a masked mean over ``mask``'s positions, or (0, 0) when there are none."""
    n = float(mask.sum())
    if n == 0:
        return 0.0, 0.0
    try:
        return float(value()) * n, n
    except EmptyBatchError:  # e.g. every target argmax outside a reduced vocabulary
        return 0.0, 0.0


RAW = "raw/"
"""With ``train.ema_decay``, the prefix of the raw (trained, not averaged) weights' held-out figures: ``raw/sim_tau``,
``raw/heldout/…``, logged beside the moving average's own."""


def heldout_figures(run: Run, engine: Any, fn: Callable[[Any, Batch], Metrics]) -> dict[str, float]:
    """Held-out metrics (``heldout/…``) and ``sim_tau`` (:func:`sim_tau` at the recipe's decode depth) of the weights
    the engine's module holds."""
    values = heldout_metrics(run, engine, fn)
    decode = run.recipe.decode
    tau = sim_tau(values, decode.depth, decode.warp.greedy, run.max_drafts)
    return {**{f"heldout/{k}": v for k, v in values.items()}, "sim_tau": tau}


def log_heldout(run: Run, metrics: dict[str, float]) -> dict[str, float]:
    """Log held-out figures (:func:`heldout_figures`, and the raw weights' ``raw/…`` beside them); return them."""
    run.monitor.log(run.state.step, {}, metrics)
    shown = ", ".join(f"{k.split('/', 1)[-1]} {v:.4f}" for k, v in metrics.items() if not k.startswith(RAW))
    if f"{RAW}sim_tau" in metrics:
        shown += f"; raw weights: sim_tau {metrics[f'{RAW}sim_tau']:.4f}"
    run.monitor.note(f"step {run.state.step} held-out: {shown}")
    return metrics


def decoder_eval(run: Run, path: str) -> dict[str, Any] | None:
    """Run the drafter folder ``path`` (see ``save.save_drafter``) in the real speculative decoder on
    rank 0 (the others wait)."""
    summary = None
    if run.world.is_main:
        from ..drafters import load
        from ..measure.prompts import load_questions
        from ..measure.evaluate import evaluate

        questions = load_questions(run.recipe.eval.prompts, run.cfg.eval.decoder_prompts)
        stats = evaluate(run.target, load(path, run.target), questions, run.recipe.decode, progress=False).stats
        summary = stats.summary()
        run.monitor.log(run.state.step, {}, {"decoder/tau_with_bonus": summary["tau_with_bonus"],
                                             "decoder/acceptance_rate": summary["acceptance_rate"],
                                             "decoder/tokens_per_s": summary["tokens_per_s"]})
        run.monitor.note(f"step {run.state.step} decoder: tau (bonus counted) {summary['tau_with_bonus']:.3f}, "
                         f"acceptance {summary['acceptance_rate']:.3f}")
    distributed.barrier()
    return summary
