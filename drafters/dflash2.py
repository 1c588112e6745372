"""DFlash2 (z-lab, August 2026; vLLM speculators 0.9.0's ``dflash2``): DFlash plus local convolutions inside the
block and a candidate selector that reranks each position's top-K drafts by the token drafted before it.

Module (:class:`DFlash2Module`): :class:`~draftsmith.drafters.dflash.DFlashModule` — its names, context injection,
block layout, anchor and mask token — with two changes:

* every layer wraps its attention and its MLP in a **grouped dynamic causal convolution** over the rows of a block
  (``attention_conv``, ``mlp_conv``: :class:`GroupedDynamicConv`). From the sublayer's normed input x [.., Bs, H], one
  projection ``kernel_projection`` gives per row two kernels of K taps × G groups (H/G channels share a coefficient):
  the input side convolves x before the sublayer, the output side its output after it; row p's coefficient of tap t
  is ``base_kernel[side, t]`` (per channel) + the projected delta of row p, and tap t reads row p − t of the same block
  (nothing before the block's first row). Initialized as the identity (base tap 0 = 1, the rest and the projection
  0), so a fresh DFlash2 layer computes exactly the DFlash layer it wraps;
* ``candidate_selector`` (:class:`CandidateSelector`): the unary logits (lm_head, as DFlash's) keep their top K
  candidates per block position; each candidate c at position k scores ``unary[c] + Σ_r P[pred, r]·W h_k[r]·S[c, r]``,
  a low-rank bilinear term in the token drafted at k − 1 (``pred``; the anchor at k = 1), the position's hidden
  state h_k and c (``predecessor_codebook`` P [V, r], ``hidden_projection`` W [r, H], ``successor_codebook`` S [V, r]).

The reference requires the target's full vocabulary (its codebooks are indexed by target ids), and so does this.

A DFlash2 module of a seed holds the DFlash module of that seed: the convolutions draw no random numbers and the
selector is drawn last, after every DFlash weight.

Decoding (:class:`DFlash2Drafter`): one forward of the block as DFlash, then the selector walks the block left to
right: position k's q is the softmax of its candidates' scores given the draft chosen at k − 1 (−∞ outside the K
candidates), the argmax when greedy — llama.cpp's walk (``common/speculative.cpp``: ``is_dflash2``). Each q is fixed
before its draft is drawn (it reads only drafts already drawn), so the chain is drawn from its law and the decoder's
accept rule stays lossless (``decode.protocol.draft_chain``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..decode.protocol import Proposal, draft_chain
from ..decode.sampling import Warp
from ..errors import ConfigError
from .common import seeded, text_config
from .dflash import DFlashConfig, DFlashDrafter, DFlashLayer, DFlashModule, dflash_layer_config


def grouped_dynamic_conv(x: Tensor, delta: Tensor, base: Tensor) -> Tensor:
    """A causal convolution along the rows of each block, its coefficients per row.

    x [..., Bs, H] (the rows of one block along dim −2); delta [..., Bs, K, G]: each row's coefficient per tap and
    channel group (H/G channels share one); base [K, H]: the per-channel coefficient every row adds.
    → [..., Bs, H]: out[p] = Σ_{t < K, t ≤ p} (base[t] + delta[p, t]) · x[p − t]."""
    k, h = base.shape
    groups = delta.shape[-1]
    out = torch.zeros_like(x)
    for t in range(min(k, x.shape[-2])):
        shifted = x if t == 0 else F.pad(x[..., : x.shape[-2] - t, :], (0, 0, t, 0))  # row p reads row p − t
        coeff = base[t].to(x.dtype) + delta[..., t, :].repeat_interleave(h // groups, dim=-1)  # [..., Bs, H]
        out = out + shifted * coeff
    return out


class GroupedDynamicConv(nn.Module):
    """The two convolutions around one sublayer (the reference's ``GroupedDynamicCausalConv``): ``base_kernel``
    [2, K, H] and ``kernel_projection`` [2·K·G, H] (row layout: side, tap, group), identity at init; the rows it
    sees come in blocks of ``block_size``."""

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.block_size, self.kernel_size, self.num_groups = block_size, kernel_size, hidden_size // group_size
        base = torch.zeros(2, kernel_size, hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.utils.skip_init(nn.Linear, hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)  # no random draw: the DFlash weights around it keep their seed

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, N·Bs, H] (blocks of ``block_size`` rows) → (x convolved by the input side, the output side's delta)."""
        b, q, h = x.shape
        delta = self.kernel_projection(x).view(b, q, 2, self.kernel_size, self.num_groups)
        return self._conv(x, delta[:, :, 0], 0), delta[:, :, 1]

    def finish(self, y: Tensor, delta: Tensor) -> Tensor:
        """The sublayer's output [B, N·Bs, H] convolved by the output side (``delta`` from :meth:`prepare`)."""
        return self._conv(y, delta, 1)

    def _conv(self, x: Tensor, delta: Tensor, side: int) -> Tensor:
        b, q, h = x.shape
        bs = self.block_size
        out = grouped_dynamic_conv(x.view(b, q // bs, bs, h), delta.reshape(b, q // bs, bs, *delta.shape[-2:]),
                                   self.base_kernel[side])
        return out.view(b, q, h)


class DFlash2Layer(DFlashLayer):
    """The DFlash layer with a convolution around its attention and around its MLP (module docstring)."""

    def __init__(self, c: Any, block_size: int, kernel_size: int, group_size: int):
        super().__init__(c)
        self.attention_conv = GroupedDynamicConv(int(c.hidden_size), block_size, kernel_size, group_size)
        self.mlp_conv = GroupedDynamicConv(int(c.hidden_size), block_size, kernel_size, group_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, context: tuple[Tensor, Tensor], mask: Tensor | None) -> Tensor:
        h, delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, cos, sin, context, mask), delta)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), delta)


class CandidateSelector(nn.Module):
    """The bilinear reranker of the unary top-K (module docstring); names as the reference's."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, std: float = 0.02):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * std)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * std)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=std)

    def scores(self, unary: Tensor, hidden: Tensor, predecessor: Tensor, candidates: Tensor) -> Tensor:
        """unary [..., V] logits, hidden [..., H], predecessor [...] (target ids), candidates [..., K] (target ids)
        → [..., K]: each candidate's unary logit plus its transition score from the predecessor."""
        context = self.predecessor_codebook[predecessor] * self.hidden_projection(hidden)  # [..., r]
        transition = (context.unsqueeze(-2) * self.successor_codebook[candidates]).sum(-1)  # [..., K]
        return unary.gather(-1, candidates) + transition.to(unary.dtype)


class DFlash2Module(DFlashModule):
    """The DFlash2 draft model: :class:`DFlashModule` with :class:`DFlash2Layer` layers and a ``candidate_selector``."""

    def __init__(self, parts: Any, layer_config: Any, num_layers: int, feature_layers: list[int], block_size: int,
                 mask_token_id: int, kernel_size: int, group_size: int, selector_rank: int, selector_top_k: int):
        layer = partial(DFlash2Layer, block_size=block_size, kernel_size=kernel_size, group_size=group_size)
        super().__init__(parts, layer_config, num_layers, feature_layers, block_size, mask_token_id, layer=layer)
        self.candidate_selector = CandidateSelector(int(parts.embed.num_embeddings), self.hidden_size, selector_rank,
                                                    selector_top_k)

    def select(self, hidden: Tensor, predecessor: Tensor, candidates: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Block rows hidden [..., H] after the final norm, the token before each row [...] → (candidates [..., K]:
        the unary top K unless given, their scores [..., K])."""
        unary = self.lm_head(hidden)  # [..., V]
        if candidates is None:
            candidates = unary.topk(self.candidate_selector.top_k, dim=-1).indices
        return candidates, self.candidate_selector.scores(unary, hidden, predecessor, candidates)


class DFlash2Drafter(DFlashDrafter):
    """Drafter protocol over a :class:`DFlash2Module`: one forward per round, then the selector's walk (module docstring)."""

    kind = "DFlash2"

    @torch.inference_mode()
    def propose(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal:
        rows = self.block(k)  # [m, H]
        m = self.module
        unary = m.lm_head(rows)  # [m, V]
        candidates = unary.topk(m.candidate_selector.top_k, dim=-1).indices  # [m, K]
        position = iter(range(len(rows)))

        def logits(predecessor: int) -> Tensor:
            """The next position's logits [V]: its candidates' scores given the draft before it, −∞ elsewhere."""
            i = next(position)
            scores = m.candidate_selector.scores(unary[i], rows[i], torch.tensor(predecessor, device=rows.device),
                                                 candidates[i])
            return unary.new_full(unary.shape[-1:], float("-inf")).index_copy_(0, candidates[i], scores)

        return draft_chain(logits, logits(self.tokens[-1]), len(rows), warp, generator, None, self.stop_below)


@dataclass
class DFlash2Config(DFlashConfig):
    """DFlash2: DFlash with local convolutions in the block and a candidate selector reranking each position's top-K."""

    type: Literal["dflash2"] = "dflash2"  # type: ignore[assignment]
    conv_kernel_size: int = 2
    """Taps of each local convolution (the reference's 2): row p reads rows p − 1 … p − K + 1 of its block too."""
    conv_group_size: int = 16
    """Channels sharing one dynamic coefficient (the reference's 16); must divide the target's hidden size."""
    selector_rank: int = 256
    """r: rank of the selector's bilinear transition score (the reference's 256); its two codebooks hold V × r each."""
    selector_top_k: int = 16
    """K: unary candidates the selector reranks per block position (the reference's 16); q is zero outside them."""

    runtime_class: ClassVar[Any] = DFlash2Drafter

    def validate(self) -> None:
        super().validate()
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(self, name) < 1:
                raise ConfigError(f"drafter.{name} = {getattr(self, name)} must be at least 1")
        if self.conv_kernel_size > self.block_size:
            raise ConfigError(f"drafter.conv_kernel_size = {self.conv_kernel_size} is larger than drafter.block_size = "
                              f"{self.block_size}: a tap reads a row of the same block")
        if self.draft_vocab or self.draft_vocab_size:
            raise ConfigError("drafter.draft_vocab: DFlash2 drafts over the target's full vocabulary (its selector's "
                              "codebooks are indexed by target ids, as the reference's); leave draft_vocab empty")

    def resolve_for(self, num_layers: int, vocab_size: int, mask_token_id: int | None = None) -> DFlash2Config:
        cfg = super().resolve_for(num_layers, vocab_size, mask_token_id)
        if self.selector_top_k > vocab_size:
            raise ConfigError(f"drafter.selector_top_k = {self.selector_top_k} is larger than the target's vocabulary "
                              f"({vocab_size})")
        return cfg

    def new_module(self, arch: Any, parts: Any, draft_vocab_size: int = 0) -> DFlash2Module:
        hidden = int(text_config(arch).hidden_size)
        if hidden % self.conv_group_size:
            raise ConfigError(f"drafter.conv_group_size = {self.conv_group_size} does not divide the target's hidden "
                              f"size {hidden}")
        with seeded(self.seed):
            return DFlash2Module(parts, dflash_layer_config(arch), self.num_layers, self.feature_layers, self.block_size,
                                 self.mask_token_id, self.conv_kernel_size, self.conv_group_size, self.selector_rank,
                                 self.selector_top_k)
