"""Device and dtype detection: the same code runs on CPU, one GPU, or many.

Nothing in draftsmith hard-codes a device. Under a launcher (torchrun, deepspeed)
``LOCAL_RANK`` picks the GPU; without CUDA everything runs on CPU.
"""

from __future__ import annotations

import os

import torch

from .errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def detect_device(requested: str = "auto") -> torch.device:
    """``"auto"`` → ``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``."""
    if requested != "auto":
        if requested.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device '{requested}' was asked for but CUDA is not available; use device=auto or cpu")
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(requested: str, device: torch.device) -> torch.dtype:
    """``"auto"`` → bf16 on a GPU that supports it, fp32 otherwise (CPU runs are exact)."""
    if requested == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if requested not in DTYPES:
        raise ConfigError(f"dtype '{requested}' is not one of: auto, {', '.join(DTYPES)}")
    if requested == "float16" and device.type == "cpu":
        raise ConfigError("dtype float16 is not supported on CPU; use float32 or bfloat16")
    return DTYPES[requested]


def cache_dir() -> str:
    """Where draftsmith caches converted targets etc. (``$DRAFTSMITH_CACHE`` or ~/.cache/draftsmith)."""
    root = os.environ.get("DRAFTSMITH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "draftsmith")
    os.makedirs(root, exist_ok=True)
    return root
