"""Drafters: one file per architecture, all speaking the protocol of ``decode/protocol.py``.

A drafter config is a tagged section (``drafter: {type: layer_skip, …}``); each
config class knows how to ``build(target)`` its runtime drafter. Add a family by
writing its file and adding its config class to ``DrafterConfig`` below.
"""

from __future__ import annotations

from typing import Union

from .checkpoint import SavedDrafterConfig, families, load, save
from .draft_lm import DraftLMConfig, DraftLMDrafter
from .eagle1 import Eagle1Config, Eagle1Head
from .eagle3 import Eagle3Config, Eagle3Head
from .hf_lm import HFDrafter, HFDrafterConfig
from .layer_skip import LayerSkipConfig
from .medusa import MedusaConfig, MedusaHeads

DrafterConfig = Union[LayerSkipConfig, HFDrafterConfig, DraftLMConfig, Eagle1Config, Eagle3Config, MedusaConfig, SavedDrafterConfig]

__all__ = [
    "DraftLMConfig",
    "DraftLMDrafter",
    "DrafterConfig",
    "Eagle1Config",
    "Eagle1Head",
    "Eagle3Config",
    "Eagle3Head",
    "HFDrafter",
    "HFDrafterConfig",
    "LayerSkipConfig",
    "MedusaConfig",
    "MedusaHeads",
    "SavedDrafterConfig",
    "families",
    "load",
    "save",
]
