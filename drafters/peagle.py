"""P-EAGLE (parallel EAGLE, as vLLM's speculators 0.9.0 defines it): the EAGLE-3 head drafting K tokens in ONE
forward. After the last true row, K − 1 rows hold a mask token and a learned hidden state instead of a token and a
target feature; row d of them predicts the d-th token after the one the last true row predicts.

Module (:class:`PEagleHead`): :class:`~draftsmith.drafters.eagle3.Eagle3Head` — its names, norm options, layers and
draft vocabulary — plus ``mask_hidden`` [1, 1, 3H], a learned stand-in for the fused target features of a masked
row (it goes through the norms and ``fc`` as features do), and the mask token id (its frozen target embedding is what
the masked rows read). The EAGLE-3 weights are drawn first, then ``mask_hidden`` (N(0, 1), the reference's init), so
a P-EAGLE head of a seed holds the EAGLE-3 head of that seed.

Layout (the reference's names): an entry is (anchor a, depth d). Depth 0 is EAGLE-3's row a: the target feature f_a
with token x_{a+1}. Depth d ≥ 1 is the mask token with ``mask_hidden``. Entry (a, d) sits at position a + d and
predicts x_{a+d+2} (the target's distribution at position a + d + 1). It attends to every depth-0 entry of an anchor
≤ a (the true context) and to the entries of its own anchor of depth ≤ d (its rollout): :func:`parallel_attention_mask`.

Decoding (:class:`PEagleDrafter`): committed tokens x_0 … x_n with features f_0 … f_{n−1}; the pending true rows
(f_s, x_{s+1}) and K − 1 masked rows at positions n, n + 1, … run in one forward under a plain causal mask over the
head's cache — exactly the layout above for the rollout of anchor n − 1, the last true row. The last true row's logits
give draft 1, masked row d's give draft d + 1. No draft is fed back, so each q is fixed by the forward and sampling
each draft from its own q draws the chain from its law (DFlash's argument): the accept rule stays lossless. The
masked rows are cropped from the cache before the next round; the true rows stay.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from ..decode.protocol import Proposal, ReducedVocab, draft_block
from ..decode.sampling import Warp
from ..errors import ConfigError, DraftsmithError
from ..target import Target, crop_cache
from .common import FeatureDrafter, check_mask_token, default_mask_token, shift_left
from .eagle3 import Eagle3Config, Eagle3Head, build_eagle3


def parallel_attention_mask(anchor: Tensor, depth: Tensor) -> Tensor:
    """[B, 1, T, T] bool (True = attend): entry q sees entry k iff both are real (anchor ≥ 0) and either k is a
    depth-0 entry of an anchor ≤ q's (the true context) or k is in q's rollout (same anchor) at a depth ≤ q's.
    anchor, depth: [B, T] long (anchor −1 = a padding entry, which sees nothing)."""
    a_q, a_k = anchor[:, :, None], anchor[:, None, :]  # [B, T, 1], [B, 1, T]
    d_q, d_k = depth[:, :, None], depth[:, None, :]
    real = (a_q >= 0) & (a_k >= 0)
    context = (d_k == 0) & (a_k <= a_q)
    rollout = (a_k == a_q) & (d_k <= d_q)
    return (real & (context | rollout))[:, None]


def parallel_inputs(input_ids: Tensor, features: Tensor, mask_hidden: Tensor, anchor: Tensor, depth: Tensor,
                    mask_token_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """The head's inputs for entries (anchor, depth) [B, T] (module docstring) over a sequence ``input_ids`` [B, S]
    with target features [B, S, F]: (ids [B, T]: x_{a+1} at depth 0, else the mask token; hidden [B, T, F]: f_a at
    depth 0, else ``mask_hidden`` [1, 1, F]; positions [B, T]: a + d). Padding entries (anchor −1) read row 0."""
    a = anchor.clamp(min=0)
    first = depth == 0
    ids = torch.where(first, shift_left(input_ids, 1).gather(1, a), mask_token_id)  # x_{a+1} (0 past the end)
    feats = features.gather(1, a[..., None].expand(-1, -1, features.shape[-1]))  # [B, T, F]
    hidden = torch.where(first[..., None], feats, mask_hidden.to(feats.dtype).expand_as(feats))
    return ids, hidden, a + depth


class PEagleHead(Eagle3Head):
    """The P-EAGLE draft model: the EAGLE-3 head plus ``mask_hidden`` (module docstring)."""

    def __init__(self, *args: Any, mask_token_id: int = 0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.mask_token_id = mask_token_id
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, 3 * self.hidden_size))  # drawn after every EAGLE-3 weight

    def parallel(self, input_ids: Tensor, features: Tensor, anchor: Tensor, depth: Tensor,
                 logits_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Training: every entry (anchor, depth) [B, T] of a batch in one forward (layout in the module docstring).
        input_ids [B, S]; features [B, S, 3H] → (hidden [B, T, H], logits [B, T, Vd]), or with ``logits_rows``
        [B, T] bool the logits of those entries only, [N, Vd] in row-major order."""
        ids, hidden, positions = parallel_inputs(input_ids, features, self.mask_hidden, anchor, depth,
                                                 self.mask_token_id)
        allowed = parallel_attention_mask(anchor, depth)
        dtype = self.fc.weight.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
        return self(ids, hidden, position_ids=positions, attention_mask=mask, logits_rows=logits_rows)


class PEagleDrafter(FeatureDrafter):
    """Drafter protocol over a :class:`PEagleHead`: one forward per round drafts up to ``num_depths`` tokens.

    State after every ``update`` as in EAGLE's runtime (``eagle_runtime.py``): committed tokens, the features of
    every committed position but the last, of which rows 0 … ``rows``−1 are in the head's cache."""

    kind = "P-EAGLE"

    def reset(self) -> None:
        self.reset_committed()
        self.cache: Any = self.module.new_cache()
        self.rows = 0  # rows in the cache computed from true features
        self._first: Tensor | None = None  # [Vd] logits of the last true row (draft 1)
        self._vocab = ReducedVocab.of(self.module.draft_ids, int(self.module.t2d.shape[0]))

    @torch.inference_mode()
    def propose(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal:
        m = min(k, int(self.config.num_depths))
        crop_cache(self.cache, self.rows)  # last round's masked rows
        head, dtype = self.module, self.module.fc.weight.dtype
        feats = [f.to(device=self.device, dtype=dtype) for f in self._pending]  # true rows (f_s, x_{s+1})
        self._pending = []
        p = sum(f.shape[0] for f in feats)
        if p == 0 and self._first is None:
            raise DraftsmithError("P-EAGLE drafter asked to propose before any target features arrived")
        ids = self.tokens[self.rows + 1 : self.rows + 1 + p] + [head.mask_token_id] * (m - 1)
        hidden = torch.cat([*feats, head.mask_hidden[0].to(dtype).expand(m - 1, -1)])[None]  # [1, p + m − 1, 3H]
        logits = hidden.new_zeros(0, head.lm_head.out_features)
        if ids:
            positions = torch.arange(self.rows, self.rows + len(ids), device=self.device)[None]
            _, logits = head(torch.tensor([ids], device=self.device), hidden, position_ids=positions, cache=self.cache,
                             logits_to_keep=m if p else m - 1)
            logits = logits[0]  # [m or m − 1, Vd]
        if p:
            self.rows += p
            self._first, logits = logits[0], logits[1:]
        return draft_block(torch.cat([self._first[None], logits]), warp, generator, self._vocab, self.stop_below)


@dataclass
class PEagleConfig(Eagle3Config):
    """P-EAGLE: the EAGLE-3 head drafting several tokens in one forward, from mask tokens with a learned hidden state."""

    type: Literal["peagle"] = "peagle"
    num_depths: int = 8
    """K: tokens drafted per forward (the last true row and K − 1 masked rows), and the depths trained (the
    reference's ``num_depths``, 8)."""
    mask_token_id: int = -1
    """Token id of the masked rows (its frozen target embedding is what they read). −1 = the tokenizer's mask token
    if it has one, else the last id of the vocabulary (as DFlash's)."""

    runtime_class: ClassVar[Any] = PEagleDrafter

    def validate(self) -> None:
        super().validate()
        if not 1 <= self.num_depths <= 64:
            raise ConfigError(f"drafter.num_depths = {self.num_depths} must be in 1 … 64 (the reference's 8): the tokens "
                              f"one forward drafts")
        if self.norm_output:
            raise ConfigError("drafter.norm_output does nothing for P-EAGLE (no hidden state is passed on to a next "
                              "step); leave it false")

    def resolve(self, target: Target) -> PEagleConfig:
        """This config checked against ``target``, with feature_layers and mask_token_id made explicit."""
        return self.resolve_for(target.num_layers, target.vocab_size, default_mask_token(self.mask_token_id, target))

    def resolve_for(self, n: int, vocab_size: int, mask_token_id: int | None = None) -> PEagleConfig:
        """:meth:`resolve` from the target's architecture alone (mask −1 → the last id of the vocabulary)."""
        cfg = super().resolve_for(n, vocab_size)
        mask = check_mask_token(self.mask_token_id if mask_token_id is None else mask_token_id, vocab_size)
        return dataclasses.replace(cfg, mask_token_id=mask)

    def new_head(self, arch: Any, embed: nn.Module, draft_vocab_size: int) -> PEagleHead:
        return build_eagle3(arch, embed, draft_vocab_size, self.seed, self.num_layers, head=PEagleHead,
                            mask_token_id=self.mask_token_id, **self.head_options)
