"""Parameter counts of every drafter family, from a target's architecture config alone.

Modules are built on the meta device (no weights, no memory), so an 8B-class target costs
nothing. ``draftsmith drafters --params`` prints the table; :func:`parameter_rows` returns it.
Columns: trainable (what the optimizer updates), frozen (target-copied parts and, with LoRA,
the base weights), stored (what ``drafters.save`` writes: all but the parts copied from the
target on load), total (unique tensors, tied weights counted once).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..tables import markdown_table
from .common import count_parameters, placeholder_parts, text_config
from .dflash import DFlashConfig, meta_dflash
from .dflash2 import DFlash2Config
from .draft_lm import DraftLMConfig, draft_arch
from .eagle1 import Eagle1Config, build_eagle1
from .eagle3 import Eagle3Config
from .medusa import MedusaConfig, build_medusa
from .peagle import PEagleConfig

# Architecture configs written from the models' published config.json (no hub access needed;
# tests/archs/ holds the two 8B config.json files and a test checks these values against them).
SMOLLM2_135M: dict[str, Any] = dict(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
)
LLAMA_31_8B: dict[str, Any] = dict(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    tie_word_embeddings=False,
)

QWEN3_8B: dict[str, Any] = dict(
    model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
)

TARGETS: dict[str, dict[str, Any]] = {"SmolLM2-135M": SMOLLM2_135M, "Llama-3.1-8B": LLAMA_31_8B, "Qwen3-8B": QWEN3_8B}

# (label, config) rows per target: the shipped recipe's drafter plus common variants.
VARIANTS: dict[str, list[tuple[str, Any]]] = {
    "SmolLM2-135M": [
        ("draft_lm: first 4 layers, frozen tied embedding", DraftLMConfig(num_layers=4)),
        ("draft_lm: 4 layers + LoRA r=16 (all linear)", DraftLMConfig(num_layers=4, lora_rank=16)),
        ("eagle1", Eagle1Config()),
        ("eagle3: full vocabulary (49152)", Eagle3Config()),
        ("eagle3: draft vocabulary 16384", Eagle3Config(draft_vocab_size=16384)),
        ("medusa: 4 heads x 1 block", MedusaConfig(num_heads=4, num_layers=1)),
        ("dflash: 3 layers, block 8 (the recipe's)", DFlashConfig(num_layers=3)),
        ("dflash: 5 layers, block 16", DFlashConfig(num_layers=5, block_size=16)),
        ("dflash2: 3 layers, block 8, selector rank 256 (the recipe's)", DFlash2Config(num_layers=3)),
        ("peagle: full vocabulary (49152), 8 depths (the recipe's)", PEagleConfig(feature_layers=[1, 14, 26])),
    ],
    "Llama-3.1-8B": [
        ("draft_lm: first 4 layers, frozen embedding/lm_head", DraftLMConfig(num_layers=4)),
        ("draft_lm: 4 layers, width 2048 (random layers)", DraftLMConfig(num_layers=4, hidden_size=2048, layer_init="random")),
        ("eagle1", Eagle1Config()),
        ("eagle3: draft vocabulary 32000", Eagle3Config(draft_vocab_size=32000)),
        ("medusa: 4 heads x 1 block", MedusaConfig(num_heads=4, num_layers=1)),
        ("dflash: 5 layers, block 16", DFlashConfig(num_layers=5, block_size=16)),
    ],
    "Qwen3-8B": [
        ("draft_lm: first 4 layers, frozen embedding/lm_head", DraftLMConfig(num_layers=4)),
        ("eagle3: draft vocabulary 32000", Eagle3Config(draft_vocab_size=32000)),
        ("dflash: 5 layers, block 16 (z-lab/Qwen3-8B-DFlash-b16's shape)", DFlashConfig(num_layers=5, block_size=16)),
    ],
}


def arch_config(values: dict[str, Any]) -> Any:
    """The HF config of a target from its architecture values (``model_type`` picks the class)."""
    from transformers import AutoConfig

    rest = {k: v for k, v in values.items() if k != "model_type"}
    return AutoConfig.for_model(values["model_type"], **rest)


def target_parameters(arch: Any) -> int:
    """Parameters of the target itself (meta device, tied weights once)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return count_parameters(AutoModelForCausalLM.from_config(arch))["total"]


def meta_module(config: Any, arch: Any) -> nn.Module:
    """The drafter module ``config`` would build for a target with HF config ``arch``, on the meta device."""
    with torch.device("meta"):
        if isinstance(config, Eagle1Config):
            return build_eagle1(arch, placeholder_parts(arch))
        if isinstance(config, Eagle3Config):  # P-EAGLE's too (its own head class)
            tc = text_config(arch)
            cfg = config.resolve_for(int(tc.num_hidden_layers), int(tc.vocab_size))
            return cfg.new_head(arch, placeholder_parts(arch).embed, config.draft_vocab_size)
        if isinstance(config, MedusaConfig):
            return build_medusa(arch, placeholder_parts(arch).norm, config.num_heads, config.num_layers)
        if isinstance(config, DraftLMConfig):
            return _meta_draft_lm(config, arch)
    if isinstance(config, DFlashConfig):
        return meta_dflash(config, arch)
    raise TypeError(f"no parameter count for {type(config).__name__}")


def _meta_draft_lm(config: DraftLMConfig, arch: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    tie = arch.tie_word_embeddings if config.tie_embeddings is None else config.tie_embeddings
    cfg = draft_arch(arch, config.num_layers, config.hidden_size, config.intermediate_size,
                     config.num_attention_heads, config.num_key_value_heads, tie)
    model = AutoModelForCausalLM.from_config(cfg)
    if config.freeze_embeddings:
        model.get_input_embeddings().requires_grad_(False)
        model.get_output_embeddings().requires_grad_(False)
    if config.lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                                                 target_modules=list(config.lora_targets)))
    return model


def count(config: Any, arch: Any) -> dict[str, int]:
    """trainable / frozen / stored / total parameters of ``config``'s drafter for target ``arch``."""
    module = meta_module(config, arch)
    counts = count_parameters(module)
    seen: set[int] = set()
    copied = 0
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in seen and name.startswith(config.target_parts):
            copied += p.numel()
        seen.add(id(p))
    return {**counts, "stored": counts["total"] - copied}


def parameter_rows() -> list[dict[str, Any]]:
    """One row per (target, drafter variant), plus the target itself."""
    rows = []
    for target, values in TARGETS.items():
        arch = arch_config(values)
        own = target_parameters(arch)
        rows.append({"target": target, "drafter": "(the target itself)", "trainable": 0, "frozen": own, "stored": 0, "total": own})
        for label, config in VARIANTS[target]:
            rows.append({"target": target, "drafter": label, **count(config, arch)})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A Markdown table, counts in millions."""
    counts = ("trainable", "frozen", "stored", "total")
    return "\n".join(markdown_table(["target", "drafter", *counts],
                                    [[r["target"], r["drafter"], *(f"{r[k] / 1e6:,.1f}M" for k in counts)] for r in rows],
                                    left=2))
