"""An exponential moving average of the drafter's trainable weights (``train.ema_decay``).

After optimizer step n = 1, 2, … the shadow holds the bias-corrected average of the weights w_1 … w_n the steps
left behind::

    s_n = Σ_{i≤n} d^{n−i} w_i / Σ_{i≤n} d^{n−i}

kept directly by s_n = β_n·s_{n−1} + (1 − β_n)·w_n with β_n = d·(1 − d^{n−1}) / (1 − d^n): Adam's bias correction
folded into the decay, so β_1 = 0 (s_1 = w_1: the untrained weights never enter) and β_n → d. The common warm-up
min(d, (1 + n)/(10 + n)) would not do here: it stays below d = 0.99 until step 890, so on a run of a few hundred
steps the decay asked for would never be the one used. Before the first step the shadow is the initial weights.

The shadow is float32 on the weights' device, one tensor per trainable parameter of the engine's module, by the
module's names. Every rank keeps its own and updates it from its own module: under ZeRO 0–2 every rank holds the
whole drafter and the same weights after each step (DeepSpeed's data parallelism), so the shadows agree without a
collective; ZeRO-3 partitions the weights and is refused (``setup.start``). In a bf16 engine the module holds bf16
copies of the optimizer's fp32 master weights, and it is those the shadow averages (in fp32; the average is rounded
to bf16 again only when it is put into the module).

Nothing here imports DeepSpeed: ``applied()`` copies the shadow into the module's parameters in place (their
storage may be a view into an engine's flat buffer) and copies the module's own weights back, bit for bit, after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from ..errors import DraftsmithError


class EMA:
    """The shadow of ``module``'s trainable parameters, with ``decay`` d in (0, 1)."""

    def __init__(self, module: torch.nn.Module, decay: float):
        self.module, self.decay, self.updates = module, decay, 0
        self.shadow = {name: p.detach().float().clone() for name, p in self._trainable()}
        """Parameter name → float32 shadow, on the parameter's device."""

    def _trainable(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return ((name, p) for name, p in self.module.named_parameters() if p.requires_grad)

    @torch.no_grad()
    def update(self) -> None:
        """Fold the module's current weights in: call once after every optimizer step."""
        self.updates += 1
        keep = keep_share(self.decay, self.updates)
        for name, p in self._trainable():
            self.shadow[name].mul_(keep).add_(p.detach().float(), alpha=1.0 - keep)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Inside the block the module holds the averaged weights (in its own dtype); after it, its own weights again,
        bit for bit. Every rank enters together (each swaps its own copy)."""
        with torch.no_grad():
            own = {name: p.detach().clone() for name, p in self._trainable()}
            for name, p in self._trainable():
                p.copy_(self.shadow[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self._trainable():
                    p.copy_(own[name])

    def state_dict(self) -> dict[str, Tensor]:
        """The shadow on the CPU, by parameter name (what a checkpoint stores)."""
        return {name: s.detach().cpu().contiguous() for name, s in self.shadow.items()}

    @torch.no_grad()
    def load_state_dict(self, saved: dict[str, Tensor], updates: int, where: str) -> None:
        """Take the shadow ``saved`` (after ``updates`` optimizer steps) from the checkpoint ``where``; its names and
        shapes must be this module's trainable parameters."""
        if set(saved) != set(self.shadow):
            missing, extra = sorted(set(self.shadow) - set(saved)), sorted(set(saved) - set(self.shadow))
            raise DraftsmithError(f"checkpoint '{where}' holds EMA weights of another drafter (missing {missing[:3]}, "
                                  f"unexpected {extra[:3]}); resume it with the drafter it was made with")
        for name, s in self.shadow.items():
            if saved[name].shape != s.shape or saved[name].dtype != torch.float32:
                raise DraftsmithError(f"checkpoint '{where}': the EMA weight {name} is {tuple(saved[name].shape)} "
                                      f"{saved[name].dtype}, the drafter's is {tuple(s.shape)} float32; it is damaged")
            s.copy_(saved[name])
        self.updates = updates


def keep_share(decay: float, n: int) -> float:
    """β_n: the share of the shadow kept at update n (module docstring); 0 at n = 1, → ``decay``."""
    return decay * (1.0 - decay ** (n - 1)) / (1.0 - decay**n)
