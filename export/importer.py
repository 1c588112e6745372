"""``draftsmith import``: a drafter trained elsewhere becomes an ordinary draftsmith drafter folder.

Import is the inverse of export: each foreign format is read by the module that writes it (``FORMATS`` of
``export/run.py``), through the same name table (``adapters``) and the same layer-id conventions
(``conventions``). What each format module gives back, ``imported(folder, fmt, target)`` → (trainable config,
module, what the folder records of its source), is saved by ``drafters.save`` like a trained drafter, so eval,
report, the tree decoder and ``export`` (``--to gguf`` included) take it.

``detect(folder)`` tells the formats apart from their files (``IMPORTS``, the one list); ``--from`` overrides it.
Refused in one line, before anything is written: a folder in no known format; an export of draftsmith that records
another target's fingerprint; a checkpoint whose vocabulary, hidden size, feature layers or embedding are not the
target's (each format's own refusal; a Medusa-2 checkpoint's heads fit only the backbone saved with them); and an
EAGLE-3, P-EAGLE, DFlash or DFlash2 drafter whose layer ids look shifted (:func:`check_layers`: it drafts the target's
next token clearly better from the neighbouring layers than from the ones it names — what a drafter whose ids were
written in the other engine's convention does).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import DraftsmithError
from ..target import Target, load_target
from . import medusa, medusa2
from .run import FORMATS, INFO_FILE, INFO_FORMAT, default_prompts, refuse_overlap
from .tensors import read_json


IMPORTS: dict[str, str] = {
    "speculators": "vLLM speculators (Eagle3DraftModel / PEagleDraftModel.save_pretrained, `speculators train`)",
    "eagle3": "the EAGLE-3 layout (LlamaForCausalLMEagle3): SpecForge / SGLang, the EAGLE authors",
    "medusa": "the Medusa reference code and TGI (medusa_lm_head.safetensors)",
    "medusa-vllm": "vLLM's MedusaModel layout",
    "medusa2": "a Medusa-2 checkpoint (the Medusa code, its axolotl training): the heads saved with the backbone they "
               "were fine-tuned with, which is then the target",
    "dflash": "z-lab's DFlashDraftModel layout (z-lab, SpecForge)",
    "speculators-dflash": "vLLM speculators (DFlashDraftModel / DFlash2DraftModel, speculators_model_type dflash or "
                          "dflash2)",
    "hf": "a transformers causal LM with the target's tokenizer (a draft model)",
}
"""Import format → who writes it. The families each one holds and the module that reads it are the export format's
(``FORMATS``): one home for both directions."""
SPECULATORS_KINDS = {kind: fmt for fmt in ("speculators", "speculators-dflash") for kind in FORMATS[fmt].families}
"""speculators_model_type → the import format that reads it: speculators names its families as draftsmith does
(eagle3, peagle, dflash, dflash2)."""
PROBED_FAMILIES = ("eagle3", "peagle", "dflash", "dflash2")
"""The families whose feature layers :func:`check_layers` probes: EAGLE-3's heads (P-EAGLE's first draft is an EAGLE-3
head's) and DFlash's blocks (DFlash2's too), the drafters that read named target layers."""
PROBE_MARGIN = 0.1
"""A neighbouring layer set must draft the target's next token this much more often (top-1, fraction of positions)
than the named one before :func:`check_layers` calls the ids shifted."""


PICKLED = (".pt", ".bin", ".pth")
"""Pickled weight files (torch.save): the EAGLE authors' ``pytorch_model.bin``, early Medusa's ``medusa_lm_head.pt``."""
WEIGHT_NAMES = f"model.safetensors; the Medusa reference layout's {medusa.FILES['medusa']}"
"""The weight files the import formats read, as a refusal names them."""


def refuse_pickled(folder: str) -> None:
    """A folder whose weights are pickled only (no .safetensors beside them) is refused in one line that names the files
    and the conversion: draftsmith reads safetensors, which hold tensors and nothing else; a pickle can run code. A
    Medusa-2 checkpoint is not refused (:func:`detect` takes it first): its pickles are the model's weights, which
    draftsmith reads only with ``torch.load(weights_only=True)`` (``export/medusa2.py``)."""
    files = os.listdir(folder)
    pickled = sorted(f for f in files if f.endswith(PICKLED))
    if pickled and not any(f.endswith(".safetensors") for f in files):
        raise DraftsmithError(
            f"'{folder}' holds its weights pickled ({', '.join(pickled[:3])}) and no .safetensors: draftsmith does not "
            f"unpickle them (a pickle can run code). Convert them under the name the format reads ({WEIGHT_NAMES}), "
            f"e.g. python -c \"import torch; from safetensors.torch import save_file; save_file({{k: v.clone() for f in "
            f"{pickled} for k, v in torch.load(f, weights_only=True).items()}}, 'model.safetensors')\" (all shards in "
            f"one file; clone: safetensors stores no tensor twice)")


def detect(folder: str) -> str:
    """The import format of ``folder`` from its files (config.json's keys, the Medusa file name); one line if none,
    or if its weights are pickled only (:func:`refuse_pickled`)."""
    if not os.path.isdir(folder):
        raise DraftsmithError(f"import source '{folder}' is not a folder")
    cfg = read_json(os.path.join(folder, "config.json")) if os.path.isfile(os.path.join(folder, "config.json")) else {}
    if is_medusa2(folder, cfg):
        return "medusa2"
    refuse_pickled(folder)
    if os.path.isfile(os.path.join(folder, medusa.FILES["medusa"])):
        return "medusa"
    if not cfg:
        raise DraftsmithError(f"'{folder}' has no config.json")
    arch = list(cfg.get("architectures") or [])
    kind = cfg.get("speculators_model_type")
    if cfg.get("format") == "draftsmith-drafter":
        raise DraftsmithError(f"'{folder}' is a draftsmith drafter already: use it as it is")
    if kind in SPECULATORS_KINDS:
        return SPECULATORS_KINDS[kind]
    if kind:
        raise DraftsmithError(f"'{folder}' is a speculators {kind} checkpoint; draftsmith imports speculators "
                              f"{', '.join(SPECULATORS_KINDS)}")
    if "DFlashDraftModel" in arch or "dflash_config" in cfg:
        return "dflash"
    if any("Eagle3" in a for a in arch) or "eagle_config" in cfg or "draft_vocab_size" in cfg:
        return "eagle3"
    if cfg.get("model_type") == "medusa" or "MedusaModel" in arch:
        return "medusa-vllm"
    if any(a.endswith("ForCausalLM") for a in arch):
        return "hf"
    raise DraftsmithError(f"'{folder}' is in no format draftsmith imports (config.json architectures {arch}); "
                          f"formats: {', '.join(IMPORTS)}; name one with --from")


def is_medusa2(folder: str, cfg: dict[str, Any]) -> bool:
    """A Medusa-2 checkpoint: a config with Medusa's keys beside the model they were saved with (no heads-only file of
    the reference layout, ``medusa_lm_head.*``, which holds Medusa-1 heads for an untouched base), or beside the LoRA
    adapter they were trained with (``medusa2.lora_only``)."""
    if "medusa_num_heads" not in cfg or cfg.get("model_type") == "medusa":
        return False
    heads_only = any(os.path.isfile(os.path.join(folder, f"medusa_lm_head{ext}")) for ext in (".safetensors", ".pt"))
    return os.path.isfile(os.path.join(folder, medusa2.ADAPTER_CONFIG)) or not heads_only


def refuse_recorded_target(folder: str, target: Target) -> None:
    """An export of draftsmith (``draftsmith_export.json`` beside the files) records its target's fingerprint: another
    target is refused, as loading a drafter folder refuses it."""
    path = os.path.join(folder, INFO_FILE)
    if not os.path.isfile(path):
        return
    info = read_json(path)
    recorded = (info.get("target") or {}).get("fingerprint") if info.get("format") == INFO_FORMAT else None
    if recorded and recorded != target.fingerprint:
        raise DraftsmithError(f"'{folder}' was exported for target fingerprint {recorded} "
                              f"({(info.get('target') or {}).get('name')}), and '{target.name}' has {target.fingerprint}: "
                              f"a drafter only fits the exact target it was trained with; pass that one with --target")


def import_drafter(folder: str, out: str, target: str | Target | None, fmt: str | None = None, force: bool = False,
                   check_ids: bool = True, base: str | None = None) -> dict[str, Any]:
    """Import the foreign drafter in ``folder`` (format ``fmt``, detected when None) for ``target`` (a spec, loaded in
    fp32 on CPU, or a loaded target) into the draftsmith drafter folder ``out`` (written atomically); returns its
    config.json. check_ids: run :func:`check_layers` on a drafter that reads named target layers
    (:data:`PROBED_FAMILIES`). base: for a LoRA-only Medusa-2 checkpoint (and only there, in place of ``target``), the
    model its adapter was trained on (:func:`import_lora_medusa2`)."""
    from ..drafters import checkpoint

    if fmt and fmt != "medusa2" and os.path.isdir(folder):
        refuse_pickled(folder)  # detect() refuses them when it runs
    fmt = fmt or detect(folder)
    if fmt not in IMPORTS:
        raise DraftsmithError(f"unknown import format '{fmt}'; formats: {', '.join(IMPORTS)}")
    refuse_overlap(folder, out)
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise DraftsmithError(f"--out '{out}' exists and is not empty; pass --force to replace it")
    if fmt == "medusa2" and medusa2.lora_only(folder):
        return import_lora_medusa2(folder, out, base, target)
    if base is not None:
        raise DraftsmithError(f"--base names the model a LoRA-only Medusa-2 checkpoint's adapter merges into, and "
                              f"'{folder}' is a {fmt} checkpoint with no adapter to merge; pass --target")
    if target is None:
        raise DraftsmithError("import needs --target: the target the drafter was trained for")
    if isinstance(target, str):
        target = load_target(target, "float32", "cpu")
    refuse_recorded_target(folder, target)
    config, module, record = FORMATS[fmt].module.imported(folder, fmt, target)
    if check_ids and config.type in PROBED_FAMILIES:
        check_layers(config.runtime(module, target), target, folder)
    extra = {"imported": {"from": os.path.abspath(folder), "format": fmt, **record}}
    checkpoint.save(out, config, module, target, extra=extra)  # atomic: replaces --out as a whole once it is written
    return checkpoint.read_meta(out)


def import_lora_medusa2(folder: str, out: str, base: str | None, target: Any) -> dict[str, Any]:
    """Import a LoRA-only Medusa-2 checkpoint (``medusa2.lora_only``): its adapter merged into ``base`` through peft is
    the backbone its heads were trained with, so that merge, written as a Medusa-2 checkpoint in ``out/backbone``
    (``medusa2.merge_lora``), is the target of the drafter written beside it in the same atomic write. Refused in one
    line: no ``base`` (naming what to pass), or a ``target`` given as well (the merge is the only one the heads fit)."""
    import shutil
    import tempfile

    from ..drafters import checkpoint

    if base is None:
        raise medusa2.refuse_unmerged(folder)
    if target is not None:
        raise DraftsmithError(f"'{folder}' is a LoRA-only Medusa-2 checkpoint: its target is --base with its adapter "
                              f"merged (written to {os.path.join(out, medusa2.BACKBONE)}), which the heads alone fit; "
                              f"pass --base, not --target")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    merged = tempfile.mkdtemp(prefix=".merged-", dir=parent)  # the file system of out: moved into it, not copied
    try:
        medusa2.merge_lora(folder, base, merged)
        target = load_target(merged, "float32", "cpu")
        target.name = os.path.abspath(os.path.join(out, medusa2.BACKBONE))  # where it is once the drafter is written
        config, module, record = medusa2.imported(merged, "medusa2", target)
        record = {**record, "backbone": target.name, "adapter": os.path.abspath(folder), "base": base}
        checkpoint.save(out, config, module, target, extra={"imported": {"from": os.path.abspath(folder),
                                                                         "format": "medusa2", **record}},
                        beside={medusa2.BACKBONE: merged})
    finally:
        shutil.rmtree(merged, ignore_errors=True)
    return checkpoint.read_meta(out)


def check_layers(drafter: Any, target: Target, where: str, prompts: list[list[int]] | None = None) -> list[str]:
    """Refuse a drafter whose feature layer ids look shifted by one, in one line.

    Its first draft at every position of ``prompts`` (default: the two fixed chat prompts of ``export --check``) is
    compared with what it is trained to draft there, the target's own next prediction (:func:`first_drafts`), from the
    layers it names and from the same layers shifted by −1 and +1 where the target has them. A drafter trained on the
    named layers drafts best from them; one whose ids came in another engine's convention (input-of-layer read as
    output-of-layer, or the reverse) drafts best one layer over. Returns the rates measured."""
    layers, n = list(drafter.feature_layers), target.num_layers
    candidates = {0: layers}
    for shift in (-1, 1):
        moved = [i + shift for i in layers]
        if all(0 <= i < n for i in moved):
            candidates[shift] = moved
    if len(candidates) == 1:
        return []
    hits = {shift: 0 for shift in candidates}
    total = 0
    for ids in prompts or default_prompts(target):
        x = torch.tensor([ids], device=target.device)  # [1, S]
        with torch.no_grad():
            for shift, chosen in candidates.items():
                out = target.forward(x, feature_layers=tuple(chosen))
                drafted = first_drafts(drafter.module, x, out.features)  # [S - 1]: entry t drafts position t + 2
                hits[shift] += int((drafted == out.logits[0, 1:].argmax(-1)).sum())
        total += len(ids) - 1
    rate = {shift: hits[shift] / total for shift in hits}
    best = max(rate, key=rate.get)
    if best != 0 and rate[best] > rate[0] + PROBE_MARGIN:
        raise DraftsmithError(
            f"{where}: its feature layers look shifted: it drafts the target's next token at {rate[0]:.0%} from the layers "
            f"it names (ours {layers}) and at {rate[best]:.0%} from {candidates[best]}; its ids are likely in another "
            f"engine's convention (docs/export.md, 'Import'); fix them, or pass --no-layer-check")
    return [f"feature layers {layers}: first drafts {rate[0]:.0%} right, "
            + ", ".join(f"{candidates[s]} {rate[s]:.0%}" for s in candidates if s)]


def first_drafts(module: Any, x: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The target ids [S - 1] a drafter ``module`` drafts first along ``x`` [1, S] given the target's ``features``
    [1, S, F] of its layers; entry t is its draft of token t + 2, the target's own argmax at position t + 1.

    EAGLE-3 (``module(input_ids, features)``): row t pairs feature t with token t + 1 and drafts token t + 2. DFlash
    (``module.train_blocks``): the block anchored at t + 1 (its token known, context rows 0 … t) drafts token t + 2 at
    its first masked position, the argmax of the lm_head there (DFlash2's before its selector reranks the candidates)."""
    from ..drafters.common import shift_left

    s = x.shape[1]
    if hasattr(module, "train_blocks"):
        anchors = torch.arange(1, s, device=x.device)[None]  # [1, S - 1]
        logits = module.lm_head(module.train_blocks(x, features, anchors)[0, :, 1])  # [S - 1, V or Vd]
    else:
        _, logits = module(shift_left(x, 1), features)  # [1, S, Vd]
        logits = logits[0, :-1]
    drafted = logits.argmax(-1)
    ids = module.draft_ids
    return drafted if ids is None else ids[drafted]
