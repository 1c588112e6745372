"""CPU linear layers whose cost stays flat from 1 to 8 tokens, the shape of a verification forward.

Three routes, chosen per layer by its dtype when :func:`install` runs:

* **bf16 on an AVX2 CPU without a bf16 GEMM** — draftsmith's own kernel (``bf16_linear.cpp``, below).
* **bf16 on a CPU where oneDNN has a bf16 path** (AVX512-BF16, AMX) — oneDNN's linear on a copy of the
  weight packed once into the blocked layout its bf16 kernel reads (``_reorder_linear_weight``). torch's
  bf16 ``F.linear`` hands oneDNN the plain [N, K] weight, and the AVX512-BF16 kernel (which multiplies pairs
  of K) re-lays every block of it out on every call: a one-token step read the weight twice, and bf16 lost
  to fp32. Packed, a linear reads the weight once, and the result is bit-identical to ``F.linear``'s at every
  row count (the costs by shape and row count: benchmarks/RESULTS.md, "gemma-3"). Only frozen
  weights (``requires_grad=False``: the target, a drafter's copies of the target's parts) take it: an
  optimizer may write a trainable weight through ``.data`` or a flat buffer it is a view of, which no
  version counter sees, and a stale packed copy would evaluate old weights. A frozen weight that is
  loaded into or replaced is packed again on its next call. The price is memory: the packed copy
  doubles the frozen bf16 linears' weights (a tied lm_head too: the embedding keeps the plain one).
* **fp32 on any CPU torch built with oneDNN** — oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``,
  the op torch's own compiler uses for CPU linears; dense weights, no copy). torch's fp32 ``F.linear``
  goes to MKL's sgemm, whose small-M kernels are pathological: the lm_head over 2–3 rows costs about as many
  one-row steps as it has rows there, and a target forward over 2–3 tokens more than one over 5, where oneDNN's cost rises smoothly
  with the rows and its one-token step is cheaper too (benchmarks/RESULTS.md, "fp32 linears on oneDNN").
  oneDNN is faster for large M too; only the smallest linears ([192, 576]) lose a little to its call
  overhead. Numerics: fp32 accumulation in another order than MKL's
  (≈ 1e-6 relative); as with MKL, a row's result may differ in the last bits with the number of rows.

The bf16 kernel: on an AVX2 CPU without AVX-512 (this project's 2-core machine, most laptops), torch's bf16
``F.linear`` runs one matrix-vector product per row, so a target forward over k+1 tokens costs
about k+1 one-token steps in its linears, and speculative verification never pays (benchmarks/history/2026.md,
"ceiling", "Why verification is not free here"). ``bf16_linear.cpp`` streams each weight once for every 8 rows (fp32 accumulation): about one
row's cost for 1–8 rows, and no slower than torch's own kernel at one row (benchmarks/RESULTS.md,
"cpu_linear").

When: :func:`install` swaps the forward of every bf16 ``nn.Linear`` of a module on such a CPU —
``load_target`` does it for the target and ``drafters.common.place`` for every drafter, so the target
alone (its own ``generate``) and the speculative decoder run the very same kernels, and
``speedup_vs_target`` compares like with like. Nothing changes

* in bf16 or fp32 on GPUs;
* while autograd records (training): neither route has a backward, so those calls take ``F.linear``;
* with ``DRAFTSMITH_CPU_KERNELS=0`` in the environment, or inside :func:`disabled` (A/B benchmarks).

The extension is compiled once with the C++ compiler torch uses (``torch.utils.cpp_extension``,
cached under ``$TORCH_EXTENSIONS_DIR``; about a minute on 2 cores); without a compiler :func:`install` warns once and
leaves the module as it was. Numerics: fp32 accumulation, one bf16 rounding at the end, as torch's
bf16 ``F.linear`` — not bit-equal to it (the order of the sums differs), but each row's result is
the same whether it is computed alone or with 7 others.
"""

from __future__ import annotations

import contextlib
import os
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bf16_linear.cpp")
_ENV = "DRAFTSMITH_CPU_KERNELS"
_ops: Any = None  # the compiled extension, once built
_failed: str | None = None  # why it could not be built (then never retried in this process)
_active = True  # flipped by disabled()


def switched_off() -> bool:
    return os.environ.get(_ENV, "1").strip().lower() in ("0", "off", "false", "no")


def wanted() -> bool:
    """Whether this process should use the bf16 kernel: an AVX2 CPU torch has no bf16 GEMM for, not
    switched off by ``DRAFTSMITH_CPU_KERNELS=0``."""
    if switched_off():
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


_onednn_ok: bool | None = None  # whether oneDNN's linear ran correctly here (checked once per process)
_packed_ok: bool | None = None  # whether oneDNN's bf16 linear on a packed weight ran correctly here (ditto)
_packed: weakref.WeakKeyDictionary[nn.Linear, tuple[tuple[int, int], Tensor]] = weakref.WeakKeyDictionary()
"""Each routed bf16 linear's packed weight, keyed by the plain weight's (data_ptr, _version) it was packed
from; outside the module, so that deepcopy, state_dict and ``.to`` never meet an opaque oneDNN tensor."""


def _route_ok(dtype: torch.dtype, available: Callable[[], bool], route: Callable[[Tensor, Tensor, Tensor], Tensor],
              exact: bool) -> bool:
    """Whether ``route`` may stand in for ``F.linear`` on ``dtype`` in this process: ``available()`` (torch has its
    op on this CPU), and on a small seeded linear (weight [24, 40], input [3, 40], bias [24]) it computes what
    ``F.linear`` does, bit for bit where ``exact``, else within 1e-4. A torch without the op, or a CPU oneDNN
    refuses, is a no."""
    try:
        if not available():
            return False
        g = torch.Generator().manual_seed(0)
        w, x, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((24, 40), (3, 40), (24,)))
        got, want = route(x, w, b), F.linear(x, w, b)
        return bool(torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-4, rtol=1e-4))
    except (RuntimeError, AttributeError):
        return False


def onednn_wanted() -> bool:
    """Whether fp32 CPU linears should go to oneDNN: torch has it, it computes a small linear right
    (checked once per process), and ``DRAFTSMITH_CPU_KERNELS=0`` is not set."""
    global _onednn_ok
    if switched_off():
        return False
    if _onednn_ok is None:
        _onednn_ok = _route_ok(torch.float32, torch.backends.mkldnn.is_available, onednn_linear, exact=False)
    return _onednn_ok


def packed_wanted() -> bool:
    """Whether bf16 CPU linears should go to oneDNN on packed weights: oneDNN has a bf16 path on this CPU
    (AVX512-BF16, AMX), the packed linear equals ``F.linear`` on a small case (checked once per process), and
    ``DRAFTSMITH_CPU_KERNELS=0`` is not set."""
    global _packed_ok
    if switched_off():
        return False
    if _packed_ok is None:
        _packed_ok = _route_ok(torch.bfloat16,
                               lambda: torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                               lambda x, w, b: packed_linear(x, pack(w), b), exact=True)
    return _packed_ok


def pack(weight: Tensor) -> Tensor:
    """[N, K] contiguous bf16 → the same weight as an opaque oneDNN tensor in the blocked layout its bf16
    linear reads (packed for one row, the decode step; any row count runs on it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` through oneDNN's bf16 path: x [..., K] bf16, packed from :func:`pack` → [..., N] bf16."""
    return torch.ops.mkldnn._linear_pointwise(x if x.is_contiguous() else x.contiguous(), packed, bias, "none", [], "")


def _packed_weight(m: nn.Linear) -> Tensor:
    """m's packed weight, packed again when the frozen plain one changed since (loaded into, or replaced)."""
    key = (m.weight.data_ptr(), m.weight._version)
    hit = _packed.get(m)
    if hit is None or hit[0] != key:
        hit = _packed[m] = (key, pack(m.weight.detach()))
    return hit[1]


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` through oneDNN: x [..., K] fp32, weight [N, K] contiguous fp32 → [..., N] fp32 (no autograd)."""
    return torch.ops.mkldnn._linear_pointwise(x if x.is_contiguous() else x.contiguous(), weight, bias, "none", [], "")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` through the kernel: x [..., K] bf16, weight [N, K] contiguous bf16 → [..., N] bf16."""
    shape = x.shape
    y = ops().linear(x.reshape(-1, shape[-1]), weight, bias)
    return y.view(*shape[:-1], weight.shape[0])


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    w = self.weight
    if (_active and x.dtype == w.dtype and x.device.type == "cpu" and w.device.type == "cpu" and w.dim() == 2
            and w.is_contiguous() and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        if w.dtype == torch.bfloat16 and _ops is not None:
            return linear(x, w, self.bias)
        if w.dtype == torch.bfloat16 and _packed_ok and not w.requires_grad:
            return packed_linear(x, _packed_weight(self), self.bias)
        if w.dtype == torch.float32 and _onednn_ok:
            return onednn_linear(x, w, self.bias)
    return F.linear(x, w, self.bias)


def route(dtype: torch.dtype) -> str | None:
    """Which route CPU linears of ``dtype`` take in this process: "bf16" (draftsmith's kernel, AVX2),
    "packed" (bf16 on oneDNN's packed weights), "onednn" (fp32) or None (torch's ``F.linear``)."""
    if dtype == torch.bfloat16 and wanted() and ops() is not None:
        return "bf16"
    if dtype == torch.bfloat16 and packed_wanted():
        return "packed"
    if dtype == torch.float32 and onednn_wanted():
        return "onednn"
    return None


def install(module: nn.Module) -> int:
    """Route every CPU ``nn.Linear`` of ``module`` whose dtype has a route here (:func:`route`);
    returns how many were routed (0: nothing changed). Idempotent."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear) and m.weight.device.type == "cpu"
               and route(m.weight.dtype) is not None]
    for m in linears:
        m.forward = types.MethodType(_forward, m)
        if route(m.weight.dtype) == "packed" and not m.weight.requires_grad:
            _packed_weight(m)  # now, not inside the first timed step
    return len(linears)


def _routed(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear) and "forward" in m.__dict__]


def installed(module: nn.Module) -> int:
    """How many linears of ``module`` run through a route of this module."""
    return len(_routed(module))


def describe(module: nn.Module) -> str:
    """The linear kernel ``module``'s linears run on, for result files."""
    routed = _routed(module)
    if not routed or not _active:
        return "torch"
    kind = route(routed[0].weight.dtype)
    return {"bf16": "draftsmith bf16 (cpu_kernels/cpu_linear.py)",
            "packed": "oneDNN bf16, packed weights (cpu_kernels/cpu_linear.py)",
            "onednn": "oneDNN fp32 (cpu_kernels/cpu_linear.py)"}.get(kind or "", "torch")


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run installed linears on torch's own ``F.linear`` inside this block (side-by-side timing; the
    stock model a plain transformers user runs)."""
    global _active
    before, _active = _active, False
    try:
        yield
    finally:
        _active = before
