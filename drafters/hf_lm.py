"""A standalone draft LM: any Hugging Face causal LM that shares the target's tokenizer.

It keeps its own KV cache. After a round, the cache holds the committed tokens plus
the drafts it fed (all but the last); on ``update`` it keeps the entries whose
tokens were accepted and crops the rest, so accepted tokens are never recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from ..decode.protocol import Proposal, common_prefix, draft_chain
from ..decode.sampling import Warp
from ..errors import ConfigError, DraftsmithError
from ..target import Target, crop_cache, freeze, rollback_cache


class HFDrafter:
    """Wraps a causal LM (``model(input_ids, cache=…, logits_to_keep=1)``) as a drafter."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, model: torch.nn.Module):
        self.model = model  # not frozen here: a draft LM may still be training (proposals run in inference mode)
        self.reset()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def set_gate(self, min_confidence: float) -> None:
        """Stop a chain where the decoder's confidence gate would cut it (``decode/protocol.py``)."""
        self.stop_below = min_confidence

    def reset(self) -> None:
        self.stop_below = 0.0  # the decoder's confidence gate, set after reset (set_gate)
        self.cache: Any = rollback_cache(self.model.config)
        self.tokens: list[int] = []
        self._drafted_from = 0  # committed length when the last proposal was made
        self._drafts: list[int] = []

    def update(self, tokens: Tensor, features: Tensor | None = None) -> None:
        new = tokens.tolist()
        if self._drafts:
            # cache rows beyond the committed prefix are drafts; keep those that were accepted
            kept = self._drafted_from + common_prefix(self._drafts, new)
            # never the last committed token's row: propose feeds it (a caller may commit exactly the first
            # draft, as the report's teacher forcing does; the decoder's last token always differs from the drafts)
            crop_cache(self.cache, min(kept, self.cache.get_seq_length(), self._drafted_from + len(new) - 1))
            self._drafts = []
        self.tokens.extend(new)

    @torch.inference_mode()
    def propose(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal:
        cached = self.cache.get_seq_length()

        def feed(ids: list[int]) -> Tensor:
            ids_t = torch.tensor([ids], device=self.device)  # [1, n ≥ 1]
            return self.model(input_ids=ids_t, cache=self.cache, use_cache=True, logits_to_keep=1).logits[0, -1]

        proposal = draft_chain(lambda token: feed([token]), feed(self.tokens[cached:]), k, warp, generator,
                               stop_below=self.stop_below)
        self._drafted_from = len(self.tokens)
        self._drafts = proposal.tokens.tolist()
        return proposal


@dataclass
class HFDrafterConfig:
    type: Literal["hf"] = "hf"
    model: str = ""
    """Hub id or local folder of a causal LM with exactly the target's vocabulary."""

    def build(self, target: Target) -> HFDrafter:
        if not self.model:
            raise ConfigError("drafter.model must name a HF causal LM (hub id or local folder)")
        return HFDrafter(freeze(load_same_vocab_lm(self.model, target, what=f"drafter '{self.model}'")))


def load_same_vocab_lm(name: str, target: Target, what: str) -> torch.nn.Module:
    """Load a HF causal LM (hub id or folder) on the target's device and dtype, refusing another vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=target.dtype)
    except (OSError, ValueError) as e:
        raise DraftsmithError(f"could not load {what}: {e}") from e
    check_same_vocab(tokenizer, target.tokenizer, what=what)
    rows = int(model.get_output_embeddings().weight.shape[0])
    if rows != target.vocab_size:
        raise DraftsmithError(
            f"{what} predicts {rows} token ids but the target predicts {target.vocab_size}; "
            f"the draft and target distributions must be over the same ids (use a model of the target's family "
            f"with the same vocabulary size)"
        )
    return model.to(target.device)


def check_same_vocab(tokenizer: Any, target_tokenizer: Any, what: str = "the drafter") -> None:
    """Speculative decoding compares token ids: the drafter must use the target's vocabulary."""
    if tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise DraftsmithError(
            f"{what} has a different tokenizer vocabulary from the target's; a drafter must share the target's "
            f"tokenizer (same family, e.g. a smaller model of the same series)"
        )
