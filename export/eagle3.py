"""EAGLE-3 heads in two layouts: the original EAGLE-3 one (``--to eagle3``, which SGLang and vLLM
load as ``LlamaForCausalLMEagle3``) and vLLM's native ``speculators`` format (``--to speculators``).

Loaders read for the static check (versions: vLLM ``vllm/model_executor/models/llama_eagle3.py``
at commit 00bd1493, ``vllm/transformers_utils/configs/speculators/algos.py`` at 055e47c2; SGLang
``python/sglang/srt/models/llama_eagle3.py`` at 03d5a777 and ``models/llama.py`` at 00239548;
speculators 0.9.0 from PyPI):

* names: ``fc.weight`` [H, 3·H_target], ``midlayer.{input_layernorm, hidden_norm,
  post_attention_layernorm}.weight`` [H], ``midlayer.self_attn.{q,k,v}_proj.weight`` [·, 2H]
  (the 2H-input attention), ``o_proj`` [H, heads·d], ``midlayer.mlp.{gate,up,down}_proj.weight``,
  ``norm.weight`` [H], ``lm_head.weight`` [Vd, H], ``d2t`` [Vd] int64, ``t2d`` [V] bool; the
  embedding is the target's (both engines share it when the file has none). speculators names
  the layer ``layers.0.*`` and needs ``embed_tokens.weight`` in the file: under transformers 5 a
  tensor missing from the file is uninitialized memory, and speculators copies the verifier's
  embedding only where it finds NaN. It holds ``d2t`` / ``t2d`` only for a reduced draft
  vocabulary (a full-vocabulary head has no such buffers, so the tensors would be unexpected).
* config: ``tie_word_embeddings: false`` (SGLang ties lm_head to the embedding otherwise), no
  attention / fc bias (SGLang builds the 2H-input qkv without bias and drops a bias tensor
  silently), ``draft_vocab_size``, ``target_hidden_size``, ``num_hidden_layers`` (the head's layers).
* layers after the first (a multi-layer head): speculators ``layers.{i}.*`` (transformers' Llama layer: H-input
  attention, ``input_layernorm``), each reading the previous layer's whole output, as vLLM computes them too; SGLang
  (the eagle3 layout) ``additional_layers.{i-1}.*`` (``hidden_norm`` its pre-attention norm, no ``input_layernorm``),
  each reading the previous layer's MLP output alone. The two compute different functions of the same tensors: a
  head is written only in the format whose engines compute what it computes (:data:`LAYER_STACKS`,
  ``Eagle3Head.residual_between_layers``), and import sets the option from the names it finds (the eagle3 layout
  under vLLM's ``layers.{i}`` names reads as vLLM computes it). llama.cpp takes one-layer heads only.
* norm flags, all written: ``norm_before_residual`` as the head has it (false by default: the residual is
  the fc output before ``hidden_norm``, as in EAGLE-3 and SGLang; true: ``hidden_norm``'s output, as
  speculators can train it, which vLLM and llama.cpp read — the original layout refuses it, as SGLang's
  loader at the commit above has no such flag); ``norm_before_fc``,
  ``fc_norm``, ``norm_output`` as the head has them (the EAGLE-3.1 options of ``drafters/eagle3.py``,
  false by default). speculators holds them (``input_norm.weight`` [3H], ``fc_norm.{0,1,2}.weight``
  [H]); the original layout's loaders (vLLM's and SGLang's ``LlamaForCausalLMEagle3`` at the commits
  above) have no such tensors and feed the pre-norm state on, so a head that uses one is refused
  ``--to eagle3`` and exported ``--to speculators``.
* layer ids: top-level ``eagle_aux_hidden_state_layer_ids`` in vLLM's convention and
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's (``conventions.engine_layer_ids``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from ..errors import DraftsmithError
from ..files import write_json
from ..target import Target
from .adapters import adapter
from .conventions import check_draft_vocab, engine_layer_ids, native_layer_ids
from .tensors import DTYPES, loaded_mismatch, CheckFailed, TensorSpec, check_tensors, dtype_name, read_json, read_safetensors, \
    write_safetensors

WEIGHTS = "model.safetensors"
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
"""The head's norm options (``drafters/eagle3.py``), under the names every format's config uses."""
LLAMACPP_CANNOT = {
    "fc_norm": "its converter and eagle3 graph have no per-layer norm of the fused features (conversion/llama.py, "
               "src/models/eagle3.cpp)",
    "norm_output": "its eagle3 graph passes the pre-norm state on to the next draft (src/models/eagle3.cpp: "
                   "t_h_nextn is eagle3_prenorm), where the head was trained on the normed one",
}
"""The flags llama.cpp (the pinned 11434) cannot compute, and why. It reads the other two: ``norm_before_residual``
(the residual is ``hidden_norm``'s output) and ``norm_before_fc`` (``input_norm.weight`` converted to
``enc.output_norm``, an RMSNorm over the fused features before fc), both from the config the converter reads."""
UNREAD_FLAGS = {"eagle3": NORM_FLAGS, "llamacpp": tuple(LLAMACPP_CANNOT), "speculators": ()}
"""Flags a reader of the eagle3 HF layout does not have (SGLang's and vLLM's ``LlamaForCausalLMEagle3`` for
``eagle3``, llama.cpp's converter and ``eagle3`` runtime for ``llamacpp``: :data:`LLAMACPP_CANNOT`): a head that sets
one is refused in that format, in one line."""
SPECULATIVE_TOKENS = 3
"""speculators_config.proposal_methods[0].speculative_tokens: vLLM's default num_speculative_tokens."""


def layer_fields(layer_config: Any, num_layers: int = 1) -> dict[str, Any]:
    """The Llama config of the head's ``num_layers`` decoder layers, as engine config keys."""
    c = layer_config
    rope = dict(getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    return {
        "model_type": "llama",
        "hidden_size": int(c.hidden_size),
        "intermediate_size": int(c.intermediate_size),
        "num_hidden_layers": int(num_layers),
        "num_attention_heads": int(c.num_attention_heads),
        "num_key_value_heads": int(c.num_key_value_heads),
        "head_dim": int(c.head_dim),
        "hidden_act": str(c.hidden_act),
        "max_position_embeddings": int(c.max_position_embeddings),
        "rms_norm_eps": float(c.rms_norm_eps),
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        "rope_parameters": rope,
        "attention_bias": bool(c.attention_bias),
        "mlp_bias": bool(c.mlp_bias),
        "tie_word_embeddings": False,
        "vocab_size": int(c.vocab_size),
    }


def _ids(source: Any) -> tuple[list[int], list[int]]:
    n = source.target.num_layers
    ours = list(source.drafter.feature_layers)
    return engine_layer_ids(ours, n, "vllm"), engine_layer_ids(ours, n, "sglang")


def norm_flags(head: Any) -> dict[str, bool]:
    """The four norm flags as the head has them (see the module docstring)."""
    return {"norm_before_residual": bool(head.midlayer.norm_before_residual), "norm_before_fc": head.input_norm is not None,
            "fc_norm": head.fc_norm is not None, "norm_output": bool(head.norm_output)}


def eagle3_config(source: Any) -> dict[str, Any]:
    head = source.drafter.module
    vllm_ids, sglang_ids = _ids(source)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **layer_fields(head.layer_config, head.num_layers),
        "draft_vocab_size": int(head.d2t.shape[0]),
        "target_hidden_size": int(source.target.hidden_size),
        "eagle_aux_hidden_state_layer_ids": vllm_ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True},
        **norm_flags(head),
        "torch_dtype": dtype_name(source.dtype),
        "dtype": dtype_name(source.dtype),
    }


def verifier_path(target: Target) -> str:
    """Where speculators finds the verifier: a hub id as given, else the local HF folder."""
    from ..target import resolve_target_folder

    folder = resolve_target_folder(target.name)
    return os.path.abspath(folder) if os.path.isdir(folder) else folder


EAGLE3_SPECULATORS = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3"}
"""What names an EAGLE-3 head in the speculators format: what speculators 0.9.0's own ``Eagle3DraftModel.save_pretrained``
writes (transformers writes the model class's name; ``Eagle3SpeculatorConfig``'s default ``Eagle3Speculator`` never
reaches a saved checkpoint). Engines route by ``speculators_model_type`` (vLLM's ``SpeculatorsConfig``), and llama.cpp's
converter registers both names (``conversion/__init__.py``); an export of an earlier draftsmith wrote
``Eagle3Speculator``, which ``--check`` and ``draftsmith import`` still take (``SPECULATORS_EAGLE3_NAMES``)."""
SPECULATORS_EAGLE3_NAMES = (EAGLE3_SPECULATORS["architectures"], ["Eagle3Speculator"])
"""The ``architectures`` a speculators-format EAGLE-3 head is read with: speculators' own, and what draftsmith wrote
before it wrote speculators' own."""
PEAGLE = {"architectures": ["PEagleDraftModel"], "speculators_model_type": "peagle"}
"""What names a P-EAGLE head in the speculators format; its config also holds ``mask_token_id`` and
``speculative_tokens`` = the head's depths, and its file ``mask_hidden``.

``architectures`` is what speculators 0.9.0's own ``PEagleDraftModel.save_pretrained`` writes (transformers writes the
model class's name; ``PEagleSpeculatorConfig``'s default ``PEagleSpeculator`` never reaches a saved checkpoint), so an
export reads as a checkpoint speculators trained. No engine routes a speculators-format P-EAGLE by it: speculators
loads by ``speculators_model_type`` (``SpeculatorModel.register("peagle")``, ``speculators/models/peagle/core.py``),
and vLLM reads a config.json that has ``speculators_config`` and no ``model_type`` as its ``SpeculatorsConfig``
(``vllm/transformers_utils/config.py``), whose ``update_peagle`` (``vllm/transformers_utils/configs/speculators/
algos.py``) replaces ``architectures`` with its own ``PeagleLlamaForCausalLM`` / ``PeagleQwen3ForCausalLM`` by the
layer's model_type; where vLLM's model registry names the checkpoint's class (``vllm/model_executor/models/
registry.py``, ``_SPECULATIVE_DECODING_MODELS``), it lists ``PEagleDraftModel``, never ``PEagleSpeculator``.
``draftsmith import`` takes either name."""


def speculators_config(source: Any) -> dict[str, Any]:
    """The speculators config of an EAGLE-3 head, or of a P-EAGLE head (``PEAGLE``)."""
    head = source.drafter.module
    vllm_ids, _ = _ids(source)
    peagle = source.family == "peagle"
    names = {**PEAGLE, "mask_token_id": int(head.mask_token_id)} if peagle else EAGLE3_SPECULATORS
    return {
        **names,
        "transformer_layer_config": layer_fields(head.layer_config, head.num_layers),
        "draft_vocab_size": int(head.d2t.shape[0]),
        "target_hidden_size": int(source.target.hidden_size),
        "eagle_aux_hidden_state_layer_ids": vllm_ids,
        **norm_flags(head),
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "peagle" if peagle else "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens":
                                  int(source.drafter.config.num_depths) if peagle else SPECULATIVE_TOKENS}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_path(source.target),
                         "architectures": list(getattr(source.target.config, "architectures", None) or [])},
        },
        "torch_dtype": dtype_name(source.dtype),
        "dtype": dtype_name(source.dtype),
    }


def write(source: Any, fmt: str, out: str, reader: str = "") -> None:
    """Write the head of ``source`` into the folder ``out`` in ``fmt`` (eagle3 | speculators); ``reader``: who reads
    it (``UNREAD_FLAGS``; default the format's own engines)."""
    from .tensors import cast_floats

    refuse_layers(source.drafter.module, reader or fmt)
    used = [flag for flag in UNREAD_FLAGS[reader or fmt] if norm_flags(source.drafter.module)[flag]]
    if used and reader == "llamacpp":
        raise DraftsmithError(f"this head uses {', '.join(used)}, which llama.cpp cannot compute: "
                              + "; ".join(f"{flag}: {LLAMACPP_CANNOT[flag]}" for flag in used)
                              + "; export it with --to speculators (vLLM)")
    if used:
        raise DraftsmithError(f"this head uses {', '.join(used)} (EAGLE-3.1 / speculators options), which the original "
                              f"eagle3 layout's loaders (SGLang's LlamaForCausalLMEagle3) do not have: export it with "
                              f"--to speculators (vLLM)")
    state = {k: v for k, v in source.drafter.module.state_dict().items() if not k.startswith("rotary_emb.")}
    if fmt == "speculators" and not _reduced(source.drafter.module.d2t.shape[0], source.target.vocab_size):
        del state["d2t"], state["t2d"]  # speculators has no such buffers for a full vocabulary (they would be unexpected)
    tensors = cast_floats(adapter(source.family, fmt).to_engine(state), source.dtype)
    write_safetensors(os.path.join(out, WEIGHTS), tensors)
    write_json(os.path.join(out, "config.json"), eagle3_config(source) if fmt == "eagle3" else speculators_config(source))


LAYER_STACKS = {
    "eagle3": (False, "SGLang (LlamaForCausalLMEagle3 at 03d5a777, the only engine that loads the eagle3 layout's "
                      "additional_layers) computes each layer after the first from the previous layer's MLP output "
                      "alone (BasicDecoderLayer drops the residual stream), and this head reads the previous layer's "
                      "whole output; export it with --to speculators (vLLM)"),
    "speculators": (True, "speculators' Eagle3DraftModel and vLLM compute each layer after the first from the previous "
                          "layer's whole output, and this head reads its MLP output alone (SGLang's computation); export "
                          "it with --to eagle3 (SGLang)"),
    "llamacpp": (None, "llama.cpp's eagle3 graph has one decoder layer (src/models/eagle3.cpp: GGML_ASSERT(n_layer == "
                       "1)); serve it with vLLM (--to speculators) or SGLang (--to eagle3), as its layer stack reads"),
}
"""Per reader of an EAGLE-3 export: what the layers after the first read there (``residual_between_layers``; None: no
multi-layer head at all) and why a head that computes otherwise is refused (``drafters/eagle3.py``, "Layers after the
first")."""


def refuse_layers(head: Any, reader: str) -> None:
    """Refuse, in one line, a multi-layer head ``reader`` would compute another way (:data:`LAYER_STACKS`)."""
    if head.num_layers > 1 and LAYER_STACKS[reader][0] is not bool(head.residual_between_layers):
        raise DraftsmithError(f"this head has {head.num_layers} decoder layers, and {LAYER_STACKS[reader][1]}")


def as_exported(source: Any, fmt: str) -> None:
    """Make ``source`` (rebuilt for ``--check`` on the fp32 target) hold what the export holds, so the check
    compares like with like.

    speculators stores ``embed_tokens.weight`` (vLLM reads the file's own embedding when it has one) in the
    head's dtype, like every other tensor; the source copies the target's embedding, fp32 here. For a
    bf16-trained head the stored embedding is that copy rounded to bf16 — what the head was trained on (a bf16
    target's embedding) and what a bf16 vLLM serves, so it is right as stored: an fp32 copy would double the
    file's largest tensor (V·H) for a precision no bf16 engine keeps. The comparison rounds the source's copy
    the same way. The eagle3 layout stores no embedding (the engine shares the target's), so nothing changes.
    """
    if fmt != "speculators":
        return
    embed = source.drafter.module.embed_tokens.weight
    with torch.no_grad():
        embed.copy_(embed.to(source.dtype).to(embed.dtype))


# ---------------------------------------------------------------- reading back


def _reduced(draft_vocab: int, vocab: int) -> bool:
    return draft_vocab != vocab


def _has_vocab_map(cfg: dict[str, Any], fmt: str) -> bool:
    """eagle3 always carries d2t / t2d; speculators only for a reduced draft vocabulary."""
    return fmt == "eagle3" or _reduced(int(cfg["draft_vocab_size"]), int(_layer_section(cfg, fmt)["vocab_size"]))


def _is_peagle(cfg: dict[str, Any]) -> bool:
    return cfg.get("speculators_model_type") == PEAGLE["speculators_model_type"]


def _layer_section(cfg: dict[str, Any], fmt: str) -> dict[str, Any]:
    return cfg["transformer_layer_config"] if fmt == "speculators" else cfg


def expected_tensors(cfg: dict[str, Any], fmt: str) -> dict[str, TensorSpec]:
    """Every tensor the engines' loaders read for this config (module docstring), with shape and dtype."""
    lc = _layer_section(cfg, fmt)
    h, i = int(lc["hidden_size"]), int(lc["intermediate_size"])
    q, kv = int(lc["num_attention_heads"]) * int(lc["head_dim"]), int(lc["num_key_value_heads"]) * int(lc["head_dim"])
    vd, v, ht = int(cfg["draft_vocab_size"]), int(lc["vocab_size"]), int(cfg.get("target_hidden_size") or h)
    f = DTYPES[cfg.get("torch_dtype", "float32")]
    out: dict[str, TensorSpec] = {"fc.weight": ((h, 3 * ht), f), "norm.weight": ((h,), f), "lm_head.weight": ((vd, h), f)}
    for n in range(int(lc.get("num_hidden_layers", 1))):  # the first reads concat(embedding, hidden) [2H]
        layer = f"layers.{n}." if fmt == "speculators" else "midlayer." if n == 0 else f"additional_layers.{n - 1}."
        width = 2 * h if n == 0 else h
        norms = ("input_layernorm", "hidden_norm") if n == 0 else ("input_layernorm",) if fmt == "speculators" \
            else ("hidden_norm",)  # SGLang's additional layers: hidden_norm is their pre-attention norm
        out.update({f"{layer}{name}.weight": ((h,), f) for name in (*norms, "post_attention_layernorm")})
        out.update({f"{layer}self_attn.q_proj.weight": ((q, width), f), f"{layer}self_attn.k_proj.weight": ((kv, width), f),
                    f"{layer}self_attn.v_proj.weight": ((kv, width), f), f"{layer}self_attn.o_proj.weight": ((h, q), f),
                    f"{layer}mlp.gate_proj.weight": ((i, h), f), f"{layer}mlp.up_proj.weight": ((i, h), f),
                    f"{layer}mlp.down_proj.weight": ((h, i), f)})
    if fmt == "speculators":
        out["embed_tokens.weight"] = ((v, h), f)
    if cfg.get("norm_before_fc") is True:
        out["input_norm.weight"] = ((3 * h,), f)
    if cfg.get("fc_norm") is True:
        out.update({f"fc_norm.{i}.weight": ((h,), f) for i in range(3)})
    if _is_peagle(cfg):
        out["mask_hidden"] = ((1, 1, 3 * ht), f)
    if _has_vocab_map(cfg, fmt):
        out.update({"d2t": ((vd,), torch.int64), "t2d": ((v,), torch.bool)})
    return out


def static_check(folder: str, fmt: str, target: Target) -> list[str]:
    """Config fields and every tensor against what SGLang / vLLM / speculators read; one line per check."""
    cfg = read_json(os.path.join(folder, "config.json"))
    tensors = read_safetensors(os.path.join(folder, WEIGHTS))
    where = folder
    lc = _layer_section(cfg, fmt)
    done: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CheckFailed(f"{where}: {what}", done)
        done.append(what)

    kind = "peagle" if _is_peagle(cfg) else "eagle3"
    names = ([PEAGLE["architectures"]] if kind == "peagle" else list(SPECULATORS_EAGLE3_NAMES)) \
        if fmt == "speculators" else [["LlamaForCausalLMEagle3"]]
    arch = cfg.get("architectures")
    need(arch in names, f"architectures = {arch if arch in names else names[0]}")
    if fmt == "speculators":
        need(cfg.get("speculators_model_type") == kind, f"speculators_model_type = {kind}")
        spec = cfg.get("speculators_config") or {}
        methods = spec.get("proposal_methods") or [{}]
        need(spec.get("algorithm") == kind and int(methods[0].get("speculative_tokens", 0)) >= 1
             and bool((spec.get("verifier") or {}).get("name_or_path")),
             f"speculators_config: algorithm {kind}, a proposal method with speculative_tokens, a verifier name_or_path")
        if kind == "peagle":
            mask = cfg.get("mask_token_id")
            need(isinstance(mask, int) and 0 <= mask < target.vocab_size,
                 f"mask_token_id = {mask}, a token of the target's vocabulary")
    layers = int(lc.get("num_hidden_layers", 0))
    need(lc.get("model_type") == "llama" and layers >= 1, f"{layers} Llama decoder layer{'s' if layers > 1 else ''}")
    need(int(lc.get("vocab_size", -1)) == target.vocab_size, f"vocab_size = the target's {target.vocab_size}")
    need(int(cfg.get("target_hidden_size", -1)) == target.hidden_size, f"target_hidden_size = {target.hidden_size}")
    need(lc.get("tie_word_embeddings") is False, "tie_word_embeddings = false (SGLang would tie lm_head to the embedding)")
    need(lc.get("attention_bias") is False and not cfg.get("bias"), "no attention / fc bias (SGLang loads none)")
    for flag in NORM_FLAGS:
        if fmt == "eagle3":
            need(cfg.get(flag) is False, f"{flag} = false, written explicitly (SGLang's loader has no such norm)")
        else:
            need(isinstance(cfg.get(flag), bool), f"{flag} = {str(cfg.get(flag)).lower()}, written explicitly")
    need(not (cfg.get("fc_norm") and cfg.get("norm_before_fc")), "fc_norm and norm_before_fc not both (speculators "
         "refuses that)")
    n = target.num_layers
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or []
    ours = native_layer_ids(ids, n, "vllm")
    need(len(ours) == 3, f"eagle_aux_hidden_state_layer_ids {ids} (vLLM: inputs of layers) = our outputs of layers {ours}")
    if fmt == "eagle3":
        eagle = cfg.get("eagle_config") or {}
        sglang = eagle.get("eagle_aux_hidden_state_layer_ids") or []
        need(eagle.get("use_aux_hidden_state") is True and native_layer_ids(sglang, n, "sglang") == ours,
             f"eagle_config.eagle_aux_hidden_state_layer_ids {sglang} (SGLang adds 1) names the same layers")
    done += check_tensors(tensors, expected_tensors(cfg, fmt), where)
    if _has_vocab_map(cfg, fmt):
        check_draft_vocab(tensors["d2t"], tensors["t2d"], target.vocab_size, where)
        done.append(f"d2t: {tensors['d2t'].shape[0]} int64 offsets in range, one target id each, consistent with t2d")
    return done


def load(folder: str, fmt: str, target: Target) -> Any:
    """The exported head as a draftsmith drafter: structure from the exported config, tensors from the
    exported file (renamed back by the adapter), feature layers from the exported ids."""
    return _load_config(folder, read_json(os.path.join(folder, "config.json")), fmt, target)


def _load_config(folder: str, cfg: dict[str, Any], fmt: str, target: Target) -> Any:
    """:func:`load` with the folder's config given (``cfg``). A layer field the config lacks (a foreign checkpoint's
    older config: no ``head_dim`` or ``rope_parameters``) is the target's, as draftsmith builds the head for it."""
    from transformers import LlamaConfig

    from ..drafters.common import draft_layer_config, frozen_copy, target_parts
    from ..drafters.eagle3 import Eagle3Head
    from ..drafters.eagle_runtime import EagleDrafter
    from ..drafters.peagle import PEagleConfig, PEagleDrafter, PEagleHead

    lc = dict(_layer_section(cfg, fmt))
    peagle = _is_peagle(cfg)
    engine = adapter("peagle" if peagle else "eagle3", fmt)
    stored = read_safetensors(os.path.join(folder, WEIGHTS))
    native = engine.from_engine(stored)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "attention_bias", "mlp_bias")
    ours = draft_layer_config(target.config)
    layer_config = LlamaConfig(num_hidden_layers=1, tie_word_embeddings=False,
                               **{k: lc[k] if k in lc else getattr(ours, k) for k in keys})
    layer_config._attn_implementation = "sdpa"
    embed = frozen_copy(target_parts(target.model).embed)  # the engine's: the target's embedding
    if "embed_tokens.weight" in native:  # speculators carries its own copy
        embed.weight.data = native.pop("embed_tokens.weight").to(embed.weight.dtype)
    options: dict[str, Any] = {flag: bool(cfg.get(flag)) for flag in NORM_FLAGS}
    num_layers = int(lc.get("num_hidden_layers", 1))
    options["residual_between_layers"] = residual_between_layers(stored, fmt, num_layers)
    if peagle:
        options["mask_token_id"] = int(cfg["mask_token_id"])
    head = (PEagleHead if peagle else Eagle3Head)(embed, layer_config, int(cfg["draft_vocab_size"]), int(lc["vocab_size"]),
                                                  num_layers=num_layers, **options)
    head.to(device=target.device, dtype=target.dtype)
    full = () if "d2t" in native else ("d2t", "t2d")  # without them: the identity mapping the head starts with
    _load_exact(head, native, skip=("embed_tokens.", "rotary_emb.", *full), where=folder)
    layers = native_layer_ids(cfg["eagle_aux_hidden_state_layer_ids"], target.num_layers, "vllm")
    if peagle:
        depths = int(cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
        config = PEagleConfig(feature_layers=list(layers), num_depths=depths, mask_token_id=head.mask_token_id,
                              draft_vocab_size=int(cfg["draft_vocab_size"]), num_layers=num_layers,
                              **{f: options[f] for f in (*NORM_FLAGS, "residual_between_layers")})
        return PEagleDrafter(head.eval(), tuple(layers), config)
    return EagleDrafter(head.eval(), tuple(layers), None)


def residual_between_layers(stored: dict[str, Tensor], fmt: str, num_layers: int) -> bool:
    """What the layers after the first of a checkpoint in ``fmt`` read, from the names its file (``stored``) holds them
    under: SGLang's ``additional_layers`` — the previous layer's MLP output alone (False, :data:`LAYER_STACKS`); vLLM's
    and speculators' ``layers.{i}`` — its whole output (True, as for a one-layer head, where nothing reads it)."""
    if fmt != "eagle3" or num_layers == 1:
        return True
    return not any(k.startswith("additional_layers.") for k in stored)


def _load_exact(module: torch.nn.Module, state: dict[str, Tensor], skip: tuple[str, ...], where: str) -> None:
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(skip)]
    if missing or unexpected:
        raise DraftsmithError(f"{where} does not load back into draftsmith: missing {missing[:5]}, unexpected "
                              f"{list(unexpected)[:5]}")


# ---------------------------------------------------------------- import: a foreign EAGLE-3 checkpoint → a drafter


LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
              "rms_norm_eps", "attention_bias", "mlp_bias")
"""The layer-config fields a draftsmith head rebuilds from the target (``drafters.common.draft_layer_config``): an
imported head whose fields differ would load into another shape (or silently another eps) when its folder is read."""


def refuse_layer_config(lc: dict[str, Any], target: Target, where: str, keys: tuple[str, ...]) -> None:
    """Refuse, in one line, a foreign head's layer config ``lc`` whose ``keys`` (those it names) or RoPE (theta, type)
    differ from the layer config draftsmith builds its head's layers with for ``target``
    (``drafters.common.draft_layer_config``): the head would load and silently compute something else."""
    from ..drafters.common import draft_layer_config

    ours = draft_layer_config(target.config)
    differ = [k for k in keys if k in lc and lc[k] != getattr(ours, k)]
    if differ:
        raise DraftsmithError(f"{where}: its layer config differs from the one draftsmith builds for {target.name} in "
                              f"{', '.join(f'{k} ({lc[k]} vs {getattr(ours, k)})' for k in differ)}")
    theirs_rope = (lc.get("rope_parameters") or {}).get("rope_theta", lc.get("rope_theta"))
    ours_rope = (getattr(ours, "rope_parameters", None) or {}).get("rope_theta")
    if theirs_rope is not None and ours_rope is not None and float(theirs_rope) != float(ours_rope):
        raise DraftsmithError(f"{where}: its rope_theta {theirs_rope} is not the {ours_rope} draftsmith builds the head with "
                              f"for {target.name}")
    kind = (lc.get("rope_parameters") or lc.get("rope_scaling") or {}).get("rope_type", "default")
    if kind != (getattr(ours, "rope_parameters", None) or {}).get("rope_type", "default"):
        raise DraftsmithError(f"{where}: its RoPE type {kind!r} is not the one draftsmith builds the head with for "
                              f"{target.name}")


def refuse_foreign(cfg: dict[str, Any], tensors: dict[str, Tensor], fmt: str, target: Target, where: str) -> None:
    """Refuse, in one line, an EAGLE-3 checkpoint in ``fmt`` (``cfg``: its config.json, ``tensors``: its file) that
    does not fit ``target`` or that draftsmith's head cannot compute: another vocabulary or hidden size, feature layers
    the target does not have, an embedding other than the target's (speculators stores the verifier's: the one
    fingerprint its folder carries), a layer config other than the one draftsmith builds for the target (another
    layer family, such as speculators' Qwen3 layer with q/k norms), or an eagle3-layout file holding its layers after
    the first under both SGLang's and vLLM's names (which compute them differently)."""
    lc = _layer_section(cfg, fmt)
    vocab, hidden = lc.get("vocab_size"), cfg.get("target_hidden_size") or lc.get("hidden_size")
    if int(vocab or -1) != target.vocab_size or int(hidden or -1) != target.hidden_size:
        raise DraftsmithError(f"{where} was trained for a target with vocabulary {vocab} and hidden size {hidden}, not "
                              f"{target.name}'s {target.vocab_size} and {target.hidden_size}")
    if lc.get("model_type", "llama") != "llama":
        raise DraftsmithError(f"{where}: its decoder layer is a {lc.get('model_type')} layer; draftsmith's EAGLE-3 head "
                              f"computes a Llama layer (another layer family is not imported yet)")
    sglang, vllm = (any(k.startswith(p) for k in tensors) for p in ("additional_layers.", "layers.1."))
    if fmt == "eagle3" and sglang and vllm:
        raise DraftsmithError(f"{where}: its layers after the first are stored under both SGLang's names "
                              f"(additional_layers.*) and vLLM's (layers.*), which compute them differently "
                              f"(drafters/eagle3.py); keep one set")
    refuse_layer_config(lc, target, where, LAYER_KEYS)
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids:  # SGLang's ids (eagle_config) must name the same layers; refuses ids the target does not have
        _checkpoint_layers(cfg, fmt, target.num_layers)
    embed = tensors.get("embed_tokens.weight")
    if embed is not None:
        from ..drafters.common import target_parts

        own = target_parts(target.model).embed.weight.detach().cpu()
        if embed.shape != own.shape or not torch.equal(embed.to(torch.bfloat16), own.to(torch.bfloat16)):
            raise DraftsmithError(f"{where}: its embedding (the verifier's, "
                                  f"{(cfg.get('speculators_config') or {}).get('verifier', {}).get('name_or_path')}) "
                                  f"is not {target.name}'s: it was trained for another target")


def _checkpoint_layers(cfg: dict[str, Any], fmt: str, num_layers: int) -> list[int]:
    """Our feature layer ids of a checkpoint, from whichever convention it writes them in (``conventions``): the top-level
    vLLM ids, or the eagle3 layout's ``eagle_config`` SGLang ids (both when both are there, which must agree). A
    checkpoint with neither gets the engines' default capture points (the same in both conventions)."""
    from ..target import default_eagle3_layers

    vllm = cfg.get("eagle_aux_hidden_state_layer_ids")
    sglang = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") if fmt == "eagle3" else None
    ours = native_layer_ids(vllm, num_layers, "vllm") if vllm else None
    if sglang:
        theirs = native_layer_ids(sglang, num_layers, "sglang")
        if ours is not None and ours != theirs:
            raise DraftsmithError(f"eagle_aux_hidden_state_layer_ids {vllm} (vLLM: inputs of layers) and eagle_config's "
                                  f"{sglang} (SGLang adds 1) name different layers, {ours} and {theirs}")
        ours = theirs
    return ours if ours is not None else list(default_eagle3_layers(num_layers))


def imported(folder: str, fmt: str, target: Target) -> tuple[Any, Any, dict[str, Any]]:
    """A foreign EAGLE-3 checkpoint in ``fmt`` (speculators: ``Eagle3DraftModel.save_pretrained``, what ``speculators
    train`` writes, or ``PEagleDraftModel``'s, a P-EAGLE head: ``speculators_model_type: peagle``, its ``mask_hidden``,
    ``mask_token_id`` and depths = ``speculative_tokens``; eagle3: the original layout, what SpecForge and the EAGLE
    authors publish) as (config, head, what the drafter folder records of it), for ``target``.

    The inverse of ``--to`` ``fmt``, through the same name table (``adapters``, read backwards: ``layers.0.* →
    midlayer.*``; fc, norm, lm_head, d2t, t2d as they are; a stored embedding dropped, as the drafter takes the
    target's) and the same layer-id conventions (``conventions``). Refused in one line: :func:`refuse_foreign`."""
    from ..drafters.eagle3 import Eagle3Config

    cfg = read_json(os.path.join(folder, "config.json"))
    refuse_foreign(cfg, read_safetensors(os.path.join(folder, WEIGHTS)), fmt, target, folder)
    if not cfg.get("eagle_aux_hidden_state_layer_ids"):  # load() reads the vLLM ids: give it the resolved ones
        cfg = {**cfg, "eagle_aux_hidden_state_layer_ids": engine_layer_ids(_checkpoint_layers(cfg, fmt, target.num_layers),
                                                                           target.num_layers, "vllm")}
    if "d2t" not in read_safetensors(os.path.join(folder, WEIGHTS)) and int(cfg.get("draft_vocab_size", -1)) != \
            int(_layer_section(cfg, fmt)["vocab_size"]):
        raise DraftsmithError(f"{folder}: a draft vocabulary of {cfg.get('draft_vocab_size')} tokens without its d2t / "
                              f"t2d tensors: which target ids its rows are is unknown")
    drafter = _load_config(folder, cfg, fmt, target)
    head = drafter.module
    config = drafter.config or Eagle3Config(feature_layers=list(drafter.feature_layers),  # a P-EAGLE head's is made
                                            draft_vocab_size=int(head.d2t.shape[0]), num_layers=head.num_layers,
                                            residual_between_layers=bool(head.residual_between_layers),
                                            **{flag: bool(cfg.get(flag)) for flag in NORM_FLAGS})
    verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
    return config, head, {"verifier": verifier.get("name_or_path"),
                          "eagle_aux_hidden_state_layer_ids": cfg.get("eagle_aux_hidden_state_layer_ids")}


# ---------------------------------------------------------------- speculators' own classes


def reference_model(folder: str) -> tuple[Any, list[str]]:
    """``folder`` loaded in speculators' own class (``Eagle3DraftModel`` or ``PEagleDraftModel``, by its
    ``speculators_model_type``), fp32, eager attention, and the check done: missing, unexpected or never-loaded tensors
    are errors — every tensor of the loaded model must equal the file's, except speculators' training-only
    verifier_norm / verifier_lm_head."""
    try:
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
        from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    except ImportError as e:
        raise DraftsmithError(f"checking a speculators export needs the speculators package ({e}): pip install "
                              f"--no-deps speculators==0.9.0 hs-connectors && pip install openai loguru") from e
    peagle = _is_peagle(read_json(os.path.join(folder, "config.json")))
    config_class, model_class = (PEagleSpeculatorConfig, PEagleDraftModel) if peagle else \
        (Eagle3SpeculatorConfig, Eagle3DraftModel)
    config = config_class.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"  # its default flex attention wants S % 128 == 0
    model = model_class.from_pretrained(folder, config=config).float().eval()
    file = read_safetensors(os.path.join(folder, WEIGHTS))
    training_only = {"verifier_norm.weight", "verifier_lm_head.weight"}
    missing, unexpected, stale = loaded_mismatch(model.state_dict(), file, training_only)
    if missing or unexpected or stale:
        raise DraftsmithError(f"{folder}: speculators' {model_class.__name__} leaves tensors missing {missing}, finds "
                              f"unexpected {unexpected}, or holds values other than the file's (uninitialized) {stale}")
    return model, [f"speculators {model_class.__name__} loads all {len(file)} tensors of the file, each equal to it "
                   f"(no missing, unexpected or uninitialized tensor)"]


def speculators_logits(folder: str, input_ids: Tensor, features: Tensor, steps: int) -> tuple[list[Tensor], list[str]]:
    """Load ``folder`` with speculators' ``Eagle3DraftModel`` and run its forward (``steps`` unrolled
    steps, eager attention, positions 0 …) on ``features`` [1, S, 3H] with ``input_ids`` [1, S] (row t
    already holds x_{t+1}); returns the logits [1, S, Vd] of each step and the checks done (:func:`reference_model`)."""
    model, lines = reference_model(folder)
    captured: list[Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    try:
        with torch.no_grad():
            model(hidden_states=features.float(), input_ids=input_ids, document_ids=torch.zeros_like(input_ids),
                  position_ids=torch.arange(input_ids.shape[1])[None], ttt_steps=steps)
    finally:
        hook.remove()
    return captured, lines


def speculators_parallel_logits(model: Any, input_ids: Tensor, features: Tensor, loss_mask: Tensor, num_depths: int,
                                seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """speculators' ``PEagleDraftModel`` ``model`` (:func:`reference_model`) run on one sequence: its training forward,
    the only one it has, on ``features`` [1, S, 3H] with ``input_ids`` [1, S] (row t already holds x_{t+1}) and
    ``loss_mask`` [1, S] (the rows whose rollouts it samples), its COD draw seeded by ``seed`` (the global RNG is
    restored). Returns (logits [T, Vd], anchor [T], depth [T]) of its own draw, read where it makes them."""
    import speculators.models.peagle.core as core
    from speculators.losses import resolve_loss_config

    drawn: list[tuple[Tensor, Tensor]] = []
    sample = core.generate_cod_sample_indices
    captured: list[Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    core.generate_cod_sample_indices = lambda *a, **kw: drawn.append(sample(*a, **kw)) or drawn[-1]
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            model(hidden_states=features.float(), input_ids=input_ids, document_ids=torch.zeros_like(input_ids),
                  loss_mask=loss_mask, verifier_last_hidden_states=features.new_zeros(1, input_ids.shape[1],
                                                                                     model.hidden_size).float(),
                  num_depths=num_depths, loss_config=resolve_loss_config("kl_div", "eager"))
    finally:
        core.generate_cod_sample_indices = sample
        hook.remove()
    anchor, depth = drawn[0]
    return captured[0][0], anchor, depth
