"""EAGLE-3 head (Li et al. 2025): fused low/mid/high target features, one decoder layer whose
attention reads concat(embedding, hidden), a reduced draft vocabulary, training-time test.

Training API (stable; the training recipe calls exactly this)::

    head = Eagle3Config(feature_layers=[1, 14, 26]).build_module(target, vocab)   # Eagle3Head
    steps = head.unroll(input_ids, features, steps=7, attention_mask=None, position_ids=None)
    for j, (hidden_j, logits_j) in enumerate(steps): ...

    input_ids      [B, S] long     the sequence x_0 … x_{S-1} itself (NOT shifted: unroll shifts)
    features       [B, S, 3H]      f_t = concat of the target's outputs of feature_layers at position t
                                   (Target.forward(feature_layers=head layers) returns exactly this)
    attention_mask [B, S]          1 = real token, 0 = padding; default all real
    position_ids   [B, S] long     default t
    → steps[j] = (hidden [B, S, H], logits [B, S, Vd])  for j = 0 … steps-1
      row t of step j reads token x_{t+j+1} at position t+j and predicts x_{t+j+2}: its target
      distribution is the target's output at position t+j+1 (restricted to the draft vocab via
      ``head.draft_ids``). Rows with t+j+2 ≥ S (and padding) have no target: mask them out.

Step 0 is plain teacher forcing (row t pairs the true feature f_t with x_{t+1}). Step j ≥ 1
feeds each row the head's own step-(j-1) output instead of a target feature, exactly as in
decoding. How step j attends (EAGLE-3's and SpecForge's scheme, kept as is): row t sees the
step-0 keys of rows 0 … t (true-feature rows, causal mask) plus, for each step 1 … j, only the
key of its own row t. That is exactly what decoding sees when the last true row is t and j
drafts were chained after it (cache rows 0 … t, then one row per draft) — a test checks
unroll == chained decoding row by row. Gradients flow through all steps (nothing detached).

Lower-level, one step: ``head(input_ids, hidden, position_ids, attention_mask, cache, ttt)`` →
``(hidden [B,S,H], logits [B,S,Vd])`` where row t pairs ``hidden[t]`` with ``input_ids[t]`` (the
caller aligns: ``input_ids = shift_left(x, 1)`` for target features). ``hidden`` is either fused
target features [B,S,3H] (→ fc) or the head's own previous output [B,S,H] (used as is).

Vocabulary (EAGLE-3 / SGLang convention): ``d2t`` [Vd] long holds offsets,
``target_id = draft_id + d2t[draft_id]``; ``t2d`` [V] bool marks target ids in the draft vocab.
Both are buffers, saved in ``model.safetensors`` under those names. ``head.draft_ids`` [Vd] is
``arange(Vd) + d2t``; ``head.target_logits(logits)`` scatters draft logits into the target's
vocabulary with −inf elsewhere. Without a draft vocabulary the head uses the target's full one.

Parameter names follow EAGLE-3 / SGLang checkpoints (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``); ``embed_tokens`` is a frozen copy of the target's, not stored.
Trainable: fc, midlayer, norm, lm_head. ``norm`` and ``lm_head`` start from the target's
final norm and the target's lm_head rows of the draft vocabulary.

EAGLE-3.1 options (speculators 0.9.0's names and semantics; all off by default, as in EAGLE-3):
``fc_norm`` — an RMSNorm per fused target layer, ``concat(norm_a(f_a), norm_b(f_b), norm_c(f_c))``
before ``fc`` (parameters ``fc_norm.{0,1,2}.weight``); ``norm_before_fc`` — one RMSNorm over the
concatenation, ``input_norm(concat(f_a, f_b, f_c))`` (``input_norm.weight``; the two exclude each
other); ``norm_output`` — the hidden state a step passes on (to the next unrolled step, or the next
draft) is ``norm(out)``, the same tensor the lm_head reads, instead of the pre-norm ``out``. They are
for targets whose features reach the head unnormalized at a large scale (Gemma-3's, far above SmolLM2's): a norm
makes fc see features of one scale whatever the layer. Measured here, ``fc_norm`` did not pay: no clear gain on
SmolLM2, a lower held-out sim τ than without it on Gemma-3 (both targets' feature scales and the runs:
benchmarks/RESULTS.md, "EAGLE-3.1 norms"), so no recipe sets them; they load and export checkpoints trained with
them elsewhere.

``norm_before_residual`` (speculators' and vLLM's flag, read by llama.cpp too): the first layer's residual is
``hidden_norm(hidden)`` instead of ``hidden``, the attention input unchanged (parameter-free: the same tensors). Off
in EAGLE-3 and SGLang; ``draftsmith import`` carries it from the checkpoints of trainers that set it.

Layers after the first (``num_layers`` > 1, ``next_layers``): plain pre-norm Llama layers over H inputs (the embedding
is read by the first layer only). What each one reads is where the engines differ, ``residual_between_layers``:
True (default) — the previous layer's output, its residual stream plus its MLP's output, as every Llama stack does:
speculators 0.9.0's ``Eagle3DraftModel`` (``layers.1…`` are transformers' ``LlamaDecoderLayer``) and vLLM's
``llama_eagle3.py`` (``input_layernorm(hidden_states, residual)``); False — the previous layer's MLP output alone, its
residual stream dropped, as SGLang's ``LlamaForCausalLMEagle3`` at 03d5a777 computes its ``additional_layers``
(``BasicDecoderLayer.forward`` sets ``residual = hidden_states``, the MLP output the layer before returned, and
ignores the residual it is passed). Either way the hidden state passed on and normed for the lm_head is the last
layer's output (stream + MLP). One head computes one of the two; ``export`` writes each only where it is computed
(``export/eagle3.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError, DraftsmithError
from ..target import Target, check_architecture, default_eagle3_layers, resolve_layer
from .common import (
    default_positions,
    draft_layer_config,
    frozen_copy,
    place,
    scatter_to_target,
    seeded,
    shift_left,
    single_layer_cache,
    step_inputs,
    target_parts,
    text_config,
)
from .eagle_runtime import EagleDrafter


@dataclass
class UnrollKV:
    """Keys/values of the steps unrolled so far: entry 0 is attended causally, entries ≥ 1 only on the diagonal."""

    keys: list[Tensor] = field(default_factory=list)
    """[B, kv_heads, S, d] per step."""
    values: list[Tensor] = field(default_factory=list)


def attend(
    q: Tensor, k0: Tensor, v0: Tensor, mask: Tensor, diag_k: list[Tensor], diag_v: list[Tensor], scale: float
) -> Tensor:
    """Attention where query row t sees k0 under ``mask`` and row t of every ``diag_k[i]``.

    q: [B, h, S, d]; k0, v0: [B, h, L, d]; mask: [B|1, 1, S, L] additive; diag_k, diag_v: lists of
    [B, h, S, d]. Returns [B, h, S, d]. Scores and softmax in float32. With no diagonal entries it
    is ordinary masked attention.
    """
    scores = torch.matmul(q, k0.transpose(2, 3)).float() * scale + mask.float()  # [B, h, S, L]
    if diag_k:
        diag = [(q * k).sum(-1, keepdim=True).float() * scale for k in diag_k]  # each [B, h, S, 1]
        scores = torch.cat([scores, *diag], dim=-1)  # [B, h, S, L + J]
    weights = scores.softmax(-1).to(q.dtype)
    length = k0.shape[2]
    out = torch.matmul(weights[..., :length], v0)  # [B, h, S, d]
    for i, v in enumerate(diag_v):
        out = out + weights[..., length + i : length + i + 1] * v
    return out


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v projections read 2H inputs (concat(embedding, hidden)) in the head's first
    layer, H in the layers after it (``inputs``); ``layer_idx`` is its layer in the decoding cache."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False,
                 inputs: int = 2, layer_idx: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling = head_dim**-0.5
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(inputs * hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(inputs * hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(inputs * hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: Any = None, ttt: UnrollKV | None = None
    ) -> Tensor:
        """x: [B, S, 2H] (first layer) or [B, S, H]; cos/sin: [B, S, d]; mask: [B|1, 1, S, L] → [B, S, H].

        cache: a HF cache (decoding; extended in place, L = past + S; mask None = every key, the
        one-row draft step); ttt: the unroll's K/V (training; this step's keys are appended, L = S);
        neither: plain causal, L = S. Decoding runs SDPA (its softmax in float32 on CPU as on GPU), the
        training paths :func:`attend`; a test checks that both give the same drafts.
        """
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [B, h, S, d]
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [B, kv, S, d]
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [B, kv, S, d]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:  # decoding: SDPA over the cache, grouped heads unrepeated, no mask for one row
            k, v = cache.update(k, v, self.layer_idx)  # [B, kv, past + S, d]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=True)
            return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        diag_k: list[Tensor] = []
        diag_v: list[Tensor] = []
        if ttt is not None:
            ttt.keys.append(k)
            ttt.values.append(v)
            k, v = ttt.keys[0], ttt.values[0]
            diag_k, diag_v = ttt.keys[1:], ttt.values[1:]
        groups = self.num_heads // self.num_kv_heads
        out = attend(
            q,
            repeat_kv(k, groups),
            repeat_kv(v, groups),
            mask,
            [repeat_kv(t, groups) for t in diag_k],
            [repeat_kv(t, groups) for t in diag_v],
            self.scaling,
        )  # [B, h, S, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Eagle3DecoderLayer(nn.Module):
    """residual = hidden; attn(concat(input_layernorm(emb), hidden_norm(hidden))) + residual; then Llama MLP block.
    With ``norm_before_residual`` the residual is ``hidden_norm(hidden)`` instead (speculators' and vLLM's option)."""

    def __init__(self, layer_config: Any, norm_before_residual: bool = False):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        c = layer_config
        h, eps = int(c.hidden_size), float(c.rms_norm_eps)
        self.self_attn = Eagle3Attention(h, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.attention_bias)
        self.mlp = LlamaMLP(c)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.norm_before_residual = norm_before_residual

    def forward(
        self, emb: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache: Any = None, ttt: UnrollKV | None = None
    ) -> tuple[Tensor, Tensor]:
        """emb, hidden: [B, S, H] → (residual stream after the attention, the MLP's output), each [B, S, H]: the
        layer's (pre-norm) output is their sum, and what a next layer reads is the head's choice
        (``Eagle3Head.residual_between_layers``)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)  # [B, S, 2H]
        hidden = residual + self.self_attn(x, cos, sin, mask, cache, ttt)
        return hidden, self.mlp(self.post_attention_layernorm(hidden))


class Eagle3NextLayer(nn.Module):
    """A layer after the first of a multi-layer head (speculators' ``layers.1…``, SGLang's ``additional_layers.*``): a
    plain pre-norm Llama layer, attention over H inputs, with the first layer's unroll and cache scheme. Its pre-attention
    norm is ``input_layernorm`` (SGLang names it ``hidden_norm``: the same norm, ``export/adapters.py``)."""

    def __init__(self, layer_config: Any, layer_idx: int):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        c = layer_config
        h, eps = int(c.hidden_size), float(c.rms_norm_eps)
        self.self_attn = Eagle3Attention(h, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.attention_bias,
                                         inputs=1, layer_idx=layer_idx)
        self.mlp = LlamaMLP(c)
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache: Any = None,
                ttt: UnrollKV | None = None) -> tuple[Tensor, Tensor]:
        """hidden: [B, S, H] → (residual stream after the attention, the MLP's output), as the first layer's."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, mask, cache, ttt)
        return hidden, self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft model. Shapes and alignment in the module docstring; the runtime drafts through its
    :class:`~.eagle_runtime.EagleHead` surface (``new_cache``, ``forward``, ``target_logits``, and the draft
    vocabulary ``draft_ids`` / ``t2d``), training through ``unroll``."""

    def __init__(self, embed: nn.Embedding, layer_config: Any, draft_vocab_size: int, target_vocab_size: int,
                 fc_norm: bool = False, norm_before_fc: bool = False, norm_output: bool = False, num_layers: int = 1,
                 norm_before_residual: bool = False, residual_between_layers: bool = True):
        """embed: frozen copy of the target's embedding; layer_config: a one-layer LlamaConfig; fc_norm,
        norm_before_fc, norm_output: the EAGLE-3.1 options (module docstring); num_layers: decoder layers, the
        first reading concat(embedding, hidden) (``midlayer``), the others plain (``next_layers``);
        norm_before_residual: the first layer's residual is the normed hidden state (module docstring);
        residual_between_layers: what a layer after the first reads (module docstring, "Layers after the first")."""
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        if fc_norm and norm_before_fc:
            raise DraftsmithError("fc_norm and norm_before_fc exclude each other: one norm per layer, or one over all")
        h, eps = int(layer_config.hidden_size), float(layer_config.rms_norm_eps)
        self.hidden_size = h
        self.layer_config = layer_config
        self.embed_tokens = embed
        self.norm_output = norm_output
        self.residual_between_layers = residual_between_layers
        # created only when on, so that a head without them has EAGLE-3's tensors and no others
        self.fc_norm = nn.ModuleList([LlamaRMSNorm(h, eps=eps) for _ in range(3)]) if fc_norm else None
        self.input_norm = LlamaRMSNorm(3 * h, eps=eps) if norm_before_fc else None
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(layer_config, norm_before_residual)
        # created only past one layer, so that a one-layer head has EAGLE-3's tensors and no others
        self.next_layers = nn.ModuleList(Eagle3NextLayer(layer_config, i) for i in range(1, num_layers)) \
            if num_layers > 1 else None
        self.norm = LlamaRMSNorm(h, eps=float(layer_config.rms_norm_eps))
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(layer_config)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(target_vocab_size) < draft_vocab_size)

    @property
    def draft_ids(self) -> Tensor:
        """[Vd] long: the target id of each draft id (``arange(Vd) + d2t``)."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def set_vocab(self, d2t: Tensor, t2d: Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def num_layers(self) -> int:
        return 1 + (len(self.next_layers) if self.next_layers is not None else 0)

    def new_cache(self) -> Any:
        """A decoding cache with a layer per decoder layer of the head."""
        c = self.layer_config
        return single_layer_cache(c if self.num_layers == 1 else type(c)(**{**c.to_dict(), "num_hidden_layers": self.num_layers}))

    def forward(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: Any = None,
        ttt: list[UnrollKV] | None = None,
        logits_to_keep: int = 0,
        logits_rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """input_ids [B,S]; hidden [B,S,3H] (target features) or [B,S,H] (own output) → ([B,S,H], [B,S',Vd]).

        logits_to_keep: 0 = logits of every row (S' = S); n = of the last n rows only (the decoder's
        catch-up needs the last row's, and the lm_head is half the head's cost per row).
        logits_rows: [B, S] bool: logits of those rows only, [N, Vd] in row-major order (training: the
        rows a loss reads)."""
        if hidden.shape[-1] == 3 * self.hidden_size:
            hidden = self.fc(self.fuse(hidden.to(self.fc.weight.dtype)))  # [B, S, H]
        elif hidden.shape[-1] != self.hidden_size:
            raise DraftsmithError(
                f"EAGLE-3 head got hidden states of width {hidden.shape[-1]}; expected 3×{self.hidden_size} "
                f"(three target layers concatenated) or {self.hidden_size} (its own previous output)"
            )
        emb = self.embed_tokens(input_ids).to(hidden.dtype)  # [B, S, H]
        if cache is not None and input_ids.shape[1] == 1 and attention_mask is None and position_ids is not None:
            mask = None  # a chain's draft step: one query that sees every cached row (no mask to build)
        else:
            position_ids, mask = step_inputs(hidden, input_ids.shape[1], cache, position_ids, attention_mask)
        cos, sin = self.rotary_emb(hidden, position_ids)
        stream, mlp = self.midlayer(emb, hidden, cos, sin, mask, cache, None if ttt is None else ttt[0])  # [B, S, H] each
        for i, layer in enumerate(self.next_layers or ()):
            x = stream + mlp if self.residual_between_layers else mlp  # SGLang's stack drops the residual stream here
            stream, mlp = layer(x, cos, sin, mask, cache, None if ttt is None else ttt[i + 1])
        out = stream + mlp  # the last layer's output, pre-norm
        if self.norm_output:  # the next step reads the normed state, which the lm_head reads as is
            out = self.norm(out)
        kept = out[logits_rows] if logits_rows is not None else out[:, -logits_to_keep:]
        return out, self.lm_head(kept if self.norm_output else self.norm(kept))

    def fuse(self, features: Tensor) -> Tensor:
        """[..., 3H] target features → [..., 3H] as fc reads them: as they are, or normed (fc_norm: each
        layer's H; norm_before_fc: all 3H together)."""
        if self.fc_norm is not None:
            return torch.cat([norm(f) for norm, f in zip(self.fc_norm, features.chunk(3, dim=-1))], dim=-1)
        if self.input_norm is not None:
            return self.input_norm(features)
        return features

    def unroll(
        self,
        input_ids: Tensor,
        features: Tensor,
        steps: int = 7,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        logits_rows: list[Tensor] | None = None,
    ) -> list[tuple[Tensor, Tensor]]:
        """Training-time test: ``steps`` chained steps over a whole sequence (see module docstring).

        Step j gives (hidden [B, S, H], logits [B, S, Vd]), or with ``logits_rows`` (one [B, S] bool
        per step) the logits of step j's rows only, [N_j, Vd]."""
        if steps < 1:
            raise DraftsmithError(f"unroll needs at least 1 step, got {steps}")
        if logits_rows is not None and len(logits_rows) != steps:
            raise DraftsmithError(f"unroll got {len(logits_rows)} logits_rows masks for {steps} steps")
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = default_positions(b, s, 0, input_ids.device)
        kv = [UnrollKV() for _ in range(self.num_layers)]  # one per layer
        hidden, out = features, []
        for j in range(steps):
            hidden, logits = self(shift_left(input_ids, j + 1), hidden, position_ids + j, attention_mask, ttt=kv,
                                  logits_rows=None if logits_rows is None else logits_rows[j])
            out.append((hidden, logits))
        return out

    def target_logits(self, logits: Tensor) -> Tensor:
        """[..., Vd] draft logits → [..., V] over the target vocabulary, −inf outside the draft vocab."""
        return scatter_to_target(logits, self.draft_ids, self.t2d.shape[0])


# ---------------------------------------------------------------- builder and config


@torch.no_grad()
def init_from_target_layer(head: Eagle3Head, layer: nn.Module) -> None:
    """Start ``head`` as the target's decoder ``layer`` (a Llama-style layer of the same width) applied to the
    highest fused feature: fc copies the last H of its 3H inputs through (identity there, zero elsewhere);
    q/k/v read the hidden half of concat(embedding, hidden) with the layer's weights and start blind to the
    embedding half (zeros: the head learns what the next token adds); o_proj, the MLP and the norms are the
    layer's (hidden_norm is its input norm). A layer of another shape or structure is refused in one line."""
    mid, h = head.midlayer, head.hidden_size
    try:
        for name in ("q_proj", "k_proj", "v_proj"):
            ours, theirs = getattr(mid.self_attn, name), getattr(layer.self_attn, name)
            ours.weight.zero_()
            ours.weight[:, h:].copy_(theirs.weight)
            if ours.bias is not None:
                ours.bias.copy_(theirs.bias)
        mid.self_attn.o_proj.load_state_dict(layer.self_attn.o_proj.state_dict())
        mid.mlp.load_state_dict(layer.mlp.state_dict())
        mid.hidden_norm.weight.copy_(layer.input_layernorm.weight)
        mid.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)
    except (AttributeError, RuntimeError) as e:  # another layer structure (extra norms, other names) or shape
        raise DraftsmithError(f"drafter.init_from_layer: the target's layer ({type(layer).__name__}) is not a Llama-style "
                              f"layer of the head's shape ({type(e).__name__}: {str(e).splitlines()[0]}); leave it unset") from e
    head.fc.weight.zero_()
    head.fc.weight[:, 2 * h:].copy_(torch.eye(h, dtype=head.fc.weight.dtype, device=head.fc.weight.device))



def build_eagle3(arch: Any, embed: nn.Embedding, draft_vocab_size: int = 0, seed: int = 0, num_layers: int = 1,
                 head: type[Eagle3Head] = Eagle3Head, **options: Any) -> Eagle3Head:
    """An EAGLE-3 head for a target with HF config ``arch`` around ``embed``; seeded-random, full-vocab mapping.
    options: the norm options of :class:`Eagle3Head` (their RMSNorms start at 1 and draw no random numbers,
    so the other weights are the same with or without them), and those of ``head``, a subclass built on it
    (P-EAGLE's); num_layers: decoder layers (the layers past the first are drawn after every one-layer weight,
    so those are the same whatever the depth)."""
    vocab = int(text_config(arch).vocab_size)
    with seeded(seed):
        return head(embed, draft_layer_config(arch), draft_vocab_size or vocab, vocab, num_layers=num_layers, **options)


@dataclass
class Eagle3Config:
    """EAGLE-3: fused low/mid/high features, a 2H-input Llama layer, reduced draft vocabulary, TTT."""

    type: Literal["eagle3"] = "eagle3"
    feature_layers: list[int] = field(default_factory=list)
    """The three target layers fused (low, middle, high); id i = output of decoder layer i (0-based,
    negative from the end). Empty = the field's default (1, N//2-1, N-4), e.g. [1, 14, 26] for SmolLM2."""
    draft_vocab_size: int = 0
    """Tokens in the draft vocabulary; 0 = taken from draft_vocab, or the target's full vocabulary."""
    draft_vocab: str = ""
    """A safetensors file with d2t [Vd] and t2d [V] (made by draftsmith prepare); empty = the full vocabulary."""
    seed: int = 0
    """Seed of the random initialization of fc and the decoder layer."""
    fc_norm: bool = False
    """EAGLE-3.1: an RMSNorm of each fused target layer's features before fc (exported as ``fc_norm: true``;
    the speculators format holds it, the original eagle3 layout does not)."""
    norm_before_fc: bool = False
    """EAGLE-3.1 (gpt-oss style): one RMSNorm over the three layers' concatenated features before fc; excludes
    fc_norm."""
    norm_output: bool = False
    """EAGLE-3.1: pass the normed hidden state (what the lm_head reads) on to the next step, not the pre-norm one."""
    norm_before_residual: bool = False
    """The first layer's residual is its normed input hidden state (speculators' ``norm_before_residual``); off in
    EAGLE-3 and SGLang. Exported --to speculators and --to gguf (vLLM and llama.cpp read it), refused --to eagle3."""
    freeze_lm_head: bool = False
    """Training leaves the lm_head at the target's rows of the draft vocabulary (it is still saved with the head):
    fewer trainable weights where the data is small. False = trained (EAGLE-3)."""
    num_layers: int = 1
    """Decoder layers of the head: the first reads concat(embedding, hidden) as in EAGLE-3, the others are plain Llama
    layers after it (speculators' ``num_hidden_layers``). More layers cost a proportional draft step."""
    residual_between_layers: bool = True
    """With more than one layer: a layer after the first reads the previous layer's output (True: speculators, vLLM) or
    its MLP output alone, the residual stream dropped (False: what SGLang computes for the layers after the first of an
    EAGLE-3 checkpoint; ``draftsmith import`` sets it for such a head). Exported --to speculators when True, --to eagle3
    (SGLang) when False."""
    init_from_layer: int | None = None
    """Training starts the head from the target: its decoder layer from the target's layer of this id (0-based,
    negative from the end: -1 = the last) and fc passing the highest fused layer through
    (:func:`init_from_target_layer`); None = seeded-random fc and layer (EAGLE-3). Read only when a head is built
    for training; a saved head loads its own weights."""

    target_parts: ClassVar[tuple[str, ...]] = ("embed_tokens.",)
    """State-dict prefixes copied from the target (frozen), not stored in checkpoints."""
    runtime_class: ClassVar[Any] = EagleDrafter
    """The runtime drafter around the head (a family built on the EAGLE-3 head drafts its own way)."""

    def validate(self) -> None:
        if len(self.feature_layers) not in (0, 3):
            raise ConfigError(
                f"drafter.feature_layers = {self.feature_layers}: EAGLE-3 fuses exactly 3 target layers "
                f"(low, middle, high); leave it empty for the default"
            )
        if self.num_layers < 1:
            raise ConfigError(f"drafter.num_layers = {self.num_layers} must be at least 1")
        if not self.residual_between_layers and self.num_layers == 1:
            raise ConfigError("drafter.residual_between_layers = false does nothing for a one-layer head (it says what "
                              "the layers after the first read); leave it true")
        if self.draft_vocab_size < 0:
            raise ConfigError(f"drafter.draft_vocab_size = {self.draft_vocab_size} must be ≥ 0 (0 = full vocabulary)")
        if self.fc_norm and self.norm_before_fc:
            raise ConfigError("drafter.fc_norm and drafter.norm_before_fc exclude each other: choose one norm per "
                              "layer (fc_norm) or one over the concatenation (norm_before_fc)")

    @property
    def norms(self) -> dict[str, bool]:
        """The norm options (EAGLE-3.1's and norm_before_residual), as :class:`Eagle3Head` takes them."""
        return {"fc_norm": self.fc_norm, "norm_before_fc": self.norm_before_fc, "norm_output": self.norm_output,
                "norm_before_residual": self.norm_before_residual}

    @property
    def head_options(self) -> dict[str, bool]:
        """Every option of :class:`Eagle3Head`'s computation: :attr:`norms` and ``residual_between_layers``."""
        return {**self.norms, "residual_between_layers": self.residual_between_layers}

    def resolve(self, target: Target) -> Eagle3Config:
        """This config checked against ``target``, with feature_layers made explicit (0-based)."""
        return self.resolve_for(target.num_layers, target.vocab_size)

    def resolve_for(self, n: int, vocab_size: int) -> Eagle3Config:
        """:meth:`resolve` from the target's architecture alone (``n`` layers, ``vocab_size`` tokens)."""
        self.validate()
        given = self.feature_layers or list(default_eagle3_layers(n))
        layers = [resolve_layer(x, n, f"drafter.feature_layers[{i}]") for i, x in enumerate(given)]
        if len(set(layers)) != 3:
            raise ConfigError(f"drafter.feature_layers = {given} names the same layer twice; give 3 distinct layers")
        if self.draft_vocab_size > vocab_size:
            raise ConfigError(
                f"drafter.draft_vocab_size = {self.draft_vocab_size} is larger than the target's vocabulary "
                f"({vocab_size})"
            )
        return dataclasses.replace(self, feature_layers=layers)

    def build(self, target: Target) -> EagleDrafter:
        cfg = self.resolve(target)
        return cfg.runtime(cfg.build_module(target), target)

    def build_module(self, target: Target, vocab: Any = None) -> Eagle3Head:
        """A fresh head for ``target``. vocab: a DraftVocab (``.d2t``, ``.t2d``), a pair, or None for
        ``draft_vocab`` (or the full vocabulary when that is empty too)."""
        cfg = self.resolve(target)
        from ..data.vocab import resolve_draft_vocab

        d2t, t2d = resolve_draft_vocab(vocab, cfg.draft_vocab, cfg.draft_vocab_size, target.vocab_size, target.tokenizer_hash)
        own = target_parts(target.model)
        head = place(cfg.new_head(target.config, frozen_copy(own.embed), int(d2t.shape[0])), target.device, target.dtype)
        head.set_vocab(d2t.to(target.device), t2d.to(target.device))
        with torch.no_grad():
            head.norm.weight.copy_(own.norm.weight)
            head.lm_head.weight.copy_(own.lm_head.weight[head.draft_ids])
        head.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
        if cfg.init_from_layer is not None:
            layers = check_architecture(target.model, target.name, "features")
            init_from_target_layer(head, layers[resolve_layer(cfg.init_from_layer, target.num_layers,
                                                              "drafter.init_from_layer")])
        return head

    def module_for_checkpoint(self, target: Target, meta: dict[str, Any]) -> Eagle3Head:
        """The head's structure for loading (d2t/t2d come from the checkpoint)."""
        cfg = self.resolve(target)
        head = cfg.new_head(target.config, frozen_copy(target_parts(target.model).embed), cfg.draft_vocab_size)
        return place(head, target.device, target.dtype)

    def new_head(self, arch: Any, embed: nn.Module, draft_vocab_size: int) -> Eagle3Head:
        """The seeded-random head of this (resolved) config for a target with HF config ``arch`` around ``embed``,
        on the CPU in float32 (a family built on the EAGLE-3 head returns its own)."""
        return build_eagle3(arch, embed, draft_vocab_size, self.seed, self.num_layers, **self.head_options)

    def runtime(self, module: Eagle3Head, target: Target) -> EagleDrafter:
        cfg = dataclasses.replace(self.resolve(target), draft_vocab_size=int(module.d2t.shape[0]), draft_vocab="")
        return self.runtime_class(module, tuple(cfg.feature_layers), cfg)

    def checkpoint_meta(self, module: nn.Module) -> dict[str, Any]:
        return {"draft_vocab_size": int(module.d2t.shape[0])}
