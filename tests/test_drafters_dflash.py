"""DFlash: block alignment (golden indices), the module against a from-scratch reference, the runtime's
cached context, greedy identity with the target (fp32) and the exact sampled law (chi-square), with the
full vocabulary and with a reduced draft vocabulary."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.protocol import Proposal
from draftsmith.decode.sampling import Warp
from draftsmith.drafters.dflash import (
    DFlashConfig,
    block_attention_mask,
    block_inputs,
    default_target_layers,
)
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.decode.reference import target_greedy
from draftsmith.target import Target
from draftsmith.train.dflash import block_labels, position_weights, sample_anchors

from .conftest import tiny_llama
from .test_decoder import DRAWS, ToyTokenizer, pooled_chi2

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- alignment (golden indices)


def test_block_labels_golden_indices_on_a_toy_sequence():
    # positions 0..9; answer tokens at 3..8 (9 is a prompt/pad position)
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    anchors = torch.tensor([[3, 6, -1]])
    label, valid = block_labels(anchors, 4, loss_mask)
    assert label.tolist() == [[[3, 4, 5, 6], [6, 7, 8, 9], [-1, 0, 1, 2]]]
    assert valid.tolist() == [[[False, True, True, True], [False, True, True, False], [False, False, False, False]]]
    # the target row whose output is each label's soft target: label − 1 (anchor 3 → rows 3, 4, 5)
    assert (label[valid] - 1).tolist() == [3, 4, 5, 6, 7]


def test_block_inputs_and_mask_golden():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    anchors = torch.tensor([[2, 4]])
    noise, pos = block_inputs(ids, anchors, 3, mask_token_id=99)
    assert noise.tolist() == [[12, 99, 99, 14, 99, 99]]
    assert pos.tolist() == [[2, 3, 4, 4, 5, 6]]
    mask = block_attention_mask(anchors, 3, 6)[0, 0].int()
    assert mask.tolist() == [
        # context 0..5   | block 0 | block 1
        [1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1],
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1],
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1],
    ]


def test_anchors_are_answer_positions_followed_by_an_answer_token_distinct_and_sorted():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1, 1, 0]], dtype=torch.bool)
    for seed in range(20):
        anchors = sample_anchors(loss_mask, 8, torch.Generator().manual_seed(seed))
        assert anchors.shape == (2, 3)  # the most eligible positions of a row (row 0: 1, 2, 5)
        assert anchors[0].tolist() == [1, 2, 5] and anchors[1].tolist() == [5, -1, -1]
    few = sample_anchors(loss_mask, 2, torch.Generator().manual_seed(0))
    assert few.shape == (2, 2) and set(few[0].tolist()) <= {1, 2, 5} and few[0, 0] < few[0, 1]


def test_position_weights_follow_the_reference_decay():
    w = position_weights(8, 0.0)
    assert w[0] == 0.0 and w[1] == 1.0 and w[2] == pytest.approx(torch.exp(torch.tensor(-0.25)).item())
    assert position_weights(16, 0.0)[2] == pytest.approx(torch.exp(torch.tensor(-1 / 7)).item())


def test_default_target_layers_follow_the_reference_rule():
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B-DFlash-b16's
    assert default_target_layers(30, 1) == [15]
    assert default_target_layers(64, 2) == [1, 61]


# ---------------------------------------------------------------- module and runtime


@pytest.fixture(scope="module")
def dflash(tiny_target):
    config = DFlashConfig(num_layers=2, block_size=4, feature_layers=[1, -1], seed=3)
    module = config.build_module(tiny_target)
    with torch.no_grad():  # a fresh head's norm equals the target's; perturb every weight so nothing is trivial
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return config.resolve(tiny_target), module


def reference_block(module, target: Target, tokens: list[int]) -> torch.Tensor:
    """The block's hidden rows from scratch, written out with plain tensor ops (no cache, no helpers):
    the anchor tokens[-1] at position n = len(tokens) − 1, the context = target features of 0 … n−1."""
    n, bs, m = len(tokens) - 1, module.block_size, module
    feats = target.forward(torch.tensor([tokens[:-1]]), feature_layers=tuple(m.feature_layers)).features  # [1, n, L·H]
    ctx = m.hidden_norm(m.fc(feats))
    x = m.embed_tokens(torch.tensor([[tokens[-1]] + [m.mask_token_id] * (bs - 1)]))
    pos = torch.arange(n + bs)[None]
    cos, sin = m.rotary_emb(x, pos)

    def rope(t, rows):  # t [1, h, S, d] at positions rows (a slice of 0 … n+Bs−1)
        c, s = cos[:, None, rows], sin[:, None, rows]
        return t * c + torch.cat([-t[..., t.shape[-1] // 2:], t[..., : t.shape[-1] // 2]], -1) * s

    ctx_rows, block_rows = slice(0, n), slice(n, n + bs)
    for layer in m.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        split = lambda t, heads: t.view(1, -1, heads, a.head_dim).transpose(1, 2)  # noqa: E731
        q = rope(a.q_norm(split(a.q_proj(h), a.num_heads)), block_rows)
        k = torch.cat([rope(a.k_norm(split(a.k_proj(ctx), a.num_kv_heads)), ctx_rows),
                       rope(a.k_norm(split(a.k_proj(h), a.num_kv_heads)), block_rows)], 2)
        v = torch.cat([split(a.v_proj(ctx), a.num_kv_heads), split(a.v_proj(h), a.num_kv_heads)], 2)
        groups = a.num_heads // a.num_kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        att = (q @ k.transpose(-1, -2) / a.head_dim**0.5).softmax(-1) @ v  # every row sees everything
        x = x + a.o_proj(att.transpose(1, 2).reshape(1, bs, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return m.norm(x)[0]  # [Bs, H]


def test_train_blocks_equal_the_from_scratch_reference(tiny_target, dflash):
    _, module = dflash
    seq = [5, 17, 42, 9, 300, 77, 8, 12, 1000, 3]
    feats = tiny_target.forward(torch.tensor([seq]), feature_layers=tuple(module.feature_layers)).features
    anchors = torch.tensor([[4, 7]])
    hidden = module.train_blocks(torch.tensor([seq]), feats, anchors)[0]  # [2, Bs, H]
    for j, a in enumerate(anchors[0].tolist()):
        torch.testing.assert_close(hidden[j], reference_block(module, tiny_target, seq[: a + 1]), atol=1e-5, rtol=1e-5)


def test_runtime_blocks_use_the_cached_context_exactly(tiny_target, dflash):
    """After rounds with rejections, the drafter's logits are the from-scratch block's: its context
    cache holds every committed position once, with true features."""
    config, module = dflash
    drafter = config.runtime(module, tiny_target)
    tokens = [5, 17, 42, 9, 300]
    drafter.reset()
    drafter.update(torch.tensor(tokens), tiny_target.forward(torch.tensor([tokens[:-1]]),
                                                             feature_layers=drafter.feature_layers).features[0])
    for accept in (0, 2, 1, 3):
        proposal = drafter.propose(3, Warp(), None)
        expected = module.lm_head(reference_block(module, tiny_target, tokens)[1:]).argmax(-1)
        assert proposal.tokens.tolist() == expected.tolist()
        commit(tiny_target, drafter, tokens, proposal.tokens[:accept].tolist() + [int(7 + 31 * accept)])
    drafter.propose(3, Warp(), None)
    assert drafter.rows == len(tokens) - 1  # each committed position once in the context cache


def prefilled(target: Target, config, module, tokens: list[int]):
    """The runtime of ``module`` after the protocol's first update: ``tokens`` and the features of all but the last."""
    drafter = config.runtime(module, target)
    drafter.reset()
    drafter.update(torch.tensor(tokens), target.forward(torch.tensor([tokens[:-1]]),
                                                        feature_layers=drafter.feature_layers).features[0])
    return drafter


def commit(target: Target, drafter, tokens: list[int], new: list[int]) -> None:
    """One round's commit: ``new`` (accepted drafts + the target's token) appended to ``tokens``, the drafter
    updated with them and the target's features of the positions verified (the protocol's invariant)."""
    n = len(tokens)
    f = target.forward(torch.tensor([tokens + new[:-1]]), feature_layers=drafter.feature_layers).features[0]
    drafter.update(torch.tensor(new), f[n - 1 :])
    tokens += new


def test_propose_caps_at_the_block_and_reports_q_per_position(tiny_target, dflash):
    config, module = dflash
    drafter = config.runtime(module, tiny_target)
    drafter.reset()
    tokens = [5, 17, 42]
    drafter.update(torch.tensor(tokens), tiny_target.forward(torch.tensor([tokens[:-1]]), feature_layers=drafter.feature_layers).features[0])
    p = drafter.propose(10, Warp(temperature=1.0), torch.Generator().manual_seed(0))
    assert p.tokens.shape == (3,) and p.probs.shape == (3, tiny_target.vocab_size)
    torch.testing.assert_close(p.probs.sum(-1), torch.ones(3))


@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_greedy_identity_with_the_target_fp32(tiny_target, request, vocab):
    config, module = request.getfixturevalue("dflash" if vocab == "full" else "reduced")
    drafter = config.runtime(module, tiny_target)
    prompt = [1, 523, 77, 9, 4021, 88]
    expected = target_greedy(tiny_target, prompt, 40)
    for k in (1, 3):
        assert speculative_decode(tiny_target, drafter, prompt, k=k, max_new_tokens=40).tokens == expected


def test_bad_config_names_the_field(tiny_target):
    with pytest.raises(ConfigError, match="drafter.block_size"):
        DFlashConfig(block_size=1).resolve(tiny_target)
    with pytest.raises(ConfigError, match=r"drafter.feature_layers\[1\]"):
        DFlashConfig(feature_layers=[1, 99]).resolve(tiny_target)
    with pytest.raises(ConfigError, match="names a layer twice"):
        DFlashConfig(feature_layers=[1, 1]).resolve(tiny_target)
    with pytest.raises(ConfigError, match="drafter.mask_token_id"):
        DFlashConfig(mask_token_id=10**6).resolve(tiny_target)


# ---------------------------------------------------------------- reduced draft vocabulary


def vocab_pair(ids: list[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the draft vocabulary ``ids`` (data/vocab.py's convention: sorted, offsets)."""
    used = torch.tensor(sorted(ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(len(ids)), t2d


DRAFT_IDS = sorted({5, 17, 42, 9, 300, 77, 523, 4021, 88, 1000} | set(range(0, 49152, 97)))


@pytest.fixture(scope="module")
def reduced(tiny_target, dflash):
    """The fixture's drafter with a draft vocabulary of 516 ids: the same body (weights copied), its lm_head
    the target's rows of those ids."""
    config, module = dflash
    small = dataclasses.replace(config, draft_vocab_size=len(DRAFT_IDS))
    out = small.build_module(tiny_target, vocab=vocab_pair(DRAFT_IDS, tiny_target.vocab_size))
    missing, unexpected = out.load_state_dict(
        {k: v for k, v in module.state_dict().items() if not k.startswith("lm_head.")}, strict=False)
    assert sorted(missing) == ["d2t", "lm_head.weight", "t2d"] and unexpected == []
    return small, out


def test_a_reduced_vocabulary_drafts_the_argmax_over_its_rows_of_the_targets_head(tiny_target, dflash, reduced):
    config, module = dflash
    small, out = reduced
    assert out.lm_head.weight.shape == (len(DRAFT_IDS), 64) and not out.lm_head.weight.requires_grad
    assert torch.equal(out.lm_head.weight, tiny_target.model.lm_head.weight[DRAFT_IDS])
    assert out.draft_ids.tolist() == DRAFT_IDS and module.draft_ids is None and module.d2t is None
    tokens = [5, 17, 42, 9, 300]
    feats = tiny_target.forward(torch.tensor([tokens[:-1]]), feature_layers=tuple(module.feature_layers)).features[0]
    hidden = reference_block(module, tiny_target, tokens)[1:]
    full_logits = module.lm_head(hidden)  # [Bs − 1, V]
    expected = torch.tensor(DRAFT_IDS)[full_logits[:, DRAFT_IDS].argmax(-1)]
    drafter = small.runtime(out, tiny_target)
    drafter.reset()
    drafter.update(torch.tensor(tokens), feats)
    greedy = drafter.propose(3, Warp(), None)
    assert greedy.tokens.tolist() == expected.tolist()
    assert greedy.tokens.tolist() != full_logits.argmax(-1).tolist()  # the restriction changes the drafts here
    sampled = drafter.propose(3, Warp(temperature=1.0), torch.Generator().manual_seed(0))
    outside = torch.ones(tiny_target.vocab_size, dtype=torch.bool)
    outside[DRAFT_IDS] = False
    assert sampled.probs.shape == (3, tiny_target.vocab_size) and bool((sampled.probs[:, outside] == 0).all())
    torch.testing.assert_close(sampled.probs[:, DRAFT_IDS], full_logits[:, DRAFT_IDS].softmax(-1))
    assert set(sampled.tokens.tolist()) <= set(DRAFT_IDS)


def test_a_saved_reduced_drafter_stores_d2t_not_the_head_and_loads_back_exactly(tmp_path, tiny_target, reduced):
    from safetensors.torch import load_file

    from draftsmith import drafters

    small, out = reduced
    drafters.save(str(tmp_path / "d"), small, out, tiny_target)
    stored = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert stored["d2t"].tolist() == [i - j for j, i in enumerate(DRAFT_IDS)] and stored["t2d"].sum() == len(DRAFT_IDS)
    assert not any(k.startswith(("lm_head.", "embed_tokens.")) for k in stored)
    back = drafters.load(str(tmp_path / "d"), tiny_target)
    assert back.config.draft_vocab_size == len(DRAFT_IDS) and back.config.draft_vocab == ""
    assert torch.equal(back.module.lm_head.weight, out.lm_head.weight)  # taken from the target again at load
    assert all(torch.equal(v, out.state_dict()[k]) for k, v in back.module.state_dict().items())
    bad = dict(stored, d2t=stored["d2t"] * 0)  # every draft id onto target ids 0 … Vd−1: t2d disagrees
    from safetensors.torch import save_file

    save_file(bad, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(DraftsmithError, match="t2d does not mark exactly"):
        drafters.load(str(tmp_path / "d"), tiny_target)


def test_a_draft_vocabulary_of_another_size_is_refused(tiny_target):
    with pytest.raises(ConfigError, match="drafter.draft_vocab_size = 7 but the draft vocabulary has 3"):
        DFlashConfig(num_layers=1, block_size=4, draft_vocab_size=7).build_module(
            tiny_target, vocab=vocab_pair([1, 2, 3], tiny_target.vocab_size))
    with pytest.raises(ConfigError, match="needs a draft vocabulary"):
        DFlashConfig(num_layers=1, block_size=4, draft_vocab_size=7).build_module(tiny_target)


# ---------------------------------------------------------------- the sampled law (chi-square)

V5 = 5


@pytest.fixture(scope="module")
def five_token_target():
    """A tiny random Llama over 5 tokens: every short continuation is enumerable."""
    return Target(tiny_llama(vocab_size=V5, hidden=32, layers=3, seed=4), ToyTokenizer(), name="tiny-5")


def exact_law(target: Target, prompt: list[int], length: int, warp: Warp) -> dict[tuple[int, ...], float]:
    """P(continuation) from the target's own warped next-token distributions (ending at EOS or ``length``)."""
    eos = target.eos_token_ids
    law: dict[tuple[int, ...], float] = {}
    frontier = [((), 1.0)]
    while frontier:
        seq, prob = frontier.pop()
        p = warp.probs(target.forward(torch.tensor([prompt + list(seq)])).logits[0, -1]).double()
        for x in range(V5):
            if p[x] == 0:
                continue
            nxt, pr = seq + (x,), prob * float(p[x])
            if x in eos or len(nxt) == length:
                law[nxt] = law.get(nxt, 0.0) + pr
            else:
                frontier.append((nxt, pr))
    return law


def law_check(target, drafter, warp: Warp) -> tuple[float, int]:
    """(pooled chi-square p-value of the sequences decoded with ``drafter`` against the target's exact law, drafts
    accepted in all): PROMPT5, 3 tokens, k = 3, DRAWS seeds."""
    counts, accepted = sampled_counts(target, drafter, PROMPT5, 3, warp)
    return pooled_chi2(counts, exact_law(target, PROMPT5, 3, warp)), accepted


def sampled_counts(target, drafter, prompt, length, warp, k=3):
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(DRAWS):
        res = speculative_decode(target, drafter, prompt, k=k, max_new_tokens=length, warp=warp, seed=seed)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
        accepted += res.stats.accepted
    return counts, accepted


PROMPT5 = [0, 3, 1]


@pytest.mark.parametrize("warp", [Warp(temperature=1.0), Warp(temperature=0.8, top_k=3)])
def test_sampled_dflash_keeps_the_exact_sequence_law(five_token_target, warp):
    drafter = DFlashConfig(num_layers=1, block_size=4, feature_layers=[0, 2], seed=1).build(five_token_target)
    counts, accepted = sampled_counts(five_token_target, drafter, PROMPT5, 3, warp)
    assert accepted > DRAWS // 10  # drafts are often accepted: the accept path is exercised
    assert pooled_chi2(counts, exact_law(five_token_target, PROMPT5, 3, warp)) > 1e-3


def test_sampled_dflash_with_a_reduced_vocabulary_keeps_the_exact_sequence_law(five_token_target):
    """Draft vocabulary {0, 2, 3} of 5: q is zero on tokens 1 and 4, which only the target's residual can give."""
    warp = Warp(temperature=1.0)
    config = DFlashConfig(num_layers=1, block_size=4, feature_layers=[0, 2], seed=1)
    drafter = config.runtime(config.build_module(five_token_target, vocab=vocab_pair([0, 2, 3], V5)), five_token_target)
    counts, accepted = sampled_counts(five_token_target, drafter, PROMPT5, 3, warp)
    assert accepted > DRAWS // 10
    assert pooled_chi2(counts, exact_law(five_token_target, PROMPT5, 3, warp)) > 1e-3
    assert any(1 in seq or 4 in seq for seq in counts)  # tokens outside the draft vocabulary are still produced


class WrongQ:
    """The DFlash drafter proposing token 0 everywhere while reporting the q it would have sampled from
    (drafts not drawn from the reported q): the check must reject it."""

    def __init__(self, drafter):
        self.drafter, self.feature_layers = drafter, drafter.feature_layers

    def reset(self):
        self.drafter.reset()

    def update(self, tokens, features):
        self.drafter.update(tokens, features)

    def propose(self, k, warp, generator):
        p = self.drafter.propose(k, warp, generator)
        return Proposal(tokens=torch.zeros_like(p.tokens), probs=p.probs)


def test_the_chi_square_check_rejects_a_drafter_that_misreports_q(five_token_target):
    drafter = DFlashConfig(num_layers=1, block_size=4, feature_layers=[0, 2], seed=1).build(five_token_target)
    counts, _ = sampled_counts(five_token_target, WrongQ(drafter), PROMPT5, 3, Warp(temperature=1.0))
    assert pooled_chi2(counts, exact_law(five_token_target, PROMPT5, 3, Warp(temperature=1.0))) < 1e-6


def test_exact_law_is_a_distribution(five_token_target):
    law = exact_law(five_token_target, PROMPT5, 3, Warp(temperature=1.0))
    assert sum(law.values()) == pytest.approx(1.0)
    assert all(len(s) == 3 or s[-1] in five_token_target.eos_token_ids for s in law) and len(law) > 20
    assert list(itertools.islice(law, 1))
