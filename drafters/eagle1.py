"""EAGLE-1 head (Li et al. 2024): one decoder layer that predicts the target's next feature.

Training API (stable; the training recipe calls exactly this)::

    head = Eagle1Config().build_module(target)          # Eagle1Head, on the target's device/dtype
    hidden, logits = head(input_ids, features, position_ids=None, attention_mask=None)

    input_ids      [B, S] long   row t holds x_{t+1}: pass shift_left(x, 1) (drafters.common)
    features       [B, S, H]     row t holds f_t = the target's output of its LAST decoder layer
                                 at position t (pre final norm; Target.forward(feature_layers=(N-1,)))
    position_ids   [B, S] long   default t (pass your own with left padding)
    attention_mask [B, S]        1 = real token, 0 = padding; default all real
    → hidden       [B, S, H]     row t predicts f_{t+1}     (feature-regression target)
    → logits       [B, S, V]     row t predicts x_{t+2}     (= lm_head(norm(hidden)), target's frozen norm/head)

so the target distribution for logits row t is the target's output at position t+1. All
outputs are in the head's dtype; softmax in float32 is the loss's business.

Architecture: ``fc(concat(embed(x_{t+1}), f_t))`` (2H → H, with bias, as EAGLE-1), then one
transformers ``LlamaDecoderLayer`` of the target's width (reused as is: its own input norm,
attention with the target's RoPE, MLP), read out through frozen copies of the target's final
norm and lm_head. The embedding is a frozen copy of the target's. Trainable: ``fc`` and
``layers.0`` only. Parameter names follow EAGLE-1 checkpoints (``fc.*``, ``layers.0.*``).

One deliberate difference from the EAGLE-1 code: there the feature is the target's
*post-norm* last hidden state, read out by lm_head alone. Here it is the *pre-norm* output of
the last layer (draftsmith's feature convention, shared with the feature cache) read out by
norm + lm_head; both give the target's own logits when the feature is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from ..errors import DraftsmithError
from ..target import Target
from .common import (
    TargetParts,
    draft_layer_config,
    frozen_target_parts,
    place,
    seeded,
    single_layer_cache,
    step_inputs,
)
from .eagle_runtime import EagleDrafter


class Eagle1Head(nn.Module):
    """fc → LlamaDecoderLayer → (frozen) norm → (frozen) lm_head. Shapes in the module docstring; the runtime drafts
    through its :class:`~.eagle_runtime.EagleHead` surface (``new_cache``, ``forward``, ``target_logits``)."""

    def __init__(self, parts: TargetParts, layer_config: Any, fc_bias: bool = True):
        """parts: frozen target embedding / final norm / lm_head; layer_config: a one-layer LlamaConfig."""
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        h = int(layer_config.hidden_size)
        self.hidden_size = h
        self.layer_config = layer_config
        self.embed_tokens = parts.embed
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList([LlamaDecoderLayer(layer_config, layer_idx=0)])
        self.rotary_emb = LlamaRotaryEmbedding(layer_config)
        self.norm = parts.norm
        self.lm_head = parts.lm_head

    def new_cache(self) -> Any:
        return single_layer_cache(self.layer_config)

    def forward(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: Any = None,
        logits_to_keep: int = 0,
    ) -> tuple[Tensor, Tensor]:
        """input_ids [B,S], hidden [B,S,H] → (hidden_out [B,S,H], logits [B,S',V]).

        cache: a ``new_cache()`` extended in place (decoding); attention_mask then covers
        the cached rows too: [B, past + S]. logits_to_keep: 0 = every row's logits (S' = S), n = the
        last n rows' only.
        """
        if hidden.shape[-1] != self.hidden_size:
            raise DraftsmithError(
                f"EAGLE-1 head got features of width {hidden.shape[-1]}, expected {self.hidden_size} "
                f"(the target's last-layer hidden state)"
            )
        emb = self.embed_tokens(input_ids)  # [B, S, H]
        x = self.fc(torch.cat([emb, hidden.to(emb.dtype)], dim=-1))  # [B, S, H]
        position_ids, mask = step_inputs(x, input_ids.shape[1], cache, position_ids, attention_mask)
        cos_sin = self.rotary_emb(x, position_ids)
        out = self.layers[0](
            x,
            attention_mask=mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=cos_sin,
        )  # [B, S, H]
        return out, self.lm_head(self.norm(out[:, -logits_to_keep:]))

    def target_logits(self, logits: Tensor) -> Tensor:
        """The head already speaks the target's full vocabulary."""
        return logits


def build_eagle1(arch: Any, parts: TargetParts, seed: int = 0) -> Eagle1Head:
    """An EAGLE-1 head for a target with HF config ``arch``, around ``parts``; fc/layer seeded-random."""
    with seeded(seed):
        head = Eagle1Head(parts, draft_layer_config(arch))
    return head


@dataclass
class Eagle1Config:
    """EAGLE-1: fc(embedding, last-layer feature) + one Llama layer predicting the next feature."""

    type: Literal["eagle1"] = "eagle1"
    seed: int = 0
    """Seed of the random initialization of fc and the decoder layer."""

    target_parts: ClassVar[tuple[str, ...]] = ("embed_tokens.", "norm.", "lm_head.")
    """State-dict prefixes copied from the target (frozen), not stored in checkpoints."""

    def build(self, target: Target) -> EagleDrafter:
        return self.runtime(self.build_module(target), target)

    def build_module(self, target: Target) -> Eagle1Head:
        """A fresh head: frozen copies of the target's parts, seeded-random fc and layer."""
        head = build_eagle1(target.config, frozen_target_parts(target.model), self.seed)
        return place(head, target.device, target.dtype)

    def module_for_checkpoint(self, target: Target, meta: dict[str, Any]) -> Eagle1Head:
        return self.build_module(target)

    def runtime(self, module: Eagle1Head, target: Target) -> EagleDrafter:
        return EagleDrafter(module, (target.num_layers - 1,), self)

    def checkpoint_meta(self, module: nn.Module) -> dict[str, Any]:
        return {}
