"""The target as a GGUF file for llama.cpp: the file it was loaded from, or a conversion made once.

Below ``data/`` (regeneration through a local ``llama-server``), ``measure/`` (a drafter measured in llama.cpp:
``eval.engine=llamacpp``), ``export/`` (``--to gguf-target``, ``export --check``) and the benchmarks, which all
serve the target in llama.cpp.
"""

from __future__ import annotations

import os

from ..devices import cache_dir
from ..errors import DraftsmithError
from ..files import atomic_path
from ..target import BUILTINS, TargetFiles, resolve_target_folder
from . import llamacpp
from .llamacpp import TARGET_GGUF_TYPES


def original_gguf(target_spec: str) -> str | None:
    """The GGUF file a target spec was loaded from (a builtin alias's packaged file, or the path), else None."""
    if target_spec in BUILTINS:
        from ..target import builtin_gguf

        return builtin_gguf(target_spec)
    return target_spec if target_spec.endswith(".gguf") and os.path.isfile(target_spec) else None


def cached_target(target: TargetFiles, kind: str = "f32") -> str:
    """A GGUF of ``target`` converted by llama.cpp's converter (once per fingerprint and kind, into the cache)."""
    path = os.path.join(cache_dir(), "gguf", f"{target.fingerprint}-{kind}.gguf")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_path(path) as tmp:
            llamacpp.convert(resolve_target_folder(target.name), tmp, kind)
    return path


def target_gguf(target: TargetFiles, kind: str) -> str:
    """The GGUF of ``target`` of type ``kind`` (``llamacpp.TARGET_GGUF_TYPES``) to serve in llama.cpp."""
    if kind not in TARGET_GGUF_TYPES:
        raise DraftsmithError(f"GGUF type {kind!r} is not one of: {', '.join(TARGET_GGUF_TYPES)}")
    if kind != "as-loaded":
        return cached_target(target, kind)
    original = original_gguf(target.name)
    if original is None:
        raise DraftsmithError(f"the target '{target.name}' was not loaded from a GGUF file, so it has no as-loaded "
                              f"GGUF; choose a converted one: {', '.join(TARGET_GGUF_TYPES[1:])}")
    return original


def target_gguf_for(target_spec: str, kind: str, target: TargetFiles) -> str:
    """The target's GGUF to serve a drafter on: the file it was loaded from (``as-loaded``; an F32 conversion for a
    target that came as an HF folder), else a conversion cached once per fingerprint (:func:`target_gguf`)."""
    return target_gguf(target, "f32" if kind == "as-loaded" and original_gguf(target_spec) is None else kind)
