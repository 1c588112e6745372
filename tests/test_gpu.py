"""What only a GPU can show (marker ``gpu``; skipped without CUDA, run by benchmarks/gpu_check.sh):
``cuda:LOCAL_RANK`` placement, the fused SDPA kernels with draftsmith's additive causal and tree-shaped
masks, and the decoder's greedy identity with the target on the GPU (fp32) for a self-speculative and
an EAGLE-3 drafter, with host syncs per round within budget."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from draftsmith.devices import detect_device, resolve_dtype
from draftsmith.drafters.common import causal_mask
from draftsmith.drafters.eagle3 import Eagle3Config
from draftsmith.drafters.layer_skip import LayerSkipConfig
from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.reference import target_greedy
from draftsmith.target import Target

from .conftest import tiny_llama

pytestmark = pytest.mark.gpu


def test_auto_device_is_cuda_local_rank_and_bf16(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count() + 0))  # wraps around the visible GPUs
    assert detect_device("auto") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "0")
    dev = detect_device("auto")
    assert dev == torch.device("cuda", 0)
    assert resolve_dtype("auto", dev) == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32)


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: node i attends to j iff j is i or an ancestor of i (parents[i] = -1 for the root)."""
    n = len(parents)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            allowed[i, j] = True
            j = parents[j]
    return allowed


@pytest.mark.parametrize("kind", ["causal", "tree"])
def test_fused_sdpa_with_additive_masks_matches_the_math_kernel(kind):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 8, 64, 64
    q, k, v = (torch.randn(b, h, s, d, generator=g).cuda() for _ in range(3))
    if kind == "causal":
        mask = causal_mask(s, 0, torch.bfloat16, torch.device("cuda"))  # [1, 1, s, s]
    else:
        parents = [-1] + [(i - 1) // 2 for i in range(1, s)]  # a binary tree of draft tokens
        allowed = tree_mask(parents).cuda()
        mask = torch.zeros(s, s, device="cuda", dtype=torch.bfloat16).masked_fill(~allowed, torch.finfo(torch.bfloat16).min)[None, None]
    with sdpa_kernel([SDPBackend.MATH]):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.float())
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # the fused kernel that takes an arbitrary mask
        fused = torch.nn.functional.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=mask)
    torch.testing.assert_close(fused.float(), ref, atol=3e-2, rtol=3e-2)
    if kind == "causal":
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            flash = torch.nn.functional.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)
        torch.testing.assert_close(flash.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.fixture(scope="module")
def gpu_target(smollm2_tokenizer) -> Target:
    model = tiny_llama(layers=4)
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    return Target(model.cuda(), smollm2_tokenizer, name="tiny-llama-cuda")


def host_syncs():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("draftsmith_bench_host_syncs", os.path.join(root, "benchmarks", "host_syncs.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_greedy_identity_on_the_gpu_and_syncs_per_round(gpu_target):
    prompts = [[1, 520, 33, 9004, 77, 1201], [1, 45, 3000, 12, 99]]
    hs = host_syncs()
    for drafter in (LayerSkipConfig(num_layers=2).build(gpu_target), Eagle3Config(feature_layers=[0, 1, 2]).build(gpu_target)):
        for p in prompts:
            expected = target_greedy(gpu_target, p, 24)
            assert speculative_decode(gpu_target, drafter, p, k=4, max_new_tokens=24).tokens == expected
        row = hs.measure(gpu_target, drafter, prompts, 4, 24, cuda_debug=True)
        assert row["host_reads_per_round"] <= hs.budget_per_round(4), row
