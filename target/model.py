"""The frozen target as draftsmith uses it: :class:`TargetFiles` (what its files say: tokenizer, configs,
fingerprint) and :class:`Target` (with the model: one forward gives the logits and, in the same forward, the
hidden states of the feature layers), and :func:`describe`.

Feature layers: ``Target.forward(..., feature_layers=(2, 15, 27))`` returns, in the same forward as the logits,
the *output of decoder layer i* (0-based, before the final norm; negative ids count from the end) for each
requested layer, concatenated on the last axis. EAGLE-style drafters name the layers they need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..chat import render_prompt, template_record
from .architecture import check_architecture, freeze, rollback_cache
from .conventions import end_of_sequence_ids, resolve_layer
from .fingerprint import model_fingerprint, tokenizer_fingerprint


@dataclass
class TargetOutput:
    logits: Tensor
    """[B, S', V] where S' = S, or logits_to_keep when given."""
    features: Tensor | None
    """[B, S, len(feature_layers) * H], or None when no layers were asked for."""


class TargetFiles:
    """A target as its files describe it, with no model built: name, tokenizer (its chat template applied),
    HF config, generation config and fingerprint (:func:`files_fingerprint`) — what a client needs when a
    server computes for the target (``data.regenerate.method: server``). A :class:`Target` is one too, with
    the model; :func:`load_target_files` reads one."""

    def __init__(self, config: Any, generation_config: Any, tokenizer: Any, name: str, fingerprint: str,
                 chat_option: str | None = None):
        self._config = config
        self._generation_config = generation_config
        self.tokenizer = tokenizer
        self.name = name
        self.fingerprint = fingerprint
        self.tokenizer_hash = tokenizer_fingerprint(tokenizer)
        self.chat_option = chat_option

    @property
    def config(self) -> Any:
        return self._config

    @property
    def generation_config(self) -> Any:
        return self._generation_config

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    @property
    def eos_token_ids(self) -> set[int]:
        """The generation config's and the tokenizer's end-of-sequence ids (:func:`end_of_sequence_ids`)."""
        return end_of_sequence_ids(self.generation_config, self.tokenizer)

    def layer_index(self, layer: int) -> int:
        """Resolve a possibly negative layer id (:func:`resolve_layer`); a ConfigError if out of range."""
        return resolve_layer(layer, self.num_layers, f"target '{self.name}': feature layer")

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` rendered with the target's chat template (a lone user prompt raw
        when there is none; see ``chat.py`` and ``target.chat_template``)."""
        return render_prompt(self.tokenizer, messages, add_generation_prompt, self.name)


class Target(TargetFiles):
    """A frozen causal LM with its tokenizer and fingerprint. Holds no config object."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, name: str, fingerprint: str | None = None,
                 chat_option: str | None = None):
        """chat_option: the ``target.chat_template`` the tokenizer's template came from, when known (drafters
        record it, ``describe``)."""
        check_architecture(model, name, need="decode")
        freeze(model)
        self.model = model
        super().__init__(model.config, None, tokenizer, name, fingerprint or model_fingerprint(model), chat_option)

    # ---- facts about the model
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def generation_config(self) -> Any:
        return getattr(self.model, "generation_config", None)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    # ---- compute
    def new_cache(self) -> Any:
        return rollback_cache(self.config)

    def forward(
        self,
        input_ids: Tensor,
        cache: Any = None,
        feature_layers: tuple[int, ...] = (),
        logits_to_keep: int = 0,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> TargetOutput:
        """One forward: logits and, if asked, the hidden states of ``feature_layers``.

        input_ids: [B, S] token ids; cache: a cache from :meth:`new_cache` (extended in place)
        or None; logits_to_keep: 0 = all positions, n = the last n. attention_mask: [B, past+S]
        padding (1 = token) or a ready 4-D additive mask [B|1, 1, S, past+S] (0 = attend, the
        dtype's minimum = not), which transformers hands to SDPA / eager attention unchanged
        (``masking_utils._preprocess_mask_arguments`` returns a 4-D mask as it is): a tree
        verification's mask; position_ids: [B, S] (default past … past+S−1).
        """
        captured: dict[int, Tensor] = {}
        hooks = []
        layers = check_architecture(self.model, self.name, need="features") if feature_layers else ()
        for layer in feature_layers:
            idx = self.layer_index(layer)

            def hook(_mod, _inp, out, idx=idx):
                captured[idx] = out[0] if isinstance(out, tuple) else out

            hooks.append(layers[idx].register_forward_hook(hook))
        try:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                cache=cache,
                use_cache=cache is not None,
                logits_to_keep=logits_to_keep,
                **({"position_ids": position_ids} if position_ids is not None else {}),
            )
        finally:
            for h in hooks:
                h.remove()
        features = None
        if feature_layers:
            features = torch.cat([captured[self.layer_index(layer)] for layer in feature_layers], dim=-1)
        return TargetOutput(logits=out.logits, features=features)


def render_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    return render_prompt(tokenizer, messages, add_generation_prompt)


def describe(target: Target) -> dict[str, Any]:
    """A small JSON-able summary (written next to run outputs)."""
    return {
        "name": target.name,
        "fingerprint": target.fingerprint,
        "tokenizer_hash": target.tokenizer_hash,
        "chat_template": template_record(target.tokenizer, target.chat_option),
        "layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "dtype": str(target.dtype).replace("torch.", ""),
        "device": str(target.device),
    }
