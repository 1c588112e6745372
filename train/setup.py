"""Run setup for the training recipes: the run folder, seeds, the frozen target, the data, the engine.

A recipe reads top to bottom; between ``begin`` and ``engine_for`` it reads what it needs off its config and module
(layer ids, a block size, a draft vocabulary's ids), and a drafter that drafts a fixed number per round sets
``run.max_drafts``::

    run, config, module = setup.begin(recipe, world)  # run folder, seeds, frozen target, data; the drafter's
                                                      # config (resolved against the target) and module (this file)
    engine = setup.engine_for(run, module, resume)    # DeepSpeed, drafter only; the weights' moving
                                                      # average (train.ema_decay); the latest checkpoint (this file)
    save.baseline(run, engine, evaluate)              # held-out metrics of the untrained drafter   (save.py)
    for micro in step.step_batches(run, rows):        # one optimizer step's micro-batches, from the
                                                      # saved data position, valid rows counted     (step.py)
        step.optimizer_step(run, engine, micro, loss_of)  # backward on each, the step; a bad loss
                                                          # skipped and replaced                    (step.py)
        step.after_step(run, engine, evaluate)        # logging, evaluation, checkpoint cadence     (step.py)
    return save.finish(run, engine, evaluate)         # final checkpoint, drafter folders, summary  (save.py)

``rows(batch)`` marks the positions whose loss counts and ``loss_of(batch)`` returns the summed loss and its
parts; :func:`micro_batches` (this file) is the data source ``step_batches`` draws from.

The target's side of a batch (one forward online, or the feature cache) is in ``target_side.py``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch

from ..devices import resolve_dtype
from ..drafters.registry import DrafterConfig, TrainableConfig, trainable_families
from ..errors import ConfigError
from ..schema import save_recipe, to_dict
from ..target import Target, load_target
from . import checkpoint, distributed
from .config import TrainConfig, TrainRecipe
from .data import Batch, BatchOrder, Split, collate, load_rows, record_lengths, split_heldout
from .distributed import World
from .ema import EMA
from .l2sp import L2SP
from .monitor import Monitor


@dataclass
class TrainState:
    """Everything besides tensors that a resumed run needs (saved as trainer_state.json)."""

    step: int = 0
    """Optimizer steps taken."""
    micro_step: int = 0
    """Micro-batches consumed: the data position."""
    tokens: int = 0
    """Real tokens processed, all ranks together."""
    train_s: float = 0.0
    """Seconds of training of the whole run, every session (process) together; setup, evaluation
    and checkpointing are left out."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Micro-batches skipped on every rank, by reason."""
    world_size: int = 1
    seed: int = 0
    sim_tau_curve: list[dict[str, float]] = field(default_factory=list)
    """``{step, sim_tau}`` of every held-out evaluation so far (see ``heldout.sim_tau``)."""


@dataclass
class Run:
    recipe: TrainRecipe
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
    """This rank's loss and loss parts since the last log line: name → [sum over valid tokens, their count]."""
    session: TrainState = field(default_factory=TrainState)
    """The state this process started from (the checkpoint it resumed, or a fresh one)."""
    logged: tuple[int, float] = (0, 0.0)
    """(tokens, train_s) of the state at the last log line."""
    clock: float = 0.0
    """``time.perf_counter()`` when the training time counted in ``state.train_s`` last advanced."""
    stop_signal: int = 0
    """A stop signal (SIGTERM / SIGUSR1) some rank received: checkpoint at the next step and stop."""
    max_drafts: int | None = None
    """The most drafts the trained drafter proposes per round (Medusa: its heads); None = any number."""
    ema: EMA | None = None
    """The moving average of the drafter's weights (``train.ema_decay``; :func:`build_engine` makes it), or None."""
    l2sp: L2SP | None = None
    """The weights training started from and the pull toward them (``train.l2sp_weight``; :func:`build_engine`), or
    None."""

    @property
    def cfg(self) -> TrainConfig:
        return self.recipe.train

    @property
    def run_dir(self) -> str:
        return self.recipe.run_dir

    @property
    def offline(self) -> bool:
        return bool(self.cfg.features)


def trainable(drafter: DrafterConfig) -> TrainableConfig:
    """The recipe's drafter config, if its family can be trained (it builds an nn.Module)."""
    if drafter.type not in trainable_families():
        raise ConfigError(f"drafter.type = '{drafter.type}' cannot be trained; the methods are: "
                          f"{', '.join(trainable_families())}")
    return drafter


@runtime_checkable
class ResolvesAgainstTarget(Protocol):
    """A family config whose fields depend on the target (EAGLE-3's and DFlash's layer ids and vocabulary)."""

    def resolve(self, target: Target) -> Any:
        """The config checked against ``target``, every target-dependent field made explicit."""
        ...


def begin(recipe: TrainRecipe, world: World) -> tuple[Run, Any, torch.nn.Module]:
    """Every recipe's start: the run (:func:`start`), the recipe's drafter config, resolved against the target
    where its family resolves one (the layer ids, block size and vocabulary a recipe reads off it), and the fresh
    module it builds, on the target's device and dtype."""
    config: Any = trainable(recipe.drafter)  # refused before the target loads
    run = start(recipe, world)
    if isinstance(config, ResolvesAgainstTarget):
        config = config.resolve(run.target)
    return run, config, config.build_module(run.target)


def start(recipe: TrainRecipe, world: World) -> Run:
    """Run folder, seeds, the frozen target (placed once on this process's device), data, engine config."""
    cfg = recipe.train
    os.makedirs(recipe.run_dir, exist_ok=True)
    if world.is_main:
        save_recipe(recipe)
    ds_config = distributed.load_engine_config(  # fail before loading; "auto" precision follows the target's dtype
        cfg.deepspeed, cfg.batch_size, world.device, resolve_dtype(recipe.target.dtype, world.device))
    for key, on, what in (("ema_decay", cfg.ema_decay is not None, "averages the whole drafter"),
                          ("l2sp_weight", cfg.l2sp_weight > 0, "pulls the whole drafter toward its start")):
        if on and ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
            raise ConfigError(f"train.{key} {what} on every rank, which ZeRO-3 (train.deepspeed = '{cfg.deepspeed}') "
                              f"partitions; use zero2 (or 0, 1), or leave train.{key} unset")
    checkpoint.seed_everything(cfg.seed)
    target = load_target(recipe.target.name, recipe.target.dtype, str(world.device), recipe.target.chat_template)
    rows = load_rows(cfg.dataset, cfg.features, target)
    split = split_heldout(len(rows), cfg.eval.heldout, cfg.seed, cfg.max_records)
    lengths = record_lengths(rows) if cfg.group_by_length else None
    order = BatchOrder(split.train, cfg.batch_size, world.world_size, world.rank, cfg.seed, lengths, cfg.group_by_length)
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
    """The DeepSpeed engine around the drafter (wrapped in :class:`Forward`); the target stays outside, frozen.
    With ``train.ema_decay`` also ``run.ema``, the moving average of the engine module's weights; with
    ``train.l2sp_weight`` ``run.l2sp``, their start and the pull toward it."""
    cfg = run.cfg
    sched = cfg.schedule
    engine = distributed.build_engine(
        Forward(module),
        run.ds_config,
        lr=cfg.optimizer.lr,
        betas=cfg.optimizer.betas,
        eps=cfg.optimizer.eps,
        weight_decay=cfg.optimizer.weight_decay,
        lr_lambda=lr_lambda(sched.kind, sched.warmup_steps, cfg.steps, sched.min_lr_ratio),
        frozen=run.target.model,
    )
    if cfg.ema_decay is not None:
        run.ema = EMA(engine.module, cfg.ema_decay)
    if cfg.l2sp_weight > 0:  # before restore(): the start of the run's first session, rebuilt as it was
        run.l2sp = L2SP(engine.module, cfg.l2sp_weight)
    return engine


def restore(run: Run, engine: Any, resume: str | None = None) -> None:
    """Continue from ``resume`` (a checkpoint folder) or the run folder's latest checkpoint, if any."""
    path = resume or checkpoint.latest_checkpoint(run.run_dir)
    if path:
        saved = checkpoint.load_checkpoint(engine, run.world, path, identity(run))
        run.state = TrainState(**{k: v for k, v in saved.items() if k in TrainState.__dataclass_fields__})
        if run.ema is not None:  # identity(run) made sure it was on from the first step: one update per step
            run.ema.load_state_dict(checkpoint.load_ema(path), run.state.step, path)
        if run.state.world_size != run.world.world_size:
            # the data position is counted in micro-batches of world_size × batch_size records
            run.state.micro_step = run.state.micro_step * run.state.world_size // run.world.world_size
            run.state.world_size = run.world.world_size
        # DeepSpeed restored the scheduler's base learning rate too: the recipe's lr wins, and the
        # schedule continues at the saved step with the new peak
        saved_lr = distributed.set_peak_lr(engine, run.cfg.optimizer.lr)
    run.session, run.logged = replace(run.state, skipped=dict(run.state.skipped)), (run.state.tokens, run.state.train_s)
    lg = run.cfg.logging
    run.monitor = Monitor(run.run_dir, run.world.rank, run.cfg.steps, run.state.step, to_dict(run.recipe),
                          wandb=lg.wandb, wandb_project=lg.wandb_project, progress=lg.progress)
    if path:
        run.monitor.note(f"resumed from {path} at step {run.state.step} (micro-batch {run.state.micro_step})")
        if saved_lr != run.cfg.optimizer.lr:
            run.monitor.note(f"learning rate: peak {run.cfg.optimizer.lr:g} (train.optimizer.lr) instead of the "
                             f"checkpoint's {saved_lr:g}, from step {run.state.step} on")


def engine_for(run: Run, module: torch.nn.Module, resume: str | None = None) -> Any:
    """The DeepSpeed engine around ``module`` (:func:`build_engine`), restored from ``resume`` or the run folder's
    latest checkpoint (:func:`restore`)."""
    engine = build_engine(run, module)
    restore(run, engine, resume)
    return engine


def identity(run: Run) -> dict[str, Any]:
    """What a checkpoint's weights and data position mean; a resumed run must match it (learning
    rate, steps, logging and evaluation may change)."""
    cfg = run.cfg
    out = {"drafter": to_dict(run.recipe.drafter), "target": run.target.fingerprint,
           "train": {"dataset": cfg.dataset, "features": cfg.features, "batch_size": cfg.batch_size,
                     "max_length": cfg.max_length, "seed": cfg.seed, "heldout": cfg.eval.heldout}}
    if cfg.group_by_length:  # another data order; absent = random batches (checkpoints from before it existed)
        out["train"]["group_by_length"] = cfg.group_by_length
    if cfg.loss_positions != "answer":  # other tokens trained on; absent = answer tokens
        out["train"]["loss_positions"] = cfg.loss_positions
    if cfg.ema_decay is not None:  # the checkpoint holds the average of these weights; absent = none
        out["train"]["ema_decay"] = cfg.ema_decay
    if cfg.l2sp_weight > 0:  # another objective from the first step; absent = none
        out["train"]["l2sp_weight"] = cfg.l2sp_weight
    return json.loads(json.dumps(out, default=str))  # as it reads back from trainer_state.json


def micro_batches(run: Run) -> Iterator[Batch]:
    """This rank's micro-batches from the saved data position on, on its device, until ``train.steps``
    optimizer steps are done; advances the data position."""
    pad = pad_id(run.target)
    for step, ids in run.order.from_step(run.state.micro_step):
        if run.state.step >= run.cfg.steps:
            return
        batch = collate([run.rows[i] for i in ids], pad, run.cfg.max_length)
        if run.cfg.loss_positions == "all":
            batch = every_token(batch)
        run.state.micro_step = step + 1
        yield batch.to(run.world.device)


def every_token(batch: Batch) -> Batch:
    """The batch with every real token but each record's first as a training target (``train.loss_positions``)."""
    mask = batch.attention_mask.bool()
    mask[:, 0] = False
    return replace(batch, loss_mask=mask, empty_rows=int((mask.sum(-1) == 0).sum()))


def pad_id(target: Target) -> int:
    tok = target.tokenizer
    pad = getattr(tok, "pad_token_id", None)
    if pad is None:
        pad = getattr(tok, "eos_token_id", None)
    return int(pad or 0)
