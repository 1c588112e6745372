"""The runtime drafter of EAGLE-1 and EAGLE-3 heads (each speaks :class:`EagleHead`): chain and tree drafting
from target features.

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

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ..decode.protocol import Proposal, ReducedVocab, draft_chain
from ..decode.sampling import Warp
from ..decode.tree import DraftTree, TreeShape, build_tree
from ..errors import DraftsmithError
from ..target import crop_cache
from .common import FeatureDrafter


@runtime_checkable
class EagleHead(Protocol):
    """What :class:`EagleDrafter` calls on its head: ``Eagle1Head``, ``Eagle3Head`` and ``PEagleHead`` (an EAGLE-3
    head) each provide it. Like the decoder's abilities (``decode/protocol.py``), one small protocol; it lives here,
    beside its one caller, since the decoder never sees a head. An EAGLE-3 head also has ``draft_ids`` [Vd] and
    ``t2d`` [V] (its reduced vocabulary, drafted in: ``reset``); EAGLE-1's speaks the full vocabulary."""

    fc: nn.Linear
    """The feature projection; its weight gives the runtime's device and dtype."""

    def new_cache(self) -> Any:
        """An empty decoding cache (a layer per decoder layer of the head), extended in place by ``forward``."""
        ...

    def forward(self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor | None = None,
                attention_mask: Tensor | None = None, cache: Any = None, logits_to_keep: int = 0) -> tuple[Tensor, Tensor]:
        """input_ids [1, S] and hidden [1, S, F] (target features, F = the feature layers' widths together, or the
        head's own output, F = H) → (the head's output [1, S, H], logits [1, S', V']). attention_mask: [1, past + S]
        or a 4-D additive mask over the cache (trees); logits_to_keep: 0 = every row's logits (S' = S), n = the last
        n rows' only. Called as ``module(...)`` (``nn.Module.__call__``)."""
        ...

    def target_logits(self, logits: Tensor) -> Tensor:
        """[..., V'] logits over the head's vocabulary → [..., V] over the target's (−inf outside a reduced one)."""
        ...


class EagleDrafter(FeatureDrafter):
    """Drafter protocol over an EAGLE head (:class:`EagleHead`); constructed as :class:`~.common.FeatureDrafter`.

    module: the head. feature_layers: the target layers the decoder must return (resolved, 0-based).
    config: the family config the head was built from, resolved (``None`` for a head read from an export).
    """

    kind = "EAGLE"
    module: EagleHead

    @property
    def dtype(self) -> torch.dtype:
        return self.module.fc.weight.dtype

    def reset(self) -> None:
        self.reset_committed()
        self.cache: Any = self.module.new_cache()
        self.rows = 0  # rows in the cache computed from true features
        self._last: tuple[Tensor, Tensor] | None = None  # (hidden [1,1,H], logits [V']) of the last true row
        ids = getattr(self.module, "draft_ids", None)  # EAGLE-3's draft vocabulary (EAGLE-1: the full one)
        self._vocab = None if ids is None else ReducedVocab.of(ids, int(self.module.t2d.shape[0]))

    @torch.inference_mode()
    def propose(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal:
        hidden, logits = self._catch_up()
        position = self.rows

        vocab = self._vocab  # EAGLE-3: logits over its draft vocabulary, drafted there

        def step(token: int) -> Tensor:
            nonlocal hidden, position
            ids = torch.tensor([[token]], device=self.device)
            hidden, out = self._step(ids, hidden, position)  # predicted feature in, next one out
            position += 1
            return out[0, -1] if vocab is not None else self.module.target_logits(out[0, -1])

        if vocab is None:
            return draft_chain(step, self.module.target_logits(logits), k, warp, generator, stop_below=self.stop_below)
        return draft_chain(step, logits, k, warp, generator, vocab, stop_below=self.stop_below)

    @torch.inference_mode()
    def propose_tree(self, shape: TreeShape, warp: Warp, generator: torch.Generator | None,
                     min_confidence: float = 0.0) -> DraftTree:
        """A draft tree (static, or EAGLE-2's dynamic one), one head forward per level of new nodes.

        A node at depth d reads its parent's predicted feature (the root's: the last true row's) at
        position rows + d − 1, as the d-th draft of a chain would, and attends to the true rows and
        the drafted rows of its own ancestors only (a 4-D mask over the head's cache).
        """
        hidden0, logits0 = self._catch_up()
        base = self.rows
        predicted: dict[int, Tensor] = {}  # node → its output feature [1, 1, H]
        cache_row: dict[int, int] = {}  # node → its row in the head's cache
        depth: dict[int, int] = {}

        def expand(new: list[int], tokens: list[int], parents: list[int]) -> Tensor:
            past = self.cache.get_seq_length()
            allowed = torch.zeros(len(new), past + len(new), dtype=torch.bool, device=self.device)
            allowed[:, :base] = True  # rows from true features
            for j, node in enumerate(new):
                parent = parents[node]
                depth[node] = 1 if parent < 0 else depth[parent] + 1
                while parent >= 0:
                    allowed[j, cache_row[parent]] = True
                    parent = parents[parent]
                allowed[j, past + j] = True
                cache_row[node] = past + j
            ids = torch.tensor([[tokens[n] for n in new]], device=self.device)  # [1, S]
            hidden = torch.cat([predicted[parents[n]] if parents[n] >= 0 else hidden0 for n in new], dim=1)  # [1, S, H]
            positions = torch.tensor([[base + depth[n] - 1 for n in new]], device=self.device)  # [1, S]
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
            mask = mask.masked_fill(~allowed, torch.finfo(self.dtype).min)[None, None]  # [1, 1, S, past+S]
            out, logits = self.module(ids, hidden, position_ids=positions, attention_mask=mask, cache=self.cache)
            for j, node in enumerate(new):
                predicted[node] = out[:, j : j + 1]
            return self.module.target_logits(logits[0])  # [S, V]

        return build_tree(shape, self.module.target_logits(logits0), expand, warp, generator,
                          min_confidence=min_confidence)

    def _catch_up(self) -> tuple[Tensor, Tensor]:
        """Drop last round's drafted rows, run the rows of features that arrived since; return the
        last true row's (predicted feature [1, 1, H], logits [V'])."""
        crop_cache(self.cache, self.rows)
        if self._pending:
            feats = torch.cat(self._pending).to(device=self.device, dtype=self.dtype)  # [m, F]
            self._pending = []
            m = feats.shape[0]
            # row s pairs f_s with x_{s+1}
            ids = torch.tensor([self.tokens[self.rows + 1 : self.rows + 1 + m]], device=self.device)  # [1, m]
            hidden, logits = self._step(ids, feats[None], self.rows, logits_to_keep=1)  # only the last row drafts
            self.rows += m
            self._last = (hidden[:, -1:], logits[0, -1])
        if self._last is None:
            raise DraftsmithError("EAGLE drafter asked to propose before any target features arrived")
        return self._last

    def _step(self, ids: Tensor, hidden: Tensor, start: int, logits_to_keep: int = 0) -> tuple[Tensor, Tensor]:
        positions = torch.arange(start, start + ids.shape[1], device=self.device)[None]  # [1, S]
        return self.module(ids, hidden, position_ids=positions, cache=self.cache, logits_to_keep=logits_to_keep)
