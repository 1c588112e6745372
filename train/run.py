"""``draftsmith train``: pick the recipe of the drafter's method and run it inside the process group.

The method is the recipe's ``drafter.type``; each method's recipe is one file in ``train/``, named
by its family's spec (``drafters/registry.py``: ``recipe="draftsmith.train.eagle3"``) and imported here.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from ..drafters.registry import specs
from ..errors import ConfigError, DraftsmithError
from . import checkpoint, distributed
from .config import TrainRecipe


def recipes() -> dict[str, Callable[..., dict[str, Any]]]:
    """Method (drafter type) → the recipe's ``train(recipe, world, resume)``, for every trainable family spec."""
    return {name: importlib.import_module(s.recipe).train for name, s in specs().items() if s.recipe}


def run_training(recipe: TrainRecipe, resume: str | None = None) -> dict[str, Any]:
    """Train the recipe's drafter (one process, torchrun or the deepspeed launcher); return the summary."""
    method = recipe.drafter.type
    table = recipes()
    if method not in table:
        raise ConfigError(f"drafter.type = '{method}' has no training recipe; the trainable methods are: "
                          f"{', '.join(table)}")
    with using(recipe.run_dir), distributed.process_group() as world, checkpoint.stop_on_signals():
        return table[method](recipe, world, resume)  # signals: checkpoint, then stop


@contextlib.contextmanager
def using(run_dir: str) -> Iterator[None]:
    """Hold ``run_dir`` for this process (rank r of a launch holds ``.train.rank<r>.lock``): a second ``train`` on the
    same folder would interleave checkpoints and logs with the first, so it is refused. The lock is the kernel's
    (``flock``), released whenever the process ends, a kill included: nothing stale is left to delete."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, f".train.rank{os.environ.get('RANK', '0')}.lock")
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            raise DraftsmithError(f"another `draftsmith train` (pid {holder}) is using run_dir '{run_dir}'; wait for it "
                                  f"to end, or give this run another run_dir") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        yield
