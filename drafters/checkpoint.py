"""Drafter checkpoints and the family registry.

A drafter folder holds

* ``config.json`` — ``{"format": "draftsmith-drafter", "format_version": 1, "drafter": {type, …
  resolved config}, "target": {name, fingerprint, tokenizer_hash, shapes}, "dtype", "tied",
  "target_parts", …family extras}``;
* ``model.safetensors`` — the drafter's own tensors. Parts copied frozen from the target
  (``config.target_parts``: EAGLE's embedding, EAGLE-1's norm and lm_head, Medusa's feature
  norm) are NOT stored — as in EAGLE checkpoints — and are copied from the target again on
  load, which is safe because the target's fingerprint must match. EAGLE-3's ``d2t`` /
  ``t2d`` are buffers of the head and so live in ``model.safetensors`` under those names (as
  in EAGLE-3/SGLang checkpoints). Tied tensors are stored once (``tied`` maps alias → name).

The folder is written atomically (``files.atomic_dir``): a reader never sees half of it.
``load`` refuses a folder made for another target (fingerprint) with a message saying so.

Families: a folder holds one of the trainable families of ``drafters/registry.py`` (a spec with a
``recipe``), which follow ``registry.TrainableConfig``: ``build_module(target)``, ``runtime(module,
target)``, ``module_for_checkpoint(target, meta)``, ``checkpoint_meta(module)`` and
``target_parts``. This file reads them as the named section ``trainable_drafter`` that the registry
defines (the registry lists :class:`SavedDrafterConfig`, so this file does not import it).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..chat import template_mismatch
from ..errors import ConfigError, DraftsmithError
from ..files import atomic_dir, write_json
from ..cpu_kernels import cpu_linear
from ..schema import choices, from_dict, to_dict
from ..target import Target, describe

FORMAT = "draftsmith-drafter"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def save(path: str, config: Any, module: torch.nn.Module, target: Target,
         state_dict: dict[str, torch.Tensor] | None = None, extra: dict[str, Any] | None = None,
         beside: dict[str, str] | None = None) -> None:
    """Write what was trained to the folder ``path``: ``module``, built by the trainable family config
    ``config`` for ``target`` (no runtime is rebuilt, no file is read again).

    state_dict: the full state dict to store instead of ``module.state_dict()`` — for ZeRO-3, where
    rank 0 gathers it (same names as the module's). extra: more JSON-able entries for ``config.json``
    (e.g. training's ``selection`` of ``drafter-best``), read back by :func:`read_meta` and ignored by
    :func:`load`. What ``config.json`` records of the family is what its runtime around ``module``
    runs with (``config.runtime(module, target)``, which only wraps it): EAGLE-3's resolved layers and
    the size of the vocabulary the head holds, and the target layers the drafter reads. beside: subfolder
    name → a folder on the same file system moved into the drafter folder within the same atomic write
    (``draftsmith import`` of a LoRA-only Medusa-2 checkpoint keeps its merged target there).
    """
    trainable = choices("trainable_drafter")
    if not isinstance(config, tuple(trainable.values())):
        raise DraftsmithError(f"drafter '{getattr(config, 'type', type(config).__name__)}' has no trained weights of its "
                              f"own to save; save works for {', '.join(trainable)}")
    drafter = config.runtime(module, target)
    config, feature_layers = drafter.config, drafter.feature_layers
    state = module.state_dict() if state_dict is None else state_dict
    tensors, tied = _unique_tensors(state, config.target_parts)
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors.values() if t.is_floating_point()})
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "drafter": to_dict(config),
        "target": describe(target),
        "feature_layers": list(feature_layers),
        "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
        "target_parts": list(config.target_parts),
        "tied": tied,
        **config.checkpoint_meta(module),
        **(extra or {}),
    }
    from safetensors.torch import save_file

    with atomic_dir(path) as tmp:
        for name, folder in (beside or {}).items():
            os.replace(folder, os.path.join(tmp, name))
        save_file(tensors, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
        write_json(os.path.join(tmp, CONFIG_FILE), meta)


def read_meta(path: str) -> dict[str, Any]:
    """The parsed ``config.json`` of a drafter folder, checked for format."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file) or not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise DraftsmithError(
            f"'{path}' is not a drafter folder: it needs {CONFIG_FILE} and {WEIGHTS_FILE} (written by drafters.save / "
            f"draftsmith train)"
        )
    try:
        with open(file, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftsmithError(f"{file} is not valid JSON ({e}); the folder is damaged — re-save the drafter") from e
    if not isinstance(meta, dict):
        raise DraftsmithError(f"{file} holds a JSON {type(meta).__name__}, not a draftsmith drafter config (an object "
                              f"with format, drafter, target); the folder is damaged — re-save the drafter")
    if meta.get("format") != FORMAT:
        raise DraftsmithError(f"{file} is not a draftsmith drafter config (format = {meta.get('format')!r})")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise DraftsmithError(
            f"{file} has format_version {meta['format_version']}, newer than this draftsmith reads ({FORMAT_VERSION}); "
            f"upgrade draftsmith"
        )
    # every reader relies on these: a hand-edited or damaged file is refused here, in one line
    target, drafter = meta.get("target"), meta.get("drafter")
    if not isinstance(target, dict) or not isinstance(target.get("fingerprint"), str):
        raise DraftsmithError(f"{file} does not record the target the drafter was trained for ('target' = {target!r:.80}, "
                              f"needs its name and fingerprint), so it cannot be checked against one; the folder is "
                              f"damaged — re-save the drafter")
    if not isinstance(drafter, dict) or not isinstance(drafter.get("type"), str):
        raise DraftsmithError(f"{file} does not record the drafter's config ('drafter' = {drafter!r:.80}, needs its "
                              f"type); the folder is damaged — re-save the drafter")
    return meta


def load(path: str, target: Target) -> Any:
    """Rebuild the runtime drafter saved in ``path`` on ``target`` (its device and dtype).

    Refuses a folder saved against a target with another fingerprint. The module (for more
    training or export) is ``drafter.module``; its config ``drafter.config``.
    """
    meta = read_meta(path)
    saved = meta.get("target", {})
    if saved.get("fingerprint") != target.fingerprint:
        raise DraftsmithError(
            f"drafter '{path}' was trained against target '{saved.get('name')}' (fingerprint {saved.get('fingerprint')}), "
            f"but the target loaded now, '{target.name}', has fingerprint {target.fingerprint}. A drafter only fits "
            f"the exact target it was trained with: load that target (target.name) or train a drafter for this one."
        )
    mismatch = template_mismatch(saved.get("chat_template"), describe(target)["chat_template"], path)
    if mismatch:
        print(f"draftsmith: warning: {mismatch}", file=sys.stderr)
    section = meta.get("drafter", {})
    kind = section.get("type")
    fams = choices("trainable_drafter")
    if kind not in fams:
        raise DraftsmithError(f"drafter '{path}' has type {kind!r}; this draftsmith loads {', '.join(fams)}")
    config = from_dict(fams[kind], section, where="drafter")
    module = config.module_for_checkpoint(target, meta)
    _load_tensors(module, path, target.device, config.target_parts, meta.get("tied", {}))
    return config.runtime(module, target)


@dataclass
class SavedDrafterConfig:
    """A drafter saved by ``draftsmith train`` / ``drafters.save``: ``drafter: {type: saved, path: …}``."""

    type: Literal["saved"] = "saved"
    path: str = ""
    """The drafter folder (config.json + model.safetensors)."""

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("drafter.path must name a saved drafter folder (config.json + model.safetensors)")

    def build(self, target: Target) -> Any:
        """The saved drafter, frozen: a recipe's ``drafter: {type: saved}`` only decodes (training starts from a
        config, never from here), and frozen bf16 linears take the CPU route the target's take (packed once for
        oneDNN, ``cpu_kernels/cpu_linear.py``): left trainable, the head ran torch's slower kernel beside a faster
        target, and c rose from 0.069 to 0.084 of a target step."""
        drafter = load(self.path, target)
        drafter.module.requires_grad_(False)
        cpu_linear.install(drafter.module)
        return drafter


# ---------------------------------------------------------------- internals


def _unique_tensors(
    state: dict[str, torch.Tensor], skip: tuple[str, ...]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors to store (CPU copies, target parts dropped) and tied aliases (alias → stored name)."""
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        if name.startswith(skip):
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            tied[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().to("cpu", copy=True).contiguous()
    return tensors, tied


def _load_tensors(
    module: torch.nn.Module, path: str, device: torch.device, skip: tuple[str, ...], tied: dict[str, str]
) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = os.path.join(path, WEIGHTS_FILE)
    try:
        state = load_file(file, device=str(device))
    except (SafetensorError, OSError) as e:
        raise DraftsmithError(f"{file} cannot be read ({e}); the folder is damaged — re-save the drafter") from e
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatch
        raise DraftsmithError(f"{file} does not fit the drafter its config.json describes: {e}") from e
    missing = [k for k in missing if not k.startswith(skip) and k not in tied]
    if missing or unexpected:
        raise DraftsmithError(
            f"{file} does not fit the drafter its config.json describes: missing {missing[:5]}, unexpected "
            f"{list(unexpected)[:5]}"
        )

