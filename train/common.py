"""Helpers the training recipes share. No base class: each recipe's loop stays in its own file.

A recipe reads like this (see ``eagle1.py``)::

    run = common.start(recipe, world)                 # run folder, seeds, frozen target, data
    engine = common.build_engine(run, module)         # DeepSpeed around the drafter only
    common.restore(run, engine, resume)               # latest checkpoint of the run folder, if any
    for batch in common.micro_batches(run):           # from the saved data position to train.steps
        if common.optimizer_step(run, engine, lambda: my_loss(batch), batch.tokens):
            common.after_step(run, engine, my_heldout_metrics)  # logging, evaluation, checkpoint cadence
    common.finish(run, engine, my_heldout_metrics)    # final checkpoint, drafter folder, summary

``optimizer_step`` is where a bad micro-batch (no valid token, a NaN/inf loss on any
rank) is skipped on *every* rank — so collectives stay in step — and counted.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..errors import ConfigError, DraftsmithError
from ..files import write_json
from ..schema import save_recipe, to_dict
from ..target import Target, TargetOutput, load_target
from . import checkpoint, distributed
from .data import Batch, BatchOrder, Split, collate, heldout_batches, load_rows, split_heldout
from .distributed import World
from .losses import EmptyBatchError
from .monitor import Monitor

Metrics = dict[str, tuple[float, float]]
"""Held-out metric name → (sum over valid positions, number of valid positions)."""


@dataclass
class TrainState:
    """Everything besides tensors that a resumed run needs (saved as trainer_state.json)."""

    step: int = 0
    """Optimizer steps taken."""
    micro_step: int = 0
    """Micro-batches consumed: the data position."""
    tokens: int = 0
    """Real tokens processed, all ranks together."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Micro-batches skipped on every rank, by reason."""
    world_size: int = 1
    seed: int = 0


@dataclass
class Run:
    recipe: Any
    world: World
    target: Target
    rows: Sequence[dict[str, Any]]
    split: Split
    order: BatchOrder
    ds_config: dict[str, Any]
    dtype: torch.dtype
    """The engine's compute dtype (bf16 or fp32)."""
    state: TrainState
    monitor: Monitor | None = None
    pending: dict[str, list[float]] = field(default_factory=dict)
    """Loss parts of the micro-batches since the last log line."""
    wall_s: float = 0.0
    """Wall time of this process's training loop so far (excludes setup)."""
    stop_signal: int = 0
    """A stop signal (SIGTERM / SIGUSR1) some rank received: checkpoint at the next step and stop."""

    @property
    def cfg(self) -> Any:
        return self.recipe.train

    @property
    def run_dir(self) -> str:
        return self.recipe.run_dir

    @property
    def offline(self) -> bool:
        return bool(self.cfg.features)


# ------------------------------------------------------------------ setup


def trainable(recipe: Any) -> Any:
    """The recipe's drafter config, if its family can be trained (it builds an nn.Module)."""
    from ..drafters.checkpoint import trainable_families

    if recipe.drafter.type not in trainable_families():
        raise ConfigError(f"drafter.type = '{recipe.drafter.type}' cannot be trained; the methods are: "
                          f"{', '.join(trainable_families())}")
    return recipe.drafter


def start(recipe: Any, world: World) -> Run:
    """Run folder, seeds, the frozen target (placed once on this process's device), data, engine config."""
    cfg = recipe.train
    os.makedirs(recipe.run_dir, exist_ok=True)
    if world.is_main:
        save_recipe(recipe)
    ds_config = distributed.load_engine_config(cfg.deepspeed, cfg.batch_size, world.device)  # fail before loading
    checkpoint.seed_everything(cfg.seed)
    target = load_target(recipe.target.name, recipe.target.dtype, str(world.device))
    rows = load_rows(cfg.dataset, cfg.features, target)
    split = split_heldout(len(rows), cfg.eval.heldout, cfg.seed)
    order = BatchOrder(split.train, cfg.batch_size, world.world_size, world.rank, cfg.seed)
    order.steps_per_epoch  # noqa: B018 — fail now, not after the engine is built, if data is too small
    state = TrainState(world_size=world.world_size, seed=cfg.seed)
    return Run(recipe, world, target, rows, split, order, ds_config, distributed.engine_dtype(ds_config), state)


def lr_lambda(kind: str, warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak learning rate after ``step`` optimizer steps."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "linear":
            return min_ratio + (1 - min_ratio) * (1 - progress)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class Forward(torch.nn.Module):
    """The engine's module: holds the drafter and runs ``fn(drafter)`` as its forward.

    DeepSpeed prepares ZeRO's backward (gradient scaling, reduction boundaries) from the
    outputs of ``engine(...)``, so every training forward must go through the engine — a
    plain call, an unroll or a loss over selected rows alike::

        pred, logits = engine(lambda head: head(ids, features, attention_mask=mask))
        steps = engine(lambda head: head.unroll(ids, features, steps=7))
    """

    def __init__(self, drafter: torch.nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, fn: Callable[[torch.nn.Module], Any]) -> Any:
        return fn(self.drafter)


def build_engine(run: Run, module: torch.nn.Module) -> Any:
    """The DeepSpeed engine around the drafter (wrapped in :class:`Forward`); the target stays outside, frozen."""
    cfg = run.cfg
    sched = cfg.schedule
    return distributed.build_engine(
        Forward(module),
        run.ds_config,
        lr=cfg.optimizer.lr,
        betas=cfg.optimizer.betas,
        eps=cfg.optimizer.eps,
        weight_decay=cfg.optimizer.weight_decay,
        lr_lambda=lr_lambda(sched.kind, sched.warmup_steps, cfg.steps, sched.min_lr_ratio),
        frozen=run.target.model,
    )


def restore(run: Run, engine: Any, resume: str | None = None) -> None:
    """Continue from ``resume`` (a checkpoint folder) or the run folder's latest checkpoint, if any."""
    path = resume or checkpoint.latest_checkpoint(run.run_dir)
    if path:
        saved = checkpoint.load_checkpoint(engine, run.world, path, identity(run))
        run.state = TrainState(**{k: v for k, v in saved.items() if k in TrainState.__dataclass_fields__})
        if run.state.world_size != run.world.world_size:
            # the data position is counted in micro-batches of world_size × batch_size records
            run.state.micro_step = run.state.micro_step * run.state.world_size // run.world.world_size
            run.state.world_size = run.world.world_size
    lg = run.cfg.logging
    run.monitor = Monitor(run.run_dir, run.world.rank, run.cfg.steps, run.state.step, to_dict(run.recipe),
                          wandb=lg.wandb, wandb_project=lg.wandb_project, progress=lg.progress)
    if path:
        run.monitor.note(f"resumed from {path} at step {run.state.step} (micro-batch {run.state.micro_step})")


def baseline(run: Run, engine: Any, heldout_fn: Callable[[Any, Batch], Metrics]) -> None:
    """Held-out metrics of the untrained drafter (step 0), when periodic evaluation is on."""
    if run.state.step == 0 and run.cfg.eval.every > 0:
        log_heldout(run, engine, heldout_fn)


# ------------------------------------------------------------------ data


def micro_batches(run: Run) -> Iterator[Batch]:
    """This rank's micro-batches from the saved data position on, on its device, until ``train.steps``
    optimizer steps are done; advances the data position."""
    pad = pad_id(run.target)
    for step, ids in run.order.from_step(run.state.micro_step):
        if run.state.step >= run.cfg.steps:
            return
        batch = collate([run.rows[i] for i in ids], pad, run.cfg.max_length)
        run.state.micro_step = step + 1
        yield batch.to(run.world.device)


def pad_id(target: Target) -> int:
    tok = target.tokenizer
    pad = getattr(tok, "pad_token_id", None)
    if pad is None:
        pad = getattr(tok, "eos_token_id", None)
    return int(pad or 0)


@torch.no_grad()
def target_forward(run: Run, batch: Batch, feature_layers: tuple[int, ...] = ()) -> TargetOutput:
    """The frozen target on a batch: logits [B, S, V] and the features of ``feature_layers``."""
    return run.target.forward(batch.input_ids, feature_layers=feature_layers, attention_mask=batch.attention_mask)


def features_and_logits(run: Run, batch: Batch, layers: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """The target's features of ``layers`` [B, S, len(layers)·H] and its logits [B, S, V].

    Online: one forward of the frozen target. Offline: read from the feature cache.
    """
    if not run.offline:
        out = target_forward(run, batch, layers)
        return out.features, out.logits
    if batch.hidden is None:
        raise DraftsmithError("offline training needs the feature cache's hidden states in every batch")
    cached = list(run.rows.layer_ids)
    features = cached_layers(batch.hidden, cached, layers, run.target.hidden_size)
    return features.to(run.target.dtype), cached_logits(run.target, batch, cached)


def cached_layers(hidden: Tensor, cached: list[int], wanted: tuple[int, ...], hidden_size: int) -> Tensor:
    """The ``wanted`` layers' slices of cached features [B, S, len(cached)·H] → [B, S, len(wanted)·H]."""
    missing = [layer for layer in wanted if layer not in cached]
    if missing:
        raise DraftsmithError(f"the feature cache holds target layers {cached}, but this drafter needs {list(wanted)} "
                              f"(missing {missing}); rebuild it with those layers (data.features.layer_ids) or train "
                              f"online (train.features empty)")
    cols = [cached.index(layer) for layer in wanted]
    return torch.cat([hidden[..., c * hidden_size : (c + 1) * hidden_size] for c in cols], dim=-1)


@torch.no_grad()
def cached_logits(target: Target, batch: Batch, cached: list[int]) -> Tensor:
    """The target's logits [B, S, V] without running it: its final norm and lm_head on the cached last
    layer (exact up to the cache's bf16), else the cached top-k logits with −inf elsewhere."""
    from ..drafters.common import target_parts

    last = target.num_layers - 1
    if last in cached:
        parts = target_parts(target.model)
        h = cached_layers(batch.hidden, cached, (last,), target.hidden_size).to(target.dtype)
        return parts.lm_head(parts.norm(h))
    if batch.topk_ids is not None and batch.topk_logits is not None:
        full = torch.full((*batch.input_ids.shape, target.vocab_size), float("-inf"), device=batch.topk_logits.device)
        return full.scatter(-1, batch.topk_ids, batch.topk_logits.float())
    raise DraftsmithError(f"the feature cache has neither the target's last layer ({last}) nor top-k logits, so it "
                          f"gives no target distribution; rebuild it with layer {last} in data.features.layer_ids "
                          f"or data.features.topk > 0")


def rows_ahead(x: Tensor, n: int, mask: Tensor) -> Tensor:
    """``shift_left(x, n)[mask]`` without building the shifted copy: the rows ``x[b, t + n]`` for
    every ``mask[b, t]``. x: [B, S, ...] (e.g. the target's logits [B, S, V]); mask: [B, S] bool,
    False in its last n columns (they have no row n ahead). Returns [N, ...], N = mask.sum()."""
    return x[:, n:][mask[:, : max(x.shape[1] - n, 0)]]


def uniform_noise(x: Tensor, amplitude: float) -> Tensor:
    """x + U(−a, a) elementwise (EAGLE's feature noise); x itself when a = 0."""
    if amplitude <= 0:
        return x
    return x + (torch.rand_like(x) * 2 - 1) * amplitude


# ------------------------------------------------------------------ the step


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
        decoder_eval(run, engine)
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


# ------------------------------------------------------------------ evaluation


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


def decoder_eval(run: Run, engine: Any, path: str | None = None) -> dict[str, Any] | None:
    """Run the drafter folder ``path`` (default: the drafter saved now) in the real speculative
    decoder on rank 0 (the others wait)."""
    path = path or save_drafter(run, engine)
    summary = None
    if run.world.is_main:
        from ..drafters import load
        from ..eval.prompts import load_questions
        from ..eval.run import evaluate

        questions = load_questions(run.recipe.eval.prompts, run.cfg.eval.decoder_prompts)
        stats, _ = evaluate(run.target, load(path, run.target), questions, run.recipe.decode, progress=False)
        summary = stats.summary()
        run.monitor.log(run.state.step, {}, {"decoder/tau_with_bonus": summary["tau_with_bonus"],
                                             "decoder/acceptance_rate": summary["acceptance_rate"],
                                             "decoder/tokens_per_s": summary["tokens_per_s"]})
        run.monitor.note(f"step {run.state.step} decoder: tau (bonus counted) {summary['tau_with_bonus']:.3f}, "
                         f"acceptance {summary['acceptance_rate']:.3f}")
    distributed.barrier()
    return summary


# ------------------------------------------------------------------ saving


def save_checkpoint(run: Run, engine: Any) -> str:
    state = {**asdict(run.state), "identity": identity(run)}
    return checkpoint.save_checkpoint(engine, run.world, run.run_dir, state, run.cfg.checkpoint.keep)


def identity(run: Run) -> dict[str, Any]:
    """What a checkpoint's weights and data position mean; a resumed run must match it (learning
    rate, steps, logging and evaluation may change)."""
    cfg = run.cfg
    out = {"drafter": to_dict(run.recipe.drafter), "target": run.target.fingerprint,
           "train": {"dataset": cfg.dataset, "features": cfg.features, "batch_size": cfg.batch_size,
                     "max_length": cfg.max_length, "seed": cfg.seed, "heldout": cfg.eval.heldout}}
    return json.loads(json.dumps(out, default=str))  # as it reads back from trainer_state.json


def save_drafter(run: Run, engine: Any) -> str:
    """Write the drafter in the drafters format to ``<run_dir>/drafter`` (ZeRO-3 weights gathered)."""
    from ..drafters import save

    path = os.path.join(run.run_dir, "drafter")
    with distributed.full_weights(engine) as module:
        drafter = module.drafter
        state = {k: v.detach().to("cpu", copy=True) for k, v in drafter.state_dict().items()} if run.world.is_main else None
    if run.world.is_main:
        config = run.recipe.drafter
        fresh = config.build_module(run.target)
        fresh.load_state_dict(state)
        save(config.runtime(fresh, run.target), path)
    distributed.barrier()
    return path


def finish(run: Run, engine: Any, heldout_fn: Callable[[Any, Batch], Metrics]) -> dict[str, Any]:
    """Final held-out metrics, checkpoint, drafter folder, optional decoder eval; write train_summary.json."""
    heldout = log_heldout(run, engine, heldout_fn)
    save_checkpoint(run, engine)
    drafter_path = save_drafter(run, engine)
    decoder = decoder_eval(run, engine, drafter_path) if run.cfg.eval.decoder_at_end else None
    summary = {
        "method": run.recipe.drafter.type,
        "steps": run.state.step,
        "micro_steps": run.state.micro_step,
        "tokens": run.state.tokens,
        "skipped": run.state.skipped,
        "world_size": run.world.world_size,
        "zero_stage": distributed.zero_stage(engine),
        "dtype": str(run.dtype).replace("torch.", ""),
        "online_target": not run.offline,
        "train_wall_s": round(run.wall_s, 3),
        "tokens_per_s": round(run.state.tokens / run.wall_s, 3) if run.wall_s > 0 else None,
        "heldout": heldout,
        "decoder": decoder,
        "drafter": drafter_path,
        "target_fingerprint": run.target.fingerprint,
    }
    if run.world.is_main:
        write_json(os.path.join(run.run_dir, "train_summary.json"), summary)
    run.monitor.close(summary={k: v for k, v in heldout.items()})
    return {**summary, "rank": run.world.rank}
