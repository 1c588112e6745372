"""Medusa heads: shapes and dtypes, no shared weights, label alignment, and which feature the
runtime reads (checked through the real decoder)."""

from __future__ import annotations

import copy

import pytest
import torch

from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.sampling import Warp
from draftsmith.drafters.medusa import MedusaConfig, medusa_labels
from draftsmith.errors import ConfigError
from draftsmith.target import Target

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


@pytest.fixture(scope="module")
def medusa(tiny_target):
    return MedusaConfig(num_heads=3, num_layers=2, seed=1).build(tiny_target)


def test_shapes_dtypes_and_init(tiny_target, medusa):
    heads = medusa.module
    logits = heads(torch.randn(2, 5, 64))
    assert logits.shape == (3, 2, 5, 49152) and logits.dtype == torch.float32
    for head in heads.heads:
        assert torch.equal(head[-1].weight, tiny_target.model.lm_head.weight)  # Medusa's init
        assert all(not block.linear.weight.any() for block in head[:-1])  # ResBlocks start near identity
    trainable = {n for n, p in heads.named_parameters() if p.requires_grad}
    assert trainable and not any(n.startswith("feature_norm") for n in trainable)
    bf = Target(copy.deepcopy(tiny_target.model).to(torch.bfloat16), tiny_target.tokenizer, "bf", fingerprint="x")
    heads_bf = MedusaConfig(num_heads=2).build_module(bf)
    assert heads_bf(torch.randn(1, 3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_no_two_parameters_share_storage(medusa):
    params = list(medusa.module.parameters())
    assert len({p.data_ptr() for p in params}) == len(params)
    blocks = [m for m in medusa.module.modules() if type(m).__name__ == "ResBlock"]
    assert len(blocks) == len({id(b) for b in blocks}) == 3 * 2


def test_labels_are_k_plus_2_ahead():
    x = torch.tensor([[10, 11, 12, 13, 14]])
    assert medusa_labels(x, 3).tolist() == [
        [[12, 13, 14, -100, -100]],
        [[13, 14, -100, -100, -100]],
        [[14, -100, -100, -100, -100]],
    ]


def test_runtime_proposes_from_the_last_feature_received(medusa):
    """Each head's draft = argmax of that head on the LAST feature row of the last update."""
    torch.manual_seed(0)
    medusa.reset()
    medusa.update(torch.arange(6), torch.randn(5, 64))  # prefill: n+1 tokens, n features
    for m in (0, 2, 1):
        f = torch.randn(m + 1, 64)
        medusa.update(torch.arange(m + 1), f)  # a round: m+1 tokens, m+1 features
        p = medusa.propose(5, Warp(), None)
        normed = medusa.module.normalize(f[-1])
        expect = [int(medusa.module.head_logits(i, normed).argmax()) for i in range(3)]
        assert p.tokens.tolist() == expect  # at most K=3 drafts even though k=5
        assert p.probs is None


def test_sampled_proposal_carries_one_q_per_head(medusa, tiny_target):
    f = tiny_target.forward(torch.tensor([[1, 2, 3, 4]]), feature_layers=medusa.feature_layers).features[0]
    medusa.reset()
    medusa.update(torch.tensor([1, 2, 3, 4, 5]), f)
    p = medusa.propose(2, Warp(temperature=1.0), torch.Generator().manual_seed(0))
    assert p.tokens.shape == (2,) and p.probs.shape == (2, 49152)
    assert torch.allclose(p.probs.sum(-1), torch.ones(2))


@pytest.mark.parametrize("override, field", [("drafter.num_heads=0", "drafter.num_heads"),
                                             ("drafter.num_layers=-1", "drafter.num_layers")])
def test_bad_config_names_the_field(override, field):
    from draftsmith.config import load_recipe

    with pytest.raises(ConfigError, match=field):
        load_recipe(None, ["drafter.type=medusa", override])
