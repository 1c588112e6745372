"""The optimizer step of every recipe, and what follows it.

:func:`optimizer_step` is where the backward happens and where a bad micro-batch (no valid
token, a NaN/inf loss on any rank) is skipped on *every* rank — so collectives stay in
step — and counted. :func:`after_step` keeps the cadence of logging, held-out and decoder
evaluation and checkpoints; a stop signal (preemption) ends the run there after a checkpoint.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..errors import DraftsmithError
from . import checkpoint, distributed
from .data import Batch
from .heldout import Metrics, decoder_eval, log_heldout
from .losses import EmptyBatchError
from .save import save_checkpoint, save_drafter
from .setup import Run


def optimizer_step(run: Run, engine: Any, compute: Callable[[], tuple[Tensor, dict[str, float]]], tokens: int) -> bool:
    """Loss from ``compute()``, then ``engine.backward`` and ``engine.step``. True when the optimizer stepped.

    If ``compute`` finds no valid token (EmptyBatchError) or the loss is not finite on any
    rank, every rank skips this micro-batch (nothing is accumulated) and counts the reason;
    more than ``train.max_bad_steps`` non-finite losses stop the run. Running out of accelerator
    memory is a DraftsmithError naming the settings that shrink a step.
    """
    loss, parts, empty = None, {}, False
    try:
        loss, parts = compute()
    except EmptyBatchError:
        empty = True
    except torch.cuda.OutOfMemoryError as e:
        raise _out_of_memory(run, tokens) from e
    bad = not empty and not bool(torch.isfinite(loss.detach()))
    n_empty, n_bad, n_stop = distributed.all_sum([float(empty), float(bad), float(bool(checkpoint.stop_requested()))])
    if n_stop and not run.stop_signal:  # some rank was signalled: every rank stops after this same step
        run.stop_signal = checkpoint.stop_requested() or int(signal.SIGTERM)
    if n_empty or n_bad:
        reason = "non_finite_loss" if n_bad else "no_valid_tokens"
        run.state.skipped[reason] = run.state.skipped.get(reason, 0) + 1
        bad_total = run.state.skipped.get("non_finite_loss", 0)
        if bad_total > run.cfg.max_bad_steps:
            raise DraftsmithError(
                f"the loss was NaN or infinite on {bad_total} micro-batches (train.max_bad_steps = "
                f"{run.cfg.max_bad_steps}); stopping at step {run.state.step}. Lower train.optimizer.lr, add warmup "
                f"(train.schedule.warmup_steps), use fp32, or check the data; the last checkpoint is intact"
            )
        run.monitor.note(f"step {run.state.step}: skipped a micro-batch ({reason}); counts so far {run.state.skipped}")
        return False
    boundary = engine.is_gradient_accumulation_boundary()
    try:
        engine.backward(loss)
        engine.step()
    except torch.cuda.OutOfMemoryError as e:
        raise _out_of_memory(run, tokens) from e
    run.monitor.count_tokens(tokens)
    for k, v in {"loss": float(loss.detach()), **parts}.items():
        run.pending.setdefault(k, []).append(float(v))
    if boundary:
        run.state.step += 1
        run.monitor.advance()
    return boundary

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

    The time spent evaluating and checkpointing is left out of the training throughput.
    """
    cfg, step = run.cfg, run.state.step
    done = step >= cfg.steps  # finish() evaluates and saves the last step
    if _due(step, cfg.logging.every) or done:
        log_train(run, engine)
    t0 = time.perf_counter()
    if _due(step, cfg.eval.every) and not done:
        log_heldout(run, engine, heldout_fn)
    if _due(step, cfg.eval.decoder_every) and not done:
        decoder_eval(run, save_drafter(run, engine))
    saved = save_checkpoint(run, engine) if _due(step, cfg.checkpoint.every) and not done else None
    run.monitor.discount(time.perf_counter() - t0)
    if run.stop_signal and not done:
        stop(run, engine, saved)

def stop(run: Run, engine: Any, saved: str | None = None) -> None:
    """Checkpoint now (unless ``saved`` is this step's) and raise :class:`checkpoint.Stopped` (preemption)."""
    path = saved or save_checkpoint(run, engine)
    name = signal.Signals(run.stop_signal).name
    message = (f"stopped by {name} after step {run.state.step} of {run.cfg.steps}; checkpoint {path} is saved, run the "
               f"same command again to resume from it")
    run.monitor.note(message)
    run.monitor.close()
    raise checkpoint.Stopped(message, run.stop_signal)

def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0

def log_train(run: Run, engine: Any) -> None:
    seconds, local_tokens = run.monitor.throughput()
    run.wall_s += seconds
    global_tokens, = distributed.all_sum([float(local_tokens)])
    run.state.tokens += int(global_tokens)
    local = {k: sum(v) / len(v) for k, v in run.pending.items() if v}
    run.pending.clear()
    shared = {
        "lr": float(engine.get_lr()[0]),
        "tokens_per_s": global_tokens / seconds if seconds > 0 else 0.0,
        "tokens": run.state.tokens,
        "micro_step": run.state.micro_step,
        **{f"skipped/{k}": v for k, v in run.state.skipped.items()},
        **distributed.memory_stats(run.world.device),
    }
    run.monitor.log(run.state.step, local, shared)
