"""Medusa-2: the heads in one folder with the backbone they were trained with (``--to medusa2``, ``--from medusa2``).

Medusa-2 (Cai et al. 2024, §2.2.2) fine-tunes the backbone together with the heads, so the heads fit that backbone
and no other: the target of an imported Medusa-2 drafter is the backbone stored in its own folder.

The layout is the one the Medusa code writes and reads. Training: the axolotl fork that FasterDecoding/Medusa's
README names (ctlllll/axolotl ``src/axolotl/monkeypatch/medusa_utils.py``, ``add_medusa_heads``) gives a
``LlamaForCausalLM`` / ``MistralForCausalLM`` a ``medusa_head`` module and ``config.medusa_num_heads`` /
``medusa_num_layers``, and ``save_pretrained`` writes them with the model. Reading: FasterDecoding/Medusa
``medusa/model/medusa_model.py``, ``MedusaModel.from_pretrained`` (its first branch: the folder's own config, the
whole model loaded from it). So the folder is a transformers causal LM: ``config.json`` of the backbone plus
``medusa_num_heads`` and ``medusa_num_layers``; ``model.safetensors`` or shards with ``model.safetensors.index.json``;
the tokenizer. Beside the backbone's tensors its weights hold head h's residual block l as
``medusa_head.{h}.{l}.linear.weight`` [H, H] / ``.bias`` [H] and its projection as ``medusa_head.{h}.{L}.weight``
[V, H] (L = ``medusa_num_layers``; 0, axolotl's default, is the projection alone).

Medusa's forward (``MedusaModelABC.forward`` with ``medusa_forward=True``) runs every head on ``self.model(...)[0]``,
the backbone's final-normed last hidden state, which is what draftsmith's heads compute from the pre-norm feature
with their copy of the target's final norm; head k predicts the token k+2 ahead in both. The weights carry over
unchanged (``adapters.MEDUSA2``: the reference layout's names under ``medusa_head.``).

The Medusa code builds a head's blocks as ``[ResBlock(H)] * L``, one block applied L times. transformers 4.x's
``save_pretrained`` keeps one name of the tensors that share storage (the last in sorted order) and drops the
others, so a head of L ≥ 2 blocks may be stored under one block's name: :func:`fill_shared_blocks` gives each dropped
name the kept tensor. A file whose blocks of one head differ is refused (Medusa's code would apply whichever it
loaded last), and so is the export of a draftsmith head whose blocks differ (``--to medusa`` or ``medusa-vllm`` hold
it: TGI and vLLM build one block per layer).

The folder is a draftsmith target as it is: transformers loads its causal LM and leaves ``medusa_head.*`` out
(without listing them as unexpected: ``target.load_causal_lm``), and the target's fingerprint leaves them out too
(``target.fingerprint.NOT_THE_MODELS``), so ``--target`` may name this folder, or its backbone saved anywhere; any
other target is refused in one line. Pickled weights (``pytorch_model*.bin``, what axolotl writes unless
``save_safetensors: true``) are read only with ``torch.load(weights_only=True)``: a pickle that holds more than
tensors is refused in one line, never run.

LoRA-only (:func:`lora_only`): a peft LoRA adapter trained with the heads, saved without the backbone (LoRAX's Medusa
LoRA adapters): its heads fit the base with the LoRA merged, which :func:`merge_lora` writes as a checkpoint of the
layout above; ``draftsmith import --base`` makes that the target.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from torch import Tensor

from ..errors import DraftsmithError
from ..files import write_json
from ..target import Target
from . import medusa
from .adapters import adapter
from .tensors import DTYPES, check_tensors, dtype_name, read_json, read_safetensors

PREFIX = "medusa_head."
"""Where the heads' tensors are in the model's state dict (the Medusa code's ``medusa_head`` attribute)."""


def read_config(folder: str) -> dict[str, Any]:
    """(heads, layers, hidden, vocab) from the backbone's ``config.json`` with Medusa's two keys; one line if either is
    missing."""
    cfg = read_json(os.path.join(folder, "config.json"))
    try:
        return {"heads": int(cfg["medusa_num_heads"]), "layers": int(cfg["medusa_num_layers"]),
                "hidden": int(cfg["hidden_size"]), "vocab": int(cfg["vocab_size"]), "raw": cfg}
    except (KeyError, TypeError, ValueError) as e:
        raise DraftsmithError(f"{folder}/config.json lacks a field the Medusa code reads: {e}") from e


def head_tensors(folder: str) -> dict[str, Tensor]:
    """The ``medusa_head.*`` tensors of the folder's weights: its safetensors (one file or the index's shards), else its
    pickled weights (``pytorch_model.bin`` or the index's shards that hold a head tensor), read only with
    ``torch.load(weights_only=True)`` (``target.load_pickled``: a pickle holding more than tensors is refused in one
    line, never run); the backbone's tensors are not kept."""
    from safetensors import safe_open

    from ..target import load_pickled, pickled_weight_files, safetensors_files

    out: dict[str, Tensor] = {}
    files = safetensors_files(folder)
    for path in files:
        with safe_open(path, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys() if name.startswith(PREFIX)})
    if not files:
        pickled = pickled_weight_files(folder)
        if not pickled:
            raise DraftsmithError(f"'{folder}' holds no model weights: no model.safetensors or pytorch_model.bin, nor "
                                  f"shards listed in their index")
        index = os.path.join(folder, "pytorch_model.bin.index.json")
        if os.path.isfile(index):  # only the shards that hold a head tensor
            wanted = {file for name, file in read_json(index)["weight_map"].items() if name.startswith(PREFIX)}
            pickled = [path for path in pickled if os.path.basename(path) in wanted]
        for path in pickled:
            out.update({name: t for name, t in load_pickled(path).items() if name.startswith(PREFIX)})
    if not out:
        raise DraftsmithError(f"'{folder}' has medusa_num_heads in its config.json and no {PREFIX}* tensor in its weights")
    return out


def fill_shared_blocks(tensors: dict[str, Tensor], c: dict[str, Any], where: str) -> dict[str, Tensor]:
    """``tensors`` with the names of a head's blocks that save_pretrained dropped as aliases (module docstring) given the
    block stored; a head whose stored blocks differ is refused in one line."""
    out = dict(tensors)
    for h in range(c["heads"]):
        for part in ("weight", "bias"):
            names = [f"{PREFIX}{h}.{layer}.linear.{part}" for layer in range(c["layers"])]
            kept = [out[n] for n in names if n in out]
            if any(not torch.equal(kept[0], t) for t in kept[1:]):
                raise DraftsmithError(f"{where}: head {h}'s {c['layers']} residual blocks differ (linear.{part}), and "
                                      f"the Medusa code applies one block {c['layers']} times ([ResBlock] * "
                                      f"medusa_num_layers): which one it would apply is undefined")
            for n in names[: len(names) if kept else 0]:
                out.setdefault(n, kept[0])
    return out


# ---------------------------------------------------------------- LoRA-only: an adapter and the heads, no backbone


ADAPTER_CONFIG = "adapter_config.json"
"""peft's adapter config (``base_model_name_or_path``, ``peft_type``, the LoRA's rank and target modules)."""
BACKBONE = "backbone"
"""The subfolder of an import's ``--out`` that holds the Medusa-2 checkpoint a LoRA-only one merges into: its target."""
_HEAD_NAME = re.compile(r"(?:^|\.)medusa_head\.(\d+\.\d+\..+)\Z|\A(\d+\.\d+\.(?:linear\.)?(?:weight|bias))\Z")
"""A head tensor in an adapter's files: under ``medusa_head.`` (behind peft's ``base_model.model.`` or not), or in the
reference layout's own names (``{h}.{l}.linear.*``, ``{h}.{L}.weight``, as LoRAX reads a Medusa LoRA adapter)."""


def lora_only(folder: str) -> bool:
    """Whether ``folder`` is a LoRA-only Medusa-2 checkpoint: a peft adapter (``adapter_config.json``) trained with the
    heads, saved without the backbone it adapts (no model weights beside it)."""
    from ..target import pickled_weight_files, safetensors_files

    return (os.path.isfile(os.path.join(folder, ADAPTER_CONFIG)) and not safetensors_files(folder)
            and not pickled_weight_files(folder))


def refuse_unmerged(folder: str) -> DraftsmithError:
    """The one-line refusal of a LoRA-only checkpoint imported without its base."""
    base = read_json(os.path.join(folder, ADAPTER_CONFIG)).get("base_model_name_or_path") or "MODEL"
    return DraftsmithError(f"'{folder}' is a LoRA-only Medusa-2 checkpoint (a peft adapter, {ADAPTER_CONFIG}, and the "
                           f"heads, no merged backbone): its heads fit the backbone with this adapter merged; pass "
                           f"--base {base} (the model it was trained from) to merge it through peft")


def adapter_tensors(folder: str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(heads under ``medusa_head.``, the LoRA tensors as peft saved them) of a LoRA-only checkpoint's files: every
    safetensors file of the folder (LoRAX reads them all), else ``adapter_model.bin`` read only with
    ``torch.load(weights_only=True)``."""
    from ..target import load_pickled

    files = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))
    tensors: dict[str, Tensor] = {}
    for path in files:
        tensors.update(read_safetensors(path))
    if not files:
        pickled = os.path.join(folder, "adapter_model.bin")
        if not os.path.isfile(pickled):
            raise DraftsmithError(f"'{folder}' has {ADAPTER_CONFIG} and no adapter weights (adapter_model.safetensors "
                                  f"or adapter_model.bin)")
        tensors = load_pickled(pickled)
    heads, lora = {}, {}
    for name, t in tensors.items():
        m = _HEAD_NAME.search(name)
        if m:
            heads[PREFIX + (m.group(1) or m.group(2))] = t
        else:
            lora[name] = t
    return heads, lora


def merge_lora(folder: str, base: str, out: str) -> None:
    """Write into ``out`` the Medusa-2 checkpoint the LoRA-only one in ``folder`` stands for: ``base`` (a target spec)
    with the adapter merged through peft (``merge_and_unload``, in fp32, stored in the base's dtype), the heads beside
    it under ``medusa_head.`` with the folder's ``medusa_num_heads`` / ``medusa_num_layers`` (the layout :func:`write`
    writes), and the folder's tokenizer, else the base's. One line if the adapter is not a LoRA, does not fit the base,
    or holds no head."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoConfig, AutoTokenizer

    from ..target import load_causal_lm, resolve_target_folder

    kind = read_json(os.path.join(folder, ADAPTER_CONFIG)).get("peft_type")
    if kind != "LORA":
        raise DraftsmithError(f"'{folder}': its adapter is a {kind} adapter; draftsmith merges LoRA adapters")
    medusa = {k: read_json(os.path.join(folder, "config.json"))[k] for k in ("medusa_num_heads", "medusa_num_layers")}
    heads, lora = adapter_tensors(folder)
    if not heads:
        raise DraftsmithError(f"'{folder}': its adapter holds no Medusa head tensor ({PREFIX}* or the reference layout's "
                              f"{{h}}.{{l}}.linear.*): it is a plain LoRA, not a Medusa-2 checkpoint")
    base_folder = resolve_target_folder(base)
    try:
        model = load_causal_lm(base_folder, torch.float32, f"the base '{base}'")
        config = LoraConfig.from_pretrained(folder)
        config.modules_to_save = None  # the heads are read from the files here, not wrapped by peft
        peft_model = get_peft_model(model, config)
        loaded = set_peft_model_state_dict(peft_model, lora)
    except (OSError, ValueError, RuntimeError) as e:  # no such base, or LoRA shapes other than the base's
        raise DraftsmithError(f"'{folder}': its adapter does not merge into '{base}' "
                              f"({' '.join(str(e).split())[:300]})") from e
    missing = [k for k in loaded.missing_keys if "lora_" in k]
    if loaded.unexpected_keys or missing:
        raise DraftsmithError(f"'{folder}': its adapter does not fit '{base}': unexpected {list(loaded.unexpected_keys)[:3]}, "
                              f"missing {missing[:3]}")
    merged = peft_model.merge_and_unload()
    stored = _config_dtype(AutoConfig.from_pretrained(base_folder))  # as the base's folder stores its weights
    state = {k: t.to(stored) if t.is_floating_point() else t for k, t in merged.state_dict().items()}
    merged.save_pretrained(out, state_dict={**state, **heads})
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):  # an adapter saved without its tokenizer
        tokenizer = AutoTokenizer.from_pretrained(base_folder)
    tokenizer.save_pretrained(out)
    path = os.path.join(out, "config.json")
    write_json(path, {**read_json(path), **medusa, "dtype": dtype_name(stored)})


def backbone_fingerprint(folder: str) -> str:
    """The fingerprint of the causal LM in ``folder`` (its heads left out: ``target.fingerprint.NOT_THE_MODELS``)."""
    from transformers import AutoConfig

    from ..target import files_fingerprint, load_target

    return files_fingerprint(folder, AutoConfig.from_pretrained(folder)) or load_target(folder, "bfloat16", "cpu").fingerprint


def static_check(folder: str, fmt: str, target: Target) -> list[str]:
    """The backbone in ``folder`` is ``target`` and every head tensor is there with its shape; one line per check."""
    c = read_config(folder)
    done = [f"config: {c['heads']} heads × {c['layers']} residual blocks (medusa_num_heads, medusa_num_layers) on a "
            f"{'/'.join(c['raw'].get('architectures') or ['?'])} backbone"]
    tensors = fill_shared_blocks(head_tensors(folder), c, folder)  # read first: a pickle of the heads is vetted here
    found = backbone_fingerprint(folder)
    if found != target.fingerprint:
        raise DraftsmithError(f"'{folder}' is a Medusa-2 checkpoint: its heads were trained together with its own "
                              f"backbone (fingerprint {found}) and fit no other, and the target '{target.name}' has "
                              f"{target.fingerprint}; pass --target {folder}")
    done.append(f"its backbone is the target (fingerprint {found}): the model the heads were trained with")
    stored = dtype_name(next(iter(tensors.values())).dtype)
    if stored not in DTYPES:
        raise DraftsmithError(f"{folder}: the heads are stored as {stored}; draftsmith reads {', '.join(DTYPES)}")
    expected = medusa.expected_tensors({**c, "dtype": stored}, "medusa")
    done += check_tensors(tensors, {PREFIX + name: spec for name, spec in expected.items()}, folder)
    return done


def load(folder: str, fmt: str, target: Target) -> Any:
    c = read_config(folder)
    return medusa.drafter_of(fill_shared_blocks(head_tensors(folder), c, folder), c, fmt, target, folder)


def imported(folder: str, fmt: str, target: Target) -> tuple[Any, Any, dict[str, Any]]:
    """A Medusa-2 checkpoint's heads as (config, heads, record) for ``target``, which must be the backbone in the same
    folder (``export/importer.py``); refused in one line: another target, a missing or misshapen head tensor."""
    from ..drafters.medusa import MedusaConfig

    static_check(folder, fmt, target)
    c = read_config(folder)
    return MedusaConfig(num_heads=c["heads"], num_layers=c["layers"]), load(folder, fmt, target).module, {
        "backbone": os.path.abspath(folder), "backbone_fingerprint": target.fingerprint}


def write(source: Any, fmt: str, out: str) -> None:
    """The target's weights (in the dtype its folder stores them in) and the heads (in the drafter's) in one causal-LM
    folder, as ``save_pretrained`` writes a Medusa-2 model; refused where a head's blocks differ (module docstring)."""
    heads = source.drafter.module
    layers = len(heads.heads[0]) - 1
    for h, head in enumerate(heads.heads):
        blocks = [block.linear for block in head[:-1]]
        if any(not (torch.equal(b.weight, blocks[0].weight) and torch.equal(b.bias, blocks[0].bias)) for b in blocks[1:]):
            raise DraftsmithError(f"head {h} has {layers} different residual blocks, and the Medusa code that reads "
                                  f"--to medusa2 applies one block {layers} times ([ResBlock] * medusa_num_layers): "
                                  f"export it with --to medusa (TGI) or --to medusa-vllm, which keep one block per layer")
    model, backbone = source.target.model, _stored_dtype(source)
    state = {name: t.to(backbone) if t.is_floating_point() else t for name, t in model.state_dict().items()}
    state.update({name: t.to(source.dtype) for name, t in adapter("medusa", fmt, layers).to_engine(heads.state_dict()).items()})
    model.save_pretrained(out, state_dict=state)
    source.target.tokenizer.save_pretrained(out)
    path = os.path.join(out, "config.json")
    write_json(path, {**read_json(path), "medusa_num_heads": int(heads.num_heads), "medusa_num_layers": layers,
                           "dtype": dtype_name(backbone)})


def _config_dtype(config: Any) -> torch.dtype:
    """The dtype a transformers config says its weights are stored in (``dtype``, formerly ``torch_dtype``); float32
    where it names none draftsmith writes."""
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return named if isinstance(named, torch.dtype) and named in DTYPES.values() else DTYPES.get(str(named), torch.float32)


def _stored_dtype(source: Any) -> torch.dtype:
    """The dtype the target's own folder stores its weights in (its config.json), else the drafter's."""
    from ..target import resolve_target_folder

    folder = resolve_target_folder(source.target.name)
    cfg = read_json(os.path.join(folder, "config.json")) if os.path.isdir(folder) else {}
    return DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype")), source.dtype)


__all__ = ["PREFIX", "backbone_fingerprint", "fill_shared_blocks", "imported", "load", "static_check", "write"]
