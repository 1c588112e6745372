"""Every drafter family, untrained, in the built-in decoder on the real SmolLM2 (fp32): greedy
output token-identical to the target's own greedy decoding on MT-bench prompts."""

from __future__ import annotations

import pytest
import torch

from draftsmith.config import load_recipe
from draftsmith.decode.rounds import speculative_decode
from draftsmith.drafters.draft_lm import DraftLMConfig
from draftsmith.drafters.medusa import MedusaConfig
from draftsmith.decode.reference import target_greedy

pytestmark = pytest.mark.e2e

MAX_NEW = 24
PROMPTS = (0, 40)  # MT-bench questions: writing and coding categories


@pytest.fixture(scope="module")
def prompts(smollm2, mtbench_first_turns):
    ids = [smollm2.render_chat([{"role": "user", "content": mtbench_first_turns[i]}]) for i in PROMPTS]
    return [(p, target_greedy(smollm2, p, MAX_NEW)) for p in ids]


def recipe_drafter(name: str):
    return load_recipe(f"smollm2-135m-{name}").drafter


@pytest.mark.parametrize("name", ["draftlm", "eagle1", "eagle3", "medusa", "draftlm-narrow"])
def test_untrained_drafter_is_lossless_on_smollm2(smollm2, prompts, name):
    if name == "draftlm-narrow":
        config = DraftLMConfig(num_layers=2, hidden_size=384, layer_init="random")
    else:
        config = recipe_drafter(name)
    drafter = config.build(smollm2)
    for prompt, reference in prompts:
        result = speculative_decode(smollm2, drafter, prompt, k=4, max_new_tokens=MAX_NEW)
        assert result.tokens == reference
        assert result.stats.drafted > 0


def test_medusa_reads_the_feature_of_the_last_committed_token(smollm2, prompts):
    """Identity blocks make every head the target's own readout; in greedy decoding each head must
    then propose exactly the last committed token (the target's argmax at f_{n-1}). Reading any
    other position's feature would propose a different token on real text."""
    drafter = MedusaConfig(num_heads=2).build(smollm2)
    with torch.no_grad():
        for head in drafter.module.heads:
            head[0].linear.bias.zero_()
    committed: list[int] = []
    seen: list[tuple[int, list[int]]] = []
    update, propose = drafter.update, drafter.propose

    def record_update(tokens, features):
        committed.extend(tokens.tolist())
        update(tokens, features)

    def record_propose(k, warp, gen):
        p = propose(k, warp, gen)
        seen.append((committed[-1], p.tokens.tolist()))
        return p

    drafter.update, drafter.propose = record_update, record_propose
    prompt, reference = prompts[0]
    result = speculative_decode(smollm2, drafter, prompt, k=2, max_new_tokens=16)
    assert result.tokens == reference[:16]
    assert len({last for last, _ in seen}) > 3  # real text: the last token changes
    for last, drafts in seen:
        assert drafts == [last] * len(drafts)
