"""Fingerprints: a hash of a target's architecture and weights that does not depend on the dtype it was loaded in
(:func:`model_fingerprint`, or :func:`files_fingerprint` from its safetensors without building it), and of its
tokenizer (:func:`tokenizer_fingerprint`). Drafters and feature caches record the fingerprint of the target they
were made with, and refuse to be used with another."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np
import torch
from torch import Tensor


_ARCH_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
)
_SAMPLES_PER_TENSOR = 4096
NOT_THE_MODELS = ("medusa_head.",)
"""Name prefixes of tensors a model folder holds beside its causal LM, which transformers leaves out of the model it
loads (a Medusa-2 checkpoint's heads, ``export/medusa2.py``): not hashed, so the folder's fingerprint is its
backbone's, as the loaded model's is."""


def model_fingerprint(model: torch.nn.Module) -> str:
    """Hash of the architecture and weights, stable across dtypes and devices.

    Per parameter (sorted by name): name, shape, and 4096 evenly spaced elements
    rounded to bf16 — so fp32 and bf16 loads of one checkpoint agree, and the cost is
    tiny even for an 8B model. Any fine-tune changes it with overwhelming probability.
    """
    params = sorted(model.named_parameters(), key=lambda kv: kv[0])
    index = lambda p: torch.as_tensor(_sample_index(p.numel()), device=p.device)  # noqa: E731
    samples = ((name, tuple(p.shape), p.detach().reshape(-1)[index(p)])
               for name, p in params if p.device.type != "meta")
    return _fingerprint(getattr(model, "config", None), samples)


def _sample_index(n: int) -> np.ndarray:
    """The flat indices of the elements a fingerprint samples from a tensor of ``n``: [min(n, 4096)] int64."""
    m = min(n, _SAMPLES_PER_TENSOR)
    return np.arange(m, dtype=np.int64) * (n - 1) // max(m - 1, 1)


def _fingerprint(config: Any, samples: Any) -> str:
    """The hash of :func:`model_fingerprint` over (name, shape, sampled values [≤ 4096], any float dtype)."""
    h = hashlib.sha256()
    arch = {k: getattr(config, k, None) for k in _ARCH_KEYS} if config is not None else {}
    h.update(json.dumps(arch, sort_keys=True, default=str).encode())
    for name, shape, vals in samples:
        h.update(name.encode())
        h.update(np.asarray(shape, dtype=np.int64).tobytes())
        h.update(vals.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


_SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<i2"}
"""safetensors dtype → the numpy dtype its elements are read as (bf16: its bits, viewed back in torch)."""


def files_fingerprint(folder: str, config: Any) -> str | None:
    """:func:`model_fingerprint` of the model in ``folder`` (a local HF folder, or a hub id: its safetensors are
    fetched into the HF cache) read from its safetensors files without building the model: each sampled element
    is read through a memory map, so only the pages that hold them are read. The files' tensor names are the
    model's parameter names for the families draftsmith supports (``tests/test_target.py`` compares the two);
    a tied output embedding is not a parameter of its own, nor are tensors under ``NOT_THE_MODELS``. None when the
    folder has no safetensors (``pytorch_model.bin``) or holds a tensor of another dtype than a float (quantized): hash
    the loaded model."""
    files = safetensors_files(folder)
    if not files:
        return None
    tensors: dict[str, tuple[str, int, str, tuple[int, ...]]] = {}  # name → (file, byte offset, dtype, shape)
    for path in files:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for name, t in header.items():
            if not name.startswith(NOT_THE_MODELS):
                tensors[name] = (path, 8 + size + t["data_offsets"][0], t["dtype"], tuple(t["shape"]))
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # the input embedding's parameter, hashed under its own name
    if any(dtype not in _SAFETENSORS_DTYPES for _, _, dtype, _ in tensors.values()):
        return None

    def sample(path: str, offset: int, dtype: str, shape: tuple[int, ...]) -> Tensor:
        n = int(np.prod(shape, dtype=np.int64))
        if n == 0:
            return torch.zeros(0)
        flat = np.memmap(path, dtype=_SAFETENSORS_DTYPES[dtype], mode="r", offset=offset, shape=(n,))
        vals = torch.from_numpy(np.ascontiguousarray(flat[_sample_index(n)]).astype(flat.dtype.newbyteorder("=")))
        return vals.view(torch.bfloat16) if dtype == "BF16" else vals

    return _fingerprint(config, ((name, shape, sample(path, offset, dtype, shape))
                                 for name, (path, offset, dtype, shape) in sorted(tensors.items())))


def safetensors_files(folder: str) -> list[str]:
    """The safetensors files transformers loads ``folder``'s weights from (the index's shards, or
    ``model.safetensors``); a hub id's are fetched into the HF cache first. Empty when there are none."""
    if not os.path.isdir(folder):
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(folder, allow_patterns=["model*.safetensors", "model.safetensors.index.json"])
        except Exception:  # offline, gated, no such repo: the caller loads the model, which says why
            return []
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    single = os.path.join(folder, "model.safetensors")
    return [single] if os.path.isfile(single) else []


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of the vocabulary, special tokens and chat template."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode())
    special = {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())}
    h.update(json.dumps(special, sort_keys=True).encode())
    h.update(str(getattr(tokenizer, "chat_template", "") or "").encode())
    return h.hexdigest()[:16]
