"""The recipe's ``report`` section: what ``draftsmith report`` measures beyond ``decode`` and ``eval``.

The prompts come from ``eval.prompts`` / ``eval.num_prompts``, k and max_new_tokens from ``decode``
(``decode.temperature`` is ignored: the report decodes greedily and at ``report.temperature``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from ..errors import ConfigError
from ..measure.config import EvalRecipe


@dataclass
class ReportConfig:
    temperature: float = 1.0
    """The sampled decodes' temperature, and the one the offline α = E[Σ min(p, q)] and KL are computed at
    (p and q both divided by it; top-k / top-p are not applied)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """One sampled decode of the whole prompt set per seed; [] = greedy only."""
    turns: Literal[1, 2] = 2
    """2: questions with a second turn are also asked it, after the target's own (fp32 greedy) first answer."""
    per_category: int = 0
    """> 0: the first this many questions of each category of eval.prompts (MT-bench lists its 8 categories one
    after another, so eval.num_prompts alone takes the first ones only); 0 = the first eval.num_prompts."""
    calibration_bins: int = 10
    """Equal-width confidence bins of the reliability curve."""
    worst: int = 12
    """How many failing tokens and contexts the report lists."""
    tolerance_sigmas: float = 3.0
    """Predicted τ agrees with the measured one when |Δ| ≤ this many combined standard errors."""
    out_dir: str = ""
    """Where report.json, report.md and the plots go; empty = <run_dir>/report."""

    def validate(self) -> None:
        if self.temperature <= 0:
            raise ConfigError(f"report.temperature = {self.temperature} must be > 0 (greedy is always decoded too)")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"report.seeds = {self.seeds} names a seed twice")
        if self.per_category < 0:
            raise ConfigError(f"report.per_category = {self.per_category} must be ≥ 0 (0 = eval.num_prompts from the start)")
        if self.calibration_bins < 1:
            raise ConfigError(f"report.calibration_bins = {self.calibration_bins} must be at least 1")
        if self.worst < 0:
            raise ConfigError(f"report.worst = {self.worst} must be ≥ 0")
        if self.tolerance_sigmas <= 0:
            raise ConfigError(f"report.tolerance_sigmas = {self.tolerance_sigmas} must be > 0")


class ReportRecipe(EvalRecipe, Protocol):
    """What ``draftsmith report`` reads of the recipe: what ``draftsmith eval`` reads, and this section. The
    top-level ``config.Recipe`` satisfies it (``config`` lies above this stage: it imports the section)."""

    report: ReportConfig
