"""GGUF for llama.cpp (``--to gguf``, ``--to gguf-target``), converted by llama.cpp's own converter.

A drafter is first written in the HF layout llama.cpp's ``convert_hf_to_gguf.py`` reads — an
EAGLE-3 head in the original EAGLE-3 layout (``export/eagle3.py``; the converter needs
``--target-model-dir``, the target's HF folder, for the tokenizer and the layer count), a draft
LM as a plain transformers folder with LoRA merged (``export/hf.py``) — and then converted,
unchanged, by the converter of the pinned llama.cpp (``engines/llamacpp.py``). What llama.cpp
reads (its source, ``conversion/llama.py`` and ``src/models/eagle3.cpp``):

* ``eagle3.target_layers``: the top-level ``eagle_aux_hidden_state_layer_ids``, input-of-layer
  ids (``conventions.engine_layer_ids(…, "llamacpp")`` = ours + 1); exactly three.
* ``eagle3.target_hidden_size``, ``eagle3.norm_before_residual`` and ``eagle3.norm_before_fc``
  (the head's; ``norm_before_fc``'s ``input_norm.weight`` becomes ``enc.output_norm``); a head with fc_norm or
  norm_output is refused, as llama.cpp cannot compute them (``eagle3.LLAMACPP_CANNOT``).
* one decoder layer (``src/models/eagle3.cpp`` asserts ``n_layer == 1``): a multi-layer head is refused
  (``eagle3.LAYER_STACKS``).
* ``d2t`` (a reduced draft vocabulary; without it the head drafts over the target's vocabulary);
  ``t2d`` is dropped; the token embedding is the target's.

The target is exported by the same converter (``--to gguf-target``: a type of
``engines.llamacpp.GGUF_TYPES``) or, for
a target that came as a GGUF file, copied as it is (``as-loaded``), so a user gets a matched pair.
:func:`engine_check` then proves a drafter GGUF in llama.cpp itself (``export --check``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from ..engines import llamacpp
from ..engines.llamacpp import DRAFT_GGUF_TYPES, GGUF_TYPES, TARGET_GGUF_TYPES
from ..engines.targets import cached_target, original_gguf
from ..errors import DraftsmithError
from ..target import Target, resolve_target_folder
from . import dflash, eagle3, hf
from .conventions import engine_layer_ids

DRAFT_FILE = "draft.gguf"
TARGET_FILE = "target.gguf"
ARCH = {"eagle3": "eagle3", "draft_lm": "llama", "dflash": "dflash", "dflash2": "dflash"}
"""general.architecture of each family's GGUF (a draft LM keeps its own, Llama for SmolLM2-style ones; DFlash2 is
llama.cpp's ``dflash`` with its conv and selector tensors)."""
BLOCK_FAMILIES = ("dflash", "dflash2")
"""The families llama.cpp drafts a whole block for in one forward (its block is n_max + 1 rows)."""
NOT_SERVED = {
    "peagle": "llama.cpp (11434) serves no P-EAGLE head: its converter registers no PEagleSpeculator or PEagleDraftModel "
              "architecture nor a mask_hidden tensor (conversion/__init__.py, conversion/llama.py), and its --spec-type "
              "has no parallel drafter (draft-eagle3 drafts one token per forward; common/speculative.cpp)",
}
"""Why llama.cpp cannot serve a family draftsmith trains, read in the pinned source (``export`` says it in its refusal)."""


def outtype(gguf_type: str, dtype: Any) -> str:
    if gguf_type not in DRAFT_GGUF_TYPES:
        raise DraftsmithError(f"--gguf-type {gguf_type!r} is not one of: {', '.join(DRAFT_GGUF_TYPES)}")
    if gguf_type != "auto":
        return gguf_type
    return "bf16" if "bfloat16" in str(dtype) else "f32"


def write(source: Any, fmt: str, out: str, gguf_type: str = "auto") -> None:
    """Write ``source`` (an eagle3, dflash or draft_lm drafter) as ``out/draft.gguf``."""
    kind = outtype(gguf_type, source.dtype)
    target_dir = resolve_target_folder(source.target.name)
    if source.family == "eagle3":
        eagle3.refuse_layers(source.drafter.module, "llamacpp")
    if source.family in ("eagle3", *BLOCK_FAMILIES):
        engine_layer_ids(source.drafter.feature_layers, source.target.num_layers, "llamacpp")  # refuses what llama.cpp skips
    with tempfile.TemporaryDirectory(prefix=".hf-layout.", dir=out) as tmp:
        if source.family == "eagle3":
            eagle3.write(source, "eagle3", tmp, reader="llamacpp")
            llamacpp.convert(tmp, os.path.join(out, DRAFT_FILE), kind, target_model_dir=target_dir)
        elif source.family in BLOCK_FAMILIES:  # z-lab's layout: the converter's DFlashModel (a Qwen3 backbone)
            dflash.write(source, "gguf", tmp)
            llamacpp.convert(tmp, os.path.join(out, DRAFT_FILE), kind, target_model_dir=target_dir)
            if source.drafter.module.d2t is not None:  # the converter writes the head rows, not their ids
                set_d2t(os.path.join(out, DRAFT_FILE), source.drafter.module.draft_ids)
        elif source.family == "draft_lm":
            hf.write(source, "hf", tmp)
            llamacpp.convert(tmp, os.path.join(out, DRAFT_FILE), kind)
        else:
            raise DraftsmithError(f"llama.cpp serves no {source.family} drafter (gguf holds eagle3, dflash and draft_lm)")


def set_d2t(path: str, draft_ids: Any) -> None:
    """Give the GGUF at ``path`` the tensor ``d2t`` (I64 [Vd], the absolute target id of each draft row, what
    llama.cpp's ``dflash`` runtime scatters by), added or replaced; the file is rewritten atomically, every other
    key/value and tensor copied as it is."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys

    reader = GGUFReader(path)
    ids = np.asarray(draft_ids.cpu() if hasattr(draft_ids, "cpu") else draft_ids, dtype=np.int64).reshape(-1)
    kept = [t for t in reader.tensors if t.name != "d2t"]
    tmp = path + ".partial"
    writer = GGUFWriter(tmp, arch=str(reader.fields[Keys.General.ARCHITECTURE].contents()), endianess=reader.endianess)
    alignment = reader.fields.get(Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = int(alignment.contents())
    for field in reader.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.add_tensor_info("d2t", ids.shape, ids.dtype, ids.nbytes, GGMLQuantizationType.I64)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in kept:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        writer.write_tensor_data(ids)
        writer.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_target(target_spec: str, out: str, kind: str = "as-loaded") -> str:
    """The target as ``out/target.gguf``: converted by llama.cpp's converter, or the original GGUF copied."""
    if kind not in TARGET_GGUF_TYPES:
        raise DraftsmithError(f"--gguf-type {kind!r} is not one of: {', '.join(TARGET_GGUF_TYPES)} for a target")
    path = os.path.join(out, TARGET_FILE)
    if kind == "as-loaded":
        original = original_gguf(target_spec)
        if original is None:
            raise DraftsmithError(f"the target '{target_spec}' was not loaded from a GGUF file; pass --gguf-type "
                                  f"{', '.join(GGUF_TYPES)}")
        shutil.copyfile(original, path)
        return path
    return llamacpp.convert(resolve_target_folder(target_spec), path, kind)


# ---------------------------------------------------------------- reading back


def read_metadata(path: str) -> dict[str, Any]:
    """The GGUF's key/values (scalars and arrays as Python values) and its tensor names."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as e:
        raise DraftsmithError(f"{path} is not a readable GGUF file: {e}") from e
    meta: dict[str, Any] = {}
    for name, f in reader.fields.items():
        if name.startswith("tokenizer."):
            continue
        try:
            meta[name] = f.contents()
        except Exception:  # noqa: BLE001 - exotic field types are not needed for the checks
            continue
    meta["__tensors__"] = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
    return meta


def static_check(folder: str, fmt: str, target: Target, source: Any) -> list[str]:
    """What llama.cpp will read: architecture, layer ids in its convention, norm flags, d2t."""
    path = os.path.join(folder, DRAFT_FILE)
    if not os.path.isfile(path):
        raise DraftsmithError(f"{folder} has no {DRAFT_FILE}")
    meta = read_metadata(path)
    arch = meta.get("general.architecture")
    family = source.family
    if arch != ARCH[family]:
        raise DraftsmithError(f"{path}: general.architecture is {arch!r}, a {family} drafter converts to {ARCH[family]!r}")
    lines = [f"{DRAFT_FILE}: a {arch} GGUF with {len(meta['__tensors__'])} tensors"]
    if family == "eagle3":
        want = engine_layer_ids(source.drafter.feature_layers, target.num_layers, "llamacpp")
        got = [int(x) for x in meta.get("eagle3.target_layers", [])]
        if got != want:
            raise DraftsmithError(f"{path}: eagle3.target_layers = {got}, but the head reads draftsmith layers "
                                  f"{list(source.drafter.feature_layers)} = llama.cpp (input of layer) {want}")
        flags = eagle3.norm_flags(source.drafter.module)
        for flag in ("norm_before_residual", "norm_before_fc"):
            if bool(meta.get(f"eagle3.{flag}", False)) != flags[flag]:
                raise DraftsmithError(f"{path}: eagle3.{flag} is {bool(meta.get(f'eagle3.{flag}', False))}, the head's "
                                      f"is {flags[flag]}")
        if int(meta.get("eagle3.target_hidden_size", -1)) != target.hidden_size:
            raise DraftsmithError(f"{path}: eagle3.target_hidden_size is {meta.get('eagle3.target_hidden_size')}, the "
                                  f"target's hidden size is {target.hidden_size}")
        vd = int(source.drafter.module.d2t.shape[0])
        d2t = meta["__tensors__"].get("d2t")
        if vd != target.vocab_size and (d2t is None or d2t[0] != vd):
            raise DraftsmithError(f"{path}: the head drafts over {vd} tokens but the GGUF's d2t is {d2t}")
        lines.append(f"eagle3.target_layers = {got} (llama.cpp captures layer inputs; draftsmith "
                     f"{list(source.drafter.feature_layers)}), norm flags the head's, target_hidden_size {target.hidden_size}, "
                     f"draft vocabulary {vd}")
    if family in BLOCK_FAMILIES:
        lines += dflash_static_check(path, meta, target, source.drafter.module)
    return lines


DFLASH_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
                        "ffn_gate", "ffn_up", "ffn_down")
"""What llama.cpp's ``dflash`` loader requires of every block (``src/models/dflash.cpp``, ``load_arch_tensors``)."""
DFLASH2_LAYER_TENSORS = ("attn_conv_base", "attn_conv_proj.weight", "ffn_conv_base", "ffn_conv_proj.weight")
"""What it requires of every block of a DFlash2 (the convolutions' bases carry no ``.weight``)."""
DFLASH2_TENSORS = frozenset({"selector_predecessor.weight", "selector_successor.weight", "selector_hidden.weight"})
"""The candidate selector of a DFlash2, as llama.cpp names it."""


def dflash_static_check(path: str, meta: dict[str, Any], target: Target, module: Any) -> list[str]:
    """What ``llama_model_dflash`` and ``common_speculative_impl_draft_dflash`` read: ``dflash.target_layers``
    (layer inputs: ours + 1), ``dflash.block_size``, the mask token, ``fc`` / ``enc.output_norm`` (our hidden_norm) /
    ``output_norm`` and each block's tensors; no token embedding or output (the target's, shared)."""
    from gguf import GGUFReader

    want = engine_layer_ids(module.feature_layers, target.num_layers, "llamacpp")
    got = [int(x) for x in meta.get("dflash.target_layers", [])]
    if got != want:
        raise DraftsmithError(f"{path}: dflash.target_layers = {got}, but the drafter reads draftsmith layers "
                              f"{list(module.feature_layers)} = llama.cpp (input of layer) {want}")
    if int(meta.get("dflash.block_size", -1)) != module.block_size:
        raise DraftsmithError(f"{path}: dflash.block_size = {meta.get('dflash.block_size')}, the drafter's is {module.block_size}")
    reader = GGUFReader(path)
    mask = reader.fields.get("tokenizer.ggml.mask_token_id")
    if mask is None or int(mask.contents()) != module.mask_token_id:
        raise DraftsmithError(f"{path}: tokenizer.ggml.mask_token_id is {None if mask is None else mask.contents()}, the "
                              f"drafter's mask token is {module.mask_token_id}")
    names = set(meta["__tensors__"])
    need = {"fc.weight", "enc.output_norm.weight", "output_norm.weight"} | {
        f"blk.{i}.{t}.weight" for i in range(len(module.layers)) for t in DFLASH_LAYER_TENSORS}
    if module.d2t is not None:
        need |= {"output.weight", "d2t"}
    selector = getattr(module, "candidate_selector", None)
    if selector is not None:  # DFlash2: the convolutions of every block and the selector (``load_arch_tensors``)
        need |= DFLASH2_TENSORS | {f"blk.{i}.{t}" for i in range(len(module.layers)) for t in DFLASH2_LAYER_TENSORS}
        layer = module.layers[0].attention_conv
        want_meta = {"dflash.conv_kernel_size": layer.kernel_size, "dflash.conv_group_size": module.hidden_size // layer.num_groups,
                     "dflash.selector_rank": selector.hidden_projection.out_features, "dflash.selector_top_k": selector.top_k}
        wrong = {k: meta.get(k) for k, v in want_meta.items() if meta.get(k) is None or int(meta[k]) != v}
        if wrong:
            raise DraftsmithError(f"{path}: {wrong} differ from the drafter's {want_meta}: llama.cpp would convolve or "
                                  f"rerank otherwise")
    missing, extra = sorted(need - names), sorted(names - need)
    if missing or extra:
        raise DraftsmithError(f"{path}: llama.cpp's dflash loader needs {missing} (missing); {extra} are unexpected")
    vocab = ""
    if module.d2t is not None:
        want_ids = module.draft_ids.cpu().tolist()
        d2t = next(t for t in reader.tensors if t.name == "d2t")
        head = meta["__tensors__"]["output.weight"]
        if d2t.data.reshape(-1).tolist() != want_ids or len(want_ids) not in head:
            raise DraftsmithError(f"{path}: d2t / output do not map the drafter's {len(want_ids)} draft tokens to their "
                                  f"target ids (output {list(head)}): llama.cpp would draft other tokens")
        vocab = f"; output [{len(want_ids)} draft rows] and d2t = the drafter's target ids"
    return [f"dflash.target_layers = {got} (llama.cpp captures layer inputs; draftsmith {list(module.feature_layers)}), "
            f"dflash.block_size {module.block_size}, mask token {module.mask_token_id}, the {len(need)} tensors "
            f"llama.cpp's dflash loader reads (fc, enc.output_norm, output_norm, {len(module.layers)} blocks with q/k norms"
            + (", their convolutions and the candidate selector, with its conv/selector sizes" if selector is not None else "")
            + ")" + vocab]


# ---------------------------------------------------------------- the engine check

ACCEPTANCE_TOLERANCE = 0.10
"""Largest |Δ| allowed between llama.cpp's and draftsmith's acceptance at any draft position (greedy, same
target weights in F32 and fp32, same prompts, same k). A faithful conversion agrees exactly on a peaked target;
the tolerance leaves room for the rare token where F32 kernels of the two engines round to another argmax."""


ENGINE_CHECK_K = 3
"""The draft length :func:`engine_check` compares acceptance at unless ``export --check --k`` names others (then its
largest: ``served.Sweep.check_k``)."""


def engine_check(folder: str, target: Target, source: Any, prompts: list[list[int]], k: int = ENGINE_CHECK_K,
                 max_new_tokens: int = 32, threads: int = 1) -> list[str]:
    """Serve the export in llama.cpp and prove it there (module docstring): greedy, on an F32 GGUF of ``target``,
    (a) its output equals llama.cpp's target alone, token for token, on every prompt; (b) its acceptance by
    draft position agrees with draftsmith's chain decoder (same target weights in fp32, same prompts, same k)."""
    from ..decode.rounds import speculative_decode
    from ..decode.stats import DecodeStats

    if source.family in BLOCK_FAMILIES:  # llama.cpp's block is n_max + 1 rows: only the whole trained block drafts as trained
        k = source.drafter.module.block_size - 1
    target_gguf = cached_target(target, "f32")
    draft = os.path.join(folder, DRAFT_FILE)
    alone_spec = llamacpp.ServerSpec(model=target_gguf, threads=threads)
    spec = llamacpp.ServerSpec(model=target_gguf, draft=draft, spec_type=llamacpp.SPEC_TYPES[source.family], n_max=k,
                               threads=threads)
    with llamacpp.serving(alone_spec) as server:
        alone = llamacpp.decode_prompts(server, prompts, max_new_tokens)
    with llamacpp.serving(spec, trace=True) as server:
        drafted = llamacpp.decode_prompts(server, prompts, max_new_tokens)
    for i, (a, b) in enumerate(zip(alone, drafted)):
        if a.completion.tokens != b.completion.tokens:
            n = next((j for j, (x, y) in enumerate(zip(a.completion.tokens, b.completion.tokens)) if x != y),
                     min(len(a.completion.tokens), len(b.completion.tokens)))
            raise DraftsmithError(f"in llama.cpp the export changes prompt {i}'s greedy output at new token {n} "
                                  f"(F32 target): speculation there is not lossless with this draft")
    engine = llamacpp.rounds_stats(drafted, k)
    ours = DecodeStats(k=engine.k)
    for ids, run in zip(prompts, drafted):
        ours = ours.merge(speculative_decode(target, source.drafter, ids, k=engine.k,
                                             max_new_tokens=len(run.completion.tokens)).stats)
    a, b = ours.acceptance_at_position, engine.acceptance_at_position
    worst = max((abs((x or 0.0) - (y or 0.0)) for x, y in zip(a, b)), default=0.0)
    fmt = lambda xs: "[" + ", ".join("–" if x is None else f"{x:.3f}" for x in xs) + "]"  # noqa: E731
    side = (f"acceptance by position (k = {k}): llama.cpp {fmt(b)} ({engine.accepted}/{engine.drafted} drafts in "
            f"{engine.rounds} rounds), draftsmith {fmt(a)} ({ours.accepted}/{ours.drafted} in {ours.rounds})")
    if engine.rounds == 0 or worst > ACCEPTANCE_TOLERANCE:
        raise DraftsmithError(f"llama.cpp runs the export with another acceptance than draftsmith's decoder: {side}; "
                              f"max |Δ| {worst:.3f} > {ACCEPTANCE_TOLERANCE}: the conversion did not keep the drafter "
                              f"(layer ids, norm flags or vocabulary)")
    n_tokens = sum(len(r.completion.tokens) for r in drafted)
    return [f"llama.cpp with the export = llama.cpp's F32 target alone on {len(prompts)} prompts ({n_tokens} tokens, "
            f"greedy, {threads} thread(s))",
            side + f": max |Δ| {worst:.3f} ≤ {ACCEPTANCE_TOLERANCE}"]
