"""bf16 linear layers that cost about the same for 1 to 8 tokens on CPUs without a bf16 GEMM.

Why: on an AVX2 CPU without AVX-512 (this project's 2-core machine, most laptops), torch's bf16
``F.linear`` runs one matrix-vector product per row, so a target forward over k+1 tokens costs
about k+1 one-token steps in its linears, and speculative verification never pays (RESULTS.md,
"Why verification is not free here"). ``bf16_linear.cpp`` streams each weight once for every 8 rows
(fp32 accumulation): ~1× the cost for 1–8 rows, and faster than torch's own kernel at one row too.

When: :func:`install` swaps the forward of every bf16 ``nn.Linear`` of a module on such a CPU —
``load_target`` does it for the target and ``drafters.common.place`` for every drafter, so the target
alone (its own ``generate``) and the speculative decoder run the very same kernels, and
``speedup_vs_target`` compares like with like. Nothing changes

* in fp32 (the identity checks), on GPUs, or on CPUs where oneDNN has a bf16 path
  (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: AVX-512 machines);
* while autograd records (training): the kernel has no backward, so those calls take ``F.linear``;
* with ``DRAFTSMITH_CPU_KERNELS=0`` in the environment, or inside :func:`disabled` (A/B benchmarks).

The extension is compiled once with the C++ compiler torch uses (``torch.utils.cpp_extension``,
cached under ``$TORCH_EXTENSIONS_DIR``, ~70 s on 2 cores); without a compiler :func:`install` warns once and
leaves the module as it was. Numerics: fp32 accumulation, one bf16 rounding at the end, as torch's
bf16 ``F.linear`` — not bit-equal to it (the order of the sums differs), but each row's result is
the same whether it is computed alone or with 7 others.
"""

from __future__ import annotations

import contextlib
import os
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bf16_linear.cpp")
_ENV = "DRAFTSMITH_CPU_KERNELS"
_ops: Any = None  # the compiled extension, once built
_failed: str | None = None  # why it could not be built (then never retried in this process)
_active = True  # flipped by disabled()


def wanted() -> bool:
    """Whether this process should use the kernel: an AVX2 CPU torch has no bf16 GEMM for, not
    switched off by ``DRAFTSMITH_CPU_KERNELS=0``."""
    if os.environ.get(_ENV, "1").strip().lower() in ("0", "off", "false", "no"):
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        return False  # AVX-512 machines: oneDNN's bf16 path; older CPUs: no AVX2 + FMA
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def ops() -> Any:
    """The compiled extension, or None (with one warning saying why) where it cannot be built."""
    global _ops, _failed
    if _ops is None and _failed is None:
        try:
            from torch.utils.cpp_extension import load

            _ops = load(name="draftsmith_bf16_linear", sources=[_SOURCE],
                        extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
        except Exception as e:  # no compiler, no ninja, a read-only cache: run on torch's kernels
            _failed = f"{type(e).__name__}: {e}".splitlines()[0]
            warnings.warn(f"draftsmith: the bf16 CPU linear kernel could not be built ({_failed}); "
                          f"bf16 on this CPU runs on torch's slower kernels (set {_ENV}=0 to silence this)")
    return _ops


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` through the kernel: x [..., K] bf16, weight [N, K] contiguous bf16 → [..., N] bf16."""
    shape = x.shape
    y = ops().linear(x.reshape(-1, shape[-1]), weight, bias)
    return y.view(*shape[:-1], weight.shape[0])


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    w = self.weight
    if (_active and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.device.type == "cpu"
            and w.is_contiguous() and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return linear(x, w, self.bias)
    return F.linear(x, w, self.bias)


def install(module: nn.Module) -> int:
    """Route every bf16 CPU ``nn.Linear`` of ``module`` through the kernel where :func:`wanted`;
    returns how many were routed (0: nothing changed). Idempotent."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear) and m.weight.dtype == torch.bfloat16
               and m.weight.device.type == "cpu"]
    if not linears or not wanted() or ops() is None:
        return 0
    for m in linears:
        m.forward = types.MethodType(_forward, m)
    return len(linears)


def installed(module: nn.Module) -> int:
    """How many linears of ``module`` run through the kernel."""
    return sum(1 for m in module.modules() if isinstance(m, nn.Linear) and "forward" in m.__dict__)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run installed linears on torch's own kernel inside this block (for side-by-side timing)."""
    global _active
    before, _active = _active, False
    try:
        yield
    finally:
        _active = before
