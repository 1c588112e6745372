"""Medusa heads (Cai et al. 2024): K heads on the target's last hidden state, each predicting
one more token ahead, proposed as a chain without any extra target forward.

Training API (stable; the training recipe calls exactly this)::

    heads = MedusaConfig(num_heads=4).build_module(target)      # MedusaHeads
    logits = heads(features)                                    # [K, B, S, V]
    labels = medusa_labels(input_ids, heads.num_heads)          # [K, B, S], -100 = no label

    features [B, S, H]   f_t = the target's output of its LAST decoder layer at position t (pre
                         final norm; the heads apply a frozen copy of the target's final norm
                         first, so they read exactly what the target's lm_head reads)
    → logits[k, :, t]    predicts x_{t+k+2}: head 0 predicts the token AFTER the one the target
                         itself predicts from f_t (x_{t+1}), head k one more step ahead
    labels[k, :, t]      = x_{t+k+2}, or -100 past the end of the sequence

Memory: [K, B, S, V] logits can be large; ``heads.head_logits(k, heads.normalize(features))``
computes one head at a time. Each head is ``num_layers`` residual blocks ``x + SiLU(W x + b)``
(W starts at zero, as in Medusa) and a projection to the vocabulary initialized from the
target's lm_head. Every block and projection is its own module (Medusa's reference code
repeats ONE block object ``[ResBlock(H)] * n``, silently sharing its weights; a test checks
that no two parameters share storage here). Trainable: all but ``feature_norm``.

Decoding: after each update the drafter keeps the last feature it received, f_{n-1} (the
position whose target output was the last committed token x_n), and proposes
d_{i+1} ~ head_i(f_{n-1}) for i < min(k, K) — at most K drafts, each with its own q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from ..decode.protocol import Proposal, draft_chain
from ..decode.sampling import Warp
from ..decode.tree import DraftTree, TreeShape, build_tree
from ..errors import ConfigError, DraftsmithError
from ..target import Target
from .common import check_features, frozen_copy, place, seeded, target_parts, text_config

IGNORE = -100


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)); the weight starts at zero so a fresh block is near the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K independent heads over normalized target features. Shapes in the module docstring."""

    def __init__(self, feature_norm: nn.Module, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int):
        """feature_norm: frozen copy of the target's final norm."""
        super().__init__()
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.feature_norm = feature_norm
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)], nn.Linear(hidden_size, vocab_size, bias=False))
            for _ in range(num_heads)
        )

    def normalize(self, features: Tensor) -> Tensor:
        """[..., H] target features (pre-norm) → what the target's lm_head reads."""
        if features.shape[-1] != self.hidden_size:
            raise DraftsmithError(
                f"Medusa heads got features of width {features.shape[-1]}, expected {self.hidden_size} "
                f"(the target's last-layer hidden state)"
            )
        return self.feature_norm(features.to(self.heads[0][-1].weight.dtype))

    def head_logits(self, k: int, normed: Tensor) -> Tensor:
        """Head k on normalized features [..., H] → [..., V]."""
        return self.heads[k](normed)

    def forward(self, features: Tensor) -> Tensor:
        """features [B, S, H] → logits [K, B, S, V]."""
        normed = self.normalize(features)
        return torch.stack([head(normed) for head in self.heads])


def medusa_labels(input_ids: Tensor, num_heads: int, ignore_index: int = IGNORE) -> Tensor:
    """[B, S] tokens → [K, B, S] labels: labels[k, b, t] = input_ids[b, t+k+2], ignore_index past the end."""
    b, s = input_ids.shape
    out = input_ids.new_full((num_heads, b, s), ignore_index)
    for k in range(num_heads):
        shift = k + 2
        if shift < s:
            out[k, :, : s - shift] = input_ids[:, shift:]
    return out


class MedusaDrafter:
    """Drafter protocol over Medusa heads: K independent proposals from the last target feature."""

    def __init__(self, module: MedusaHeads, feature_layer: int, config: Any):
        self.module = module
        self.feature_layers = (feature_layer,)
        self.config = config
        self.reset()

    def reset(self) -> None:
        self.last: Tensor | None = None  # [H] the feature of the last position with one
        self.num_tokens = 0
        self.num_features = 0

    def update(self, tokens: Tensor, features: Tensor | None) -> None:
        self.num_tokens += tokens.shape[0]
        if features is not None and features.shape[0] > 0:
            self.last = features[-1]
            self.num_features += features.shape[0]
        check_features("Medusa", self.num_tokens, self.num_features, self.feature_layers)

    @torch.inference_mode()
    def propose(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal:
        if self.last is None:
            raise DraftsmithError("Medusa drafter asked to propose before any target features arrived")
        normed = self.module.normalize(self.last)  # [H]
        heads = iter(range(1, self.module.num_heads))
        # head i drafts token i from the same feature: the drafted tokens are not fed back
        return draft_chain(lambda _token: self.module.head_logits(next(heads), normed),
                           self.module.head_logits(0, normed), min(k, self.module.num_heads), warp, generator)

    @torch.inference_mode()
    def propose_tree(self, shape: TreeShape, warp: Warp, generator: torch.Generator | None,
                     min_confidence: float = 0.0) -> DraftTree:
        """A draft tree at most K deep: the children of every node at depth d come from head d (Medusa's
        heads read the last target feature only, so all nodes of a depth share one distribution)."""
        if self.last is None:
            raise DraftsmithError("Medusa drafter asked to propose before any target features arrived")
        normed = self.module.normalize(self.last)  # [H]
        heads: dict[int, Tensor] = {}

        def head(d: int) -> Tensor:
            if d not in heads:
                heads[d] = self.module.head_logits(d, normed)  # [V]
            return heads[d]

        def expand(new: list[int], tokens: list[int], parents: list[int]) -> Tensor:
            depth = [0] * len(parents)
            for i, p in enumerate(parents):
                depth[i] = 1 if p < 0 else depth[p] + 1
            return torch.stack([head(depth[n]) for n in new])  # [S, V]

        return build_tree(shape, head(0), expand, warp, generator, max_depth=self.module.num_heads,
                          min_confidence=min_confidence)


def build_medusa(arch: Any, feature_norm: nn.Module, num_heads: int, num_layers: int, seed: int = 0) -> MedusaHeads:
    """Medusa heads for a target with HF config ``arch``; random blocks, zero block weights."""
    tc = text_config(arch)
    with seeded(seed):
        return MedusaHeads(feature_norm, int(tc.hidden_size), int(tc.vocab_size), num_heads, num_layers)


@dataclass
class MedusaConfig:
    """Medusa: K heads of residual SiLU blocks on the last hidden state; head k predicts k+2 ahead."""

    type: Literal["medusa"] = "medusa"
    num_heads: int = 4
    """K: heads, i.e. the most tokens proposed per round (head k predicts k+1 tokens past the target's next)."""
    num_layers: int = 1
    """Residual SiLU blocks per head (0: the projection alone, the default of Medusa-2's training code)."""
    seed: int = 0
    """Seed of the random initialization of the block biases."""

    target_parts: ClassVar[tuple[str, ...]] = ("feature_norm.",)
    """State-dict prefixes copied from the target (frozen), not stored in checkpoints."""

    def validate(self) -> None:
        if self.num_heads < 1:
            raise ConfigError(f"drafter.num_heads = {self.num_heads}: Medusa needs at least 1 head")
        if self.num_layers < 0:
            raise ConfigError(f"drafter.num_layers = {self.num_layers}: a Medusa head has 0 or more residual blocks")

    def build(self, target: Target) -> MedusaDrafter:
        return self.runtime(self.build_module(target), target)

    def build_module(self, target: Target) -> MedusaHeads:
        """Fresh heads: frozen copy of the target's final norm, vocabulary projections = the target's lm_head."""
        self.validate()
        own = target_parts(target.model)
        heads = build_medusa(target.config, frozen_copy(own.norm), self.num_heads, self.num_layers, self.seed)
        heads = place(heads, target.device, target.dtype)
        with torch.no_grad():
            for head in heads.heads:
                head[-1].weight.copy_(own.lm_head.weight)
        return heads

    def module_for_checkpoint(self, target: Target, meta: dict[str, Any]) -> MedusaHeads:
        self.validate()
        heads = build_medusa(target.config, frozen_copy(target_parts(target.model).norm), self.num_heads, self.num_layers)
        return place(heads, target.device, target.dtype)

    def runtime(self, module: MedusaHeads, target: Target) -> MedusaDrafter:
        return MedusaDrafter(module, target.num_layers - 1, self)

    def checkpoint_meta(self, module: nn.Module) -> dict[str, Any]:
        return {}
