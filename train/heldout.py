"""Held-out metrics during training: the recipe's metrics over the held-out split, and the real decoder.

A recipe's metric function maps (engine, batch) to :data:`Metrics` — sums and counts, so that
the figures of all batches and ranks combine exactly into means over valid positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import distributed
from .data import Batch, collate, heldout_batches
from .losses import EmptyBatchError
from .setup import Run, pad_id


Metrics = dict[str, tuple[float, float]]
"""Held-out metric name → (sum over valid positions, number of valid positions)."""


def baseline(run: Run, engine: Any, heldout_fn: Callable[[Any, Batch], Metrics]) -> None:
    """Held-out metrics of the untrained drafter (step 0), when periodic evaluation is on."""
    if run.state.step == 0 and run.cfg.eval.every > 0:
        log_heldout(run, engine, heldout_fn)


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


def with_chain_summary(metrics: dict[str, float]) -> dict[str, float]:
    """For per-step rates ``acceptance_step{j}`` (EAGLE-3 unroll steps, Medusa heads): add
    ``acceptance`` = step 0's and ``expected_tokens`` = Σ_k Π_{j≤k} α_j, the drafts accepted per
    round that the rates imply for a chain as long as the unroll (each α_j is measured given
    correct earlier tokens, as in a chain whose earlier drafts were accepted)."""
    rates = []
    while f"acceptance_step{len(rates)}" in metrics:
        rates.append(metrics[f"acceptance_step{len(rates)}"])
    if not rates:
        return metrics
    expected, survive = 0.0, 1.0
    for a in rates:
        survive *= a
        expected += survive
    return {**metrics, "acceptance": rates[0], "expected_tokens": expected}


def masked_metric(value: Callable[[], Tensor], mask: Tensor) -> tuple[float, float]:
    """(mean · count, count) of a masked mean over ``mask``'s positions, or (0, 0) when there are none."""
    n = float(mask.sum())
    if n == 0:
        return 0.0, 0.0
    try:
        return float(value()) * n, n
    except EmptyBatchError:  # e.g. every target argmax outside a reduced vocabulary
        return 0.0, 0.0


def log_heldout(run: Run, engine: Any, fn: Callable[[Any, Batch], Metrics]) -> dict[str, float]:
    metrics = {f"heldout/{k}": v for k, v in heldout_metrics(run, engine, fn).items()}
    run.monitor.log(run.state.step, {}, metrics)
    run.monitor.note(f"step {run.state.step} held-out: " + ", ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in metrics.items()))
    return metrics


def decoder_eval(run: Run, path: str) -> dict[str, Any] | None:
    """Run the drafter folder ``path`` (see ``save.save_drafter``) in the real speculative decoder on
    rank 0 (the others wait)."""
    summary = None
    if run.world.is_main:
        from ..drafters import load
        from ..eval.prompts import load_questions
        from ..eval.run import evaluate

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
