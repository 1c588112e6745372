"""Building blocks shared by the trainable drafters (draft LM, EAGLE-1, EAGLE-3, Medusa).

* :func:`draft_layer_config` — the HF ``LlamaConfig`` of one draft decoder layer with the
  target's width, heads, MLP, norm epsilon and RoPE (EAGLE heads are Llama layers, as in
  EAGLE and SpecForge, whatever the target's family).
* :func:`causal_mask` — the additive attention mask every head uses (training and decoding).
* :func:`shift_left` — the token/feature alignment helper the training recipes use.
* :class:`TargetParts` / :func:`frozen_target_parts` — frozen copies of the target's
  embedding, final norm and lm_head that heads are built around; a checkpoint does not
  store them (they are copied again from the target on load, whose fingerprint matches).
* :func:`seeded` — deterministic random initialization that leaves the global RNG alone.
* :class:`FeatureDrafter` — the protocol state (``update``, ``set_gate``) of the feature-reading runtimes.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..errors import ConfigError, DraftsmithError
from ..cpu_kernels import cpu_linear


def text_config(arch: Any) -> Any:
    """The language-model part of a HF config (multimodal configs nest it)."""
    get = getattr(arch, "get_text_config", None)
    return get() if callable(get) else arch


def draft_layer_config(arch: Any) -> Any:
    """A one-layer ``LlamaConfig`` with the target's dimensions and RoPE; attention via SDPA.

    arch: the target's HF config (``target.config``).
    """
    from transformers import LlamaConfig

    tc = text_config(arch)
    heads = int(tc.num_attention_heads)
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(tc, "rope_theta", 10000.0)}
    if "full_attention" in rope:  # per layer type (Gemma-3: local 10k, global 1M): the head attends the whole context
        rope = rope["full_attention"]
    cfg = LlamaConfig(
        vocab_size=int(tc.vocab_size),
        hidden_size=int(tc.hidden_size),
        intermediate_size=int(tc.intermediate_size),
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(tc, "head_dim", None) or tc.hidden_size // heads),
        hidden_act=getattr(tc, "hidden_act", "silu"),
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 4096)),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_parameters=dict(rope),
        attention_bias=bool(getattr(tc, "attention_bias", False)),
        mlp_bias=bool(getattr(tc, "mlp_bias", False)),
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def causal_mask(
    q_len: int, past_len: int, dtype: torch.dtype, device: torch.device, padding: Tensor | None = None
) -> Tensor:
    """Additive attention mask ``[B|1, 1, q_len, past_len + q_len]``.

    Query i sits at absolute row ``past_len + i`` and may attend key j iff ``j ≤ past_len + i``
    and ``padding[b, j] != 0``. Allowed entries are 0, the others the dtype's minimum (a fully
    masked padding row then gets uniform weights instead of NaN).
    padding: [B, past_len + q_len] (1 = real token, 0 = padding) or None.
    """
    kv_len = past_len + q_len
    q_pos = torch.arange(past_len, kv_len, device=device)[:, None]  # [q, 1]
    k_pos = torch.arange(kv_len, device=device)[None, :]  # [1, kv]
    allowed = (k_pos <= q_pos)[None, None]  # [1, 1, q, kv]
    if padding is not None:
        if padding.shape[-1] != kv_len:
            raise DraftsmithError(f"attention_mask covers {padding.shape[-1]} positions, expected {kv_len}")
        allowed = allowed & padding[:, None, None, :].bool()  # [B, 1, q, kv]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


def default_positions(batch: int, seq: int, past_len: int, device: torch.device) -> Tensor:
    """[B, S] position ids past_len … past_len+S-1 (no left padding)."""
    return torch.arange(past_len, past_len + seq, device=device)[None].expand(batch, seq)


def step_inputs(
    like: Tensor, seq: int, cache: Any, position_ids: Tensor | None, attention_mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Position ids [B, S] and the additive mask [B|1, 1, S, past+S] of a head's step over ``seq`` rows.

    like: a [B, S, H] tensor giving batch, device and dtype; cache: the head's cache or None;
    attention_mask: [B, past+S] padding, or a ready 4-D additive mask (a draft tree's), used as is.
    """
    past = cache.get_seq_length() if cache is not None else 0
    if position_ids is None:
        position_ids = default_positions(like.shape[0], seq, past, like.device)
    if attention_mask is not None and attention_mask.dim() == 4:
        if tuple(attention_mask.shape[-2:]) != (seq, past + seq):
            raise DraftsmithError(f"a 4-D attention mask of shape {tuple(attention_mask.shape)} does not cover "
                                  f"{seq} queries over {past + seq} keys")
        return position_ids, attention_mask.to(like.dtype)
    return position_ids, causal_mask(seq, past, like.dtype, like.device, attention_mask)


def default_mask_token(given: int, target: Any) -> int:
    """The mask token id of a drafter that fills masked positions (DFlash, P-EAGLE): ``given`` when ≥ 0, else the
    tokenizer's mask token if it has one, else the last id of the vocabulary (an unused row of Qwen3's, a reserved
    token of Llama-3's; a rare token of SmolLM2's, which has no free row)."""
    if given >= 0:
        return given
    mask = getattr(target.tokenizer, "mask_token_id", None)
    return target.vocab_size - 1 if mask is None else int(mask)


def check_mask_token(mask: int, vocab_size: int) -> int:
    """``mask`` checked against the target's vocabulary (−1 = its last id); a ConfigError naming the field."""
    mask = vocab_size - 1 if mask < 0 else mask
    if not 0 <= mask < vocab_size:
        raise ConfigError(f"drafter.mask_token_id = {mask} is outside the target's vocabulary (0 … {vocab_size - 1})")
    return mask


def single_layer_cache(layer_config: Any) -> Any:
    """A HF DynamicCache for a one-layer head (layer index 0)."""
    from transformers import DynamicCache

    return DynamicCache(config=layer_config)


def check_features(kind: str, num_tokens: int, num_features: int, feature_layers: tuple[int, ...]) -> None:
    """The protocol's invariant: target features for every committed position but the last."""
    if num_features != num_tokens - 1:
        raise DraftsmithError(
            f"{kind} drafter holds {num_tokens} tokens but {num_features} target features; it needs the features "
            f"of every committed position but the last (the decoder must request drafter.feature_layers = "
            f"{feature_layers})"
        )


def take_committed(state: Any, kind: str, tokens: Tensor, features: Tensor | None) -> None:
    """The drafter protocol's ``update`` for a feature-reading runtime: append the committed tokens [m'] to
    ``state.tokens`` and queue their target features [m, F] in ``state._pending`` (counted in
    ``state.num_features``), then check :func:`check_features`."""
    state.tokens.extend(tokens.tolist())
    if features is not None and features.shape[0] > 0:
        state._pending.append(features)
        state.num_features += features.shape[0]
    check_features(kind, len(state.tokens), state.num_features, state.feature_layers)


class FeatureDrafter:
    """The base of the runtimes that read target features (EAGLE, DFlash, P-EAGLE): their module (which has an
    ``fc``), feature layers and config, and what they keep of the protocol's ``update`` calls — the
    committed tokens, the count of target features received and the feature blocks not yet consumed — and the
    decoder's confidence gate (a chain stops where the gate would cut it; a block is still one forward, and drafts
    past the cut are not kept). ``kind`` names the drafter in errors; ``reset`` (the subclass's) calls
    :meth:`reset_committed`.

    module: the drafter's nn.Module; feature_layers: the target layers the decoder must return (resolved,
    0-based); config: what ``drafters.save`` writes next to the weights."""

    kind: ClassVar[str] = "feature-reading"

    def __init__(self, module: nn.Module, feature_layers: tuple[int, ...], config: Any):
        self.module = module
        self.feature_layers = tuple(feature_layers)
        self.config = config
        self.reset()

    def reset(self) -> None:
        self.reset_committed()

    @property
    def device(self) -> torch.device:
        return self.module.fc.weight.device

    def reset_committed(self) -> None:
        self.stop_below = 0.0  # the decoder's confidence gate, set after reset (set_gate)
        self.tokens: list[int] = []
        self.num_features = 0
        self._pending: list[Tensor] = []  # [m, F] feature blocks not yet consumed

    def set_gate(self, min_confidence: float) -> None:
        """The decoder's confidence gate (``decode/protocol.py``: ``Gated``)."""
        self.stop_below = min_confidence

    def update(self, tokens: Tensor, features: Tensor | None) -> None:
        """Append committed tokens [m'] and the target features [m, F] of committed positions."""
        take_committed(self, self.kind, tokens, features)


def shift_left(x: Tensor, n: int, fill: float | int = 0) -> Tensor:
    """Shift ``x`` left by n along dim 1: ``out[:, t] = x[:, t + n]``, the last n rows = fill.

    x: [B, S, ...]. The training recipes align tokens with features with it: EAGLE's row t pairs
    feature f_t with token ``shift_left(input_ids, 1)[:, t]`` = x_{t+1}.
    """
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


@dataclass
class TargetParts:
    """Frozen copies of the target's input embedding, final norm and output head."""

    embed: nn.Embedding
    norm: nn.Module
    lm_head: nn.Module


def target_parts(model: nn.Module) -> TargetParts:
    """The target's own embedding, final norm and lm_head (shared, not copied)."""
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    norm = getattr(decoder, "norm", None)
    if embed is None or head is None or norm is None:
        raise DraftsmithError(
            f"the target ({type(model).__name__}) has no input embedding, final norm or lm_head where a "
            f"Llama-style causal LM keeps them (model.get_input_embeddings(), model.model.norm, model.lm_head)"
        )
    return TargetParts(embed=embed, norm=norm, lm_head=head)


def frozen_target_parts(model: nn.Module) -> TargetParts:
    """Frozen copies (not shared) of the target's embedding, final norm and lm_head, same device/dtype.

    Copies keep a head self-contained: any DeepSpeed stage may partition it without touching
    the target. A tied target gives a tied copy (one tensor for embedding and lm_head).
    """
    own = target_parts(model)
    parts = TargetParts(embed=frozen_copy(own.embed), norm=frozen_copy(own.norm), lm_head=frozen_copy(own.lm_head))
    if own.lm_head.weight is own.embed.weight:
        parts.lm_head.weight = parts.embed.weight
    return parts


def placeholder_parts(arch: Any) -> TargetParts:
    """Frozen modules with the target's shapes (for counting parameters on the meta device)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    tc = text_config(arch)
    h, v = int(tc.hidden_size), int(tc.vocab_size)
    parts = TargetParts(nn.Embedding(v, h), LlamaRMSNorm(h, eps=float(getattr(tc, "rms_norm_eps", 1e-6))), nn.Linear(h, v, bias=False))
    if getattr(tc, "tie_word_embeddings", False):
        parts.lm_head.weight = parts.embed.weight
    for m in (parts.embed, parts.norm, parts.lm_head):
        m.requires_grad_(False)
    return parts


def place(module: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """Move ``module`` to ``device`` and cast its floating PARAMETERS to ``dtype``.

    Unlike ``module.to(dtype)`` this leaves buffers alone, so RoPE's ``inv_freq`` stays float32
    as in the target (a bf16 ``inv_freq`` shifts every rotary angle). bf16 linears on an AVX2 CPU are
    routed through ``cpu_kernels.cpu_linear``, and fp32 ones through oneDNN, as the target's are.
    """
    module.to(device=device)
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    cpu_linear.install(module)  # as the target's (``target.load_target``)
    return module


def scatter_to_target(logits: Tensor, draft_ids: Tensor, vocab_size: int) -> Tensor:
    """[..., Vd] logits over a reduced draft vocabulary (target ids ``draft_ids`` [Vd]) → [..., V] over the
    target's ``vocab_size`` tokens, −inf outside the draft vocabulary (q = 0 there)."""
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    out[..., draft_ids] = logits
    return out


def frozen_copy(module: nn.Module) -> nn.Module:
    """A deep copy with every parameter frozen."""
    out = copy.deepcopy(module)
    out.requires_grad_(False)
    return out


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with the CPU RNG seeded, restoring the global RNG state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def count_parameters(module: nn.Module) -> dict[str, int]:
    """Unique parameters (tied weights counted once): trainable, frozen and total."""
    seen: set[int] = set()
    trainable = frozen = 0
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return {"trainable": trainable, "frozen": frozen, "total": trainable + frozen}

