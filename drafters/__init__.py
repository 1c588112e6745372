"""Drafters: one file per architecture, all speaking the protocol of ``decode/protocol.py``.

A drafter config is a tagged section (``drafter: {type: layer_skip, …}``); each
config class knows how to ``build(target)`` its runtime drafter. A family is registered
once, by one :class:`~draftsmith.drafters.registry.FamilySpec` line in ``registry.SPECS``:
add a family by writing its file and that line (the contract is ``registry.FamilyConfig`` /
``registry.TrainableConfig``).
"""

from __future__ import annotations

from .checkpoint import SavedDrafterConfig, load, save
from .draft_lm import DraftLMConfig, DraftLMDrafter
from .eagle1 import Eagle1Config, Eagle1Head
from .eagle3 import Eagle3Config, Eagle3Head
from .hf_lm import HFDrafter, HFDrafterConfig
from .layer_skip import LayerSkipConfig
from .hybrid import HybridConfig
from .medusa import MedusaConfig, MedusaHeads
from .prompt_lookup import PromptLookupConfig
from .registry import DrafterConfig, FamilySpec, families, spec, specs
from .suffix import SuffixConfig

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
    "HybridConfig",
    "FamilySpec",
    "LayerSkipConfig",
    "MedusaConfig",
    "MedusaHeads",
    "PromptLookupConfig",
    "SuffixConfig",
    "SavedDrafterConfig",
    "families",
    "load",
    "save",
    "spec",
    "specs",
]
