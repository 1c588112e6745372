"""The recipe: one YAML per (target, method) in ``configs/``, loaded into typed dataclasses.

``load_recipe("configs/smollm2-135m-layerskip.yaml", ["decode.k=5"])`` reads the
YAML, applies dotted overrides, validates every key (unknown keys are errors that
list the valid ones) and returns a :class:`Recipe`. Each run writes the resolved
recipe to ``<run_dir>/config.yaml`` (``schema.save_recipe``). The machinery lives in
``schema.py``; each section's dataclass lives next to the code it configures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .data.config import DataConfig
from .drafters import DrafterConfig
from .errors import ConfigError
from .drafters.layer_skip import LayerSkipConfig
from .measure.config import DecodeConfig, EvalConfig
from .report.config import ReportConfig
from .schema import from_dict, load_yaml, merge, parse_overrides
from .target import TargetConfig
from .train.config import TrainConfig

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


@dataclass
class Recipe:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=LayerSkipConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    run_dir: str = "runs/default"
    """Where this run writes its outputs (resolved config, metrics, checkpoints)."""

    def validate(self) -> None:
        if not self.run_dir.strip():
            raise ConfigError("run_dir is empty; name the folder this run writes to, e.g. run_dir=runs/mine")


def resolve_config_path(path: str) -> str:
    """A path as given, or the name of a recipe shipped in ``configs/`` (with or without .yaml)."""
    if os.path.isfile(path):
        return path
    for candidate in (os.path.join(CONFIG_DIR, path), os.path.join(CONFIG_DIR, path + ".yaml")):
        if os.path.isfile(candidate):
            return candidate
    return path  # load_yaml reports it missing


def load_recipe(path: str | None = None, overrides: list[str] | None = None) -> Recipe:
    data = load_yaml(resolve_config_path(path)) if path else {}
    data = merge(data, parse_overrides(overrides or []))
    return from_dict(Recipe, data)
