"""Small helpers every format shares: safetensors files, dtype names, the tensor-spec comparison."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import Tensor

from ..errors import DraftsmithError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckFailed(DraftsmithError):
    """A check of ``export --check`` failed; ``passed`` holds the lines of the checks that passed before it."""

    def __init__(self, message: str, passed: list[str]):
        super().__init__(message)
        self.passed = passed


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def cast_floats(tensors: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """CPU contiguous copies, floating tensors cast to ``dtype`` (integer/bool tensors kept)."""
    return {k: (v.to(dtype) if v.is_floating_point() else v).detach().to("cpu").contiguous().clone()
            for k, v in tensors.items()}


def write_safetensors(path: str, tensors: dict[str, Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})


def read_safetensors(path: str) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise DraftsmithError(f"{path} is missing")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise DraftsmithError(f"{path} cannot be read ({e})") from e


def read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise DraftsmithError(f"{path} is missing")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{path} is not valid JSON ({e})") from e


TensorSpec = tuple[tuple[int, ...], torch.dtype]


def check_tensors(found: dict[str, Tensor], expected: dict[str, TensorSpec], where: str) -> list[str]:
    """Every expected name present with its shape and dtype, nothing else; one line per check done.

    Raises a DraftsmithError listing missing, unexpected and mismatched tensors.
    """
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [f"{k}: {tuple(found[k].shape)} {dtype_name(found[k].dtype)}, the loader reads "
             f"{expected[k][0]} {dtype_name(expected[k][1])}"
             for k in sorted(set(found) & set(expected))
             if tuple(found[k].shape) != expected[k][0] or found[k].dtype != expected[k][1]]
    if missing or unexpected or wrong:
        parts = [f"missing {missing}" if missing else "", f"unexpected (the engine would drop them) {unexpected}"
                 if unexpected else "", f"wrong shape/dtype {wrong}" if wrong else ""]
        raise DraftsmithError(f"{where}: " + "; ".join(p for p in parts if p))
    return [f"{len(expected)} tensors: every name, shape and dtype the loader reads, and no other"]


def loaded_mismatch(loaded: dict[str, Tensor], file: dict[str, Tensor],
                    not_in_file: set[str]) -> tuple[list[str], list[str], list[str]]:
    """What a reference loader's state dict ``loaded`` makes of the export's tensors ``file``: (names it has that the
    file lacks, beyond ``not_in_file``; names of the file it has not; names whose values differ from the file's)."""
    missing = sorted(set(loaded) - set(file) - not_in_file)
    unexpected = sorted(set(file) - set(loaded))
    stale = sorted(k for k in set(loaded) & set(file) if not torch.equal(loaded[k].to(file[k].dtype), file[k]))
    return missing, unexpected, stale
