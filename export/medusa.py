"""Medusa heads in the reference / TGI layout (``--to medusa``) and in vLLM's (``--to medusa-vllm``).

Reference (FasterDecoding/Medusa ``medusa_model.py``, read by TGI): ``medusa_lm_head.safetensors``
holds head h's residual block l as ``{h}.{l}.linear.weight`` [H, H] / ``.bias`` [H] and its
projection as ``{h}.{L}.weight`` [V, H]; ``config.json`` carries ``medusa_num_heads``,
``medusa_num_layers``, ``hidden_size``, ``vocab_size`` and ``base_model_name_or_path``.

vLLM (``vllm/model_executor/models/medusa.py`` at commit 01dbb081,
``vllm/transformers_utils/configs/medusa.py`` at 0531c222): ``model.safetensors`` with
``blocks.{h}.layers.{l}.weight`` / ``.bias`` and ``lm_heads.{h}.weight``; the residual blocks
have a bias only when ``medusa_fc_bias: true`` (default false), and a name the loader does not
know is dropped silently. Its config reader renames every key containing "num" and "heads"
to ``num_heads`` (and "num" + "layers" to ``num_hidden_layers``), so the config is minimal:
one such key each.

Both read the target's *final-normed* last hidden state, which is exactly what draftsmith's
heads compute first (a frozen copy of the target's final norm over the pre-norm feature), and
head k predicts the token k+2 ahead in both, so the weights carry over unchanged.
"""

from __future__ import annotations

import os
from typing import Any


from ..errors import DraftsmithError
from ..files import write_json
from ..target import Target
from .adapters import adapter
from .tensors import DTYPES, TensorSpec, cast_floats, check_tensors, dtype_name, read_json, read_safetensors, \
    write_safetensors

FILES = {"medusa": "medusa_lm_head.safetensors", "medusa-vllm": "model.safetensors"}


def _config(source: Any, fmt: str) -> dict[str, Any]:
    heads = source.drafter.module
    h, v = int(heads.hidden_size), int(heads.heads[0][-1].weight.shape[0])
    k, layers = int(heads.num_heads), len(heads.heads[0]) - 1
    if fmt == "medusa":
        from .eagle3 import verifier_path

        return {"medusa_num_heads": k, "medusa_num_layers": layers, "hidden_size": h, "vocab_size": v,
                "base_model_name_or_path": verifier_path(source.target), "torch_dtype": dtype_name(source.dtype)}
    return {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": h, "vocab_size": v,
            "num_heads": k, "num_hidden_layers": layers, "truncated_vocab_size": v, "medusa_fc_bias": True,
            "torch_dtype": dtype_name(source.dtype)}


def write(source: Any, fmt: str, out: str) -> None:
    cfg = _config(source, fmt)
    layers = cfg.get("medusa_num_layers", cfg.get("num_hidden_layers"))
    tensors = adapter("medusa", fmt, int(layers)).to_engine(dict(source.drafter.module.state_dict()))
    write_safetensors(os.path.join(out, FILES[fmt]), cast_floats(tensors, source.dtype))
    write_json(os.path.join(out, "config.json"), cfg)


def read_config(folder: str, fmt: str) -> dict[str, Any]:
    """(heads, layers, hidden, vocab, dtype) as the engine's config reader sees them (vLLM's renaming applied; the
    reference layout's dimensions off its tensors where its config names none: :func:`_projection_fields`)."""
    cfg = read_json(os.path.join(folder, "config.json"))
    if fmt == "medusa":
        keys = {"heads": "medusa_num_heads", "layers": "medusa_num_layers"}
    else:
        renamed: dict[str, Any] = {}
        for key, value in cfg.items():  # vLLM MedusaConfig.from_pretrained
            if "num" in key and "heads" in key:
                if "num_heads" in renamed:
                    raise DraftsmithError(f"{folder}/config.json: two keys vLLM reads as num_heads")
                renamed["num_heads"] = value
            elif "num" in key and "layers" in key:
                renamed["num_hidden_layers"] = value
        cfg = {**cfg, **renamed}
        keys = {"heads": "num_heads", "layers": "num_hidden_layers"}
    if fmt == "medusa" and not {"hidden_size", "vocab_size", "torch_dtype"} <= set(cfg):
        cfg = {**_projection_fields(folder, cfg.get("medusa_num_layers")), **cfg}
    try:
        out = {"heads": int(cfg[keys["heads"]]), "layers": int(cfg[keys["layers"]]), "hidden": int(cfg["hidden_size"]),
               "vocab": int(cfg["vocab_size"]), "dtype": cfg.get("torch_dtype", "float32"), "raw": cfg}
    except (KeyError, TypeError, ValueError) as e:
        raise DraftsmithError(f"{folder}/config.json lacks a field the {fmt} loader reads: {e}") from e
    if out["dtype"] not in DTYPES:
        raise DraftsmithError(f"{folder}: the heads are stored as {out['dtype']}; draftsmith reads {', '.join(DTYPES)}")
    return out


def _projection_fields(folder: str, layers: Any) -> dict[str, Any]:
    """hidden_size, vocab_size and torch_dtype of the reference layout read off head 0's projection ``0.{L}.weight``
    [V, H]: the Medusa code's own training (``medusa/train/train_legacy.py``) writes a config of
    ``medusa_num_heads``, ``medusa_num_layers`` and ``base_model_name_or_path`` only, and its loaders (and TGI's)
    take the dimensions from the base model."""
    from safetensors import SafetensorError, safe_open

    path, name = os.path.join(folder, FILES["medusa"]), f"0.{layers}.weight"
    try:
        with safe_open(path, "pt") as f:
            if name not in f.keys():
                return {}
            view = f.get_slice(name)
            (vocab, hidden), dtype = view.get_shape(), view.get_dtype()
    except (SafetensorError, OSError, ValueError) as e:
        raise DraftsmithError(f"{path}: its {name} cannot be read as a [V, H] projection ({e})") from e
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    return {"hidden_size": hidden, "vocab_size": vocab, "torch_dtype": names.get(dtype, dtype)}


def expected_tensors(c: dict[str, Any], fmt: str) -> dict[str, TensorSpec]:
    f, h, v = DTYPES[c["dtype"]], c["hidden"], c["vocab"]
    out: dict[str, TensorSpec] = {}
    for head in range(c["heads"]):
        for layer in range(c["layers"]):
            block = f"{head}.{layer}.linear" if fmt == "medusa" else f"blocks.{head}.layers.{layer}"
            out[f"{block}.weight"] = ((h, h), f)
            out[f"{block}.bias"] = ((h,), f)
        out[f"{head}.{c['layers']}.weight" if fmt == "medusa" else f"lm_heads.{head}.weight"] = ((v, h), f)
    return out


def static_check(folder: str, fmt: str, target: Target) -> list[str]:
    c = read_config(folder, fmt)
    done = [f"config: {c['heads']} heads × {c['layers']} residual blocks as the {fmt} loader reads them"]
    if c["hidden"] != target.hidden_size or c["vocab"] != target.vocab_size:
        raise DraftsmithError(f"{folder}: hidden_size / vocab_size {c['hidden']} / {c['vocab']} are not the target's "
                              f"{target.hidden_size} / {target.vocab_size}")
    done.append("hidden_size and vocab_size are the target's")
    if fmt == "medusa-vllm":
        raw = c["raw"]
        if raw.get("medusa_fc_bias") is not True or raw.get("truncated_vocab_size") != c["vocab"]:
            raise DraftsmithError(f"{folder}: vLLM needs medusa_fc_bias: true (the blocks have biases) and "
                                  f"truncated_vocab_size = vocab_size (no token_map)")
        done.append("medusa_fc_bias: true, truncated_vocab_size = vocab_size (no token map)")
    done += check_tensors(read_safetensors(os.path.join(folder, FILES[fmt])), expected_tensors(c, fmt), folder)
    return done


def load(folder: str, fmt: str, target: Target) -> Any:
    c = read_config(folder, fmt)
    return drafter_of(read_safetensors(os.path.join(folder, FILES[fmt])), c, fmt, target, folder)


def drafter_of(tensors: dict[str, Any], c: dict[str, Any], fmt: str, target: Target, where: str) -> Any:
    """The heads stored as ``tensors`` (``fmt``'s names; ``c``: :func:`read_config`'s fields) as a draftsmith
    Medusa drafter on ``target``."""
    from ..drafters.common import frozen_copy, target_parts
    from ..drafters.medusa import MedusaDrafter, MedusaHeads

    native = adapter("medusa", fmt, c["layers"]).from_engine(tensors)
    heads = MedusaHeads(frozen_copy(target_parts(target.model).norm), c["hidden"], c["vocab"], c["heads"], c["layers"])
    heads.to(device=target.device, dtype=target.dtype)
    missing, unexpected = heads.load_state_dict(native, strict=False)
    missing = [k for k in missing if not k.startswith("feature_norm.")]
    if missing or unexpected:
        raise DraftsmithError(f"{where} does not load back into draftsmith: missing {missing[:5]}, unexpected "
                              f"{list(unexpected)[:5]}")
    return MedusaDrafter(heads.eval(), target.num_layers - 1, None)


def imported(folder: str, fmt: str, target: Target) -> tuple[Any, Any, dict[str, Any]]:
    """Medusa heads trained elsewhere (either layout) as (config, heads, record) for ``target`` (``export/importer.py``);
    the static checks of ``--check`` refuse another hidden size or vocabulary, or a tensor the layout lacks, in one
    line. A Medusa-2 checkpoint (heads fine-tuned together with the backbone, saved with it) is read by
    ``export/medusa2.py``."""
    from ..drafters.medusa import MedusaConfig

    static_check(folder, fmt, target)
    c = read_config(folder, fmt)
    heads = load(folder, fmt, target).module
    return MedusaConfig(num_heads=c["heads"], num_layers=c["layers"]), heads, {
        "base_model_name_or_path": c["raw"].get("base_model_name_or_path")}


__all__ = ["FILES", "drafter_of", "expected_tensors", "imported", "load", "static_check", "write"]
