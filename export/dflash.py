"""DFlash drafters in two layouts: z-lab's (``--to dflash``, what SpecForge trains into and vLLM / SGLang
load as ``DFlashDraftModel``) and speculators' ``dflash`` (``--to speculators-dflash``, vLLM's native
format); ``export/gguf.py`` converts the z-lab layout for llama.cpp's ``draft-dflash``.

What the loaders read (z-lab/dflash ``dflash/model.py``; speculators 0.9.0 ``models/dflash`` and its
``convert/dflash/converter.py``, which turns a z-lab folder into a speculators one; llama.cpp 11434
``conversion/qwen.py`` ``DFlashModel`` and ``src/models/dflash.cpp``):

* tensors (the same names in both layouts): ``fc.weight`` [H, L·H], ``hidden_norm.weight`` [H],
  ``layers.{i}.input_layernorm / post_attention_layernorm.weight`` [H],
  ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight`` [d],
  ``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``norm.weight`` [H]. No embedding or lm_head: every
  loader takes the target's (z-lab's ``spec_generate`` calls ``target.model.embed_tokens`` and
  ``target.lm_head``; speculators' ``load_verifier_weights`` copies them from the verifier, which its
  own full-vocabulary checkpoints leave out too; llama.cpp shares the target's via ``ctx_other``).
* z-lab config: a Qwen3 config (``model_type: qwen3``, the draft's ``num_hidden_layers``) with
  ``architectures: [DFlashDraftModel]``, ``block_size`` and ``num_target_layers`` at the top level and
  ``dflash_config: {block_size, mask_token_id, target_layer_ids}``; ``target_layer_ids`` are ours (z-lab
  reads ``hidden_states[id + 1]``, the output of layer id). No ``auto_map``: no modeling code is shipped
  (the engines have their own class; z-lab's ``trust_remote_code`` path needs its ``dflash.py`` added).
* speculators config: ``speculators_model_type: dflash``, ``transformer_layer_config`` (the Qwen3
  config), ``block_size``, ``mask_token_id``, ``sample_from_anchor: false`` (the anchor is the bonus
  token: Bs − 1 drafts), ``aux_hidden_state_layer_ids`` = ours + 1 (its converter's rule; the target's
  last layer cannot be one), ``draft_vocab_size`` = the target's vocabulary, a greedy proposal of Bs − 1
  tokens and the verifier (the target's folder, which it reads the embedding and lm_head from).

A reduced draft vocabulary (``drafter.draft_vocab``; the drafter's lm_head is the target's rows of it):

* speculators' ``dflash`` carries one as its EAGLE-3 does: ``draft_vocab_size`` = Vd, ``lm_head.weight``
  [Vd, H] stored (``DraftVocabMixin``: a reduced head is saved, not rebuilt from the verifier), ``d2t`` [Vd]
  int64 offsets and ``t2d`` [V] bool; vLLM's ``DFlashQwen3ForCausalLM`` reads ``draft_vocab_size``, the
  lm_head and ``d2t`` (as ``draft_id_to_target_id``) and scatters the logits to the target's vocabulary.
* z-lab's layout cannot: z-lab's ``spec_generate``, SpecForge and speculators' ``DFlashConverter`` (which
  sets ``draft_vocab_size`` to the full vocabulary and drops ``d2t``/``t2d``) all use the target's lm_head, so
  the export is refused. Expanding the head to the full vocabulary is not exact — the expanded drafter would
  draft tokens outside the draft vocabulary, which the drafter proven in draftsmith never does — so it is not
  offered.
* GGUF (llama.cpp) carries one: llama.cpp's ``dflash`` runtime (``src/models/dflash.cpp``) reads an own
  ``output`` [H, Vd] head and a ``d2t`` [Vd] I64 of absolute target ids, and scatters the draft logits to the
  target's vocabulary. Its converter writes the head (our lm_head rows, ``--to gguf``'s layout) but ``d2t`` only
  for the DSpark architectures, so ``export/gguf.py`` adds it to the converted file (:func:`~draftsmith.export.
  gguf.set_d2t`), as the converter's ``DSparkModel`` writes it (offsets + arange).

DFlash2 (``drafter.type: dflash2``) goes to speculators' format only (``--to speculators-dflash``): its
``DFlash2SpeculatorConfig`` is DFlash's plus ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``,
``selector_top_k`` (``speculators_model_type: dflash2``, ``architectures: [DFlash2DraftModel]``, the config's default,
which llama.cpp's converter registers too), and its tensors DFlash's plus ``layers.{i}.{attention,mlp}_conv.base_kernel``
[2, K, H] / ``.kernel_projection.weight`` [2·K·G, H] and ``candidate_selector.{predecessor,successor}_codebook`` [V, r],
``candidate_selector.hidden_projection.weight`` [r, H]; full vocabulary only (the reference refuses a draft
vocabulary). For GGUF it is written in z-lab's layout with ``architectures: [DFlash2DraftModel]`` and those four
fields in ``dflash_config``, what llama.cpp's converter reads (``conversion/qwen.py`` ``DFlashModel``: ``dflash.conv_*``,
``dflash.selector_*``, the ``blk.{i}.{attn,ffn}_conv_{base,proj}`` and ``selector_*`` tensors); z-lab's own loaders
know no DFlash2, so ``--to dflash`` refuses it.

``--check`` beyond the static checks: the z-lab folder is converted by speculators' own
``DFlashConverter`` (which refuses unexpected tensors and missing draft tensors, and maps
``target_layer_ids``), and speculators' ``DFlashDraftModel`` loaded from either layout computes the
block's logits on the same target hidden states as draftsmith's drafter (:func:`compare_reference`).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from ..errors import DraftsmithError
from ..files import write_json
from ..target import Target
from .adapters import adapter
from .conventions import engine_layer_ids, native_layer_ids
from .eagle3 import layer_fields, refuse_layer_config, verifier_path
from .tensors import DTYPES, loaded_mismatch, TensorSpec, check_tensors, dtype_name, read_json, read_safetensors, \
    write_safetensors

WEIGHTS = "model.safetensors"
LOGIT_TOLERANCE = 1e-4
"""Largest |Δlogit| between speculators' forward and draftsmith's drafter (other attention kernels, fp32)."""


def qwen3_fields(module: Any) -> dict[str, Any]:
    """The draft layers as a Qwen3 config: the EAGLE-3 head's Llama layer fields (the target's dimensions, RoPE,
    norm epsilon) with ``model_type: qwen3``, ``num_hidden_layers`` = draft layers and full attention everywhere."""
    n = len(module.layers)
    return {**layer_fields(module.layer_config), "model_type": "qwen3", "num_hidden_layers": n, "attention_dropout": 0.0,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": n,
            "layer_types": ["full_attention"] * n}


def zlab_config(source: Any) -> dict[str, Any]:
    """z-lab's config; a DFlash2's (``DFlash2DraftModel``, for llama.cpp's converter only) adds its conv and selector
    sizes to ``dflash_config``, where the converter reads them; a target whose embedding scales its rows (Gemma) adds
    ``input_embedding_scale``, which z-lab's code applies to the raw embedding."""
    m, scale = source.drafter.module, embedding_scale(source.target)
    extra = {name: int(getattr(source.drafter.config, name)) for name in DFLASH2_FIELDS} if source.family == "dflash2" else {}
    return {
        "architectures": ["DFlash2DraftModel" if extra else "DFlashDraftModel"],
        **qwen3_fields(m),
        "num_target_layers": int(source.target.num_layers),
        "block_size": int(m.block_size),
        "dflash_config": {"block_size": int(m.block_size), "mask_token_id": int(m.mask_token_id),
                          "target_layer_ids": engine_layer_ids(m.feature_layers, source.target.num_layers, "zlab"),
                          **extra, **({"input_embedding_scale": scale} if scale != 1.0 else {})},
        "torch_dtype": dtype_name(source.dtype),
        "dtype": dtype_name(source.dtype),
    }


SPECULATORS_ARCHITECTURE = {"dflash": "DFlashSpeculator", "dflash2": "DFlash2DraftModel"}
"""speculators_model_type → the architectures entry its config class writes by default."""
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""What speculators' DFlash2 config adds to DFlash's, under the same names as draftsmith's DFlash2Config."""


def speculators_config(source: Any) -> dict[str, Any]:
    m, target, kind = source.drafter.module, source.target, source.family
    extra = {name: int(getattr(source.drafter.config, name)) for name in DFLASH2_FIELDS} if kind == "dflash2" else {}
    return {
        "architectures": [SPECULATORS_ARCHITECTURE[kind]],
        "speculators_model_type": kind,
        "transformer_layer_config": qwen3_fields(m),
        "draft_vocab_size": int(target.vocab_size if m.d2t is None else m.d2t.shape[0]),
        "block_size": int(m.block_size),
        "target_hidden_size": int(target.hidden_size),
        "aux_hidden_state_layer_ids": engine_layer_ids(m.feature_layers, target.num_layers, "speculators"),
        "mask_token_id": int(m.mask_token_id),
        "sliding_window_non_causal": kind == "dflash2",  # each config's default (no sliding-window layer either way)
        "sample_from_anchor": False,
        **extra,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(m.block_size) - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_path(target),
                         "architectures": list(getattr(target.config, "architectures", None) or [])},
        },
        "torch_dtype": dtype_name(source.dtype),
        "dtype": dtype_name(source.dtype),
    }


def write(source: Any, fmt: str, out: str) -> None:
    """Write the drafter of ``source`` into the folder ``out`` in ``fmt``: dflash | speculators-dflash, or gguf
    (z-lab's layout as llama.cpp's converter reads it, plus the lm_head rows of a reduced draft vocabulary)."""
    from .tensors import cast_floats

    m, n = source.drafter.module, source.target.num_layers
    if fmt == "speculators-dflash" and n - 1 in m.feature_layers:
        raise DraftsmithError(f"the speculators format cannot hold target layer {n - 1} (the last layer's output): its "
                              f"training splits that layer off as the verifier's own; train with earlier layers")
    refuse_draft_vocab(source, fmt)
    state = {k: v for k, v in m.state_dict().items() if not k.startswith("rotary_emb.")}
    tensors = cast_floats(adapter(source.family, fmt, reduced_vocab=m.d2t is not None).to_engine(state), source.dtype)
    write_safetensors(os.path.join(out, WEIGHTS), tensors)
    write_json(os.path.join(out, "config.json"), speculators_config(source) if fmt == "speculators-dflash" else zlab_config(source))


def refuse_draft_vocab(source: Any, fmt: str) -> None:
    """One line for a format that cannot carry the drafter's reduced vocabulary (module docstring)."""
    m = source.drafter.module
    if m.d2t is None or fmt != "dflash":  # speculators' dflash and GGUF carry it
        return
    raise DraftsmithError(f"this DFlash drafter has a reduced draft vocabulary ({m.d2t.shape[0]} tokens), which the "
                          f"{fmt} format cannot carry: z-lab's layout has no draft vocabulary (its loaders use the "
                          f"target's lm_head); export it with --to speculators-dflash")


# ---------------------------------------------------------------- reading back


def _zlab_value(cfg: dict[str, Any], name: str, default: Any = None) -> Any:
    """A draft option as z-lab's code reads it (``_draft_value``): ``dflash_config``'s, else the config's own."""
    return (cfg.get("dflash_config") or {}).get(name, cfg.get(name, default))


def embedding_scale(target: Target) -> float:
    """What the target's embedding module multiplies its rows by (Gemma's ``embed_scale``, √H; 1 for most): the
    scale draftsmith's DFlash applies, as it reads the target's embedding module."""
    from ..drafters.common import target_parts

    return float(getattr(target_parts(target.model).embed, "embed_scale", 1.0))


def _layers(cfg: dict[str, Any], fmt: str) -> dict[str, Any]:
    return cfg["transformer_layer_config"] if fmt == "speculators-dflash" else cfg


def _draft_fields(cfg: dict[str, Any], fmt: str, num_layers: int) -> dict[str, Any]:
    """block_size, mask_token_id, our feature layer ids (and speculators' draft_vocab_size), read from either layout."""
    if fmt == "speculators-dflash":
        vd, v = int(cfg["draft_vocab_size"]), int(cfg["transformer_layer_config"]["vocab_size"])
        extra = {name: int(cfg[name]) for name in DFLASH2_FIELDS} if cfg.get("speculators_model_type") == "dflash2" else {}
        return {"block_size": int(cfg["block_size"]), "mask_token_id": int(cfg["mask_token_id"]),
                "feature_layers": native_layer_ids(cfg["aux_hidden_state_layer_ids"], num_layers, "speculators"),
                "draft_vocab_size": 0 if vd == v else vd, **extra}
    d = cfg.get("dflash_config") or {}
    return {"block_size": int(d.get("block_size", cfg.get("block_size", 16))), "mask_token_id": int(d["mask_token_id"]),
            "feature_layers": native_layer_ids(d["target_layer_ids"], num_layers, "zlab")}


def expected_tensors(cfg: dict[str, Any], fmt: str, num_features: int) -> dict[str, TensorSpec]:
    """Every tensor the loaders read for this config (module docstring), with shape and dtype."""
    lc = _layers(cfg, fmt)
    h, i, d = int(lc["hidden_size"]), int(lc["intermediate_size"]), int(lc["head_dim"])
    q, kv = int(lc["num_attention_heads"]) * d, int(lc["num_key_value_heads"]) * d
    f = DTYPES[cfg.get("torch_dtype", "float32")]
    out: dict[str, TensorSpec] = {"fc.weight": ((h, num_features * h), f), "hidden_norm.weight": ((h,), f),
                                  "norm.weight": ((h,), f)}
    vd, v = int(cfg.get("draft_vocab_size") or lc["vocab_size"]), int(lc["vocab_size"])
    if fmt == "speculators-dflash" and vd < v:  # a reduced vocabulary: its head rows and the mapping
        out.update({"lm_head.weight": ((vd, h), f), "d2t": ((vd,), torch.int64), "t2d": ((v,), torch.bool)})
    for n in range(int(lc["num_hidden_layers"])):
        p = f"layers.{n}."
        out.update({
            f"{p}input_layernorm.weight": ((h,), f), f"{p}post_attention_layernorm.weight": ((h,), f),
            f"{p}self_attn.q_proj.weight": ((q, h), f), f"{p}self_attn.k_proj.weight": ((kv, h), f),
            f"{p}self_attn.v_proj.weight": ((kv, h), f), f"{p}self_attn.o_proj.weight": ((h, q), f),
            f"{p}self_attn.q_norm.weight": ((d,), f), f"{p}self_attn.k_norm.weight": ((d,), f),
            f"{p}mlp.gate_proj.weight": ((i, h), f), f"{p}mlp.up_proj.weight": ((i, h), f),
            f"{p}mlp.down_proj.weight": ((h, i), f),
        })
        if cfg.get("speculators_model_type") == "dflash2":
            k, g = int(cfg["conv_kernel_size"]), h // int(cfg["conv_group_size"])
            for conv in ("attention_conv", "mlp_conv"):
                out.update({f"{p}{conv}.base_kernel": ((2, k, h), f), f"{p}{conv}.kernel_projection.weight": ((2 * k * g, h), f)})
    if cfg.get("speculators_model_type") == "dflash2":
        r = int(cfg["selector_rank"])
        out.update({"candidate_selector.predecessor_codebook": ((v, r), f),
                    "candidate_selector.successor_codebook": ((v, r), f),
                    "candidate_selector.hidden_projection.weight": ((r, h), f)})
    return out


def static_check(folder: str, fmt: str, target: Target) -> list[str]:
    """Config fields and every tensor against what the loaders read; one line per check."""
    from ..drafters.dflash import dflash_layer_config

    cfg = read_json(os.path.join(folder, "config.json"))
    tensors = read_safetensors(os.path.join(folder, WEIGHTS))
    lc = _layers(cfg, fmt)
    done: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise DraftsmithError(f"{folder}: {what}")
        done.append(what)

    if fmt == "speculators-dflash":
        kind = cfg.get("speculators_model_type")
        arch = SPECULATORS_ARCHITECTURE.get(kind)
        need(arch is not None and cfg.get("architectures") == [arch],
             f"architectures = [{arch}], speculators_model_type = {kind} (dflash or dflash2)")
        spec = cfg.get("speculators_config") or {}
        methods = spec.get("proposal_methods") or [{}]
        need(spec.get("algorithm") == kind and int(methods[0].get("speculative_tokens", 0)) == int(cfg["block_size"]) - 1
             and bool((spec.get("verifier") or {}).get("name_or_path")),
             f"speculators_config: algorithm {kind}, block_size − 1 speculative tokens, a verifier name_or_path")
        vd = int(cfg.get("draft_vocab_size", -1))
        need(cfg.get("sample_from_anchor") is False and 0 < vd <= target.vocab_size,
             f"sample_from_anchor = false (Bs − 1 drafts), draft_vocab_size {vd} ≤ the target's {target.vocab_size}")
    else:
        need(cfg.get("architectures") == ["DFlashDraftModel"], "architectures = [DFlashDraftModel]")
        need(int(cfg.get("num_target_layers", -1)) == target.num_layers, f"num_target_layers = {target.num_layers}")
    fields = _draft_fields(cfg, fmt, target.num_layers)
    if "selector_rank" in fields:
        need(fields["draft_vocab_size"] == 0 and all(fields[k] >= 1 for k in DFLASH2_FIELDS)
             and int(lc["hidden_size"]) % fields["conv_group_size"] == 0 and fields["conv_kernel_size"] <= fields["block_size"]
             and fields["selector_top_k"] <= target.vocab_size,
             f"DFlash2: the full vocabulary, {fields['conv_kernel_size']} taps ≤ block_size, groups of "
             f"{fields['conv_group_size']} channels dividing the hidden size, selector rank {fields['selector_rank']}, "
             f"top {fields['selector_top_k']} ≤ the vocabulary")
    need(2 <= fields["block_size"] <= 64, f"block_size = {fields['block_size']}")
    need(0 <= fields["mask_token_id"] < target.vocab_size, f"mask_token_id {fields['mask_token_id']} in the vocabulary")
    need(all(0 <= i < target.num_layers for i in fields["feature_layers"]),
         f"target layers {fields['feature_layers']} (draftsmith: outputs of layers) exist in the target")
    own = dflash_layer_config(target.config)
    differ = [f"{k} {lc[k]} (the target's {getattr(own, k)})" for k in
              ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
              if int(lc[k]) != int(getattr(own, k))]
    need(lc.get("model_type") == "qwen3" and not differ and lc.get("tie_word_embeddings") is False
         and lc.get("attention_bias") is False and not lc.get("use_sliding_window"),
         "a Qwen3 layer config with the target's dimensions, no bias, no sliding window, untied"
         + (f": it has {', '.join(differ)}, trained for another target" if differ else ""))
    refuse_layer_config(lc, target, folder, ("hidden_act", "rms_norm_eps"))
    done.append("hidden_act, rms_norm_eps and RoPE are those the draft layers are built with for the target")
    if fmt == "dflash":
        scale, own = float(_zlab_value(cfg, "input_embedding_scale", 1.0)), embedding_scale(target)
        need(abs(scale - own) <= 1e-3 * own, f"input_embedding_scale {scale:g} (z-lab's code scales the raw embedding "
             f"by it) = the target embedding's own {own:g} (draftsmith's drafter reads the target's embedding as it is)")
        need(float(_zlab_value(cfg, "output_multiplier", 1.0)) == 1.0
             and not float(_zlab_value(cfg, "final_logit_softcapping", 0.0) or 0.0),
             "no output_multiplier or final_logit_softcapping (draftsmith's drafter reads the target's lm_head as it is)")
        need(not _zlab_value(cfg, "is_causal") and all(t == "full_attention" for t in lc.get("layer_types") or []),
             "every layer attends the whole block and context (no is_causal, no sliding_attention layer_types)")
    done += check_tensors(tensors, expected_tensors(cfg, fmt, len(fields["feature_layers"])), folder)
    if "d2t" in tensors:
        from ..data.vocab import check_draft_vocab

        check_draft_vocab(tensors["d2t"], tensors["t2d"], target.vocab_size, folder)
        done.append(f"d2t: {tensors['d2t'].shape[0]} int64 offsets in range, one target id each, consistent with t2d")
    return done


def load(folder: str, fmt: str, target: Target) -> Any:
    """The export as a draftsmith drafter: fields from the exported config, tensors from the exported file
    (renamed back by the adapter), the target's embedding and lm_head."""
    from ..drafters.dflash import DFlashConfig
    from ..drafters.dflash2 import DFlash2Config

    cfg = read_json(os.path.join(folder, "config.json"))
    fields = _draft_fields(cfg, fmt, target.num_layers)
    kind = "dflash2" if "selector_rank" in fields else "dflash"
    family = DFlash2Config if kind == "dflash2" else DFlashConfig
    config = family(num_layers=int(_layers(cfg, fmt)["num_hidden_layers"]), **fields).resolve(target)
    module = config.module_for_checkpoint(target, {})  # a reduced head: the target's rows, taken after d2t is read
    file = read_safetensors(os.path.join(folder, WEIGHTS))
    native = adapter(kind, fmt, reduced_vocab="d2t" in file).from_engine(file)
    missing, unexpected = module.load_state_dict(native, strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens.", "lm_head.", "rotary_emb."))]
    if missing or unexpected:
        raise DraftsmithError(f"{folder} does not load back into draftsmith: missing {missing[:5]}, unexpected "
                              f"{list(unexpected)[:5]}")
    return config.runtime(module.eval(), target)


def imported(folder: str, fmt: str, target: Target) -> tuple[Any, Any, dict[str, Any]]:
    """A DFlash drafter trained elsewhere (z-lab's layout or speculators') as (config, module, record) for ``target``
    (``export/importer.py``): the static checks of ``--check`` first (the target's dimensions, layers it has, every
    tensor the loaders read and no other, d2t), each refusal one line; then :func:`load`."""
    static_check(folder, fmt, target)
    drafter = load(folder, fmt, target)
    cfg = read_json(os.path.join(folder, "config.json"))
    verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return drafter.config, drafter.module, {"verifier": verifier} if verifier else {}


# ---------------------------------------------------------------- the reference loader (speculators)


def reference_model(folder: str, fmt: str, target: Target) -> tuple[Any, list[str]]:
    """speculators' ``DFlashDraftModel`` holding the export (a z-lab folder converted by its ``DFlashConverter``
    first), fp32, eager attention; and the checks done on the way."""
    try:
        from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
        from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    except ImportError as e:
        raise DraftsmithError(f"checking a DFlash export needs the speculators package ({e}): pip install --no-deps "
                              f"speculators==0.9.0 hs-connectors && pip install openai loguru") from e
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dflash-check.") as tmp:
        if fmt == "dflash":
            from speculators.convert.dflash.converter import DFlashConverter

            try:
                DFlashConverter().convert(folder, tmp, base_model=verifier_path(target), validate=False)
            except (ValueError, KeyError, RuntimeError) as e:
                raise DraftsmithError(f"speculators' DFlashConverter refuses the z-lab layout in {folder}: {e}") from e
            lines.append("speculators' DFlashConverter reads the z-lab layout (no unexpected tensor, no draft tensor "
                         "missing) and maps dflash_config.target_layer_ids")
            folder = tmp
        dflash2 = read_json(os.path.join(folder, "config.json")).get("speculators_model_type") == "dflash2"
        config_class, model_class = ((DFlash2SpeculatorConfig, DFlash2DraftModel) if dflash2 else
                                     (DFlashSpeculatorConfig, DFlashDraftModel))
        config = config_class.from_pretrained(folder)
        config.transformer_layer_config._attn_implementation = "eager"  # its default flex attention wants S % 128 == 0
        model = model_class.from_pretrained(folder, config=config).float().eval()
        file = read_safetensors(os.path.join(folder, WEIGHTS))
    loaded = model.state_dict()
    from_verifier = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    missing, unexpected, stale = loaded_mismatch(loaded, file, from_verifier)
    if missing or unexpected or stale:
        raise DraftsmithError(f"speculators' {type(model).__name__} leaves tensors missing {missing}, finds unexpected "
                              f"{unexpected}, or holds values other than the file's {stale}")
    lines.append(f"speculators {type(model).__name__} loads all {len(file)} draft tensors, each equal to the file, "
                 f"and the embedding and lm_head from the verifier")
    return model, lines


def compare_reference(folder: str, fmt: str, target: Target, source: Any, ids: list[int]) -> list[str]:
    """speculators' model and draftsmith's drafter, the same block on the same target hidden states: the anchor
    (the last prompt token) at position n − 1 and Bs − 1 mask tokens, context = the target's features of
    positions 0 … n − 2. Its layers are run one by one as its forward does (that forward is its training step). A
    DFlash2's selector scores too, each block row's candidates given a predecessor (the anchor for row 1, the unary
    argmax of the row before for the others: a walk the runtime could take)."""
    model, lines = reference_model(folder, fmt, target)
    m = source.drafter.module
    if [i - 1 for i in model.target_layer_ids] != list(m.feature_layers):
        raise DraftsmithError(f"speculators reads target layers {model.target_layer_ids} (input of layer), draftsmith's "
                              f"drafter {list(m.feature_layers)} (output of layer)")
    n, bs = len(ids) - 1, m.block_size
    with torch.no_grad():
        feats = target.forward(torch.tensor([ids[:-1]]), feature_layers=tuple(m.feature_layers)).features.float()
        block = torch.tensor([[ids[-1]] + [m.mask_token_id] * (bs - 1)])
        positions = torch.arange(n + bs)[None]
        hidden = m(block, positions[:, n:], m.context(feats, positions[:, :n]))[0]  # [Bs, H]
        ours = m.lm_head(hidden)  # [Bs, V]
        ctx = model.hidden_norm(model.fc(feats))
        x = model.embed_tokens(block)
        pe = model.rotary_emb(x, positions)
        for layer in model.layers:
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_ids=positions, position_embeddings=pe)
        their_hidden = model.norm(x)[0]
        theirs = model.lm_head(their_hidden)
        what = "logits"
        if hasattr(m, "candidate_selector"):
            # row k's predecessor: the anchor for rows 0 (unused) and 1, then the unary argmax of row k − 1
            previous = torch.cat([block[0, :1], block[0, :1], ours[1:-1].argmax(-1)])  # [Bs]
            candidates, scores = m.select(hidden, previous)
            their_candidates, their_scores = model.candidate_selector.select(theirs, their_hidden, previous)
            if not torch.equal(candidates, their_candidates):
                raise DraftsmithError("speculators' DFlash2 selector picks other candidates than draftsmith's drafter")
            ours, theirs, what = torch.cat([ours, scores], -1), torch.cat([theirs, their_scores], -1), "logits and selector scores"
    diff = float((ours.float() - theirs.float()).abs().max())
    if diff > LOGIT_TOLERANCE:
        raise DraftsmithError(f"speculators' {type(model).__name__} {what} differ from draftsmith's drafter by {diff:.2e} "
                              f"(> {LOGIT_TOLERANCE:.0e})")
    return lines + [f"speculators' layers on the same target hidden states ({n} context positions, a block of {bs}) = "
                    f"draftsmith's {what} (max |Δ| = {diff:.1e}, fp32)"]
