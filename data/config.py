"""Config of the data stage (``draftsmith prepare``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    """Where training conversations come from and how they are rendered (filled by the data pipeline)."""
