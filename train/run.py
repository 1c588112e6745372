"""``draftsmith train``: pick the recipe of the drafter's method and run it inside the process group.

The method is the recipe's ``drafter.type``; each method's recipe is one file in ``train/``, named
by its family's spec (``drafters/registry.py``: ``recipe="draftsmith.train.eagle3"``) and imported here.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from ..drafters.registry import specs
from ..errors import ConfigError, DraftsmithError, SaidElsewhere
from . import checkpoint, distributed, monitor
from .config import TrainRecipe, unread


def recipes() -> dict[str, ModuleType]:
    """Method (drafter type) → its recipe's module (``train(recipe, world, resume)``, ``READS``), for every trainable
    family spec."""
    return {name: importlib.import_module(s.recipe) for name, s in specs().items() if s.recipe}


def run_training(recipe: TrainRecipe, resume: str | None = None) -> dict[str, Any]:
    """Train the recipe's drafter (one process, torchrun or the deepspeed launcher); return the summary."""
    method = recipe.drafter.type
    table = recipes()
    if method not in table:
        raise ConfigError(f"drafter.type = '{method}' has no training recipe; the trainable methods are: "
                          f"{', '.join(table)}")
    ignored = unread(recipe.train, table[method].READS)
    if ignored:
        users = {key: [name for name, module in table.items() if key in module.READS] for key in ignored}
        raise ConfigError("; ".join(f"train.{key} is read by the {', '.join(users[key])} recipe(s) only" for key in ignored)
                          + f": drafter.type = '{method}' would ignore it; remove it or train one of those")
    with distributed.process_group() as world, using(recipe.run_dir, world.rank), checkpoint.stop_on_signals(), \
            monitor.closed_on_error():
        return table[method].train(recipe, world, resume)  # signals: checkpoint, then stop


@contextlib.contextmanager
def using(run_dir: str, rank: int = 0) -> Iterator[None]:
    """Hold ``run_dir`` for this launch: a second ``train`` on the same folder would interleave checkpoints and logs
    with the first, so it is refused. Rank 0 alone takes the lock (``.train.lock``) and every rank learns its verdict
    before any of them writes: two launches of N processes started at once cannot split the locks between them (each
    rank taking its own, both launches died), and the refused launch says so once, from its rank 0. The lock is the
    kernel's (``flock``), released whenever the process ends, a kill included: nothing stale is left to delete."""
    with contextlib.ExitStack() as held:
        holder = 0  # 0: rank 0 holds the folder; else the pid holding it, -1 when it has not written it yet
        if rank == 0:
            os.makedirs(run_dir, exist_ok=True)
            lock = held.enter_context(open(os.path.join(run_dir, ".train.lock"), "a+"))
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                holder = int(lock.read().strip() or -1)
            else:
                lock.seek(0)
                lock.truncate()
                lock.write(f"{os.getpid()}\n")
                lock.flush()
        holder = int(distributed.all_sum([float(holder)])[0])  # rank 0's verdict, on every rank
        if holder and rank != 0:
            raise SaidElsewhere(f"run_dir '{run_dir}' is in use (rank 0 says by whom)")
        if holder:
            raise DraftsmithError(f"another `draftsmith train` (pid {holder if holder > 0 else 'unknown'}) is using "
                                  f"run_dir '{run_dir}'; wait for it to end, or give this run another run_dir")
        yield
