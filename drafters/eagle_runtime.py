"""The runtime drafter of EAGLE-1 and EAGLE-3 heads: chain drafting from target features.

Alignment (both heads): cache row s pairs the target feature f_s (hidden state at position
s) with token x_{s+1} and sits at position s; its output predicts f_{s+1} and x_{s+2}.

State after every ``update``: the committed tokens x_0 … x_n and the target features
f_0 … f_{n-1} (the decoder's invariant), of which rows 0 … ``rows``-1 are in the head's KV
cache — always computed from TRUE target features. ``propose(k)``:

1. crops the cache back to its true rows (drafted rows of the last round used the head's
   own predicted features, so even accepted ones are recomputed — EAGLE does the same);
2. runs the pending rows (features that arrived since, paired with the next tokens) in one
   forward; the last row's output gives the first draft's logits and its predicted feature;
3. chains: row n+i pairs the predicted feature with draft d_{i+1} at position n+i, and
   its output gives the next draft.

The probabilities q are over the target's full vocabulary (``module.target_logits`` maps a
reduced EAGLE-3 vocabulary back, −inf elsewhere), exactly the distribution each draft
was sampled from, so the decoder's accept rule stays lossless.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..decode.protocol import Proposal, draft_chain
from ..decode.sampling import Warp
from ..errors import DraftsmithError
from ..target import crop_cache
from .common import check_features


class EagleDrafter:
    """Drafter protocol over an EAGLE head (``Eagle1Head`` or ``Eagle3Head``).

    module: the head; it provides ``new_cache()``, ``forward(input_ids, hidden, position_ids=,
    cache=) -> (hidden [1,S,H], logits [1,S,V'])`` and ``target_logits(logits [..,V']) -> [..,V]``.
    feature_layers: the target layers the decoder must return (resolved, 0-based).
    config / target_info: what ``drafters.save`` writes next to the weights.
    """

    def __init__(self, module: nn.Module, feature_layers: tuple[int, ...], config: Any, target_info: dict[str, Any]):
        self.module = module
        self.feature_layers = tuple(feature_layers)
        self.config = config
        self.target_info = target_info
        self.reset()

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.module.fc.weight.dtype

    def reset(self) -> None:
        self.cache: Any = self.module.new_cache()
        self.tokens: list[int] = []
        self.num_features = 0
        self.rows = 0  # rows in the cache computed from true features
        self._pending: list[Tensor] = []  # [m, F] feature blocks not yet in the cache
        self._last: tuple[Tensor, Tensor] | None = None  # (hidden [1,1,H], logits [V']) of the last true row

    def update(self, tokens: Tensor, features: Tensor | None) -> None:
        """Append committed tokens [m'] and the target features [m, F] of committed positions."""
        self.tokens.extend(tokens.tolist())
        if features is not None and features.shape[0] > 0:
            self._pending.append(features)
            self.num_features += features.shape[0]
        check_features("EAGLE", len(self.tokens), self.num_features, self.feature_layers)

    @torch.inference_mode()
    def propose(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal:
        crop_cache(self.cache, self.rows)
        if self._pending:
            feats = torch.cat(self._pending).to(device=self.device, dtype=self.dtype)  # [m, F]
            self._pending = []
            m = feats.shape[0]
            # row s pairs f_s with x_{s+1}
            ids = torch.tensor([self.tokens[self.rows + 1 : self.rows + 1 + m]], device=self.device)  # [1, m]
            hidden, logits = self._step(ids, feats[None], self.rows)
            self.rows += m
            self._last = (hidden[:, -1:], logits[0, -1])
        if self._last is None:
            raise DraftsmithError("EAGLE drafter asked to propose before any target features arrived")
        hidden, logits = self._last
        position = self.rows

        def step(token: int) -> Tensor:
            nonlocal hidden, position
            ids = torch.tensor([[token]], device=self.device)
            hidden, out = self._step(ids, hidden, position)  # predicted feature in, next one out
            position += 1
            return self.module.target_logits(out[0, -1])

        return draft_chain(step, self.module.target_logits(logits), k, warp, generator)

    def _step(self, ids: Tensor, hidden: Tensor, start: int) -> tuple[Tensor, Tensor]:
        positions = torch.arange(start, start + ids.shape[1], device=self.device)[None]  # [1, S]
        return self.module(ids, hidden, position_ids=positions, cache=self.cache)
