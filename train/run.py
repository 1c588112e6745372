"""``draftsmith train``: pick the recipe of the drafter's method and run it inside the process group.

The method is the recipe's ``drafter.type``; each method's recipe is one file in ``train/``, named
by its family's spec (``drafters/registry.py``: ``recipe="draftsmith.train.eagle3"``) and imported here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ..drafters.registry import specs
from ..errors import ConfigError
from . import checkpoint, distributed


def recipes() -> dict[str, Callable[..., dict[str, Any]]]:
    """Method (drafter type) → the recipe's ``train(recipe, world, resume)``, for every trainable family spec."""
    return {name: importlib.import_module(s.recipe).train for name, s in specs().items() if s.recipe}


def run_training(recipe: Any, resume: str | None = None) -> dict[str, Any]:
    """Train the recipe's drafter (one process, torchrun or the deepspeed launcher); return the summary."""
    method = recipe.drafter.type
    table = recipes()
    if method not in table:
        raise ConfigError(f"drafter.type = '{method}' has no training recipe; the trainable methods are: "
                          f"{', '.join(table)}")
    with distributed.process_group() as world, checkpoint.stop_on_signals():  # signals: checkpoint, then stop
        return table[method](recipe, world, resume)
