"""The conventions serving engines disagree on, written once.

**Layer ids.** draftsmith's feature layer id ``i`` is the *output of decoder layer i*
(0-based, before the final norm), what ``Target.forward(feature_layers=…)`` returns. The
engines name the same tensor differently:

* vLLM (``eagle_aux_hidden_state_layer_ids`` at the top level of the draft config, and the
  ``speculators`` format) capture the *input of layer j* (``hidden_states + residual`` before
  layer j runs, i.e. HF ``hidden_states[j]``): j = i + 1. Its default for a target of N layers
  is (2, N//2, N-3) = our (1, N//2-1, N-4).
* SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` and adds 1 itself before
  capturing at the input of that layer (``LlamaForCausalLM.set_eagle3_layers_to_capture``,
  sglang ``python/sglang/srt/models/llama.py``: "we plus 1 here because in sglang, for the ith
  layer, it takes the output of the (i-1)th layer"), so its ids are ours unchanged. Its default
  without ids is the same (2, N//2, N-3) capture points.

 * llama.cpp (``draft-eagle3``) reads the GGUF key ``eagle3.target_layers``, which its converter
   (``convert_hf_to_gguf.py``, ``conversion/llama.py``) copies from the top-level
   ``eagle_aux_hidden_state_layer_ids``, and captures the *input* of those target layers
   (``common/speculative.cpp`` → ``llama_set_embeddings_layer_inp``): vLLM's convention, j = i + 1.
   It skips an id ≥ the target's layer count, so the output of the last layer (ours N-1) cannot
   be a llama.cpp feature: :func:`engine_layer_ids` refuses it for ``llamacpp``.

 * z-lab's DFlash (``dflash_config.target_layer_ids``) reads ``hidden_states[id + 1]``, the output of layer id:
   ours unchanged. speculators' DFlash (``aux_hidden_state_layer_ids``) is vLLM's convention, ours + 1.

:func:`engine_layer_ids` is the one place that converts; :func:`native_layer_ids` inverts it; ``draftsmith import``
reads every format's ids through the latter, so a head imported from either convention drafts from the same layers.

**Draft vocabulary.** ``d2t`` [Vd] int64 holds offsets, ``target_id = draft_id + d2t[draft_id]``;
``t2d`` [V] bool marks the target ids in the draft vocabulary (EAGLE-3 / SGLang / vLLM /
speculators all use this). :func:`check_draft_vocab` refuses a pair that is out of range or
inconsistent; it is the draft vocabulary's own check, written once in ``data/vocab.py`` below both
the drafters that read a pair and the exports that write one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from ..data.vocab import check_draft_vocab  # noqa: F401  (exports check the pair they write here)
from ..errors import DraftsmithError

Engine = Literal["vllm", "speculators", "sglang", "llamacpp", "zlab"]
ENGINE_OFFSET: dict[str, int] = {"vllm": 1, "speculators": 1, "sglang": 0, "llamacpp": 1, "zlab": 0}
"""engine id = draftsmith id + offset (see the module docstring for where each engine reads it)."""


def engine_layer_ids(ours: Sequence[int], num_layers: int, engine: Engine) -> list[int]:
    """draftsmith feature layer ids (output of layer i, 0-based, resolved) → the ids ``engine`` reads.

    SmolLM2 (30 layers): [1, 14, 26] → vLLM / speculators [2, 15, 27], SGLang [1, 14, 26].
    """
    if engine not in ENGINE_OFFSET:
        raise DraftsmithError(f"unknown engine {engine!r}; known: {', '.join(ENGINE_OFFSET)}")
    for i in ours:
        if not 0 <= int(i) < num_layers:
            raise DraftsmithError(f"feature layer {i} is not a layer of a {num_layers}-layer target (0 … {num_layers - 1})")
    theirs = [int(i) + ENGINE_OFFSET[engine] for i in ours]
    if engine == "llamacpp" and max(theirs, default=0) >= num_layers:
        raise DraftsmithError(f"feature layer {num_layers - 1} (the output of the last layer) cannot be served by llama.cpp, "
                              f"which captures the inputs of layers 0 … {num_layers - 1} only; train with earlier layers")
    return theirs


def native_layer_ids(theirs: Sequence[int], num_layers: int, engine: Engine) -> list[int]:
    """The inverse of :func:`engine_layer_ids`: ids read by ``engine`` → draftsmith's."""
    out = [int(j) - ENGINE_OFFSET[engine] for j in theirs]
    for j, i in zip(theirs, out):
        if not 0 <= i < num_layers:
            raise DraftsmithError(
                f"{engine} layer id {j} names no decoder output of a {num_layers}-layer target "
                f"({engine} ids run {ENGINE_OFFSET[engine]} … {num_layers - 1 + ENGINE_OFFSET[engine]})")
    return out
