"""cpu_kernels/cpu_linear.py: the bf16 linear for AVX2 CPUs equals F.linear up to bf16 rounding, at every
row count, with and without bias and a K that is not a multiple of 8; a row's result does not depend
on how many rows share the call; the fp32 route (oneDNN) equals F.linear up to fp32 summation order;
the bf16 route on packed weights (AVX512-BF16 CPUs) is bit-identical to F.linear and follows a frozen
weight that is loaded into; each is installed only where it should be, and never under autograd."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.cpu_kernels import cpu_linear

from .conftest import SMOLLM2, tiny_llama

needs_kernel = pytest.mark.skipif(not cpu_linear.wanted(), reason="the kernel is for AVX2 CPUs without a bf16 GEMM")
needs_onednn = pytest.mark.skipif(not cpu_linear.onednn_wanted(), reason="this torch has no working oneDNN linear")
needs_packed = pytest.mark.skipif(cpu_linear.wanted() or not cpu_linear.packed_wanted(),
                                  reason="the packed bf16 route is for CPUs where oneDNN has a bf16 path")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The exact product of the bf16 values, in float64."""
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@needs_kernel
@pytest.mark.parametrize("n,k", [(96, 64), (200, 20), (33, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_is_the_linear_up_to_one_bf16_rounding(n, k, bias):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    for m in (1, 2, 3, 7, 8, 9, 17, 40):
        x = torch.randn(m, k, generator=g).bfloat16()
        ref = reference(x, w, b)
        ours = cpu_linear.linear(x, w, b)
        assert ours.dtype == torch.bfloat16 and ours.shape == (m, n)
        # one rounding to bf16 (relative 2^-8) plus fp32 accumulation noise; a dropped K tail (k = 20: 4 of
        # 20 terms), a wrong row or a missing bias is off by far more
        err = (ours.double() - ref).abs()
        assert (err <= 2 ** -8 * ref.abs() + 1e-4 * ref.abs().max()).all(), (m, err.max().item())
        aten = F.linear(x, w, b).double()
        assert (ours.double() - aten).abs().max() <= 2 ** -7 * ref.abs().max()


@needs_kernel
def test_a_row_is_computed_the_same_alone_or_among_others():
    w = torch.randn(300, 576).bfloat16()
    x = torch.randn(13, 576).bfloat16()
    together = cpu_linear.linear(x, w)
    for i in range(13):
        assert torch.equal(cpu_linear.linear(x[i : i + 1], w), together[i : i + 1])
    batched = cpu_linear.linear(x.view(1, 13, 576), w)  # [..., K] in, [..., N] out
    assert batched.shape == (1, 13, 300) and torch.equal(batched[0], together)


@needs_kernel
def test_install_routes_bf16_linears_and_keeps_the_model_s_output():
    model = tiny_llama(layers=2).to(torch.bfloat16).eval()
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert cpu_linear.install(model) == linears == cpu_linear.installed(model)
    assert cpu_linear.install(model) == linears  # idempotent
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        fast = model(ids).logits.float()
        with cpu_linear.disabled():
            slow = model(ids).logits.float()
    assert not torch.equal(fast, slow)  # the kernel really ran (its sums are ordered differently)
    assert (fast - slow).abs().max() <= 0.05 * slow.abs().max()
    assert (fast.argmax(-1) == slow.argmax(-1)).float().mean() >= 0.9
    copied = copy.deepcopy(model)  # frozen_copy deep-copies heads: the routing follows the copy
    assert cpu_linear.installed(copied) == linears


@needs_kernel
def test_autograd_takes_torch_s_linear_and_gets_gradients():
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    assert cpu_linear.install(lin) == 1
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    lin(x).float().sum().backward()  # the kernel has no backward: this must not go through it
    assert x.grad is not None and lin.weight.grad is not None
    with torch.no_grad():
        assert torch.equal(lin(x), cpu_linear.linear(x, lin.weight, lin.bias))


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_the_fp32_route_is_the_linear_up_to_summation_order(bias):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 576, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    for m in (1, 2, 3, 5, 8, 33):
        x = torch.randn(1, m, 576, generator=g)
        ref = reference(x, w, b)
        ours = cpu_linear.onednn_linear(x, w, b)
        assert ours.dtype == torch.float32 and ours.shape == (1, m, 200)
        # fp32 sums of 576 terms of size ~1: a few 1e-6 relative; a wrong row or a missing bias is off by ~1
        assert (ours.double() - ref).abs().max() <= 1e-5 * ref.abs().max(), m
    view = torch.randn(4, 6, 576, generator=g)[:, 2:]  # not contiguous: copied, not misread
    assert torch.allclose(cpu_linear.onednn_linear(view, w, b), F.linear(view, w, b), atol=1e-4)


@needs_onednn
def test_install_routes_fp32_linears_and_autograd_still_takes_torch_s():
    model = tiny_llama(layers=2).eval()  # fp32
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert cpu_linear.install(model) == linears == cpu_linear.installed(model)
    assert cpu_linear.describe(model).startswith("oneDNN fp32")
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        fast = model(ids).logits
        with cpu_linear.disabled():
            slow = model(ids).logits
            assert cpu_linear.describe(model) == "torch"
    assert torch.allclose(fast, slow, atol=1e-4, rtol=1e-4) and torch.equal(fast.argmax(-1), slow.argmax(-1))
    lin = nn.Linear(64, 32)
    assert cpu_linear.install(lin) == 1
    x = torch.randn(4, 64, requires_grad=True)
    lin(x).sum().backward()  # the op has no backward: this must not go through it
    assert x.grad is not None and lin.weight.grad is not None


@needs_packed
@pytest.mark.parametrize("n,k", [(96, 64), (200, 20), (33, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_packed_bf16_route_is_bit_identical_to_the_linear(n, k, bias):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = cpu_linear.pack(w)
    for m in (1, 2, 3, 7, 8, 9, 17, 40):
        x = torch.randn(1, m, k, generator=g).bfloat16()
        ours = cpu_linear.packed_linear(x, packed, b)
        assert ours.dtype == torch.bfloat16 and ours.shape == (1, m, n)
        # the same oneDNN kernel, only the weight's layout differs. ATen's linear itself: a ZeRO-3 test earlier in the
        # session leaves DeepSpeed's F.linear patch behind, which adds the bias in a second, separately rounded op
        assert torch.equal(ours, torch._C._nn.linear(x, w, b)), m
        # and not trivially: the exact product rounds differently in places, a wrong layout everywhere
        assert (ours.double() - reference(x, w, b)).abs().max() <= 2 ** -7 * reference(x, w, b).abs().max()


@needs_packed
def test_install_packs_frozen_bf16_linears_and_follows_a_loaded_weight():
    model = tiny_llama(layers=2).to(torch.bfloat16).eval().requires_grad_(False)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert cpu_linear.install(model) == linears == cpu_linear.installed(model)
    assert cpu_linear.describe(model).startswith("oneDNN bf16, packed")
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        fast = model(ids).logits
        with cpu_linear.disabled():
            slow = model(ids).logits
    assert torch.equal(fast, slow)
    head = model.lm_head
    other = torch.randn_like(head.weight)
    with torch.no_grad():
        head.weight.copy_(other)  # loaded into: the packed copy must not serve the old rows
    x = torch.randn(3, head.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(head(x), F.linear(x, other))
    head.weight = nn.Parameter(torch.randn_like(other), requires_grad=False)  # replaced
    with torch.no_grad():
        assert torch.equal(head(x), F.linear(x, head.weight))
    copied = copy.deepcopy(model)  # the packed copies live outside the module: deepcopy never meets them
    with torch.inference_mode():
        assert torch.equal(copied(ids).logits, model(ids).logits)


@needs_packed
def test_a_trainable_bf16_weight_never_takes_the_packed_copy():
    """An optimizer writes through .data or a flat buffer, which no version counter sees: a packed copy of a
    trainable weight could go stale, so those take F.linear, under autograd and outside it."""
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    assert cpu_linear.install(lin) == 1
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    lin(x).float().sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    with torch.no_grad():
        lin(x)  # a route that packed would pack here
    new = torch.randn_like(lin.weight)
    lin.weight.data.copy_(new)  # as an optimizer may: same storage, and the param's version counter does not move
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, new, lin.bias))


def test_a_route_is_taken_only_where_it_computes_what_f_linear_does():
    """Both oneDNN routes are checked by one probe: available, then F.linear's result on a small seeded case, to the
    bit or within 1e-4; a route that raises (a torch without the op) or is not available (never run) is refused."""
    def shifted(eps: float):
        return lambda x, w, b: F.linear(x, w, b) + eps

    def refused(x, w, b):
        raise RuntimeError("could not create a primitive")

    ran = []
    assert cpu_linear._route_ok(torch.float32, lambda: True, shifted(0.0), exact=True)
    assert cpu_linear._route_ok(torch.bfloat16, lambda: True, shifted(0.0), exact=True)
    assert cpu_linear._route_ok(torch.float32, lambda: True, shifted(1e-6), exact=False)
    assert not cpu_linear._route_ok(torch.float32, lambda: True, shifted(1e-6), exact=True)
    assert not cpu_linear._route_ok(torch.float32, lambda: True, shifted(1e-2), exact=False)
    assert not cpu_linear._route_ok(torch.float32, lambda: True, refused, exact=False)
    assert not cpu_linear._route_ok(torch.float32, lambda: False, lambda *a: ran.append(a), exact=False) and ran == []
    assert not cpu_linear._route_ok(torch.float32, lambda: torch.ops.mkldnn._no_such_op(), shifted(0.0), exact=True)


def test_nothing_is_installed_when_switched_off(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CPU_KERNELS", "0")
    assert not cpu_linear.wanted() and not cpu_linear.onednn_wanted() and not cpu_linear.packed_wanted()
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_llama(layers=1).to(dtype)
        assert cpu_linear.install(model) == 0 and cpu_linear.installed(model) == 0
        assert cpu_linear.describe(model) == "torch"


@needs_kernel
@pytest.mark.e2e
def test_the_bf16_target_loads_with_the_kernel_and_fp32_without():
    from draftsmith.target import load_target

    bf16 = load_target(SMOLLM2, dtype="bfloat16", device="cpu")
    linears = sum(isinstance(m, nn.Linear) for m in bf16.model.modules())
    assert cpu_linear.installed(bf16.model) == linears == 30 * 7 + 1  # q k v o gate up down per layer, lm_head

@needs_onednn
@pytest.mark.e2e
def test_the_fp32_target_loads_with_oneDNN_linears():
    from draftsmith.target import load_target

    fp32 = load_target(SMOLLM2, dtype="float32", device="cpu")
    assert cpu_linear.installed(fp32.model) == 30 * 7 + 1 and cpu_linear.describe(fp32.model).startswith("oneDNN")
