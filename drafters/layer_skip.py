"""Layer-skip self-drafter: the target's first N layers, its final norm and lm_head.

It needs no training, so the decoder can be exercised end to end before any drafter
exists (as in LayerSkip / self-speculative decoding). Two runtimes, same drafts:

* :class:`SelfSpeculativeDrafter` (default, ``share_cache: true``) drafts *inside the
  target's own KV cache*: the first N layers of the target are the drafter, so their
  cache entries for committed tokens are already there (no drafter prefill, no second
  cache), and the layer-N hidden states computed while drafting are reused by the
  verification forward, which then runs only layers N…L-1 for those positions (plus
  layers 0…N-1 for the last draft, never seen by the drafter). Lossless like any
  verification: the target's logits come from the target's own layers.
* a plain truncated HF causal LM with its own cache (:class:`HFDrafter`), exactly what HF
  assisted generation uses as ``assistant_model``; the fallback for architectures whose
  layer stack the self-speculative path does not know.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from ..decode.protocol import Proposal, common_prefix, draft_chain
from ..decode.sampling import Warp
from ..errors import ConfigError, DraftsmithError
from ..target import Target, TargetOutput
from .hf_lm import HFDrafter

# Architectures whose decoder stack is model.model.{embed_tokens, layers, norm, rotary_emb} + lm_head,
# with no embedding scaling, so running a slice of layers by hand equals the model's own forward.
SELF_SPECULATIVE_TYPES = ("llama", "qwen2", "qwen3")


def truncated_model(target_model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A causal LM that runs the first ``num_layers`` decoder layers of ``target_model``."""
    _check_depth(target_model, num_layers)
    config = copy.deepcopy(target_model.config)
    config.num_hidden_layers = num_layers
    with torch.device("meta"):
        model = type(target_model)(config)
    model.model.embed_tokens = target_model.model.embed_tokens
    model.model.layers = torch.nn.ModuleList(list(target_model.model.layers[:num_layers]))
    model.model.norm = target_model.model.norm
    model.model.rotary_emb = target_model.model.rotary_emb
    model.lm_head = target_model.lm_head
    model.generation_config = copy.deepcopy(target_model.generation_config)
    model.eval()
    return model


def _check_depth(target_model: torch.nn.Module, num_layers: int) -> None:
    total = int(target_model.config.num_hidden_layers)
    if not 1 <= num_layers < total:
        raise ConfigError(f"drafter.num_layers = {num_layers} must be between 1 and {total - 1} for this target")


def supports_self_speculation(model: torch.nn.Module) -> bool:
    cfg = model.config
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
    return (
        getattr(cfg, "model_type", None) in SELF_SPECULATIVE_TYPES
        and all(t == "full_attention" for t in layer_types)
        and all(hasattr(model.model, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))
    )


class SelfSpeculativeDrafter:
    """Drafts with the target's first N layers inside the target's KV cache (see the module docstring).

    Optional ability ``BindsTargetCache`` (``decode/protocol.py``), used by the chain decoder:
    ``bind(cache)`` hands over the target's cache before the prefill, and ``verify(ids)``
    replaces the target's verification forward. Cache invariant between rounds (kept by the
    decoder's crop): every layer holds all committed tokens but the last.
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(self, target_model: torch.nn.Module, num_layers: int):
        _check_depth(target_model, num_layers)
        if not supports_self_speculation(target_model):
            raise ConfigError(
                f"self-speculative layer skip supports model types {', '.join(SELF_SPECULATIVE_TYPES)} with full "
                f"attention; use drafter.share_cache=false for this target"
            )
        self.model = target_model
        self.num_layers = num_layers
        self.total_layers = int(target_model.config.num_hidden_layers)
        self.reset()

    def reset(self) -> None:
        self.cache: Any = None
        self.tokens: list[int] = []
        self._states: list[Tensor] = []  # [1, 1, H] layer-N hidden states of the positions drafted from
        self._state_tokens: list[int] = []

    def bind(self, cache: Any) -> None:
        self.cache = cache

    def update(self, tokens: Tensor, features: Tensor | None = None) -> None:
        self.tokens.extend(tokens.tolist())
        self._states, self._state_tokens = [], []  # used by verify; the decoder has cropped the cache since

    @torch.inference_mode()
    def propose(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal:
        if self.cache is None:
            raise DraftsmithError("SelfSpeculativeDrafter.propose needs the target's cache: call bind(cache) first")
        position = len(self.tokens) - 1  # of the last committed token, not yet in the cache
        device = self.model.lm_head.weight.device

        def step(token: int) -> Tensor:
            nonlocal position
            h = self._layers(self._embed([token], device), 0, self.num_layers, position)  # [1, 1, H]
            position += 1
            self._states.append(h)
            self._state_tokens.append(token)
            return self.model.lm_head(self.model.model.norm(h))[0, -1]  # [V]

        return draft_chain(step, step(self.tokens[-1]), k, warp, generator)

    @torch.inference_mode()
    def verify(self, input_ids: Tensor) -> TargetOutput:
        """The target's forward over [1, S] ids (last committed token + drafts), reusing drafted states."""
        ids = input_ids[0].tolist()
        start = len(self.tokens) - 1
        reuse = common_prefix(self._state_tokens, ids)
        for layer in self.cache.layers[: self.num_layers]:  # drop drafted entries that are not verified now
            extra = layer.get_seq_length() - (start + reuse)
            if extra > 0:
                layer.crop(-extra)
        parts = self._states[:reuse]
        if reuse < len(ids):
            parts.append(self._layers(self._embed(ids[reuse:], input_ids.device), 0, self.num_layers, start + reuse))
        h = self._layers(torch.cat(parts, dim=1), self.num_layers, self.total_layers, start)  # [1, S, H]
        self._states, self._state_tokens = [], []
        return TargetOutput(logits=self.model.lm_head(self.model.model.norm(h)), features=None)

    def _embed(self, ids: list[int], device: torch.device) -> Tensor:
        return self.model.model.embed_tokens(torch.tensor([ids], device=device))  # [1, S, H]

    def _layers(self, h: Tensor, first: int, last: int, start: int) -> Tensor:
        """Run decoder layers first…last-1 on h [1, S, H] at positions start…start+S-1, through the cache."""
        from transformers.masking_utils import create_causal_mask

        inner = self.model.model
        position_ids = torch.arange(start, start + h.shape[1], device=h.device)[None]  # [1, S]
        mask = create_causal_mask(
            config=self.model.config, inputs_embeds=h, attention_mask=None, cache=self.cache,
            position_ids=position_ids, layer_idx=first,
        )
        position_embeddings = inner.rotary_emb(h, position_ids=position_ids)
        for layer in inner.layers[first:last]:
            h = layer(h, attention_mask=mask, position_ids=position_ids, cache=self.cache, use_cache=True,
                      position_embeddings=position_embeddings)
        return h


def layer_skip_drafter(target_model: torch.nn.Module, num_layers: int, share_cache: bool = False) -> Any:
    """The layer-skip drafter: self-speculative (shared cache) or a truncated HF model with its own cache."""
    if share_cache and supports_self_speculation(target_model):
        return SelfSpeculativeDrafter(target_model, num_layers)
    return HFDrafter(truncated_model(target_model, num_layers))


@dataclass
class LayerSkipConfig:
    type: Literal["layer_skip"] = "layer_skip"
    num_layers: int = 8
    """How many of the target's first layers the drafter runs (1 … layers-1)."""
    share_cache: bool = True
    """Draft inside the target's KV cache and reuse the drafted hidden states in verification
    (self-speculative; Llama/Qwen-style models, else falls back). false = a truncated copy with its
    own cache, as HF assisted generation runs it. Both propose the same tokens."""

    def build(self, target: Target) -> Any:
        return layer_skip_drafter(target.model, self.num_layers, self.share_cache)
