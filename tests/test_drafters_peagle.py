"""P-EAGLE: the attention layout against the reference's mask function, logits equal to speculators'
``PEagleDraftModel`` on the same weights, the runtime's one-forward drafts against the training forward, greedy
identity with the target (fp32) and the exact sampled law (chi-square)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.sampling import Warp
from draftsmith.drafters.peagle import PEagleConfig, PEagleHead, parallel_attention_mask, parallel_inputs
from draftsmith.errors import ConfigError
from draftsmith.export.adapters import adapter
from draftsmith.export.eagle3 import speculators_parallel_logits
from draftsmith.decode.reference import target_greedy

# the five-token target, its exact sequence law and the sampler of decoded sequences: DFlash's chi-square fixtures
from .test_drafters_dflash import PROMPT5, V5, WrongQ, exact_law, five_token_target, sampled_counts, vocab_pair  # noqa: F401
from .test_decoder import DRAWS, pooled_chi2

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = [0, 1, 3]
"""Three distinct layers of the 4-layer tiny target."""

# the reference's docstring example (speculators/models/peagle/attention.py): a sequence of 6, COD rounds
# [0, 1, 3, 4], [0, 3], [0] → the entries (anchor, depth) below
ANCHOR = [0, 1, 2, 3, 4, 5, 0, 1, 3, 4, 0, 3, 0]
DEPTH = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3]


def perturb(module: torch.nn.Module, scale: float = 0.05) -> None:
    """Move every trainable weight off its init (a fresh head's norms equal the target's)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * scale)


# ---------------------------------------------------------------- layout


def test_the_attention_layout_is_the_references_mask_function():
    from speculators.models.peagle.attention import create_peagle_mask_mod

    anchor, depth = torch.tensor(ANCHOR), torch.tensor(DEPTH)
    mod = create_peagle_mask_mod(anchor, depth, torch.zeros(6, dtype=torch.long))
    q, k = torch.meshgrid(torch.arange(13), torch.arange(13), indexing="ij")
    theirs = mod(0, 0, q, k)
    ours = parallel_attention_mask(anchor[None], depth[None])[0, 0]
    assert torch.equal(ours, theirs)
    # entry 10 is (a=0, d=2): it sees the depth-0 entries of anchors ≤ 0 and its rollout (anchor 0, depth ≤ 2)
    assert ours[10].nonzero().flatten().tolist() == [0, 6, 10]
    assert ours[8].nonzero().flatten().tolist() == [0, 1, 2, 3, 8]  # (3, 1): context 0 … 3 and itself


def test_parallel_inputs_golden():
    ids = torch.tensor([[10, 11, 12, 13]])
    feats = torch.arange(4.0).view(1, 4, 1).expand(1, 4, 3).clone()  # f_t = t
    anchor, depth = torch.tensor([[0, 1, 2, 3, 1, 1, -1]]), torch.tensor([[0, 0, 0, 0, 1, 2, 0]])
    out_ids, hidden, pos = parallel_inputs(ids, feats, torch.full((1, 1, 3), -7.0), anchor, depth, mask_token_id=99)
    assert out_ids.tolist() == [[11, 12, 13, 0, 99, 99, 11]]  # x_{a+1} at depth 0 (0 past the end), else the mask
    assert hidden[0, :, 0].tolist() == [0, 1, 2, 3, -7, -7, 0]
    assert pos.tolist() == [[0, 1, 2, 3, 2, 3, 0]]
    allowed = parallel_attention_mask(anchor, depth)[0, 0]
    assert not allowed[6].any() and not allowed[:, 6].any()  # a padding entry sees nothing and is seen by none


# ---------------------------------------------------------------- parity with speculators' PEagleDraftModel


def speculators_model(head: PEagleHead, config: PEagleConfig, verifier_dir: str):
    """speculators' PEagleDraftModel of ``head``'s shape (eager attention), holding ``head``'s weights."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(**{**head.layer_config.to_dict(), "num_hidden_layers": head.num_layers})
    layer._attn_implementation = "eager"
    spec = PEagleSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=int(head.d2t.shape[0]), mask_token_id=config.mask_token_id,
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in config.feature_layers], **config.norms,
        speculators_config=SpeculatorsConfig(algorithm="peagle", proposal_methods=[GreedyTokenProposalConfig(
            speculative_tokens=config.num_depths)], default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(verifier_dir)))
    model = PEagleDraftModel(spec).eval()
    state = {k: v for k, v in head.state_dict().items() if not k.startswith(("rotary_emb.", "d2t", "t2d"))}
    mask_hidden = state.pop("mask_hidden")
    deep = {k: state.pop(k) for k in list(state) if k.startswith("next_layers.")}
    theirs = adapter("eagle3", "speculators").to_engine(state)
    for k, v in deep.items():  # next_layers.i is the (i + 1)-th layer after the first
        i, rest = k.removeprefix("next_layers.").split(".", 1)
        theirs[f"layers.{int(i) + 1}.{rest}"] = v
    theirs["mask_hidden"] = mask_hidden
    missing, unexpected = model.load_state_dict(theirs, strict=False)
    assert unexpected == [] and sorted(missing) == ["verifier_lm_head.weight", "verifier_norm.weight"]
    return model


OPTIONS = {
    "plain": {},
    "norms": {"norm_before_residual": True, "fc_norm": True},
    "two_layers": {"num_layers": 2, "norm_before_fc": True},
}


@pytest.mark.parametrize("options", list(OPTIONS))
def test_logits_equal_speculators_peagle_model_on_the_same_weights(tiny_target, tiny_target_dir, options):
    config = PEagleConfig(feature_layers=LAYERS, num_depths=4, seed=1, **OPTIONS[options]).resolve(tiny_target)
    head = config.build_module(tiny_target).eval()
    perturb(head)
    model = speculators_model(head, config, tiny_target_dir)
    x = torch.tensor([[1, 523, 77, 9, 4021, 88, 5, 17, 42, 300, 12, 1000, 3, 64, 9, 81]])
    features = tiny_target.forward(x, feature_layers=tuple(config.feature_layers)).features  # [1, S, 3H]
    loss_mask = torch.tensor([[0] * 3 + [1] * 13])
    theirs, anchor, depth = speculators_parallel_logits(model, torch.cat([x[:, 1:], x[:, :1] * 0], 1), features,
                                                        loss_mask, 4)  # its rows hold x_{t+1} (speculators' shift_batch)
    assert int(depth.max()) == 3 and len(anchor) > x.shape[1] + 6  # every depth drawn, several rollouts
    with torch.no_grad():
        _, ours = head.parallel(x, features, anchor[None], depth[None])
    scale = float(theirs.abs().max())
    torch.testing.assert_close(ours[0], theirs, atol=1e-5 * scale, rtol=1e-5)
    with torch.no_grad():  # the mask's hidden state is what makes them equal: without it, they are not
        head.mask_hidden.add_(1.0)
        _, moved = head.parallel(x, features, anchor[None], depth[None])
    assert float((moved[0] - theirs)[depth > 0].abs().max()) > 100 * 1e-5 * scale


# ---------------------------------------------------------------- runtime


@pytest.fixture(scope="module")
def peagle(tiny_target):
    config = PEagleConfig(feature_layers=LAYERS, num_depths=4, seed=3).resolve(tiny_target)
    head = config.build_module(tiny_target).eval()
    perturb(head)
    return config, head


def test_a_peagle_head_holds_the_eagle3_head_of_its_seed_and_stores_mask_hidden(tiny_target, peagle, tmp_path):
    from draftsmith import drafters
    from draftsmith.drafters import Eagle3Config

    base = Eagle3Config(feature_layers=LAYERS, seed=3).build_module(tiny_target)
    fresh = PEagleConfig(feature_layers=LAYERS, num_depths=4, seed=3).build_module(tiny_target)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in base.state_dict().items())
    assert fresh.mask_hidden.shape == (1, 1, 3 * 64) and fresh.mask_hidden.requires_grad
    assert not fresh.embed_tokens.weight.requires_grad  # frozen, as EAGLE-3's (the reference trains it)
    config, head = peagle
    drafters.save(str(tmp_path / "d"), config, head, tiny_target)
    back = drafters.load(str(tmp_path / "d"), tiny_target)
    assert type(back.module) is PEagleHead and back.config.mask_token_id == config.mask_token_id == 49151
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in back.module.state_dict().items())


def test_one_forward_drafts_are_the_training_forwards_rollout_after_rejections(tiny_target, peagle):
    """Round after round (rejections included), the drafter's logits are those of the training forward's rollout at
    the last true row: the cache holds every committed row once, from true features, and no masked row."""
    config, head = peagle
    drafter = config.runtime(head, tiny_target)
    tokens = [5, 17, 42, 9, 300]
    layers = drafter.feature_layers

    def expected(tokens: list[int]) -> torch.Tensor:
        x = torch.tensor([tokens])
        n = len(tokens) - 1
        anchor = torch.tensor([list(range(n + 1)) + [n - 1] * 3])  # depth 0 rows 0 … n, then anchor n − 1's rollout
        depth = torch.tensor([[0] * (n + 1) + [1, 2, 3]])
        feats = tiny_target.forward(x, feature_layers=layers).features
        _, logits = head.parallel(x, feats, anchor, depth)
        return head.draft_ids[logits[0, [n - 1, n + 1, n + 2, n + 3]].argmax(-1)]  # row n − 1 drafts first

    drafter.reset()
    drafter.update(torch.tensor(tokens), tiny_target.forward(torch.tensor([tokens[:-1]]), feature_layers=layers).features[0])
    for accept in (0, 2, 1, 4):
        proposal = drafter.propose(6, Warp(), None)  # capped at num_depths
        with torch.no_grad():
            assert proposal.tokens.tolist() == expected(tokens).tolist()
        new = proposal.tokens[:accept].tolist() + [int(7 + 31 * accept)]
        n = len(tokens)
        f = tiny_target.forward(torch.tensor([tokens + new[:-1]]), feature_layers=layers).features[0]
        drafter.update(torch.tensor(new), f[n - 1 :])
        tokens += new
    drafter.propose(3, Warp(), None)
    assert drafter.rows == len(tokens) - 1 and drafter.cache.get_seq_length() == drafter.rows + 2


def test_sampled_proposals_report_q_per_depth(tiny_target, peagle):
    config, head = peagle
    drafter = config.runtime(head, tiny_target)
    drafter.reset()
    tokens = [5, 17, 42]
    drafter.update(torch.tensor(tokens), tiny_target.forward(torch.tensor([tokens[:-1]]),
                                                             feature_layers=drafter.feature_layers).features[0])
    p = drafter.propose(10, Warp(temperature=1.0), torch.Generator().manual_seed(0))
    assert p.tokens.shape == (4,) and p.probs.shape == (4, tiny_target.vocab_size)
    torch.testing.assert_close(p.probs.sum(-1), torch.ones(4))


@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_greedy_identity_with_the_target_fp32(tiny_target, peagle, vocab):
    config, head = peagle
    if vocab == "reduced":
        ids = sorted({5, 17, 42, 9, 300, 77, 523, 4021, 88, 1000} | set(range(0, 49152, 97)))
        config = dataclasses.replace(config, draft_vocab_size=len(ids))
        head = config.build_module(tiny_target, vocab=vocab_pair(ids, tiny_target.vocab_size)).eval()
        perturb(head)
    drafter = config.runtime(head, tiny_target)
    prompt = [1, 523, 77, 9, 4021, 88]
    expected = target_greedy(tiny_target, prompt, 40)
    for k in (1, 3, 6):
        assert speculative_decode(tiny_target, drafter, prompt, k=k, max_new_tokens=40).tokens == expected


def test_bad_config_is_refused_in_one_line(tiny_target):
    cases = [({"num_depths": 0}, "drafter.num_depths"), ({"norm_output": True}, "drafter.norm_output"),
             ({"mask_token_id": 10**6, "feature_layers": LAYERS}, "drafter.mask_token_id"), ({"feature_layers": [1, 2]}, "drafter.feature_layers")]
    for kwargs, field in cases:
        with pytest.raises(ConfigError, match=field) as e:
            PEagleConfig(**kwargs).resolve(tiny_target)
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the sampled law (chi-square)


def five_token_peagle(target, vocab=None):
    config = PEagleConfig(feature_layers=[0, 1, 2], num_depths=3, seed=1)
    head = config.build_module(target, vocab=vocab)
    perturb(head, 0.5)
    return config.runtime(head, target)


@pytest.mark.parametrize("warp", [Warp(temperature=1.0), Warp(temperature=0.8, top_k=3)])
def test_sampled_peagle_keeps_the_exact_sequence_law(five_token_target, warp):
    counts, accepted = sampled_counts(five_token_target, five_token_peagle(five_token_target), PROMPT5, 3, warp)
    assert accepted > DRAWS // 10  # drafts are often accepted: the accept path is exercised
    assert pooled_chi2(counts, exact_law(five_token_target, PROMPT5, 3, warp)) > 1e-3


def test_sampled_peagle_with_a_reduced_vocabulary_keeps_the_exact_sequence_law(five_token_target):
    warp = Warp(temperature=1.0)
    drafter = five_token_peagle(five_token_target, vocab_pair([0, 2, 3], V5))
    counts, accepted = sampled_counts(five_token_target, drafter, PROMPT5, 3, warp)
    assert accepted > DRAWS // 10
    assert pooled_chi2(counts, exact_law(five_token_target, PROMPT5, 3, warp)) > 1e-3


def test_the_chi_square_check_rejects_a_peagle_drafter_that_misreports_q(five_token_target):
    warp = Warp(temperature=1.0)
    counts, _ = sampled_counts(five_token_target, WrongQ(five_token_peagle(five_token_target)), PROMPT5, 3, warp)
    assert pooled_chi2(counts, exact_law(five_token_target, PROMPT5, 3, warp)) < 1e-6
