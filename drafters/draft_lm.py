"""Standalone draft LM: a small causal LM that shares the target's tokenizer.

Two ways to get one:

* **from the target's own config** (default): the same architecture class with ``num_layers``
  layers, optionally narrower (``hidden_size``). At the target's width, ``layer_init: copy``
  starts from the target's FIRST n layers (as layer-skip drafting does), and the embedding,
  final norm and lm_head are copies of the target's (untrained, an early exit drafts poorly:
  see the layer-skip depth sweep in benchmarks/RESULTS.md).
  Narrower, the layers start random and the embedding / lm_head are the target's projected
  onto their top ``hidden_size`` principal directions: with P [H, h] the top eigenvectors of
  EᵀE, the draft embedding is E·P (and the lm_head W·P_W, P_W from WᵀW; a tied draft uses
  E·P for both). Embedding and lm_head are tied iff ``tie_embeddings`` (default: as the target).
* **an existing small pretrained model** (``pretrained``: hub id or local folder) whose
  tokenizer vocabulary equals the target's (checked; refused otherwise).

``freeze_embeddings`` freezes the embedding and lm_head. ``lora_rank > 0`` wraps the model with
peft LoRA adapters on ``lora_targets``: only the adapters train; :func:`merged_model` merges
them for export (a checkpoint keeps them separate, so save → load is bit-exact).

Training API (stable)::

    config = DraftLMConfig(num_layers=4)
    model = config.build_module(target)   # a HF causal LM (a peft PeftModel with LoRA)
    logits = model(input_ids=ids, attention_mask=mask).logits   # ids [B,S] → [B,S,V]; row t predicts x_{t+1}
    drafters.save(folder, config, model, target)   # config.json + model.safetensors (all weights, LoRA separate)
    drafter = config.runtime(model, target)        # DraftLMDrafter: the decoder's view of it

At decoding time it is an ordinary HF causal LM driven by ``hf_lm.HFDrafter``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from ..errors import ConfigError, DraftsmithError
from ..target import Target
from .common import place, seeded, text_config
from .hf_lm import HFDrafter, load_same_vocab_lm

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class DraftLMDrafter(HFDrafter):
    """``HFDrafter`` over a trainable draft LM, carrying its module and config (what export reads)."""

    def __init__(self, module: nn.Module, config: Any):
        super().__init__(module)
        self.module = module
        self.config = config


def layer_sources(num_layers: int, target_layers: int) -> list[int]:
    """Target layer each draft layer starts from: the first ``num_layers`` (≤ target_layers)."""
    return list(range(min(num_layers, target_layers)))


def principal_projection(weight: Tensor, width: int) -> Tensor:
    """[H, width]: the top ``width`` eigenvectors of weightᵀ·weight (weight [V, H]), float32."""
    w = weight.detach().float()
    _, vecs = torch.linalg.eigh(w.T @ w)  # ascending eigenvalues
    return vecs[:, -width:].flip(-1)


def draft_arch(
    arch: Any, num_layers: int, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, tie: bool
) -> Any:
    """The draft's HF config: the target's, with fewer layers and optionally narrower."""
    tc = text_config(arch)
    big = int(tc.hidden_size)
    h = hidden_size or big
    cfg = copy.deepcopy(tc)
    cfg.num_hidden_layers = num_layers
    cfg.tie_word_embeddings = tie
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in layer_sources(num_layers, int(tc.num_hidden_layers))]
    if h == big and not (intermediate_size or num_heads or num_kv_heads):
        return cfg
    heads = num_heads or max(1, round(int(tc.num_attention_heads) * h / big))
    kv_ratio = int(tc.num_attention_heads) // int(getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads)
    kv = num_kv_heads or max(1, heads // kv_ratio)
    if h % heads:
        raise ConfigError(f"drafter.num_attention_heads = {heads} does not divide drafter.hidden_size = {h}")
    if heads % kv:
        raise ConfigError(f"drafter.num_key_value_heads = {kv} does not divide drafter.num_attention_heads = {heads}")
    cfg.hidden_size = h
    cfg.num_attention_heads = heads
    cfg.num_key_value_heads = kv
    cfg.head_dim = h // heads
    cfg.intermediate_size = intermediate_size or max(1, round(int(tc.intermediate_size) * h / big))
    return cfg


def build_draft_lm(
    target_model: nn.Module,
    num_layers: int,
    hidden_size: int = 0,
    intermediate_size: int = 0,
    num_heads: int = 0,
    num_kv_heads: int = 0,
    layer_init: str = "copy",
    tie: bool | None = None,
    seed: int = 0,
) -> nn.Module:
    """A draft causal LM from the target's config (see the module docstring), on CPU in float32."""
    tc = text_config(target_model.config)
    tie = bool(getattr(tc, "tie_word_embeddings", False)) if tie is None else tie
    cfg = draft_arch(target_model.config, num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, tie)
    with seeded(seed):
        model = type(target_model)(cfg).float()
    own_embed = target_model.get_input_embeddings().weight
    own_head = target_model.get_output_embeddings().weight
    with torch.no_grad():
        if cfg.hidden_size == tc.hidden_size:
            model.get_input_embeddings().weight.copy_(own_embed)
            if not tie:
                model.get_output_embeddings().weight.copy_(own_head)
        else:
            model.get_input_embeddings().weight.copy_(own_embed.float() @ principal_projection(own_embed, cfg.hidden_size))
            if not tie:
                model.get_output_embeddings().weight.copy_(own_head.float() @ principal_projection(own_head, cfg.hidden_size))
        if layer_init == "copy":
            src_layers = target_model.get_decoder().layers
            for i, j in enumerate(layer_sources(num_layers, int(tc.num_hidden_layers))):
                model.get_decoder().layers[i].load_state_dict(src_layers[j].state_dict())
            model.get_decoder().norm.load_state_dict(target_model.get_decoder().norm.state_dict())
    model.generation_config = copy.deepcopy(target_model.generation_config)
    return model


def merged_model(module: nn.Module) -> nn.Module:
    """A plain HF causal LM for export: LoRA adapters merged into a copy (the module itself untouched)."""
    if hasattr(module, "merge_and_unload"):
        return copy.deepcopy(module).merge_and_unload()
    return module


@dataclass
class DraftLMConfig:
    """A small causal LM sharing the target's tokenizer: fewer target layers (or narrower), or pretrained; optional LoRA."""

    type: Literal["draft_lm"] = "draft_lm"
    pretrained: str = ""
    """Hub id or local folder of a small causal LM with the target's vocabulary; empty = build from the target."""
    num_layers: int = 4
    """Decoder layers of a draft built from the target (1 … the target's layers); unused with pretrained."""
    hidden_size: int = 0
    """Width of a draft built from the target; 0 = the target's. Narrower drafts start with random layers."""
    intermediate_size: int = 0
    """MLP width; 0 = the target's, scaled by hidden_size / target width."""
    num_attention_heads: int = 0
    """0 = the target's (scaled with the width, keeping head_dim when possible)."""
    num_key_value_heads: int = 0
    """0 = keep the target's query/key-value head ratio."""
    layer_init: Literal["copy", "random"] = "copy"
    """copy: layers and final norm start from the target's first num_layers layers (needs the target's width)."""
    tie_embeddings: bool | None = None
    """Tie embedding and lm_head; null = as the target does."""
    freeze_embeddings: bool = True
    """Keep the embedding and lm_head frozen during training."""
    lora_rank: int = 0
    """> 0: train LoRA adapters of this rank only (peft), merged on export."""
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Module names that get LoRA adapters."""
    seed: int = 0
    """Seed of the random initialization."""

    target_parts: ClassVar[tuple[str, ...]] = ()
    """Nothing is re-attached from the target: a draft LM checkpoint is a complete model."""

    def validate(self) -> None:
        for name in ("num_layers",):
            if getattr(self, name) < 1:
                raise ConfigError(f"drafter.{name} = {getattr(self, name)} must be at least 1")
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "lora_rank"):
            if getattr(self, name) < 0:
                raise ConfigError(f"drafter.{name} = {getattr(self, name)} must be ≥ 0 (0 = default)")
            if self.pretrained and name != "lora_rank" and getattr(self, name):
                raise ConfigError(f"drafter.{name} has no effect with drafter.pretrained (the model brings its own shape)")

    def check(self, target: Target) -> None:
        """Refuse a configuration that does not fit ``target`` (ConfigError naming the field)."""
        self.validate()
        if self.pretrained:
            return
        if self.num_layers > target.num_layers:
            raise ConfigError(
                f"drafter.num_layers = {self.num_layers} exceeds the target's {target.num_layers} layers; a draft LM is smaller"
            )
        if self.hidden_size > target.hidden_size:
            raise ConfigError(
                f"drafter.hidden_size = {self.hidden_size} is wider than the target ({target.hidden_size}); "
                f"use at most the target's width (0 = the same)"
            )
        if self.layer_init != "copy":
            return
        tc = text_config(target.config)
        for name, theirs in (("hidden_size", tc.hidden_size), ("intermediate_size", tc.intermediate_size),
                             ("num_attention_heads", tc.num_attention_heads),
                             ("num_key_value_heads", getattr(tc, "num_key_value_heads", tc.num_attention_heads))):
            if getattr(self, name) not in (0, int(theirs)):
                raise ConfigError(
                    f"drafter.layer_init = copy starts from the target's layers, so drafter.{name} must be 0 or the "
                    f"target's ({theirs}), not {getattr(self, name)}; use layer_init: random for another shape"
                )

    def build(self, target: Target) -> DraftLMDrafter:
        return self.runtime(self.build_module(target), target)

    def build_module(self, target: Target) -> nn.Module:
        """A fresh draft LM on the target's device and dtype, trainable flags set (LoRA wrapped)."""
        self.check(target)
        if self.pretrained:
            model = self._pretrained(target)
        else:
            model = build_draft_lm(
                target.model, self.num_layers, self.hidden_size, self.intermediate_size, self.num_attention_heads,
                self.num_key_value_heads, self.layer_init, self.tie_embeddings, self.seed,
            )
        return self._finish(model, target)

    def _pretrained(self, target: Target) -> nn.Module:
        return load_same_vocab_lm(self.pretrained, target, what=f"drafter.pretrained = '{self.pretrained}'")

    def _finish(self, model: nn.Module, target: Target) -> nn.Module:
        """Freeze embeddings as configured, wrap LoRA, place on the target's device/dtype."""
        model = place(model, target.device, target.dtype)
        model.requires_grad_(True)
        if self.freeze_embeddings:
            model.get_input_embeddings().requires_grad_(False)
            model.get_output_embeddings().requires_grad_(False)
        if self.lora_rank:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=self.lora_rank, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                              target_modules=list(self.lora_targets), bias="none")
            with seeded(self.seed):
                model = get_peft_model(model, lora)
            model = place(model, target.device, target.dtype)
        return model

    def module_for_checkpoint(self, target: Target, meta: dict[str, Any]) -> nn.Module:
        """The saved architecture (``hf_config`` in config.json), weights to be loaded into it."""
        from transformers import AutoConfig, AutoModelForCausalLM

        hf = dict(meta.get("hf_config") or {})
        if "model_type" not in hf:
            raise DraftsmithError("this draft LM checkpoint lacks hf_config in config.json; re-save it")
        arch = AutoConfig.for_model(hf.pop("model_type"), **hf)
        with seeded(self.seed):
            model = AutoModelForCausalLM.from_config(arch).float()
        return self._finish(model, target)

    def runtime(self, module: nn.Module, target: Target) -> DraftLMDrafter:
        return DraftLMDrafter(module, self)

    def checkpoint_meta(self, module: nn.Module) -> dict[str, Any]:
        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        return {"hf_config": base.config.to_dict()}
