"""DFlash (z-lab 2026, "Block Diffusion for Flash Speculative Decoding"): a small stack of decoder
layers that fills a whole block of masked positions in ONE forward, conditioned on the target's
hidden states injected into every layer's attention as extra keys and values.

Architecture (the reference ``DFlashDraftModel`` of z-lab/dflash, which SpecForge, speculators'
``dflash`` and llama.cpp's ``draft-dflash`` all load under these names)::

    ctx   = hidden_norm(fc(concat of the target's outputs of feature_layers))   [B, C, H]
    noise = embed_tokens([anchor, MASK, MASK, …])                                [B, Bs, H]
    layer i:  q from input_layernorm(noise) (q_proj → q_norm → RoPE);
              keys/values = [k_norm(k_proj(ctx)), k_norm(k_proj(noise))] → RoPE, [v_proj(ctx), v_proj(noise)];
              non-causal attention over [context rows before the anchor ; the whole block];
              residual, post_attention_layernorm, MLP, residual
    logits = lm_head(norm(noise))   (the target's lm_head, frozen; with a draft vocabulary, its rows of it)

Every layer reads the SAME context (``ctx`` is not updated through the layers), so its keys and
values are a per-layer cache that only grows with committed positions. The layers are Qwen3-style
(q/k RMS norms per head) with the target's width, heads, MLP, RoPE and norm epsilon: for a Llama
target too, because every loader of the format builds Qwen3 layers (z-lab and speculators
instantiate ``Qwen3DFlashDecoderLayer``, llama.cpp's ``dflash`` graph requires ``attn_q_norm``),
so Llama-style layers without q/k norms could be trained but not served anywhere.

Alignment: the block starts at an anchor position a, whose token is known (the last committed
token when decoding) but whose target feature is not (the target has not run on it yet); block
position k (1 … Bs−1) predicts the token at a + k, from context rows 0 … a−1. Training and
decoding use the same rule (training: ``block_inputs`` / ``block_attention_mask``).

Layer ids: ``feature_layers`` are ours (output of decoder layer i, 0-based), which are the
reference's ``target_layer_ids`` exactly (it reads ``hidden_states[i + 1]``); llama.cpp's GGUF
stores them + 1 (layer inputs), which the converter adds. Default: the reference's rule, as many
target layers as draft layers, spread from layer 1 to N − 3.

Decoding (:class:`DFlashDrafter`): the anchor at position n (the last committed token) and Bs−1
mask tokens run once; positions 1 … k give k drafts (k ≤ Bs−1), each with its own q (they do
not depend on the earlier drafts, so sampling each independently is drawing the chain from its
law, and the decoder's accept rule stays lossless). Context keys/values of committed positions
are cached per layer; the block's own keys are never cached (nothing to roll back).

Reduced draft vocabulary (``draft_vocab``: the file ``draftsmith prepare`` writes, EAGLE-3's convention in
``data/vocab.py``): the lm_head computes only the Vd rows of the draft vocabulary — a FROZEN slice of the
target's lm_head (rows ``draft_ids = arange(Vd) + d2t``), not a trained head. The reference keeps the target's
lm_head frozen, and so does speculators' DFlash with a draft vocabulary (it slices the verifier's head by
``t2d``); frozen, the body trained with or without the reduced vocabulary is the same kind of model, the slice
is not stored in drafter folders (it is taken from the target again at load, after ``d2t`` is read), and the
reduction changes only the cost of the head (half of a block's cost at SmolLM2's 49k rows) and which tokens
can be drafted. Greedy drafts are the argmax over the Vd rows, mapped to target ids; sampled drafts report q
over the target's whole vocabulary, zero outside the draft vocabulary (``decode.protocol.draft_chain``), so the
accept rule stays exact. ``d2t``/``t2d`` are buffers (saved in ``model.safetensors``) only when Vd < V: a
full-vocabulary drafter has neither, as before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..decode.protocol import Proposal, ReducedVocab, draft_block
from ..decode.sampling import Warp
from ..errors import ConfigError, DraftsmithError
from ..target import Target, resolve_layer
from .common import (
    FeatureDrafter,
    check_mask_token,
    default_mask_token,
    draft_layer_config,
    frozen_target_parts,
    place,
    placeholder_parts,
    scatter_to_target,
    seeded,
    target_parts,
    text_config,
)

KV = list[tuple[Tensor, Tensor]]
"""Per draft layer: (keys, values) [B, kv_heads, T, head_dim] of T context rows, RoPE applied."""


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's choice: one layer (the middle) for one draft layer, else ``num_draft_layers``
    layers spread evenly from 1 to N − 3 (rounded half to even, as Python's round).
    SmolLM2 (30 layers), 5 draft layers: [1, 8, 14, 20, 27]; Qwen3-8B (36), 5: [1, 9, 17, 25, 33]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, max(num_target_layers - 3, 1)
    spread = [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    return sorted(set(spread))  # a target shallower than the draft (tests' tiny ones) gives fewer, distinct layers


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the HF (NeoX) layout: x [B, h, S, d], cos/sin [B, S, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DFlashAttention(nn.Module):
    """Qwen3 attention (q/k RMS norm per head) whose keys/values are prefixed by the context's."""

    def __init__(self, c: Any):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        h, d = int(c.hidden_size), int(c.head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = int(c.num_attention_heads), int(c.num_key_value_heads), d
        bias = bool(c.attention_bias)
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = LlamaRMSNorm(d, eps=float(c.rms_norm_eps))
        self.k_norm = LlamaRMSNorm(d, eps=float(c.rms_norm_eps))

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, S, H] → (k, v) [B, kv_heads, S, d], k normed and rotated."""
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, context: tuple[Tensor, Tensor], mask: Tensor | None) -> Tensor:
        """x [B, Q, H] (normed block rows) → [B, Q, H]; context (k, v) [B, kv_heads, C, d];
        mask [B|1, 1, Q, C+Q] bool (True = attend) or None (every row sees everything: decoding)."""
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.num_heads, self.head_dim)).transpose(1, 2)
        q = rotate(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k = torch.cat([context[0].to(k.dtype), k], dim=2)  # [B, kv, C+Q, d]
        v = torch.cat([context[1].to(v.dtype), v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class DFlashLayer(nn.Module):
    """Pre-norm decoder layer: attention over [context ; block], then the target's MLP shape."""

    def __init__(self, c: Any):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        h, eps = int(c.hidden_size), float(c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.mlp = LlamaMLP(c)
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, context: tuple[Tensor, Tensor], mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModule(nn.Module):
    """The DFlash draft model. Names follow the reference checkpoints (``fc``, ``hidden_norm``,
    ``layers.{i}.*``, ``norm``); ``embed_tokens`` and ``lm_head`` are frozen copies of the target's
    (one tensor when the target ties them), not stored. Trainable: fc, hidden_norm, layers, norm
    (which starts from the target's final norm, so a fresh draft's logits have the target's scale).

    draft_vocab_size: 0 (or V) = the target's vocabulary; Vd < V = a reduced draft vocabulary: ``lm_head`` is
    a frozen [Vd, H] slice of the target's head (set by :meth:`set_vocab`) and ``d2t`` [Vd] / ``t2d`` [V] are
    buffers (module docstring). It is created last, so the body's random initialization is the same either way.
    layer: builds one draft layer from ``layer_config`` (DFlash2's adds its convolutions)."""

    def __init__(self, parts: Any, layer_config: Any, num_layers: int, feature_layers: list[int], block_size: int,
                 mask_token_id: int, draft_vocab_size: int = 0, layer: Callable[[Any], nn.Module] = DFlashLayer):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        h, eps = int(layer_config.hidden_size), float(layer_config.rms_norm_eps)
        self.hidden_size = h
        self.layer_config = layer_config
        self.feature_layers = list(feature_layers)
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.embed_tokens = parts.embed
        self.lm_head = parts.lm_head
        self.fc = nn.Linear(len(feature_layers) * h, h, bias=False)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.layers = nn.ModuleList(layer(layer_config) for _ in range(num_layers))
        self.norm = LlamaRMSNorm(h, eps=eps)
        self.rotary_emb = LlamaRotaryEmbedding(layer_config)
        vocab = int(parts.embed.num_embeddings)
        if 0 < draft_vocab_size < vocab:
            self.lm_head = nn.Linear(h, draft_vocab_size, bias=False).requires_grad_(False)
            self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.arange(vocab) < draft_vocab_size)
        else:
            self.register_buffer("d2t", None)
            self.register_buffer("t2d", None)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def draft_ids(self) -> Tensor | None:
        """[Vd] long: the target id of each lm_head row (``arange(Vd) + d2t``); None for the full vocabulary."""
        if self.d2t is None:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def set_vocab(self, d2t: Tensor, t2d: Tensor, target_head: Tensor) -> None:
        """Put a checked reduced vocabulary in place and take lm_head's rows from the target's head
        ``target_head`` [V, H]: row i = the target's row of draft id i."""
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)
            self.lm_head.weight.copy_(target_head[self.draft_ids.to(target_head.device)])

    def target_logits(self, logits: Tensor) -> Tensor:
        """[..., Vd] logits of lm_head → [..., V] over the target's vocabulary (−inf outside a reduced one)."""
        return logits if self.d2t is None else scatter_to_target(logits, self.draft_ids, self.t2d.shape[0])

    def context(self, features: Tensor, positions: Tensor) -> KV:
        """Target features [B, C, L·H] at ``positions`` [B, C] → each layer's context keys/values."""
        if features.shape[-1] != self.fc.in_features:
            raise DraftsmithError(f"DFlash drafter got target features of width {features.shape[-1]}; expected "
                                  f"{len(self.feature_layers)}×{self.hidden_size} (target layers {self.feature_layers})")
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))  # [B, C, H]
        cos, sin = self.rotary_emb(ctx, positions)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(self, noise_ids: Tensor, positions: Tensor, context: KV, mask: Tensor | None = None) -> Tensor:
        """Block rows: noise_ids [B, Q] (anchors and mask tokens) at ``positions`` [B, Q], attending
        ``context`` (from :meth:`context`) under ``mask`` [B|1, 1, Q, C+Q] bool or None (all) →
        hidden [B, Q, H] after the final norm (``lm_head`` of it gives the logits)."""
        x = self.embed_tokens(noise_ids).to(self.dtype)  # [B, Q, H]
        cos, sin = self.rotary_emb(x, positions)
        for layer, kv in zip(self.layers, context):
            x = layer(x, cos, sin, kv, mask)
        return self.norm(x)

    def train_blocks(self, input_ids: Tensor, features: Tensor, anchors: Tensor) -> Tensor:
        """Training: every block of a batch in one forward. input_ids [B, S]; features [B, S, L·H];
        anchors [B, N] long (−1 = no block) → hidden [B, N, Bs, H]; row (b, j, k) predicts the token
        at anchors[b, j] + k (k ≥ 1; the alignment of the module docstring)."""
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device)[None].expand(b, s)
        noise_ids, noise_pos = block_inputs(input_ids, anchors, self.block_size, self.mask_token_id)
        mask = block_attention_mask(anchors, self.block_size, s)
        hidden = self(noise_ids, noise_pos, self.context(features, positions), mask)
        return hidden.view(b, anchors.shape[1], self.block_size, -1)


def block_inputs(input_ids: Tensor, anchors: Tensor, block_size: int, mask_token_id: int) -> tuple[Tensor, Tensor]:
    """The block rows of every anchor: ids [B, N·Bs] (the anchor's token, then Bs−1 mask tokens) and
    positions [B, N·Bs] (anchor + k). anchors [B, N] long; −1 (no block) gives mask ids at 0, k."""
    b, n = anchors.shape
    k = torch.arange(block_size, device=anchors.device)
    start = anchors.clamp(min=0)
    ids = torch.full((b, n, block_size), mask_token_id, dtype=torch.long, device=anchors.device)
    ids[..., 0] = torch.where(anchors >= 0, input_ids.gather(1, start), mask_token_id)
    return ids.view(b, -1), (start[..., None] + k).view(b, -1)


def block_attention_mask(anchors: Tensor, block_size: int, seq_len: int) -> Tensor:
    """[B, 1, N·Bs, S + N·Bs] bool: block j sees context rows t < anchors[b, j] (the target has run on
    them; right padding lies past every anchor) and every row of its own block, nothing else."""
    b, n = anchors.shape
    q_block = torch.arange(n * block_size, device=anchors.device) // block_size  # [Q]
    ctx = torch.arange(seq_len, device=anchors.device)[None, None] < anchors.repeat_interleave(block_size, 1)[..., None]
    own = (q_block[:, None] == q_block[None, :])[None].expand(b, -1, -1)  # [B, Q, Q]
    return torch.cat([ctx, own], dim=-1)[:, None]


class DFlashDrafter(FeatureDrafter):
    """Drafter protocol over a :class:`DFlashModule`: one forward per round drafts up to Bs − 1 tokens."""

    kind = "DFlash"

    def __init__(self, module: DFlashModule, config: DFlashConfig):
        super().__init__(module, tuple(config.feature_layers), config)

    def reset(self) -> None:
        self.reset_committed()
        self.rows = 0  # context rows in self.kv
        self.kv: KV | None = None
        ids = self.module.draft_ids  # a reduced vocabulary: logits over it, drafted there (EAGLE-3's way)
        self._vocab = None if ids is None else ReducedVocab.of(ids, int(self.module.t2d.shape[0]))

    @torch.inference_mode()
    def propose(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal:
        rows = self.block(k)
        logits = self.module.lm_head(rows)  # [m, V], or [m, Vd] over a draft vocabulary
        return draft_block(logits, warp, generator, self._vocab, self.stop_below)

    def block(self, k: int) -> Tensor:
        """This round's block (the context caught up first): the hidden rows [m, H] of block positions 1 … m,
        m = min(k, Bs − 1), from one forward of the whole block, as trained."""
        self._catch_up()
        m, bs = min(k, self.module.block_size - 1), self.module.block_size
        anchor = self.rows  # = len(tokens) − 1: the last committed token's position
        ids = torch.full((1, bs), self.module.mask_token_id, dtype=torch.long, device=self.device)
        ids[0, 0] = self.tokens[-1]
        positions = torch.arange(anchor, anchor + bs, device=self.device)[None]
        return self.module(ids, positions, self.kv)[0, 1 : 1 + m]  # [Bs, H] → block positions 1 … m

    def _catch_up(self) -> None:
        """Append the context keys/values of the features that arrived since the last round."""
        if not self._pending:
            if self.kv is None:
                raise DraftsmithError("DFlash drafter asked to propose before any target features arrived")
            return
        feats = torch.cat(self._pending)[None]  # [1, m, L·H]
        self._pending = []
        positions = torch.arange(self.rows, self.rows + feats.shape[1], device=self.device)[None]
        new = self.module.context(feats.to(self.device), positions)
        self.kv = new if self.kv is None else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                               for (k0, v0), (k1, v1) in zip(self.kv, new)]
        self.rows += feats.shape[1]


def dflash_layer_config(arch: Any) -> Any:
    """The draft layers' config: the target's dimensions, MLP, norm epsilon and RoPE (one Llama-shaped
    layer config; q/k norms are added by :class:`DFlashAttention`)."""
    return draft_layer_config(arch)


def build_dflash(arch: Any, parts: Any, config: DFlashConfig, draft_vocab_size: int = 0) -> DFlashModule:
    """A seeded-random DFlash module for a target with HF config ``arch`` around ``parts`` (embedding and
    lm_head); ``config`` resolved (explicit feature layers and mask token); ``draft_vocab_size`` as
    :class:`DFlashModule` takes it (its lm_head rows and d2t still to be set)."""
    return config.new_module(arch, parts, draft_vocab_size)


@dataclass
class DFlashConfig:
    """DFlash: a few Qwen3-style layers fill a block of masked positions in one forward from injected target context."""

    type: Literal["dflash"] = "dflash"
    num_layers: int = 5
    """Draft decoder layers (the reference's Qwen3-8B drafter has 5)."""
    block_size: int = 8
    """Bs: rows per block — the anchor and Bs − 1 masked positions, so at most Bs − 1 drafts per round
    (8 here and in speculators; the reference's published drafters use 16)."""
    feature_layers: list[int] = field(default_factory=list)
    """Target layers whose outputs form the context (id i = output of decoder layer i, 0-based, negative
    from the end). Empty = the reference's rule for num_layers draft layers (:func:`default_target_layers`)."""
    mask_token_id: int = -1
    """Token id of the mask rows (its frozen target embedding is what they read). −1 = the tokenizer's
    mask token if it has one, else the last id of the vocabulary (an unused row of Qwen3's and a reserved
    token of Llama-3's; a rare token of SmolLM2's, which has no free row)."""
    seed: int = 0
    """Seed of the random initialization of fc and the layers."""
    draft_vocab: str = ""
    """A reduced draft vocabulary: the safetensors file with d2t [Vd] and t2d [V] that ``draftsmith prepare``
    writes (``data.vocab``); the lm_head is then the target's rows of it, frozen. Empty = the full vocabulary."""
    draft_vocab_size: int = 0
    """Tokens in the draft vocabulary; 0 = taken from draft_vocab, or the target's full vocabulary."""

    target_parts: ClassVar[tuple[str, ...]] = ("embed_tokens.", "lm_head.")
    """State-dict prefixes copied from the target (frozen), not stored in checkpoints (a reduced lm_head too:
    it is the target's rows, taken again at load)."""
    runtime_class: ClassVar[Any] = DFlashDrafter

    def validate(self) -> None:
        if self.num_layers < 1:
            raise ConfigError(f"drafter.num_layers = {self.num_layers}: DFlash needs at least 1 draft layer")
        if not 2 <= self.block_size <= 64:
            raise ConfigError(f"drafter.block_size = {self.block_size} must be in 2 … 64 (8 or 16 are usual): a block "
                              f"is the anchor plus block_size − 1 drafted positions")
        if self.draft_vocab_size < 0:
            raise ConfigError(f"drafter.draft_vocab_size = {self.draft_vocab_size} must be ≥ 0 (0 = full vocabulary)")

    def resolve(self, target: Target) -> DFlashConfig:
        """This config checked against ``target``, with feature_layers and mask_token_id made explicit."""
        return self.resolve_for(target.num_layers, target.vocab_size, default_mask_token(self.mask_token_id, target))

    def resolve_for(self, num_layers: int, vocab_size: int, mask_token_id: int | None = None) -> DFlashConfig:
        """:meth:`resolve` from the target's architecture alone (mask −1 → the last id of the vocabulary)."""
        self.validate()
        given = self.feature_layers or default_target_layers(num_layers, self.num_layers)
        layers = [resolve_layer(x, num_layers, f"drafter.feature_layers[{i}]") for i, x in enumerate(given)]
        if len(set(layers)) != len(layers):
            raise ConfigError(f"drafter.feature_layers = {given} names a layer twice; give distinct layers")
        mask = check_mask_token(self.mask_token_id if mask_token_id is None else mask_token_id, vocab_size)
        if self.draft_vocab_size > vocab_size:
            raise ConfigError(f"drafter.draft_vocab_size = {self.draft_vocab_size} is larger than the target's "
                              f"vocabulary ({vocab_size})")
        return dataclasses.replace(self, feature_layers=layers, mask_token_id=mask)

    def new_module(self, arch: Any, parts: Any, draft_vocab_size: int = 0) -> DFlashModule:
        """The seeded-random module of this (resolved) config for a target with HF config ``arch`` (:func:`build_dflash`)."""
        with seeded(self.seed):
            return DFlashModule(parts, dflash_layer_config(arch), self.num_layers, self.feature_layers,
                                self.block_size, self.mask_token_id, draft_vocab_size)

    def build(self, target: Target) -> DFlashDrafter:
        cfg = self.resolve(target)
        return cfg.runtime(cfg.build_module(target), target)

    def build_module(self, target: Target, vocab: Any = None) -> DFlashModule:
        """A fresh module for ``target``: frozen copies of its embedding and lm_head (or of the lm_head's rows of
        the draft vocabulary), norm from its final norm. vocab: a DraftVocab (``.d2t``, ``.t2d``), a pair, or None
        for ``draft_vocab`` (the full vocabulary when that is empty too)."""
        from ..data.vocab import resolve_draft_vocab

        cfg = self.resolve(target)
        d2t, t2d = resolve_draft_vocab(vocab, cfg.draft_vocab, cfg.draft_vocab_size, target.vocab_size,
                                       target.tokenizer_hash)
        own = target_parts(target.model)
        module = place(build_dflash(target.config, frozen_target_parts(target.model), cfg, int(d2t.shape[0])),
                       target.device, target.dtype)
        with torch.no_grad():
            module.norm.weight.copy_(own.norm.weight)
        if module.d2t is not None:
            module.set_vocab(d2t.to(target.device), t2d.to(target.device), own.lm_head.weight)
        return module

    def module_for_checkpoint(self, target: Target, meta: dict[str, Any]) -> DFlashModule:
        """The module's structure for loading. With a reduced vocabulary (``meta['draft_vocab_size']``, or this
        config's) the d2t/t2d the load puts in place are checked, and lm_head's rows taken from the target then."""
        cfg = self.resolve(target)
        size = int(meta.get("draft_vocab_size", 0)) or cfg.draft_vocab_size
        module = place(build_dflash(target.config, frozen_target_parts(target.model), cfg, size), target.device,
                       target.dtype)
        if module.d2t is not None:
            head = target_parts(target.model).lm_head.weight

            def take_rows(m: DFlashModule, _keys: Any) -> None:
                from ..data.vocab import check_draft_vocab

                check_draft_vocab(m.d2t.cpu(), m.t2d.cpu(), target.vocab_size, "the DFlash drafter's d2t/t2d")
                m.set_vocab(m.d2t.clone(), m.t2d.clone(), head)

            module.register_load_state_dict_post_hook(take_rows)
        return module

    def runtime(self, module: DFlashModule, target: Target) -> DFlashDrafter:
        size = 0 if module.d2t is None else int(module.d2t.shape[0])
        cfg = dataclasses.replace(self.resolve(target), draft_vocab="", draft_vocab_size=size)
        return self.runtime_class(module, cfg)

    def checkpoint_meta(self, module: nn.Module) -> dict[str, Any]:
        return {} if module.d2t is None else {"draft_vocab_size": int(module.d2t.shape[0])}


def meta_dflash(config: DFlashConfig, arch: Any) -> DFlashModule:
    """The module ``config`` builds for a target with HF config ``arch``, on the meta device (parameter counts)."""
    tc = text_config(arch)
    cfg = config.resolve_for(int(tc.num_hidden_layers), int(tc.vocab_size))
    with torch.device("meta"):
        return build_dflash(arch, placeholder_parts(arch), cfg)
