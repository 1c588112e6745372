"""The pure accept/resample rule and the warps.

Statistical tests draw many times from the production ``speculative_accept`` and compare
the emitted tokens with the target distribution p by a chi-square test. Each test also
runs a deliberately biased variant through the SAME check and asserts it is rejected, so
the check is shown to have the power to catch a wrong rule. Generators are seeded: the
outcome of every test is deterministic.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from draftsmith.decode.sampling import Warp, greedy_accept, speculative_accept

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: intra-op threads only add sync cost

V = 6
DRAWS = 6000
PASS_P = 1e-3  # the correct rule must not look this unlikely
FAIL_P = 1e-6  # a biased rule must look at least this unlikely

AcceptFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], tuple[int, int]]


def dist(*weights: float) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float32)
    return w / w.sum()


def random_dist(gen: torch.Generator, zeros: int = 0) -> torch.Tensor:
    w = torch.rand(V, generator=gen) + 0.05
    w[torch.randperm(V, generator=gen)[:zeros]] = 0.0
    return w / w.sum()


# ------------------------------------------------------------------ biased variants (must FAIL)


def _accept_with(prob_fn: Callable, residual_fn: Callable, bonus_offset: int = 0) -> AcceptFn:
    """A hand-written accept rule with pluggable (possibly wrong) pieces, for the power checks."""

    def accept(p, q, draft, gen):
        k = draft.shape[0]
        for i in range(k):
            x = int(draft[i])
            if float(torch.rand(1, generator=gen)) >= prob_fn(float(p[i, x]), float(q[i, x])):
                return i, int(torch.multinomial(residual_fn(p[i], q[i]), 1, generator=gen))
        return k, int(torch.multinomial(p[k - bonus_offset], 1, generator=gen))

    return accept


def _norm_residual(pi, qi):
    r = (pi - qi).clamp_min(0)
    return r / r.sum() if r.sum() > 0 else pi


resample_from_p = _accept_with(lambda px, qx: min(1.0, px / qx), lambda pi, qi: pi)
accept_with_p_only = _accept_with(lambda px, qx: px, _norm_residual)
bonus_from_previous_position = _accept_with(lambda px, qx: min(1.0, px / qx), _norm_residual, bonus_offset=1)
correct_by_hand = _accept_with(lambda px, qx: min(1.0, px / qx), _norm_residual)


# ------------------------------------------------------------------ the check


def chi2_pvalue(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Chi-square p-value; a draw in a cell of probability 0 is an outright failure (p = 0)."""
    counts, expected_probs = counts.reshape(-1), expected_probs.reshape(-1)
    impossible = expected_probs <= 1e-12
    if counts[impossible].sum() > 0:
        return 0.0
    obs, exp = counts[~impossible], expected_probs[~impossible] * counts.sum()
    if obs.size == 1:
        return 1.0  # a single possible outcome, and nothing landed elsewhere
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs, exp).pvalue)


def first_token_pvalue(accept: AcceptFn, p: torch.Tensor, q: torch.Tensor, k: int, seed: int = 0) -> float:
    """Draft k tokens from q (position-wise), apply ``accept``, test the first emitted token against p[0]."""
    gen = torch.Generator().manual_seed(seed)
    p, q = p[: k + 1], q[:k]
    counts = np.zeros(V)
    for _ in range(DRAWS):
        draft = torch.multinomial(q, 1, generator=gen)[:, 0]  # [k]
        n, token = accept(p, q, draft, gen)
        counts[int(draft[0]) if n > 0 else token] += 1
    return chi2_pvalue(counts, p[0].numpy())


def pair_pvalue(accept: AcceptFn, p: torch.Tensor, q: torch.Tensor, k: int, seed: int = 0) -> float:
    """Chain rounds until two tokens are out; test their joint law against p[0] ⊗ p[1].

    p, q: [L, V] per-position laws (independent of the prefix), so the exact answer is the
    outer product — a rule that mixes up positions (bonus, residual) fails it.
    """
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros((V, V))
    for _ in range(DRAWS):
        out: list[int] = []
        while len(out) < 2:
            pos = len(out)
            draft = torch.multinomial(q[pos : pos + k], 1, generator=gen)[:, 0]
            n, token = accept(p[pos : pos + k + 1], q[pos : pos + k], draft, gen)
            out += draft[:n].tolist() + [token]
        counts[out[0], out[1]] += 1
    return chi2_pvalue(counts, np.outer(p[0].numpy(), p[1].numpy()))


def _stack(*rows: torch.Tensor) -> torch.Tensor:
    return torch.stack(rows)


# ------------------------------------------------------------------ adversarial pairs, k = 1

G = torch.Generator().manual_seed(1234)
P_RANDOM, Q_RANDOM = random_dist(G), random_dist(G)
PAIRS = {
    "p_equals_q": (P_RANDOM, P_RANDOM.clone()),
    "disjoint_supports": (dist(3, 2, 1, 0, 0, 0), dist(0, 0, 0, 1, 1, 2)),
    "one_hot_q": (P_RANDOM, dist(0, 0, 1, 0, 0, 0)),
    "q_zero_where_p_positive": (dist(1, 1, 1, 1, 1, 1), dist(5, 1, 0, 0, 0, 0)),
    "random": (P_RANDOM, Q_RANDOM),
    "p_one_hot": (dist(0, 0, 0, 0, 1, 0), Q_RANDOM),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_first_token_follows_p_for_adversarial_pairs(name):
    p0, q0 = PAIRS[name]
    p = _stack(p0, P_RANDOM)  # [k+1, V]: position 1 and the bonus position
    q = q0[None]
    assert first_token_pvalue(speculative_accept, p, q, k=1) > PASS_P


@pytest.mark.parametrize("name,biased", [
    ("random", resample_from_p),
    ("one_hot_q", resample_from_p),
    ("q_zero_where_p_positive", resample_from_p),
    ("random", accept_with_p_only),
])
def test_biased_rule_fails_the_same_check(name, biased):
    p0, q0 = PAIRS[name]
    p, q = _stack(p0, P_RANDOM), q0[None]
    assert first_token_pvalue(biased, p, q, k=1) < FAIL_P
    # and the hand-written correct rule (same code path as the biased ones) passes: the
    # failure above is the bias, not the harness
    assert first_token_pvalue(correct_by_hand, p, q, k=1) > PASS_P


# ------------------------------------------------------------------ chains, k > 1


def _chain_laws(seed: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.stack([random_dist(g, zeros=i % 3) for i in range(length)])
    q = torch.stack([random_dist(g, zeros=(i + 1) % 3) for i in range(length)])
    return p, q


@pytest.mark.parametrize("k", [2, 4])
def test_chain_first_token_and_pairs_follow_p(k):
    p, q = _chain_laws(seed=k, length=k + 3)
    assert first_token_pvalue(speculative_accept, p, q, k=k) > PASS_P
    assert pair_pvalue(speculative_accept, p, q, k=k) > PASS_P


def test_chain_pairs_with_near_copy_drafter():
    """q close to p: long accepted runs, so the bonus token carries much of the pair law."""
    p, _ = _chain_laws(seed=7, length=6)
    q = 0.9 * p + 0.1 / V
    assert pair_pvalue(speculative_accept, p, q, k=2) > PASS_P
    assert pair_pvalue(bonus_from_previous_position, p, q, k=1) < FAIL_P


# ------------------------------------------------------------------ exact small cases


def test_accept_probability_is_min_one_p_over_q():
    """P(accept x) = min(1, p(x)/q(x)): measured with the production function on a fixed draft."""
    p = _stack(dist(1, 3, 0, 0, 0, 0), dist(1, 1, 1, 1, 1, 1))
    q = dist(3, 1, 0, 0, 0, 0)[None]
    gen = torch.Generator().manual_seed(0)
    for x, expected in ((0, (1 / 4) / (3 / 4)), (1, 1.0)):
        accepted = sum(speculative_accept(p, q, torch.tensor([x]), gen)[0] for _ in range(4000))
        assert abs(accepted / 4000 - expected) < 0.03


def test_token_with_zero_target_probability_is_always_rejected():
    p = _stack(dist(1, 0, 0, 0, 0, 0), dist(1, 1, 1, 1, 1, 1))
    q = dist(0, 1, 0, 0, 0, 0)[None]
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        assert speculative_accept(p, q, torch.tensor([1]), gen) == (0, 0)


def test_all_accepted_gives_bonus_from_last_position():
    p = _stack(dist(1, 0, 0, 0, 0, 0), dist(0, 1, 0, 0, 0, 0), dist(0, 0, 0, 0, 0, 1))
    q = p[:2].clone()
    gen = torch.Generator().manual_seed(0)
    assert speculative_accept(p, q, torch.tensor([0, 1]), gen) == (2, 5)


def test_greedy_accept():
    assert greedy_accept(torch.tensor([4, 7, 9, 1]), torch.tensor([4, 7, 9])) == (3, 1)
    assert greedy_accept(torch.tensor([4, 7, 9, 1]), torch.tensor([4, 8, 9])) == (1, 7)
    assert greedy_accept(torch.tensor([4, 7]), torch.tensor([5])) == (0, 4)
    assert greedy_accept(torch.tensor([3]), torch.empty(0, dtype=torch.long)) == (0, 3)


# ------------------------------------------------------------------ warps: exact masks


def test_greedy_warp_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 0.0]])
    w = Warp(temperature=0.0)
    assert w.greedy
    assert torch.equal(w.probs(logits), torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0]]))
    assert w.choose(logits[0], None) == (1, None)


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 0.0])
    torch.testing.assert_close(Warp(temperature=0.5).probs(logits), torch.softmax(logits / 0.5, -1))


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, 2.5], [0.0, -1.0, 4.0, 3.0, 1.0]])
    probs = Warp(temperature=1.0, top_k=2).probs(logits)
    assert torch.equal(probs > 0, torch.tensor([[False, True, False, False, True], [False, False, True, True, False]]))
    torch.testing.assert_close(probs[0, [1, 4]], torch.softmax(torch.tensor([3.0, 2.5]), -1))
    assert torch.equal(Warp(temperature=1.0, top_k=5).probs(logits) > 0, torch.ones(2, 5, dtype=torch.bool))


def test_top_p_keeps_the_smallest_set_reaching_p():
    base = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = base.log()[torch.tensor([3, 0, 4, 1, 2])]  # shuffled: [0.1, 0.5, 0.05, 0.2, 0.15]
    masks = {
        0.4: [False, True, False, False, False],  # 0.5 alone reaches 0.4
        0.65: [False, True, False, True, False],  # 0.5 + 0.2
        0.8: [False, True, False, True, True],  # 0.5 + 0.2 + 0.15 = 0.85
        0.99: [True, True, True, True, True],
    }
    for top_p, mask in masks.items():
        probs = Warp(temperature=1.0, top_p=top_p).probs(logits)
        assert (probs > 0).tolist() == mask, top_p
        kept = logits.softmax(-1)[torch.tensor(mask)]
        torch.testing.assert_close(probs[torch.tensor(mask)], kept / kept.sum())


def test_top_k_then_top_p_compose():
    logits = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]).log()
    probs = Warp(temperature=1.0, top_k=3, top_p=0.7).probs(logits)
    # top-k leaves [0.5, 0.2, 0.15]/0.85 = [0.588, 0.235, 0.176]; top-p 0.7 then keeps the first two
    assert (probs > 0).tolist() == [True, True, False, False, False]
