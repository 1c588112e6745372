"""End to end on the real SmolLM2-135M-Instruct target (fp32): the decoder's output IS the target's.

Greedy speculative decoding with the layer-skip drafter must reproduce the target's own
greedy ``generate`` token for token on MT-bench first turns — through accepted blocks
(multi-token acceptance is asserted to happen), rejections and cache rollbacks.
"""

from __future__ import annotations

import pytest
import torch

from draftsmith.config import load_recipe
from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.sampling import Warp
from draftsmith.decode.stats import DecodeStats
from draftsmith.drafters.hf_lm import HFDrafterConfig
from draftsmith.drafters.layer_skip import SelfSpeculativeDrafter, truncated_model

from .conftest import MTBENCH_GREEDY_TOKENS

pytestmark = pytest.mark.e2e

MAX_NEW = MTBENCH_GREEDY_TOKENS


@pytest.fixture(scope="module")
def prompts(mtbench_prompts):
    return mtbench_prompts


@pytest.fixture(scope="module")
def references(mtbench_greedy):
    return mtbench_greedy


def test_greedy_identical_to_target_on_10_mtbench_prompts(smollm2, prompts, references):
    recipe = load_recipe("smollm2-135m-layerskip")
    drafter = recipe.drafter.build(smollm2)
    assert isinstance(drafter, SelfSpeculativeDrafter)  # the default runtime
    total = DecodeStats(k=3)
    for p, ref in zip(prompts, references):
        res = speculative_decode(smollm2, drafter, p, k=3, max_new_tokens=MAX_NEW)
        assert res.tokens == ref
        total = total.merge(res.stats)
    assert sum(total.accept_hist[2:]) > 0  # blocks of ≥ 2 accepted drafts happened
    assert total.accepted < total.drafted  # and rejections


def test_default_recipe_greedy_identity(smollm2, prompts, references):
    recipe = load_recipe("smollm2-135m-layerskip")
    drafter = recipe.drafter.build(smollm2)
    cfg = dict(k=recipe.decode.k, max_new_tokens=MAX_NEW)
    for p, ref in list(zip(prompts, references))[:4]:
        assert speculative_decode(smollm2, drafter, p, **cfg).tokens == ref


def test_hf_lm_drafter_from_a_folder_is_identical(smollm2, prompts, references, tmp_path_factory):
    """A truncated copy of the target saved as its own HF model folder, loaded as an `hf` drafter."""
    folder = tmp_path_factory.mktemp("drafter")
    truncated_model(smollm2.model, 12).save_pretrained(folder)
    smollm2.tokenizer.save_pretrained(folder)
    drafter = HFDrafterConfig(model=str(folder)).build(smollm2)
    assert drafter.model.model.layers[0] is not smollm2.model.model.layers[0]  # its own weights
    for p, ref in list(zip(prompts, references))[:3]:
        res = speculative_decode(smollm2, drafter, p, k=2, max_new_tokens=MAX_NEW)
        assert res.tokens == ref


def test_sampled_decoding_reproducible_with_seed(smollm2, prompts):
    drafter = load_recipe("smollm2-135m-layerskip").drafter.build(smollm2)

    def run(seed: int) -> list[int]:
        cfg = dict(k=2, max_new_tokens=16, warp=Warp(temperature=0.8, top_p=0.95), seed=seed)
        return speculative_decode(smollm2, drafter, prompts[0], **cfg).tokens

    first = run(11)
    assert run(11) == first
    assert run(12) != first
    assert all(0 <= t < smollm2.vocab_size for t in first)


def test_first_token_is_exactly_the_target_argmax(smollm2, prompts):
    """Sanity on the prefill path: one new token = the target's argmax after the prompt."""
    drafter = load_recipe("smollm2-135m-layerskip").drafter.build(smollm2)
    res = speculative_decode(smollm2, drafter, prompts[1], k=1, max_new_tokens=1)
    with torch.inference_mode():
        expected = int(smollm2.model(input_ids=torch.tensor([prompts[1]])).logits[0, -1].argmax())
    assert res.tokens == [expected] and res.stats.rounds == 0
