"""What is exported: a drafter folder (``drafters.save``) or a training checkpoint folder.

Either way the result is the runtime drafter rebuilt on its target (fp32, CPU), with what the
export records about where it came from. A checkpoint of any ZeRO stage is read without an
engine or a process group (``train.checkpoint.read_checkpoint`` gathers ZeRO-3 partitions, and takes
the moving average of the weights where the run kept one, as its ``drafter/`` does), and
its target is the one its run folder's ``config.yaml`` names unless ``--target`` says otherwise;
either way the target's fingerprint must be the one the drafter was made for.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..errors import DraftsmithError
from ..target import Target, load_target
from .tensors import DTYPES


@dataclass
class Source:
    path: str
    kind: Literal["drafter", "checkpoint"]
    family: str
    """The drafter's ``type`` (draft_lm, eagle1, eagle3, medusa, dflash)."""
    drafter: Any
    """The runtime drafter: ``.module``, ``.config``, ``.feature_layers``."""
    target: Target
    dtype: torch.dtype
    """The dtype its weights were stored in (what the export writes)."""
    step: int | None = None
    """The training step of a checkpoint source."""

    @property
    def info(self) -> dict[str, Any]:
        """What the exported folder records about its source."""
        from ..schema import to_dict

        out = {"path": os.path.abspath(self.path), "kind": self.kind, "family": self.family,
               "drafter": to_dict(self.drafter.config), "feature_layers": list(self.drafter.feature_layers)}
        if self.step is not None:
            out["step"] = self.step
        return out


def source_kind(path: str) -> Literal["drafter", "checkpoint"]:
    """Which kind of folder ``path`` is (without reading weights); a one-line error for anything else."""
    if os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "model.safetensors")):
        return "drafter"
    if os.path.isfile(os.path.join(path, "trainer_state.json")):
        return "checkpoint"
    if not os.path.isdir(path):
        raise DraftsmithError(f"export source '{path}' does not exist")
    raise DraftsmithError(f"'{path}' is neither a drafter folder (config.json + model.safetensors, written by draftsmith "
                          f"train into <run_dir>/drafter) nor a complete training checkpoint (trainer_state.json + "
                          f"DeepSpeed files, <run_dir>/checkpoints/step_N)")


def source_family(path: str) -> str:
    """The drafter type a source folder holds, read from its metadata only (cheap: before loading anything)."""
    if source_kind(path) == "drafter":
        from ..drafters.checkpoint import read_meta

        return str(read_meta(path).get("drafter", {}).get("type"))
    from ..train.checkpoint import read_trainer_state

    return str(read_trainer_state(path)["identity"].get("drafter", {}).get("type"))


def open_source(path: str, target_spec: str | None = None) -> Source:
    """Rebuild the drafter of ``path`` on its target (fp32, CPU); refuse another target."""
    return _open_drafter(path, target_spec) if source_kind(path) == "drafter" else _open_checkpoint(path, target_spec)


def _load_checked_target(spec: str, fingerprint: str | None, what: str) -> Target:
    target = load_target(spec, "float32", "cpu")
    if fingerprint != target.fingerprint:
        raise DraftsmithError(f"{what} was made for a target with fingerprint {fingerprint}, but --target '{spec}' has "
                              f"fingerprint {target.fingerprint}: a drafter only fits the exact target it was trained "
                              f"with; name that target with --target")
    return target


def _open_drafter(path: str, target_spec: str | None) -> Source:
    from ..drafters.checkpoint import read_meta
    from ..drafters import load

    meta = read_meta(path)
    saved = meta.get("target", {})
    target = _load_checked_target(target_spec or saved.get("name", ""), saved.get("fingerprint"), f"drafter '{path}'")
    drafter = load(path, target)
    dtype = meta.get("dtype")
    return Source(path, "drafter", meta["drafter"]["type"], drafter, target,
                  DTYPES.get(dtype, torch.float32) if isinstance(dtype, str) else torch.float32)


def _open_checkpoint(path: str, target_spec: str | None) -> Source:
    from ..drafters.registry import trainable_families
    from ..schema import from_dict
    from ..train.checkpoint import read_checkpoint

    state, weights = read_checkpoint(path)
    identity = state["identity"]
    section = dict(identity.get("drafter") or {})
    kind = section.get("type")
    families = trainable_families()
    if kind not in families:
        raise DraftsmithError(f"checkpoint '{path}' holds a drafter of type {kind!r}; this draftsmith exports "
                              f"{', '.join(families)}")
    spec = target_spec or _run_target_name(path)
    target = _load_checked_target(spec, identity.get("target"), f"checkpoint '{path}'")
    config = from_dict(families[kind], section, where="drafter")
    if kind == "eagle3" and "d2t" not in weights:
        raise DraftsmithError(f"checkpoint '{path}' holds an EAGLE-3 head without its d2t buffer; it is damaged")
    if "d2t" in weights:  # EAGLE-3, a reduced DFlash: the vocabulary is in the weights; its file may be gone
        config = dataclasses.replace(config, draft_vocab="", draft_vocab_size=int(weights["d2t"].shape[0]))
        module = config.module_for_checkpoint(target, {})
    else:
        module = config.build_module(target)
    missing, unexpected = module.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith(config.target_parts)]
    if missing or unexpected:
        raise DraftsmithError(f"checkpoint '{path}' does not hold the drafter its trainer_state.json describes: missing "
                              f"{missing[:5]}, unexpected {list(unexpected)[:5]}")
    return Source(path, "checkpoint", kind, config.runtime(module, target), target, torch.float32,
                  step=int(state.get("step", 0)))


def _run_target_name(path: str) -> str:
    """The target a checkpoint's run used: ``target.name`` in ``<run_dir>/config.yaml``."""
    import yaml

    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "config.yaml")
    try:
        with open(recipe, encoding="utf-8") as f:
            name = (yaml.safe_load(f) or {}).get("target", {}).get("name")
    except (OSError, yaml.YAMLError):
        name = None
    if not name:
        raise DraftsmithError(f"cannot tell which target checkpoint '{path}' was trained against ({recipe} is missing "
                              f"or names none); pass --target")
    return str(name)
