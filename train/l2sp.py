"""An L2 pull of the drafter's trainable weights toward the weights training started from (``train.l2sp_weight``).

L2-SP (Li et al. 2018, "Explicit inductive bias for transfer learning"): where a drafter starts from trained weights
(EAGLE-3's ``drafter.init_from_layer``: the target's own decoder layer, fc passing a feature through, the target's
lm_head rows), weight decay toward zero pulls it away from what it was given; this term pulls it back toward it
instead, so a head trained on little data keeps more of the layer it started as::

    R = ½ · λ · Σ_p ‖p − p₀‖²        (p₀: the weights before the first step, float32)

added once per optimizer step to the mean token loss (``train/step.py`` adds R / scale to every micro-batch's
summed loss, so that after DeepSpeed's 1/gas and its average over ranks the step's gradient gains exactly
λ·(p − p₀)). It is a coupled penalty: Adam normalizes its gradient with the data's.

The start is taken from the engine's module before a checkpoint is restored, so a resumed run pulls toward the same
weights its first session started from (the fresh module is built deterministically from the recipe's seed and the
target). Every rank holds the whole drafter under ZeRO 0–2 and keeps its own copy; ZeRO-3 partitions the weights
and is refused (``setup.start``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor


class L2SP:
    """The start of ``module``'s trainable parameters and the penalty of weight ``weight`` (λ > 0) toward it."""

    def __init__(self, module: torch.nn.Module, weight: float):
        self.module, self.weight = module, weight
        self.start = {name: p.detach().float().clone() for name, p in self._trainable()}
        """Parameter name → float32 copy of its weights before the first step, on the parameter's device."""

    def _trainable(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return ((name, p) for name, p in self.module.named_parameters() if p.requires_grad)

    def _squared(self) -> Tensor:
        """Σ ‖p − p₀‖² over every trainable parameter, float32."""
        return sum(((p.float() - self.start[name]) ** 2).sum() for name, p in self._trainable())

    def penalty(self) -> Tensor:
        """R = ½ λ Σ ‖p − p₀‖² as a scalar float32 tensor with a gradient to the module's parameters."""
        return 0.5 * self.weight * self._squared()

    @torch.no_grad()
    def distance(self) -> float:
        """‖w − w₀‖ over every trainable parameter: how far training has moved the drafter (logged)."""
        return float(self._squared()) ** 0.5
