"""Offline alignment: the drafter's q against the target's p on the target's own greedy answers.

Each answer y_0 … y_{N−1} is the target's greedy continuation of a prompt (fp32: no decoding noise).
The target runs once over prompt + answer: its p at every answer position, and the features EAGLE
heads read. At every start m = 1 … N−1 (the prompt and y_0 … y_{m−1} committed, as after a decoder
round) the drafter, driven through the ordinary protocol (``reset`` / ``update`` / ``propose``),
drafts a chain of k_m = min(k, max_new_tokens − m − 1, N − m) tokens (the decoder's own cap, and
no draft past the answer's end) twice, by two instances fed the same updates:

* **teacher-forced**: draft j is forced to be y_{m+j−1} (the drafter reads the true tokens; its
  internal state is its own — an EAGLE head's predicted features); q_j is compared with the
  target's p at that position;
* **rollout**: the drafter drafts its own argmax chain d_1 … d_{k_m}; p_j is the target's
  distribution after prompt + y_<m + d_<j — the reference p while d_<j = y (on the answer), else
  one forward over the chains' off-answer drafts on the answer's cache with a mask that hides
  the answer after each chain's start and the other chains.

Per draft: α_j = Σ_x min(p_T(x), q_T(x)) (the chance a sampled draft is accepted; T =
``report.temperature``, p and q both tempered), KL(p_T ‖ q_T) (q floored at 1e-10), top-1
agreement (the greedy acceptance), and the drafter's top-1 confidence (max of its q at
temperature 1). Positions a drafter did not propose (a model-free drafter may propose fewer than k_m
drafts, or none) stay NaN: the figures by position are over the starts that proposed draft j, as the
decoder's ``acceptance_at_position`` is over the rounds that did; the expected rounds count them as
not accepted.

How the drafter is steered: every chain drafter picks its drafts in ``decode.protocol.draft_chain``
by calling ``warp.choose(logits)``; :class:`Steer` is handed to ``propose`` as the warp, records the
logits and returns the forced token (teacher-forced) or the argmax (rollout). Model-free drafters
(prompt lookup, suffix) never call it: their q is their proposal's (point masses, not tempered),
and their drafts do not depend on earlier drafts, so forced and rollout q are the same.

Greedy decoding verifies draft j only after drafts 1 … j−1 were accepted, i.e. equal to the answer:
then rollout and teacher-forced contexts coincide, so the cumulative top-1 (all of 1 … j right) is
the same along both, and replaying the decoder's rounds over the per-start accepted lengths
(:func:`expected_rounds`) gives the greedy decoder's τ and histogram in fp32 exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..decode.protocol import Drafter, Proposal
from ..decode.sampling import Warp
from ..target import Target, crop_cache

Q_FLOOR = 1e-10


class Steer:
    """Stands in for the decode warp inside ``draft_chain``: records each draft step's logits [V] and
    chooses the forced token (teacher forcing) or the argmax (the drafter's own greedy rollout).

    It returns q at temperature 1 (``greedy`` is False) so that every drafter fills ``Proposal.probs``.
    """

    temperature = 1.0
    top_k = 0
    top_p = 1.0
    greedy = False

    def __init__(self, forced: list[int] | None = None):
        self.forced = forced
        self.logits: list[Tensor] = []

    def probs(self, logits: Tensor) -> Tensor:
        return Warp(1.0).probs(logits)

    def choose(self, logits: Tensor, generator: torch.Generator | None) -> tuple[int, Tensor]:
        i = len(self.logits)
        self.logits.append(logits.detach().float())
        token = int(self.forced[i]) if self.forced is not None else int(logits.argmax(-1))
        return token, torch.softmax(logits.float(), -1)


@dataclass
class Drafts:
    """The q of one proposed chain: n' ≤ k_m drafts."""

    tokens: list[int]
    q_t: Tensor
    """[n', V] float32 q at the report's temperature."""
    conf: Tensor
    """[n'] the drafter's top-1 probability at temperature 1."""
    top: Tensor
    """[n'] the drafter's top-1 token."""


def steered_drafts(drafter: Drafter, k: int, forced: list[int] | None, temperature: float,
                   generator: torch.Generator, vocab_size: int) -> Drafts:
    """Ask ``drafter`` for k drafts with :class:`Steer`; its q from the recorded logits (tempered) or,
    for a drafter that does not draft through ``warp.choose``, from the proposal (not tempered)."""
    steer = Steer(forced)
    proposal: Proposal = drafter.propose(k, steer, generator)  # type: ignore[arg-type]
    tokens = proposal.tokens[:k].tolist()
    n = len(tokens)
    if steer.logits:
        logits = torch.stack(steer.logits[:n])  # [n, V]
        q1 = torch.softmax(logits, -1)
        q_t = torch.softmax(logits / temperature, -1)
    elif n and proposal.probs is not None:
        q1 = q_t = proposal.probs[:n].float()
    else:  # no draft, or (against the protocol) no probs outside greedy mode: point masses
        q1 = q_t = torch.nn.functional.one_hot(proposal.tokens[:n].long(), vocab_size).float()
    conf, top = q1.max(-1)
    return Drafts(tokens, q_t, conf.cpu(), top.cpu())


def overlap_and_kl(p_t: Tensor, q_t: Tensor) -> tuple[Tensor, Tensor]:
    """p_t, q_t: [n, V] probabilities → (Σ min(p, q) [n], KL(p ‖ q) [n] with q floored at 1e-10)."""
    q_t = q_t.to(p_t.device)
    alpha = torch.minimum(p_t, q_t).sum(-1)
    logp = p_t.clamp_min(1e-30).log()
    kl = (p_t * (logp - q_t.clamp_min(Q_FLOOR).log())).sum(-1)
    return alpha, kl


@dataclass
class AnswerAlignment:
    """Per start m (rows, m = 1 … N−1) and draft position j (columns, k of them); NaN where draft j was not
    proposed (j > k_m, or the drafter proposed fewer)."""

    id: str
    category: str
    turn: int
    k_m: np.ndarray
    """[starts] chain length at each start."""
    tf_alpha: np.ndarray
    tf_top1: np.ndarray
    tf_kl: np.ndarray
    tf_conf: np.ndarray
    ro_alpha: np.ndarray
    ro_top1: np.ndarray
    first: list[dict[str, Any]] = field(default_factory=list)
    """Per start, position 1 teacher-forced: target token, drafted token, p(y), q(y), q(draft), α."""
    answer: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    """prompt + answer token ids (for the failing contexts' text)."""
    vocab_mass: float | None = None
    """Mean over answer positions of the target's p_T mass inside the draft vocabulary (None: full vocabulary)."""
    in_vocab: int | None = None
    """Answer tokens inside the draft vocabulary (None: full vocabulary)."""
    ends_with_eos: bool = False


@torch.inference_mode()
def align_answer(target: Target, teacher: Drafter, rollout: Drafter, prompt: list[int], answer: list[int], k: int,
                 max_new_tokens: int, temperature: float, draft_ids: Tensor | None = None,
                 meta: tuple[str, str, int] = ("", "", 1), chunk: int = 64) -> AnswerAlignment:
    """One answer: every start's teacher-forced and rollout chains (see the module docstring).

    teacher, rollout: two instances of the same drafter (each sees one ``propose`` per ``update``,
    as in the decoder). draft_ids: [Vd] the drafter's vocabulary, when reduced. The rollouts' off-answer
    drafts of ``chunk`` starts go through the target in one forward.
    """
    device = target.device
    seq = list(prompt) + list(answer)
    P, N = len(prompt), len(answer)
    cache = target.new_cache()
    out = target.forward(torch.tensor([seq], device=device), cache, tuple(teacher.feature_layers))
    p_t = torch.softmax(out.logits[0, P - 1 : P + N - 1].float() / temperature, -1)  # [N, V] p_T of y_0 … y_{N-1}
    feats = out.features[0] if out.features is not None else None  # [P+N, F]
    gen = torch.Generator(device=device).manual_seed(0)
    for d in (teacher, rollout):
        d.reset()
        d.update(torch.tensor(seq[: P + 1], device=device), None if feats is None else feats[:P])
    starts = max(N - 1, 0)
    shape = (starts, k)
    tf_a, tf_g, tf_kl, tf_c, ro_a, ro_g = (np.full(shape, np.nan) for _ in range(6))
    k_m = np.zeros(starts, dtype=int)
    first: list[dict[str, Any]] = []
    pending: list[tuple[int, int, Drafts, list[int]]] = []  # rollouts whose off-answer p is still to compute
    for m in range(1, N):
        km = min(k, max_new_tokens - m - 1, N - m)
        row = m - 1
        k_m[row] = km
        if km > 0:
            truth = answer[m : m + km]
            tf = steered_drafts(teacher, km, truth, temperature, gen, target.vocab_size)
            n = len(tf.tokens)
            if n:
                a, kl = overlap_and_kl(p_t[m : m + n], tf.q_t)
                tf_a[row, :n], tf_kl[row, :n], tf_c[row, :n] = a.cpu().numpy(), kl.cpu().numpy(), tf.conf.numpy()
                tf_g[row, :n] = (tf.top.numpy() == np.array(truth[:n])).astype(float)
                y = truth[0]
                q0 = tf.q_t[0]
                first.append({"m": m, "target": y, "drafted": int(tf.top[0]), "alpha": float(a[0]),
                              "p_target": float(p_t[m, y]), "q_target": float(q0[y]), "q_drafted": float(q0[tf.top[0]])})
            ro = steered_drafts(rollout, km, None, temperature, gen, target.vocab_size)
            if ro.tokens:
                pending.append((row, m, ro, truth))
        if len(pending) >= chunk or (m == N - 1 and pending):
            for (row, m_, ro, truth), p_ro in zip(pending, rollout_ps(
                    target, cache, seq, [(P + m_, ro.tokens, truth, m_) for _, m_, ro, truth in pending], p_t, temperature)):
                a, _ = overlap_and_kl(p_ro, ro.q_t)
                nr = len(ro.tokens)
                ro_a[row, :nr] = a.cpu().numpy()
                ro_g[row, :nr] = (np.array(ro.tokens) == p_ro_argmax(p_ro, ro.tokens, truth)).astype(float)
            pending = []
        token = torch.tensor([seq[P + m]], device=device)
        for d in (teacher, rollout):
            d.update(token, None if feats is None else feats[P + m - 1 : P + m])
    mass = in_vocab = None
    if draft_ids is not None:
        ids = draft_ids.to(p_t.device)
        mass = float(p_t[:, ids].sum(-1).mean()) if N else 0.0
        in_vocab = int(torch.isin(torch.tensor(answer, device=ids.device), ids).sum())
    return AnswerAlignment(meta[0], meta[1], meta[2], k_m, tf_a, tf_g, tf_kl, tf_c, ro_a, ro_g, first,
                           list(answer), seq, mass, in_vocab, bool(answer) and answer[-1] in target.eos_token_ids)


def p_ro_argmax(p_ro: Tensor, drafts: list[int], truth: list[int]) -> np.ndarray:
    """The target's greedy token at each rollout draft: the answer's token while the rollout is on the
    answer (exactly what the greedy decoder compares with), else the argmax of its p there."""
    out = p_ro.argmax(-1).cpu().numpy().copy()
    for j in range(len(drafts)):
        if drafts[:j] != truth[:j]:
            break
        out[j] = truth[j]
    return out


def rollout_ps(target: Target, cache: Any, seq: list[int], chains: list[tuple[int, list[int], list[int], int]],
               p_t: Tensor, temperature: float) -> list[Tensor]:
    """For each chain (start, drafts, truth, m): [n, V] the target's p_T at each draft d_j after
    seq[:start] + d_<j, all chains in one forward.

    While d_<j equals the answer the p is the answer's own (row m + j of p_t, p_t [N, V] the answer's);
    after a chain's first deviation i its drafts d_i … d_{n−2} run over the answer's cache (which holds
    all of seq, and is cropped back after), each seeing seq[:start + i] and its own chain's deviating
    drafts before it (a 4-D additive mask [1, 1, B, len(seq) + B])."""
    device, past = target.device, len(seq)
    rows: list[list[Tensor]] = []
    extra_ids, positions, spans = [], [], []
    for start, drafts, truth, m in chains:
        n = len(drafts)
        dev = next((i for i in range(n) if drafts[i] != truth[i]), n)
        rows.append([p_t[m + j] for j in range(min(dev + 1, n))])
        extra = drafts[dev : n - 1]
        spans.append((len(extra_ids), len(extra), start + dev))
        extra_ids += extra
        positions += list(range(start + dev, start + dev + len(extra)))
    if extra_ids:
        b = len(extra_ids)
        allowed = torch.zeros(b, past + b, dtype=torch.bool, device=device)
        for at, size, visible in spans:
            allowed[at : at + size, :visible] = True
            allowed[at : at + size, past + at : past + at + size] = torch.ones(size, size, dtype=torch.bool,
                                                                              device=device).tril()
        mask = torch.zeros(allowed.shape, dtype=target.dtype, device=device)
        mask = mask.masked_fill(~allowed, torch.finfo(target.dtype).min)[None, None]  # [1, 1, B, past+B]
        out = target.forward(torch.tensor([extra_ids], device=device), cache, attention_mask=mask,
                             position_ids=torch.tensor([positions], device=device))
        crop_cache(cache, past)
        p_extra = torch.softmax(out.logits[0].float() / temperature, -1)  # [B, V]
        for r, (at, size, _) in zip(rows, spans):
            r += list(p_extra[at : at + size])
    return [torch.stack(r) for r in rows]


def expected_rounds(survival: np.ndarray, k_m: np.ndarray, n_answer: int, k: int,
                    ends_with_eos: bool = False) -> tuple[float, float, np.ndarray]:
    """The decoder's rounds over one answer, in expectation, from the acceptance at every start.

    survival: [starts, k] P(drafts 1..j all accepted) in a round starting at m (row m − 1; NaN past k_m);
    the decoder emits y_0 at prefill, then per round the accepted drafts and one more token, until the
    answer's end (its EOS or max_new_tokens; a round at the very end may propose no draft and still
    counts, as in the decoder). A round that accepts the answer's final EOS emits no bonus token (only
    what is emitted counts, ``decode/stats.py``). Returns (expected rounds, expected tokens emitted by
    rounds, expected accepted-length histogram [k+1]). With 0/1 survivals (greedy) it is the decoder's
    exact replay.
    """
    rounds = np.zeros(n_answer + 2)
    tokens = np.zeros(n_answer + 2)
    hist = np.zeros((n_answer + 2, k + 1))
    for m in range(n_answer - 1, 0, -1):  # m = answer tokens committed; m ≥ n_answer is the end
        km = int(k_m[m - 1])
        surv = [1.0] + [float(x) for x in np.nan_to_num(survival[m - 1, :km], nan=0.0)] + [0.0]
        for n in range(km + 1):
            p = surv[n] - surv[n + 1]
            if p <= 0:
                continue
            nxt = min(m + n + 1, n_answer)
            rounds[m] += p * (1 + rounds[nxt])
            bonus = 0 if ends_with_eos and m + n == n_answer else 1
            tokens[m] += p * (n + bonus + tokens[nxt])
            hist[m] += p * hist[nxt]
            hist[m, n] += p
    return float(rounds[1]), float(tokens[1]), hist[1]
