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


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 matrix products natively, so that bf16 is the faster dtype for
    throughput-bound work (regeneration, feature capture, training): a GPU with bf16 support, or a CPU
    whose oneDNN has a bf16 path (AVX512-BF16 / AMX; ``torch.ops.mkldnn._is_mkldnn_bf16_supported``).

    On an AVX2-only CPU torch's bf16 GEMM is a slow fallback, so fp32 stays the faster dtype there; on a
    CPU with AVX-512 BF16, bf16 regenerates, captures features and trains faster than fp32 (the figures:
    benchmarks/RESULTS.md, "prepare"). Identity checks stay in fp32 wherever this says True: it only picks
    a speed."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu" or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    # oneDNN also "supports" bf16 on AVX-512 CPUs without bf16 instructions (emulated, no faster than
    # fp32): where the kernel's flags can be read, ask for the instructions themselves
    flags = _cpu_flags()
    return flags is None or bool(flags & {"avx512_bf16", "amx_bf16"})


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (Linux), or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def cache_dir() -> str:
    """Where draftsmith caches converted targets etc. (``$DRAFTSMITH_CACHE`` or ~/.cache/draftsmith)."""
    root = os.environ.get("DRAFTSMITH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "draftsmith")
    os.makedirs(root, exist_ok=True)
    return root
