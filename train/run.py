"""``draftsmith train``: pick the recipe of the drafter's method and run it inside the process group.

The method is the recipe's ``drafter.type``; each method's recipe is one file in ``train/``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from . import checkpoint, distributed, draft_lm, eagle1, eagle3, medusa


def recipes() -> dict[str, Callable[..., dict[str, Any]]]:
    """Method (drafter type) → the recipe's ``train(recipe, world, resume)``."""
    return {"draft_lm": draft_lm.train, "eagle1": eagle1.train, "eagle3": eagle3.train, "medusa": medusa.train}


def run_training(recipe: Any, resume: str | None = None) -> dict[str, Any]:
    """Train the recipe's drafter (one process, torchrun or the deepspeed launcher); return the summary."""
    method = recipe.drafter.type
    table = recipes()
    if method not in table:
        raise ConfigError(f"drafter.type = '{method}' has no training recipe; the trainable methods are: "
                          f"{', '.join(table)}")
    with distributed.process_group() as world, checkpoint.stop_on_signals():  # signals: checkpoint, then stop
        return table[method](recipe, world, resume)
