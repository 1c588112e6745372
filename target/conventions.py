"""Conventions written once, below every user (data/, drafters/, decode/, export/): a layer id's range and negative
ids (:func:`resolve_layer`), EAGLE-3's default low/mid/high layers (:func:`default_eagle3_layers`), and the
end-of-sequence set (:func:`end_of_sequence_ids`)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


def resolve_layer(layer: int, num_layers: int, field: str) -> int:
    """A feature layer id (negative counts from the end: -1 is the last layer) → 0-based index, or a
    ConfigError naming ``field`` (the config key, or what asked for the layer)."""
    idx = layer + num_layers if layer < 0 else layer
    if not 0 <= idx < num_layers:
        raise ConfigError(
            f"{field} = {layer} is out of range: the target has {num_layers} layers (valid ids 0 … {num_layers - 1}, "
            f"or -{num_layers} … -1 from the end)"
        )
    return idx


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high feature layers in our ids (id i = output of decoder layer i, 0-based).

    EAGLE-3 and SGLang capture the *inputs* of layers 2, N//2 and N-3; SpecForge's HF backend
    hooks the *outputs* of layers 1, N//2-1, N-4 — the same tensors, which are ours.
    SmolLM2-135M (30 layers): (1, 14, 26); Llama-3.1-8B (32 layers): (1, 15, 28).
    """
    return (1, num_layers // 2 - 1, num_layers - 4)


def end_of_sequence_ids(*sources: Any) -> set[int]:
    """The end-of-sequence set: every ``eos_token_id`` (one id or a list, Llama-3's end-of-turn ids) of
    ``sources`` — a generation config, a tokenizer; a source that is None or has none adds nothing."""
    ids: set[int] = set()
    for src in sources:
        eos = getattr(src, "eos_token_id", None)
        if eos is not None:
            ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ids
