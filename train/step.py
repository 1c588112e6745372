"""The optimizer step of every recipe, and what follows it.

A recipe's loop::

    for micro in step.step_batches(run, rows):                  # the micro-batches of one optimizer step
        step.optimizer_step(run, engine, micro, summed_loss)     # backward of each, normalized; bad ones skipped;
                                                                 # the weights' moving average (train.ema_decay)
        step.after_step(run, engine, evaluate)                   # logging, evaluation, checkpoint cadence

**Normalization.** Every valid token of an optimizer step weighs the same, whichever
micro-batch (gradient accumulation) or rank it is in: :func:`step_batches` gathers the step's
micro-batches first and counts their valid tokens (``rows(batch)``: the positions whose
loss counts) on every rank, and :func:`optimizer_step` hands DeepSpeed each micro-batch's
*summed* loss times gas · world_size / (valid tokens of the step, all ranks), so that after
DeepSpeed's own 1/gas and its average over ranks the gradient is
∇ (Σ of every token loss of the step) / (their number) — what one micro-batch holding all of
them would give. (Averaging per micro-batch instead would let a micro-batch with 10 answer
tokens weigh as much as one with 2,000.)

**Bad batches.** A micro-batch with no valid token on any rank is dropped when the step is
gathered, and the next one takes its place; one whose loss is NaN/inf on some rank is skipped
on *every* rank (collectives stay in step), counted, and replaced by the next micro-batch,
which is normalized by the step's count as gathered (exact normalization would need the count
of a replacement before the bad loss is known; such skips are rare and capped by
``train.max_bad_steps``).
"""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..errors import DraftsmithError
from . import checkpoint, distributed
from .data import Batch
from .heldout import Metrics, decoder_eval
from .save import evaluate, save_checkpoint, save_drafter
from .setup import Run, micro_batches


SummedLoss = Callable[[Batch], tuple[Tensor, Metrics]]
"""A recipe's loss of a micro-batch: (the loss summed over its valid tokens, a scalar tensor;
loss parts for the log as name → (sum, count))."""


@dataclass
class StepBatches:
    """The micro-batches of one optimizer step, with the count that normalizes their losses."""

    batches: list[tuple[Batch, int]]
    """(micro-batch on this rank's device, its valid tokens on this rank), gradient_accumulation_steps of them."""
    total: int
    """Valid tokens of the whole step: every micro-batch, every rank."""
    more: Callable[[], list[tuple[Batch, int]]]
    """The next micro-batch that holds a valid token on some rank (replaces one skipped for a bad loss)."""


def step_batches(run: Run, rows: Callable[[Batch], Tensor],
                 prepare: Callable[[Batch], Batch] | None = None) -> Iterator[StepBatches]:
    """This rank's micro-batches, one optimizer step at a time, from the saved data position until
    ``train.steps`` steps are done. ``rows(batch)`` [B, S] bool marks the positions whose loss counts;
    ``prepare`` (optional) turns a micro-batch into the one trained on (e.g. on-policy samples) before
    it is counted. All ranks take the same micro-batches in the same order (the count is all-reduced)."""
    source = micro_batches(run)
    gas = int(run.ds_config["gradient_accumulation_steps"])

    def pull(n: int) -> list[tuple[Batch, int, int]]:
        got: list[tuple[Batch, int, int]] = []
        while len(got) < n:
            new = [prepare(b) if prepare else b for b in itertools.islice(source, n - len(got))]
            if not new:
                break
            local = [int(rows(b).sum()) for b in new]
            for b, mine, everyone in zip(new, local, distributed.all_sum([float(x) for x in local])):
                if everyone == 0:
                    skip(run, "no_valid_tokens")
                else:
                    got.append((b, mine, int(everyone)))
        return got

    run.clock = time.perf_counter()
    while run.state.step < run.cfg.steps:
        got = pull(gas)
        if len(got) < gas:
            return
        yield StepBatches([(b, n) for b, n, _ in got], sum(t for _, _, t in got),
                          lambda: [(b, n) for b, n, _ in pull(1)])


def optimizer_step(run: Run, engine: Any, micro: StepBatches, loss_of: SummedLoss) -> None:
    """``engine.backward`` and ``engine.step`` on each micro-batch of ``micro``, its summed loss scaled
    so that the step's gradient is the mean over all its valid tokens (module docstring).

    A loss that is not finite on any rank is skipped on every rank, counted, and replaced by the
    next micro-batch; more than ``train.max_bad_steps`` of them stop the run. Running out of
    accelerator memory is a DraftsmithError naming the settings that shrink a step. After the step, the
    moving average of the weights takes them in (``run.ema``, with ``train.ema_decay``). With
    ``train.l2sp_weight`` the pull toward the start (``run.l2sp``) joins every step's gradient once.
    """
    gas = int(run.ds_config["gradient_accumulation_steps"])
    scale = gas * run.world.world_size / micro.total  # DeepSpeed divides by gas and averages over ranks
    queue, stepped = list(micro.batches), False
    while queue:
        batch, valid = queue.pop(0)
        try:
            loss, parts = loss_of(batch)
        except torch.cuda.OutOfMemoryError as e:
            raise _out_of_memory(run, batch.tokens) from e
        bad = not bool(torch.isfinite(loss.detach()))
        n_bad, n_stop, tokens = distributed.all_sum([float(bad), float(bool(checkpoint.stop_requested())),
                                                     float(batch.tokens)])
        if n_stop and not run.stop_signal:  # some rank was signalled: every rank stops after this same step
            run.stop_signal = checkpoint.stop_requested() or int(signal.SIGTERM)
        if n_bad:
            skip(run, "non_finite_loss")
            queue.extend(micro.more())
            continue
        boundary = engine.is_gradient_accumulation_boundary()
        # train.l2sp_weight: R / scale on every micro-batch, so the step's gradient gains ∇R once (train/l2sp.py)
        pull = run.l2sp.penalty() / scale if run.l2sp is not None else 0.0
        try:
            engine.backward((loss + pull) * scale)
            engine.step()
        except torch.cuda.OutOfMemoryError as e:
            raise _out_of_memory(run, batch.tokens) from e
        run.state.tokens += int(tokens)
        for name, (s, n) in {"loss": (float(loss.detach()), valid), **parts}.items():
            acc = run.pending.setdefault(name, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + s, acc[1] + n
        stepped = boundary
        if boundary != (not queue):
            raise DraftsmithError(f"internal: DeepSpeed's accumulation boundary ({boundary}) is out of step with the "
                                  f"{gas} micro-batches of step {run.state.step + 1}")
    if not stepped:
        raise DraftsmithError(f"step {run.state.step + 1} ran out of micro-batches before its optimizer step")
    if run.ema is not None:  # train.ema_decay: the moving average takes the new weights in
        run.ema.update()
    run.state.step += 1
    now = time.perf_counter()
    run.state.train_s += now - run.clock
    run.clock = now
    run.monitor.advance()


def skip(run: Run, reason: str) -> None:
    """Count a micro-batch skipped on every rank; too many non-finite losses stop the run."""
    run.state.skipped[reason] = run.state.skipped.get(reason, 0) + 1
    bad_total = run.state.skipped.get("non_finite_loss", 0)
    if bad_total > run.cfg.max_bad_steps:
        raise DraftsmithError(
            f"the loss was NaN or infinite on {bad_total} micro-batches (train.max_bad_steps = "
            f"{run.cfg.max_bad_steps}); stopping at step {run.state.step}. Lower train.optimizer.lr, add warmup "
            f"(train.schedule.warmup_steps), use fp32, or check the data; the last checkpoint is intact"
        )
    run.monitor.note(f"step {run.state.step}: skipped a micro-batch ({reason}); counts so far {run.state.skipped}")


def _out_of_memory(run: Run, tokens: int) -> DraftsmithError:
    cfg = run.cfg
    return DraftsmithError(
        f"out of memory on {run.world.device} at step {run.state.step} (a micro-batch of {tokens} tokens). Lower "
        f"train.batch_size ({cfg.batch_size}) or train.max_length ({cfg.max_length}) and raise "
        f"gradient_accumulation_steps in the DeepSpeed JSON to keep the batch, partition the drafter with ZeRO-3 "
        f"(train.deepspeed=zero3), or train from a feature cache (train.features); the last checkpoint is intact"
    )


def after_step(run: Run, engine: Any, heldout_fn: Callable[[Any, Batch], Metrics]) -> None:
    """After an optimizer step: logging, held-out evaluation, decoder evaluation and checkpoint cadence.

    The time spent evaluating and checkpointing is left out of the training time (``state.train_s``).
    """
    cfg, step = run.cfg, run.state.step
    done = step >= cfg.steps  # finish() evaluates and saves the last step
    if _due(step, cfg.logging.every) or done:
        log_train(run, engine)
    if _due(step, cfg.eval.every) and not done:
        evaluate(run, engine, heldout_fn)  # held-out metrics, sim_tau, drafter-best
    if _due(step, cfg.eval.decoder_every) and not done:
        decoder_eval(run, save_drafter(run, engine))
    saved = save_checkpoint(run, engine) if _due(step, cfg.checkpoint.every) and not done else None
    run.clock = time.perf_counter()
    if run.stop_signal and not done:
        stop(run, engine, saved)


def stop(run: Run, engine: Any, saved: str | None = None) -> None:
    """Checkpoint now (unless ``saved`` is this step's) and raise :class:`checkpoint.Stopped` (preemption)."""
    path = saved or save_checkpoint(run, engine)
    name = signal.Signals(run.stop_signal).name
    message = (f"stopped by {name} after step {run.state.step} of {run.cfg.steps}; checkpoint {path} is saved, run the "
               f"same command again to resume from it")
    raise checkpoint.Stopped(message, run.stop_signal)  # the CLI prints the message, once


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def log_train(run: Run, engine: Any) -> None:
    """A log line: this rank's mean losses per valid token since the last line, and the global figures."""
    tokens, seconds = run.state.tokens - run.logged[0], run.state.train_s - run.logged[1]
    run.logged = (run.state.tokens, run.state.train_s)
    local = {k: s / n for k, (s, n) in run.pending.items() if n > 0}
    run.pending.clear()
    shared = {
        "lr": float(engine.get_lr()[0]),
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "tokens": run.state.tokens,
        "micro_step": run.state.micro_step,
        **{f"skipped/{k}": v for k, v in run.state.skipped.items()},
        **distributed.memory_stats(run.world.device),
        **({"l2sp_distance": run.l2sp.distance()} if run.l2sp is not None else {}),
    }
    run.monitor.log(run.state.step, local, shared)
