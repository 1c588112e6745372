"""Config of the training stage (``draftsmith train``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    """Optimizer, schedule, losses and checkpointing (filled by the training recipes)."""
