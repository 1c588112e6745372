"""Counting a module's forward calls: how many, the tokens they fed and the seconds spent inside them."""

from __future__ import annotations

import time
from typing import Any

import torch


class ForwardCounter:
    """Forward calls of a module, the tokens they fed and the seconds spent inside them (to show two
    speculative methods verify as often, and how much of their time is their own loop's)."""

    def __init__(self, module: torch.nn.Module):
        self.calls, self.tokens, self.seconds, self._t0 = 0, 0, 0.0, 0.0
        self._handles = [module.register_forward_pre_hook(self._pre, with_kwargs=True),
                         module.register_forward_hook(self._post)]

    def _pre(self, _module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls += 1
        self.tokens += int(ids.shape[1]) if ids is not None else 0
        self._t0 = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self._t0

    def take(self) -> tuple[int, int, float]:
        """(calls, tokens fed, seconds inside) since the last take."""
        out = (self.calls, self.tokens, self.seconds)
        self.calls, self.tokens, self.seconds = 0, 0, 0.0
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
