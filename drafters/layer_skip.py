"""Layer-skip self-drafter: the target's first N layers, its final norm and lm_head.

It needs no training, so the decoder can be exercised end to end before any drafter
exists (as in LayerSkip / self-speculative decoding). The truncated model is a real
HF causal LM sharing the target's modules (no weight copy), so the same object can
also serve as ``assistant_model`` for HF assisted generation in benchmarks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import torch

from ..errors import ConfigError
from ..target import Target
from .hf_lm import HFDrafter


def truncated_model(target_model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A causal LM that runs the first ``num_layers`` decoder layers of ``target_model``."""
    total = int(target_model.config.num_hidden_layers)
    if not 1 <= num_layers < total:
        raise ConfigError(f"drafter.num_layers = {num_layers} must be between 1 and {total - 1} for this target")
    config = copy.deepcopy(target_model.config)
    config.num_hidden_layers = num_layers
    with torch.device("meta"):
        model = type(target_model)(config)
    model.model.embed_tokens = target_model.model.embed_tokens
    model.model.layers = torch.nn.ModuleList(list(target_model.model.layers[:num_layers]))
    model.model.norm = target_model.model.norm
    model.model.rotary_emb = target_model.model.rotary_emb
    model.lm_head = target_model.lm_head
    model.generation_config = copy.deepcopy(target_model.generation_config)
    model.eval()
    return model


def layer_skip_drafter(target_model: torch.nn.Module, num_layers: int) -> HFDrafter:
    return HFDrafter(truncated_model(target_model, num_layers))


@dataclass
class LayerSkipConfig:
    type: Literal["layer_skip"] = "layer_skip"
    num_layers: int = 8
    """How many of the target's first layers the drafter runs (1 … layers-1)."""

    def build(self, target: Target) -> HFDrafter:
        return layer_skip_drafter(target.model, self.num_layers)
