"""A draft LM as a plain transformers model folder (``--to hf``): LoRA merged into the weights,
frozen parts (embedding, lm_head) written like any other, the target's tokenizer files and
generation config beside it, so ``target.generate(..., assistant_model=AutoModelForCausalLM
.from_pretrained(DIR))`` works as is."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import DraftsmithError
from ..target import Target
from .adapters import adapter


def write(source: Any, fmt: str, out: str) -> None:
    from ..drafters.draft_lm import merged_model

    model = merged_model(source.drafter.module)  # a copy when LoRA is merged; the source is untouched
    state = adapter("draft_lm", "hf").to_engine(dict(model.state_dict()))
    assert set(state) == set(model.state_dict())  # the plain-LM table maps every name to itself
    was = next(model.parameters()).dtype
    model.to(source.dtype)
    try:
        model.save_pretrained(out)
    finally:
        model.to(was)
    source.target.tokenizer.save_pretrained(out)


def load(folder: str, fmt: str, target: Target) -> Any:
    from ..drafters.hf_lm import HFDrafter, load_same_vocab_lm
    from ..target import freeze

    return HFDrafter(freeze(load_same_vocab_lm(folder, target, what=f"the hf export '{folder}'").to(target.dtype)))


def imported(folder: str, fmt: str, target: Target) -> tuple[Any, Any, dict[str, Any]]:
    """A transformers causal LM folder (weights in safetensors, the target's tokenizer beside them) as a draft_lm
    drafter: (config, model, record) for ``target`` (``export/importer.py``). Another tokenizer vocabulary or another
    number of output ids is refused in one line (``drafters.hf_lm.load_same_vocab_lm``); so is a folder with pickled
    weights only (transformers would unpickle them)."""
    import os

    from ..drafters.draft_lm import DraftLMConfig
    from ..drafters.hf_lm import load_same_vocab_lm

    if not any(f.endswith(".safetensors") for f in os.listdir(folder)):
        raise DraftsmithError(f"'{folder}' holds no .safetensors weights; draftsmith does not load pickled ones (loading "
                              f"them runs code from the file): save the model with safe_serialization")
    model = load_same_vocab_lm(folder, target, what=f"the draft LM '{folder}'").to(target.dtype)
    layers = int(getattr(model.config, "num_hidden_layers", 0) or getattr(model.config.get_text_config(), "num_hidden_layers"))
    return DraftLMConfig(num_layers=layers), model, {"model_type": model.config.model_type}


def assisted_identity(folder: str, target: Target, prompts: list[list[int]], max_new_tokens: int) -> list[str]:
    """transformers' assisted generation with the exported model must give the target's greedy output."""
    from transformers import AutoModelForCausalLM

    assistant = AutoModelForCausalLM.from_pretrained(folder, dtype=target.dtype).to(target.device).eval()
    for ids in prompts:
        x = torch.tensor([ids], device=target.device)
        mask = torch.ones_like(x)
        common = dict(attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                      pad_token_id=target.tokenizer.pad_token_id or 0)
        with torch.no_grad():
            greedy = target.model.generate(x, **common)
            assisted = target.model.generate(x, assistant_model=assistant, **common)
        if not torch.equal(greedy, assisted):
            raise DraftsmithError(f"{folder}: transformers' assisted generation with the exported model differs from "
                                  f"the target's greedy output")
    return [f"transformers assisted generation (assistant_model = the export) = the target's greedy output on "
            f"{len(prompts)} prompts × {max_new_tokens} tokens"]
