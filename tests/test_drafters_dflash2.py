"""DFlash2: the convolution against a from-scratch loop, a fresh DFlash2 holding the DFlash of its seed, logits and
selector scores equal to speculators' ``DFlash2DraftModel`` on the same weights (its training forward), the runtime's
selector walk against the training forward, greedy identity with the target (fp32) and the exact sampled law
(chi-square)."""

from __future__ import annotations

import re

import pytest
import torch

from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.reference import target_greedy
from draftsmith.decode.sampling import Warp
from draftsmith.drafters.dflash import DFlashConfig
from draftsmith.drafters.dflash2 import DFlash2Config, DFlash2Module, grouped_dynamic_conv
from draftsmith.errors import ConfigError

# the five-token target, its exact sequence law and the sampler of decoded sequences: DFlash's chi-square fixtures
from .test_drafters_dflash import WrongQ, commit, five_token_target, law_check, prefilled  # noqa: F401
from .test_decoder import DRAWS
from .test_drafters_peagle import perturb

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"num_layers": 2, "block_size": 4, "feature_layers": [1, 2], "conv_group_size": 8, "selector_rank": 8,
         "selector_top_k": 5}
"""A tiny DFlash2 for the tiny target (hidden 64: 8 groups of 8 channels)."""


def test_the_convolution_is_the_from_scratch_loop():
    gen = torch.Generator().manual_seed(0)
    x, delta, base = torch.randn(2, 3, 4, 6, generator=gen), torch.randn(2, 3, 4, 2, 3, generator=gen), torch.randn(2, 6, generator=gen)
    out = grouped_dynamic_conv(x, delta, base)  # 2 taps, 3 groups of 2 channels, blocks of 4
    for b in range(2):
        for n in range(3):
            for p in range(4):
                for c in range(6):
                    want = sum((base[t, c] + delta[b, n, p, t, c // 2]) * x[b, n, p - t, c] for t in range(2) if p - t >= 0)
                    assert abs(float(out[b, n, p, c]) - float(want)) < 1e-5


def test_the_convolution_matches_the_references_on_flat_blocks():
    from speculators.models.dflash2.model_definitions import grouped_dynamic_conv as theirs

    gen = torch.Generator().manual_seed(1)
    x, delta, base = torch.randn(12, 16, generator=gen), torch.randn(12, 3, 4, generator=gen), torch.randn(3, 16, generator=gen)
    ours = grouped_dynamic_conv(x.view(3, 4, 16), delta.view(3, 4, 3, 4), base).view(12, 16)
    torch.testing.assert_close(ours, theirs(x, delta, base, block_size=4, group_size=4))


@pytest.fixture(scope="module")
def dflash2(tiny_target):
    config = DFlash2Config(seed=3, **SMALL).resolve(tiny_target)
    module = config.build_module(tiny_target).eval()
    perturb(module)  # the convolutions off the identity and the selector off its init: nothing is trivial
    return config, module


def test_a_fresh_dflash2_holds_the_dflash_of_its_seed_and_computes_it(tiny_target):
    config = DFlash2Config(seed=3, **SMALL)
    module = config.build_module(tiny_target)
    base = DFlashConfig(num_layers=2, block_size=4, feature_layers=[1, 2], seed=3).build_module(tiny_target)
    theirs = base.state_dict()
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in theirs.items())
    extra = sorted({re.sub(r"^layers\.\d+\.", "", k) for k in set(module.state_dict()) - set(theirs)})
    assert extra == ["attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
                     "candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
                     "candidate_selector.successor_codebook", "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight"]
    seq = torch.tensor([[5, 17, 42, 9, 300, 77, 8, 12, 1000, 3]])
    feats = tiny_target.forward(seq, feature_layers=(1, 2)).features
    anchors = torch.tensor([[2, 5]])
    with torch.no_grad():  # identity convolutions: the DFlash block exactly
        torch.testing.assert_close(module.train_blocks(seq, feats, anchors), base.train_blocks(seq, feats, anchors))
    assert module.candidate_selector.predecessor_codebook.shape == (tiny_target.vocab_size, 8)


# ---------------------------------------------------------------- parity with speculators' DFlash2DraftModel


def speculators_model(module: DFlash2Module, config: DFlash2Config, verifier_dir: str):
    """speculators' DFlash2DraftModel of ``module``'s shape (eager attention), holding ``module``'s weights."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    from draftsmith.export.dflash import qwen3_fields

    layers = Qwen3Config(**qwen3_fields(module))
    layers._attn_implementation = "eager"
    spec = DFlash2SpeculatorConfig(
        transformer_layer_config=layers, draft_vocab_size=layers.vocab_size, block_size=config.block_size,
        aux_hidden_state_layer_ids=[i + 1 for i in config.feature_layers], mask_token_id=config.mask_token_id,
        conv_kernel_size=config.conv_kernel_size, conv_group_size=config.conv_group_size,
        selector_rank=config.selector_rank, selector_top_k=config.selector_top_k,
        speculators_config=SpeculatorsConfig(algorithm="dflash2", proposal_methods=[GreedyTokenProposalConfig(
            speculative_tokens=config.block_size - 1)], default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(verifier_dir)))
    model = DFlash2DraftModel(spec).eval()
    state = {k: v for k, v in module.state_dict().items() if not k.startswith("rotary_emb.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and sorted(missing) == ["verifier_lm_head.weight", "verifier_norm.weight"]
    return model


def test_logits_and_selector_scores_equal_speculators_dflash2_model(tiny_target, tiny_target_dir, dflash2):
    """speculators' training forward (its anchors, block layout, mask and layers) and ours on the same anchors: the
    unary logits of every block row and the selector's scores of its candidates given the true previous token."""
    config, module = dflash2
    model = speculators_model(module, config, tiny_target_dir)
    x = torch.tensor([[1, 523, 77, 9, 4021, 88, 5, 17, 42, 300, 12, 1000, 3, 64, 9, 81]])
    features = tiny_target.forward(x, feature_layers=tuple(config.feature_layers)).features  # [1, S, 2H]
    loss_mask = torch.tensor([[0] * 3 + [1] * 13])
    with torch.no_grad():
        hidden, unary, _, _, index = model._backbone_forward(features, x, loss_mask, torch.zeros(1, 16, 64),
                                                             torch.zeros_like(x), max_anchors=9)
        anchors = index.view(-1, config.block_size)[:, 0]
        assert anchors.tolist() == list(range(3, 12))  # every answer position but the last block's
        candidates, theirs = model.candidate_selector.select(unary, hidden, model._predecessor_ids(x, index).view(1, -1))
        ours_hidden = module.train_blocks(x, features, anchors[None])  # [1, N, Bs, H]
        previous = x[0, anchors[:, None] + torch.arange(config.block_size) - 1]  # [N, Bs]: the token before each row
        previous[:, 0] = x[0, anchors]  # row 0 (the anchor, never drafted) reads itself, as the reference's
        ours_candidates, ours = module.select(ours_hidden[0], previous)
    scale = float(unary.abs().max())
    torch.testing.assert_close(module.lm_head(ours_hidden).view_as(unary), unary, atol=1e-5 * scale, rtol=1e-5)
    assert torch.equal(ours_candidates.view_as(candidates), candidates)
    torch.testing.assert_close(ours.view_as(theirs), theirs, atol=1e-5 * scale, rtol=1e-5)
    with torch.no_grad():  # the convolutions are what make them equal: moved, they are not
        module.layers[0].attention_conv.base_kernel.add_(0.5)
        moved = module.lm_head(module.train_blocks(x, features, anchors[None])).view_as(unary)
        module.layers[0].attention_conv.base_kernel.sub_(0.5)
    assert float((moved - unary).abs().max()) > 100 * 1e-5 * scale


# ---------------------------------------------------------------- runtime


def test_the_runtime_walks_the_selector_over_the_training_forwards_block(tiny_target, dflash2):
    """Round after round (rejections included), each greedy draft is the argmax of the training forward's selector
    scores at its block position, given the draft before it (the anchor for the first)."""
    config, module = dflash2
    tokens = [5, 17, 42, 9, 300]
    drafter = prefilled(tiny_target, config, module, tokens)

    def expected(tokens: list[int]) -> list[int]:
        x = torch.tensor([tokens])
        feats = tiny_target.forward(x, feature_layers=drafter.feature_layers).features
        rows = module.train_blocks(x, feats, torch.tensor([[len(tokens) - 1]]))[0, 0]  # [Bs, H]
        out, previous = [], tokens[-1]
        for k in range(1, config.block_size):
            candidates, scores = module.select(rows[k], torch.tensor(previous))
            previous = int(candidates[scores.argmax()])
            out.append(previous)
        return out

    walked = False
    for accept in (0, 2, 1, 3):
        proposal = drafter.propose(5, Warp(), None)  # capped at Bs − 1
        with torch.no_grad():
            want = expected(tokens)
        assert proposal.tokens.tolist() == want
        with torch.no_grad():  # the selector changes the drafts somewhere: the walk is exercised
            unary = module.lm_head(module.train_blocks(torch.tensor([tokens]), tiny_target.forward(
                torch.tensor([tokens]), feature_layers=drafter.feature_layers).features,
                torch.tensor([[len(tokens) - 1]]))[0, 0, 1:]).argmax(-1).tolist()
        walked |= unary != want
        commit(tiny_target, drafter, tokens, proposal.tokens[:accept].tolist() + [int(7 + 31 * accept)])
    assert walked
    drafter.propose(3, Warp(), None)
    assert drafter.rows == len(tokens) - 1  # each committed position once in the context cache


def test_sampled_proposals_report_q_over_the_candidates(tiny_target, dflash2):
    p = prefilled(tiny_target, *dflash2, [5, 17, 42]).propose(10, Warp(temperature=1.0), torch.Generator().manual_seed(0))
    assert p.tokens.shape == (3,) and p.probs.shape == (3, tiny_target.vocab_size)
    torch.testing.assert_close(p.probs.sum(-1), torch.ones(3))
    assert ((p.probs > 0).sum(-1) <= 5).all()  # q is zero outside the top K = 5 candidates
    assert all(float(p.probs[i, t]) > 0 for i, t in enumerate(p.tokens.tolist()))


def test_greedy_identity_with_the_target_fp32(tiny_target, dflash2):
    config, module = dflash2
    drafter = config.runtime(module, tiny_target)
    prompt = [1, 523, 77, 9, 4021, 88]
    expected = target_greedy(tiny_target, prompt, 40)
    for k in (1, 3):
        assert speculative_decode(tiny_target, drafter, prompt, k=k, max_new_tokens=40).tokens == expected


def test_a_saved_dflash2_loads_back_exactly(tmp_path, tiny_target, dflash2):
    from draftsmith import drafters

    config, module = dflash2
    drafters.save(str(tmp_path / "d"), config, module, tiny_target)
    back = drafters.load(str(tmp_path / "d"), tiny_target)
    assert type(back.module) is DFlash2Module and back.config.selector_top_k == 5 and back.config.type == "dflash2"
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in back.module.state_dict().items())


def test_bad_config_is_refused_in_one_line(tiny_target):
    cases = [({"conv_kernel_size": 5, "block_size": 4}, "drafter.conv_kernel_size"),
             ({"selector_rank": 0}, "drafter.selector_rank"), ({"selector_top_k": 10**6}, "drafter.selector_top_k"),
             ({"draft_vocab_size": 512}, "drafter.draft_vocab"), ({"conv_group_size": 7}, "drafter.conv_group_size"),
             ({"block_size": 1}, "drafter.block_size")]
    for kwargs, field in cases:
        with pytest.raises(ConfigError, match=field) as e:
            DFlash2Config(**{**SMALL, **kwargs}).build_module(tiny_target)
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the sampled law (chi-square)


def five_token_dflash2(target):
    config = DFlash2Config(num_layers=1, block_size=4, feature_layers=[0, 2], seed=1, conv_group_size=8,
                           selector_rank=4, selector_top_k=3)
    module = config.build_module(target)
    perturb(module, 0.5)
    return config.runtime(module, target)


@pytest.mark.parametrize("warp", [Warp(temperature=1.0), Warp(temperature=0.8, top_k=3)])
def test_sampled_dflash2_keeps_the_exact_sequence_law(five_token_target, warp):
    p_value, accepted = law_check(five_token_target, five_token_dflash2(five_token_target), warp)
    assert accepted > DRAWS // 10 and p_value > 1e-3  # drafts often accepted: the accept path is exercised


def test_the_chi_square_check_rejects_a_dflash2_drafter_that_misreports_q(five_token_target):
    assert law_check(five_token_target, WrongQ(five_token_dflash2(five_token_target)), Warp(temperature=1.0))[0] < 1e-6
