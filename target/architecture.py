"""What a model must be for draftsmith to decode with it or capture its features, and its KV cache: the checks
that refuse another in one line (:func:`check_cache_argument`, :func:`check_architecture`), a cache that rolls
back after a rejected draft (:func:`rollback_cache`, :func:`crop_cache`, :func:`keep_cache_rows`), and
:func:`freeze`."""

from __future__ import annotations

import inspect
from typing import Any, Literal

import torch
from torch import Tensor

from ..errors import DraftsmithError


MIN_TRANSFORMERS = "5.24"
"""The oldest transformers whose models take the KV cache as ``cache=`` (pyproject.toml's lower bound, tested)."""
DECODABLE_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_cache_argument(model: torch.nn.Module, name: str) -> None:
    """Refuse a model whose forward has no ``cache`` argument. draftsmith hands the KV cache over as ``cache=``
    (transformers 5.24 renamed ``past_key_values``); an older transformers takes the unknown keyword without a
    word and runs every step without the cache, so regenerated answers and drafts turn to noise (a GPU machine
    with transformers 5.17 did exactly that)."""
    if "cache" not in inspect.signature(model.forward).parameters:
        import transformers

        raise DraftsmithError(
            f"target '{name}' ({type(model).__name__}, transformers {transformers.__version__}) takes no cache= "
            f"argument: draftsmith needs transformers >= {MIN_TRANSFORMERS} (pip install 'transformers>={MIN_TRANSFORMERS}')")


def check_architecture(model: torch.nn.Module, name: str, need: Literal["decode", "features"]) -> Any:
    """Refuse, in one line, a target draftsmith cannot decode with (``decode``) or capture features from
    (``features``: also needs the Llama-style layer stack ``model.model.layers``, returned).

    Families known to work: Llama / Llama-3.x (rope scaling), Qwen2 / Qwen3 (q/k norms, untied
    embeddings), Mistral and SmolLM; sliding-window layers decode (see :func:`rollback_cache`).
    """
    cfg = getattr(model, "config", None)
    other = sorted({t for t in (getattr(cfg, "layer_types", None) or ()) if t not in DECODABLE_LAYER_TYPES})
    if other:
        raise DraftsmithError(
            f"target '{name}' ({type(model).__name__}) has {', '.join(other)} layers: draftsmith's decoder rolls the KV "
            f"cache back after a rejected draft, which only attention layers ({', '.join(DECODABLE_LAYER_TYPES)}) allow"
        )
    if need == "decode":
        return None
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise DraftsmithError(
            f"target '{name}' ({type(model).__name__}) has no decoder layers at model.model.layers, "
            f"where draftsmith captures features; the feature cache and the EAGLE / Medusa drafters need a "
            f"Llama-style model (Llama, Qwen2/3, Mistral, SmolLM, …)"
        )
    return layers


def rollback_cache(config: Any) -> Any:
    """A HF ``DynamicCache`` for ``config`` that :func:`crop_cache` can roll back.

    transformers gives sliding-window layers a cache that forgets positions past the window,
    so it cannot be cropped after a rejected draft; here every layer keeps its full past (the
    attention mask still applies the window, so logits are unchanged).
    """
    from transformers import DynamicCache

    layer_types = getattr(config, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):
        return DynamicCache()  # layers created on first use, all full
    return DynamicCache(config=config)


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions of a HF cache (drops speculative entries)."""
    n = cache.get_seq_length()
    if n > length:
        cache.crop(length - n)  # transformers 5: a negative count of positions to remove


def keep_cache_rows(cache: Any, start: int, rows: Tensor) -> None:
    """Keep positions 0 … start−1 and start + ``rows`` of every layer of a HF DynamicCache, in that order.

    rows: [n] long, increasing offsets past ``start`` (a tree verification's accepted path). The
    kept tail rows are copied into place and the rest cut off, so only n rows move, not the cache.
    """
    n = int(rows.shape[0])
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer":
            raise DraftsmithError(f"cannot compact a cache layer of type {type(layer).__name__}: tree decoding needs "
                                  f"full-attention layers (a sliding window drops rows by position)")
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        index = rows.to(layer.keys.device) + start
        layer.keys[..., start : start + n, :] = layer.keys[..., index, :]
        layer.values[..., start : start + n, :] = layer.values[..., index, :]
        layer.keys = layer.keys[..., : start + n, :]
        layer.values = layer.values[..., : start + n, :]


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
