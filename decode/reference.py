"""The target decoding alone: the reference every speculative output is checked against."""

from __future__ import annotations

from typing import Any

import torch

from ..target import Target


@torch.inference_mode()
def hf_generate(target: Target, prompt_ids: list[int], max_new_tokens: int, **kwargs: Any) -> list[int]:
    """HF ``generate`` on the target, greedy, batch 1; new tokens only, stopping after EOS.

    kwargs go to ``generate`` (e.g. ``assistant_model=`` for HF assisted generation).
    """
    eos = sorted(target.eos_token_ids)
    out = target.model.generate(
        torch.tensor([prompt_ids], device=target.device),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=target.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos[0] if eos else None,
        **kwargs,
    )
    return out[0, len(prompt_ids) :].tolist()


def target_greedy(target: Target, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy decoding (HF ``generate``), new tokens only, stopping after EOS."""
    return hf_generate(target, prompt_ids, max_new_tokens)
