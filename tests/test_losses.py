"""Golden values of the distillation losses, computed by hand on 3-token vocabularies."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.train import losses as L

ln = math.log
# position 0: p = [1/2, 1/4, 1/4], q = [1/8, 3/8, 1/2]; position 1 is masked out (garbage, NaN)
P = [0.5, 0.25, 0.25]
Q = [0.125, 0.375, 0.5]


def _pair(masked_garbage: float = float("nan")) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    target = torch.tensor([[ln(x) for x in P], [masked_garbage, 0.0, 1.0]])  # [2, 3]
    draft = torch.tensor([[ln(x) for x in Q], [5.0, masked_garbage, -3.0]])
    mask = torch.tensor([True, False])
    return draft, target, mask


# Each value below is written out term by term from the definition.
GOLDEN = {
    "forward_kl": 0.5 * ln(0.5 / 0.125) + 0.25 * ln(0.25 / 0.375) + 0.25 * ln(0.25 / 0.5),  # Σ p log p/q
    "reverse_kl": 0.125 * ln(0.125 / 0.5) + 0.375 * ln(0.375 / 0.25) + 0.5 * ln(0.5 / 0.25),  # Σ q log q/p
    "tvd": 0.5 * (0.375 + 0.125 + 0.25),
    "ce": -ln(0.125),  # target argmax is token 0
    "soft_ce": -(0.5 * ln(0.125) + 0.25 * ln(0.375) + 0.25 * ln(0.5)),
    # β = 0.5: m = [0.3125, 0.3125, 0.375]
    "jsd": 0.5 * (0.5 * ln(0.5 / 0.3125) + 0.25 * ln(0.25 / 0.3125) + 0.25 * ln(0.25 / 0.375))
    + 0.5 * (0.125 * ln(0.125 / 0.3125) + 0.375 * ln(0.375 / 0.3125) + 0.5 * ln(0.5 / 0.375)),
    # α = Σ min(p, q) = 0.125 + 0.25 + 0.25 = 0.625
    "lk_alpha": -ln(0.625),
    # λ = exp(−3·α); λ·KL(p‖q) + (1 − λ)·(1 − α)
    "lk_hybrid": math.exp(-3 * 0.625) * (0.5 * ln(0.5 / 0.125) + 0.25 * ln(0.25 / 0.375) + 0.25 * ln(0.25 / 0.5))
    + (1 - math.exp(-3 * 0.625)) * 0.375,
    # HASS's top-K term at K = 1 (GOLDEN_K): the target's top token only, p not renormalized over it
    "top_k_ce": -0.5 * ln(0.125),
}
GOLDEN_K = {"top_k_ce": 1}
"""The K a golden value above is computed at (p's second and third tokens tie: K = 1 alone is unambiguous)."""


def test_every_token_loss_has_a_golden_value():
    assert set(GOLDEN) == set(L.TOKEN_LOSSES)


def test_lk_hybrid_takes_no_gradient_through_its_weight():
    # d/dq of λ·KL + (1 − λ)·TV with λ constant: the weight's own dependence on α must not add a term
    draft, target, mask = _pair()
    draft = draft.clone().requires_grad_(True)
    L.lk_hybrid(draft, target, mask).backward()
    lam = math.exp(-3 * 0.625)
    draft2 = draft.detach().clone().requires_grad_(True)
    (lam * L.forward_kl(draft2, target, mask) + (1 - lam) * L.tvd(draft2, target, mask)).backward()
    assert torch.allclose(draft.grad[0], draft2.grad[0], atol=1e-6)


@pytest.mark.parametrize("kind", sorted(GOLDEN))
def test_golden_values_ignore_masked_positions(kind):
    draft, target, mask = _pair()
    got = L.token_loss(kind, draft, target, mask, top_k=GOLDEN_K.get(kind, 0))
    assert got.item() == pytest.approx(GOLDEN[kind], abs=1e-6)
    assert math.isfinite(got.item())  # the NaN at the masked position never leaks in


def test_golden_numbers_themselves():
    # guards against a typo in the formulas above: known decimal values
    assert GOLDEN["forward_kl"] == pytest.approx(0.418494, abs=1e-6)
    assert GOLDEN["reverse_kl"] == pytest.approx(0.325336, abs=1e-6)
    assert GOLDEN["jsd"] == pytest.approx(0.087763, abs=1e-6)
    assert GOLDEN["soft_ce"] == pytest.approx(1.458215, abs=1e-6)


def test_mean_is_over_valid_positions_only():
    # two valid positions: the loss is the average of the two per-position values
    target = torch.tensor([[ln(x) for x in P], [ln(0.5), ln(0.5), -math.inf]])
    draft = torch.tensor([[ln(x) for x in Q], [ln(0.5), ln(0.5), -math.inf]])  # identical at position 1
    mask = torch.tensor([True, True])
    assert L.forward_kl(draft, target, mask).item() == pytest.approx(GOLDEN["forward_kl"] / 2, abs=1e-6)
    assert L.tvd(draft, target, mask).item() == pytest.approx(GOLDEN["tvd"] / 2, abs=1e-6)


def test_expected_acceptance_is_one_minus_tvd():
    draft, target, mask = _pair()
    assert L.expected_acceptance(draft, target, mask).item() == pytest.approx(0.125 + 0.25 + 0.25, abs=1e-6)
    assert L.top1_accuracy(draft, target.argmax(-1), mask).item() == 0.0  # draft argmax 2, target argmax 0


def test_temperature_divides_logits():
    # T = 2 turns logits [2 ln 2, 0] into p = [2/3, 1/3]; q = uniform
    target = torch.tensor([[2 * ln(2), 0.0]])
    draft = torch.zeros(1, 2)
    mask = torch.tensor([True])
    want = 2 / 3 * ln((2 / 3) / 0.5) + 1 / 3 * ln((1 / 3) / 0.5)
    assert L.forward_kl(draft, target, mask, temperature=2.0).item() == pytest.approx(want, abs=1e-6)
    with pytest.raises(DraftsmithError, match="temperature"):
        L.forward_kl(draft, target, mask, temperature=0.0)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd", "tvd"])
def test_zero_for_identical_distributions(kind):
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0)) * 3
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert L.token_loss(kind, logits, logits.clone(), mask).item() == pytest.approx(0.0, abs=1e-6)
    assert L.expected_acceptance(logits, logits, mask).item() == pytest.approx(1.0, abs=1e-6)


def test_jsd_beta_limits_and_range():
    draft, target, mask = _pair()
    with pytest.raises(DraftsmithError, match="beta"):
        L.jsd(draft, target, mask, beta=1.0)
    # small β: JSD(β)/β → KL(p‖q) (GKD/DistillSpec's interpolation)
    assert (L.jsd(draft, target, mask, beta=1e-4) / 1e-4).item() == pytest.approx(GOLDEN["forward_kl"], rel=1e-3)


def test_reduced_vocabulary_renormalizes_and_masks_outside_argmax():
    # V = 4, draft vocabulary = target ids [0, 2]
    draft_ids = torch.tensor([0, 2])
    target = torch.tensor([[ln(0.4), ln(0.3), ln(0.2), ln(0.1)],  # argmax 0: in the draft vocab, kept
                           [ln(0.1), ln(0.6), ln(0.2), ln(0.1)]])  # argmax 1: outside, masked
    mask = torch.tensor([True, True])
    restricted, kept = L.restrict_to_draft_vocab(target, draft_ids, mask)
    assert kept.tolist() == [True, False]
    # p over {0, 2} renormalized: [0.4, 0.2] / 0.6 = [2/3, 1/3]
    assert restricted[0].softmax(-1).tolist() == pytest.approx([2 / 3, 1 / 3], abs=1e-6)
    draft = torch.tensor([[0.0, 0.0], [9.0, -9.0]])  # q = [1/2, 1/2] at the kept position
    want = -(2 / 3 * ln(0.5) + 1 / 3 * ln(0.5))
    assert L.soft_ce(draft, restricted, kept).item() == pytest.approx(want, abs=1e-6)


def test_smooth_l1_feature_regression():
    pred = torch.tensor([[0.0, 0.0], [100.0, 100.0]])
    target = torch.tensor([[0.5, 3.0], [0.0, 0.0]])
    mask = torch.tensor([True, False])
    # |0.5| < 1: 0.5·0.5² = 0.125; |3| ≥ 1: 3 − 0.5 = 2.5; mean over the feature axis = 1.3125
    assert L.smooth_l1(pred, target, mask).item() == pytest.approx(1.3125, abs=1e-6)


def test_no_valid_tokens_is_a_clear_error():
    draft, target, _ = _pair()
    with pytest.raises(L.EmptyBatchError, match="no valid .loss-masked. positions"):
        L.forward_kl(draft, target, torch.tensor([False, False]))


def test_unknown_loss_names_the_choices():
    draft, target, mask = _pair()
    with pytest.raises(DraftsmithError, match="choose one of: forward_kl"):
        L.token_loss("kl", draft, target, mask)


def test_gradient_flows_to_draft_only_through_valid_positions():
    draft, target, mask = _pair(masked_garbage=0.0)
    draft.requires_grad_(True)
    L.forward_kl(draft, target, mask).backward()
    assert draft.grad[1].abs().sum().item() == 0.0
    # d KL(p‖q) / d draft_logits = q − p at the valid position
    assert draft.grad[0].tolist() == pytest.approx([q - p for p, q in zip(P, Q)], abs=1e-6)


def test_decayed_weights():
    assert L.decayed_weights(3, 0.8) == pytest.approx([1.0, 0.8, 0.64])


@pytest.mark.parametrize("chunk_rows", [1, 7, 256])
def test_draft_vocab_agreement_equals_the_scattered_metrics_without_the_full_vocabulary_copy(chunk_rows):
    """Σ min(p, q) and top-1 read over the draft rows (p through its log-normalizer) are the figures of
    expected_acceptance / top1_accuracy on the draft logits scattered to the whole vocabulary (q = 0 outside), also
    when the target's rows are picked by index and the rows do not fill the last chunk."""
    from draftsmith.drafters.common import scatter_to_target

    g = torch.Generator().manual_seed(3)
    V, ids = 300, torch.tensor(sorted(torch.randperm(300, generator=g)[:40].tolist()))
    target = torch.randn(25, V, generator=g) * 3
    draft = torch.randn(19, len(ids), generator=g) * 3
    rows = torch.randperm(25, generator=g)[:19]  # distinct rows: each planted argmax stands alone
    target[rows[:6], ids[draft[:6].argmax(-1)]] += 50.0  # six rows where the draft's argmax is the target's
    accept, top1 = L.draft_vocab_agreement(draft, target, ids, rows=rows, chunk_rows=chunk_rows)
    q, p, every = scatter_to_target(draft, ids, V), target[rows], torch.ones(19, dtype=torch.bool)
    assert accept.shape == (19,) and top1.dtype == torch.bool
    assert torch.allclose(accept.mean(), L.expected_acceptance(q, p, every), atol=1e-6)
    assert torch.allclose(accept, torch.minimum(q.softmax(-1), p.softmax(-1)).sum(-1), atol=1e-6)
    assert top1.tolist() == (q.argmax(-1) == p.argmax(-1)).tolist() and int(top1[:6].sum()) == 6
    assert float(top1.float().mean()) == pytest.approx(float(L.top1_accuracy(q, p.argmax(-1), every)))


# HASS's top-K term over a reduced vocabulary: V = 6, draft vocabulary = target ids [0, 2, 3, 5]
HASS_P = [0.30, 0.28, 0.25, 0.10, 0.04, 0.03]  # the target's p; its own top 2 is {0, 1}, and 1 is not a draft token
HASS_Q = [0.1, 0.2, 0.3, 0.4]  # the drafter's q over the draft vocabulary


def _hass_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    target = torch.tensor([[ln(x) for x in HASS_P], [float("nan")] * 6])  # row 1 masked out (garbage)
    draft = torch.tensor([[ln(x) for x in HASS_Q], [float("nan")] * 4])
    restricted, kept = L.restrict_to_draft_vocab(target, torch.tensor([0, 2, 3, 5]), torch.tensor([True, False]))
    return draft, restricted, kept


def test_the_top_k_term_is_hass_soft_ce_over_the_targets_k_likeliest_draft_tokens():
    """p renormalized over the draft vocabulary is [0.30, 0.25, 0.10, 0.03] / 0.68 (the soft labels); its top 2 are
    target ids 0 and 2, and the term is −Σ over them of p log q — not renormalized over the 2, not divided by K."""
    draft, restricted, kept = _hass_case()
    want = -(0.30 / 0.68 * ln(0.1) + 0.25 / 0.68 * ln(0.2))
    assert want == pytest.approx(1.6076, abs=1e-4)
    assert L.top_k_ce(draft, restricted, kept, k=2).item() == pytest.approx(want, abs=1e-6)
    assert L.top_k_ce(draft, restricted, kept, k=9).item() == pytest.approx(L.soft_ce(draft, restricted, kept).item(),
                                                                           abs=1e-6)  # K past the vocabulary: all of it
    # beside another loss, weighed: soft CE + w · the term, over the same positions, summed or averaged
    soft = -sum(p / 0.68 * ln(q) for p, q in zip([0.30, 0.25, 0.10, 0.03], HASS_Q))
    for reduction in ("mean", "sum"):
        got = L.token_loss("soft_ce", draft, restricted, kept, reduction=reduction, top_k=2, top_k_weight=0.5)
        assert got.item() == pytest.approx(soft + 0.5 * want, abs=1e-6)
    # kind top_k_ce is the term alone (not added twice); K = 0 is refused there, and adds nothing elsewhere, bit for bit
    assert L.token_loss("top_k_ce", draft, restricted, kept, top_k=2, top_k_weight=0.5).item() == pytest.approx(want)
    with pytest.raises(DraftsmithError, match="needs K ≥ 1"):
        L.token_loss("top_k_ce", draft, restricted, kept)
    assert torch.equal(L.token_loss("lk_alpha", draft, restricted, kept, top_k=0, top_k_weight=3.0),
                       L.lk_alpha(draft, restricted, kept))


def test_the_top_k_terms_gradient_pulls_up_the_k_tokens_by_their_p():
    """d/dz_j of −Σ_{x ∈ Ω} p_x log q_x = (Σ_Ω p)·q_j − p_j·[j ∈ Ω]: the K tokens are pulled up by their own p, the
    rest pushed down by q alone, and no gradient reaches a masked row."""
    draft, restricted, kept = _hass_case()
    draft = torch.where(draft.isnan(), torch.zeros_like(draft), draft).requires_grad_(True)
    restricted = torch.where(restricted.isnan(), torch.zeros_like(restricted), restricted)
    L.top_k_ce(draft, restricted, kept, k=2).backward()
    p = [0.30 / 0.68, 0.25 / 0.68, 0.0, 0.0]
    assert draft.grad[0].tolist() == pytest.approx([sum(p) * q - pj for q, pj in zip(HASS_Q, p)], abs=1e-6)
    assert draft.grad[1].abs().sum().item() == 0.0
