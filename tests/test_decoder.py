"""The speculative decoder loop, on models small enough to check exactly.

* A toy second-order Markov LM (a real ``nn.Module`` that behaves like a HF causal LM with a
  ``DynamicCache``) is the target, wrapped in the production ``Target``; a different toy LM
  is the drafter, wrapped in the production ``HFDrafter``. The exact probability of every
  short sequence is enumerable, so sampled outputs are chi-squared against it. The next
  token depends on the token *before* the current one, read from the KV cache, so a cache
  that is not rolled back correctly after a rejection changes the output law.
* Tiny random Llamas check greedy identity, cache contents after rollback, that no
  accepted token is fed twice, EOS (also inside an accepted block), max_new_tokens and the
  metrics arithmetic — with a scripted drafter whose acceptance lengths are known.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import DynamicCache, LlamaConfig

from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.protocol import Proposal
from draftsmith.decode.sampling import Warp
from draftsmith.drafters.hf_lm import HFDrafter
from draftsmith.drafters.layer_skip import SelfSpeculativeDrafter, layer_skip_drafter
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.measure.config import DecodeConfig
from draftsmith.decode.reference import target_greedy
from draftsmith.target import Target

from .conftest import tiny_llama


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: intra-op threads only add sync cost


# ------------------------------------------------------------------ toy Markov LM

V, EOS, BOS = 5, 4, 0


class MarkovLM(torch.nn.Module):
    """P(x_{t+1} | x_{t-1}, x_t) = softmax(table[x_{t-1}, x_t]); x_{-1} = BOS.

    forward(input_ids [1, S], cache=…, logits_to_keep=…) -> .logits [1, S', V], like a HF
    causal LM. The cache stores each fed token id (as a float key) so that the first new
    position reads its predecessor from the cache; with a 4-D tree mask each row reads the last
    row it attends before itself (its parent), so a wrongly compacted cache changes the law.
    """

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.config = LlamaConfig(
            vocab_size=V, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
            num_key_value_heads=1, max_position_embeddings=64, eos_token_id=EOS,
        )
        self.table = torch.nn.Parameter(table.log())  # [V, V, V] log-probabilities
        self.head = torch.nn.Linear(1, V, bias=False)
        self.fed = 0

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def forward(self, input_ids, attention_mask=None, cache=None, use_cache=False, logits_to_keep=0, **_):
        ids = input_ids[0]  # [S]
        prev = BOS
        past = torch.zeros(0)
        if cache is not None:
            if cache.get_seq_length() > 0:
                past = cache.layers[0].keys[0, 0, :, 0]
                prev = int(past[-1])
            kv = ids.float().view(1, 1, -1, 1)
            cache.update(kv, kv, 0)
        self.fed += ids.shape[0]
        prevs = torch.cat([torch.tensor([prev]), ids[:-1]])
        if attention_mask is not None and attention_mask.dim() == 4:  # a tree: x_{t-1} = the last row attended before t
            seen = torch.cat([past, ids.float()]).long()
            allowed = attention_mask[0, 0] == 0  # [S, past+S]
            rows = [allowed[i, : len(past) + i].nonzero() for i in range(ids.shape[0])]
            prevs = torch.tensor([int(seen[r[-1, 0]]) if len(r) else BOS for r in rows])
        logits = self.table[prevs, ids]  # [S, V]
        if logits_to_keep:
            logits = logits[-logits_to_keep:]
        return SimpleNamespace(logits=logits[None])


class ToyTokenizer:
    eos_token_id = EOS
    special_tokens_map = {"eos_token": f"<{EOS}>"}
    chat_template = None

    def get_vocab(self) -> dict[str, int]:
        return {f"<{i}>": i for i in range(V)}


def random_table(seed: int, second_order: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(V, V, V, generator=g) ** 2 + 0.02
    if not second_order:
        t = t[:1].expand(V, V, V).clone()  # ignores x_{t-1}: a first-order drafter
    return t / t.sum(-1, keepdim=True)


def warp_np(p: np.ndarray, w: Warp) -> np.ndarray:
    """Reference warp written independently of sampling.py: temperature, top-k, top-p."""
    logits = np.log(p) / w.temperature
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = np.zeros_like(probs, dtype=bool)
    keep[order[: w.top_k or len(p)]] = True
    probs = np.where(keep, probs, 0.0) / probs[keep].sum()
    if w.top_p < 1.0:
        sorted_p = probs[order]
        before = np.cumsum(sorted_p) - sorted_p
        keep_sorted = before < w.top_p
        keep = np.zeros_like(keep)
        keep[order[keep_sorted]] = True
        probs = np.where(keep, probs, 0.0) / probs[keep].sum()
    return probs


def sequence_law(table: torch.Tensor, prompt: list[int], length: int, w: Warp) -> dict[tuple[int, ...], float]:
    """Exact probability of every output (up to ``length`` tokens, ending early at EOS)."""
    t = table.double().numpy()
    law: dict[tuple[int, ...], float] = {}

    def walk(prev: int, cur: int, out: tuple[int, ...], prob: float) -> None:
        probs = warp_np(t[prev, cur], w)
        for x in range(V):
            if probs[x] == 0:
                continue
            seq, pr = out + (x,), prob * probs[x]
            if x == EOS or len(seq) == length:
                law[seq] = law.get(seq, 0.0) + pr
            else:
                walk(cur, x, seq, pr)

    walk(prompt[-2], prompt[-1], (), 1.0)
    return law


def pooled_chi2(counts: dict[tuple[int, ...], int], law: dict[tuple[int, ...], float]) -> float:
    """Chi-square p-value; cells expected < 5 are pooled; an impossible outcome fails outright."""
    n = sum(counts.values())
    if any(seq not in law for seq in counts):
        return 0.0
    obs, exp, rare_obs, rare_exp = [], [], 0, 0.0
    for seq, pr in law.items():
        if pr * n < 5:
            rare_obs, rare_exp = rare_obs + counts.get(seq, 0), rare_exp + pr * n
        else:
            obs.append(counts.get(seq, 0))
            exp.append(pr * n)
    if rare_exp > 0:
        obs.append(rare_obs)
        exp.append(rare_exp)
    exp_arr = np.asarray(exp, dtype=np.float64)
    return float(chisquare(np.asarray(obs, dtype=np.float64), exp_arr * sum(obs) / exp_arr.sum()).pvalue)


class Rewritten:
    """A drafter whose every proposal is rewritten by ``rewrite`` (a deliberately wrong drafter: the
    statistical checks must reject what it does)."""

    feature_layers = ()

    def __init__(self, drafter, rewrite):
        self.drafter, self.rewrite = drafter, rewrite

    def reset(self):
        self.drafter.reset()

    def update(self, tokens, features):
        self.drafter.update(tokens, features)

    def propose(self, k, warp, generator):
        return self.rewrite(self.drafter.propose(k, warp, generator))


@pytest.fixture(scope="module")
def markov():
    target = Target(MarkovLM(random_table(1)), ToyTokenizer(), name="markov")
    drafter = HFDrafter(MarkovLM(random_table(2, second_order=False)))
    return target, drafter


PROMPT = [1, 2, 3]
DRAWS = 2000


@pytest.mark.parametrize("warp,k", [
    (Warp(temperature=1.0), 3),
    (Warp(temperature=1.0, top_k=3), 2),
    (Warp(temperature=0.7, top_p=0.8), 2),
])
def test_markov_sequence_frequencies_match_exact_law(markov, warp, k):
    target, drafter = markov
    length = 3
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(DRAWS):
        res = speculative_decode(target, drafter, PROMPT, k=k, max_new_tokens=length, warp=warp, seed=seed)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
        accepted += res.stats.accepted
    assert accepted > DRAWS // 10  # the drafter's proposals are often accepted: the accept path is exercised
    law = sequence_law(target.model.table.exp(), PROMPT, length, warp)
    assert pooled_chi2(counts, law) > 1e-3


def test_markov_confidence_gate_keeps_the_exact_law(markov):
    """The confidence gate reads only the drafter's q: the output law stays p, while drafts are dropped."""
    target, drafter = markov
    warp, counts, proposed_at = Warp(temperature=1.0), {}, [0, 0, 0]
    for seed in range(DRAWS):
        res = speculative_decode(target, drafter, PROMPT, k=3, max_new_tokens=3, warp=warp, seed=seed, min_confidence=0.15)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
        proposed_at = [a + b for a, b in zip(proposed_at, res.stats.proposed_at)]
    rounds = DRAWS  # every decode has at least one round with room for a draft
    assert proposed_at[0] < rounds and proposed_at[1] < proposed_at[0]  # the gate dropped drafts
    assert pooled_chi2(counts, sequence_law(target.model.table.exp(), PROMPT, 3, warp)) > 1e-3


def test_markov_gate_on_the_drawn_token_is_biased_and_the_check_sees_it(markov):
    """Gating on q(d) of the token drawn (instead of q's top-1, known before the draw) keeps a biased
    subset of drafts: the same check rejects it — the reason Proposal.confidence is the top-1 mass."""
    target, drafter = markov

    drawn = Rewritten(drafter, lambda p: Proposal(p.tokens, p.probs, p.probs.gather(1, p.tokens[:, None])[:, 0]))
    warp, counts = Warp(temperature=1.0), {}
    for seed in range(DRAWS):
        res = speculative_decode(target, drawn, PROMPT, k=3, max_new_tokens=3, warp=warp, seed=seed, min_confidence=0.15)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
    assert pooled_chi2(counts, sequence_law(target.model.table.exp(), PROMPT, 3, warp)) < 1e-6


def test_confidence_gate_counts_the_leading_drafts_above_the_threshold():
    from draftsmith.decode.rounds import gate

    c = torch.tensor([0.9, 0.5, 0.9, 0.1])  # running products 0.9, 0.45, 0.405, 0.0405
    assert [gate(c, t) for t in (0.0, 0.5, 0.45, 0.4, 0.05, 0.95)] == [4, 1, 2, 3, 3, 0]
    assert gate(torch.tensor([0.2, 1.0]), 0.3) == 0  # a later confident draft cannot revive the chain


def test_markov_check_has_power_against_a_wrong_q(markov):
    """A drafter that reports a q other than the one it sampled from biases the output; the same check sees it."""
    target, drafter = markov

    lying = Rewritten(drafter, lambda p: Proposal(p.tokens, torch.full_like(p.probs, 1.0 / V)))
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(DRAWS):
        res = speculative_decode(target, lying, PROMPT, k=2, max_new_tokens=3, warp=Warp(temperature=1.0), seed=seed)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
    assert pooled_chi2(counts, sequence_law(target.model.table.exp(), PROMPT, 3, Warp(temperature=1.0))) < 1e-6


def test_markov_same_seed_same_output_different_seeds_differ(markov):
    target, drafter = markov
    cfg = dict(k=3, max_new_tokens=24, warp=Warp(temperature=1.0))
    outs = [speculative_decode(target, drafter, PROMPT, seed=s, **cfg).tokens for s in (5, 5, 6, 7, 8, 9)]
    assert outs[0] == outs[1]
    assert len({tuple(o) for o in outs[1:]}) >= 4  # short outputs (EOS is likely) may coincide by chance


def test_markov_greedy_matches_argmax_chain(markov):
    target, drafter = markov
    res = speculative_decode(target, drafter, PROMPT, k=3, max_new_tokens=10)
    t = target.model.table
    prev, cur, ref = PROMPT[-2], PROMPT[-1], []
    for _ in range(10):
        nxt = int(t[prev, cur].argmax())
        ref.append(nxt)
        if nxt == EOS:
            break
        prev, cur = cur, nxt
    assert res.tokens == ref


# ------------------------------------------------------------------ tiny random Llamas

PROMPT_IDS = [1, 520, 33, 9004, 77, 1201, 45, 3000]


def make_target(tokenizer, layers: int = 4, seed: int = 0, eos: int | None = None) -> Target:
    """A tiny Llama re-initialized with larger weights: its greedy output varies (the default
    init repeats one token), and its first 3 layers draft it with partial acceptance."""
    model = tiny_llama(layers=layers, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3, generator=gen)
    if eos is not None:
        model.generation_config.eos_token_id = eos
    return Target(model, tokenizer, name="tiny")


def reference(target: Target, n: int) -> list[int]:
    """Target's greedy continuation ignoring EOS (for scripting drafters past it)."""
    saved = target.model.generation_config.eos_token_id
    target.model.generation_config.eos_token_id = None
    try:
        out = target.model.generate(torch.tensor([PROMPT_IDS]), attention_mask=torch.ones(1, len(PROMPT_IDS), dtype=torch.long),
                                    max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    finally:
        target.model.generation_config.eos_token_id = saved
    return out[0, len(PROMPT_IDS):].tolist()


class ScriptedDrafter:
    """Proposes the target's own greedy continuation, corrupted at position ``pattern[r]`` in round r.

    So round r accepts exactly min(pattern[r], k') drafts; q is one-hot (the drafts are
    "sampled" from it), which keeps the sampling path lossless too.
    """

    feature_layers = ()

    def __init__(self, ref: list[int], pattern: list[int], vocab: int):
        self.ref, self.pattern, self.vocab = ref, pattern, vocab

    def reset(self):
        self.committed: list[int] = []
        self.round = 0

    def update(self, tokens, features):
        self.committed += tokens.tolist()

    def propose(self, k, warp, generator):
        pos = len(self.committed) - len(PROMPT_IDS)
        drafts = list(self.ref[pos: pos + k])
        want = self.pattern[self.round % len(self.pattern)]
        self.round += 1
        if want < len(drafts):
            drafts[want] = (drafts[want] + 1) % self.vocab
        tokens = torch.tensor(drafts, dtype=torch.long)
        probs = None if warp.greedy else torch.nn.functional.one_hot(tokens, self.vocab).float()
        return Proposal(tokens, probs)


def expected_rounds(pattern: list[int], k: int, max_new: int) -> list[tuple[int, int]]:
    """(proposed, accepted) per round for the scripted drafter, without EOS."""
    rounds, have, r = [], 1, 0
    while have < max_new:
        kr = min(k, max_new - have - 1)
        n = min(pattern[r % len(pattern)], kr) if kr > 0 else 0
        if kr > 0:
            r += 1
        rounds.append((kr, n))
        have += n + 1
    return rounds


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    target = make_target(smollm2_tokenizer)
    return target, reference(target, 40)


def test_greedy_identity_with_layer_skip_and_standalone_drafters(tiny):
    target, ref = tiny
    drafters = (layer_skip_drafter(target.model, 3, share_cache=True), layer_skip_drafter(target.model, 1, share_cache=True),
                layer_skip_drafter(target.model, 3), HFDrafter(tiny_llama(layers=2, seed=1)))
    expected = target_greedy(target, PROMPT_IDS, 30)
    assert expected == ref[:30]
    for drafter in drafters:
        for k in (1, 4):
            res = speculative_decode(target, drafter, PROMPT_IDS, k=k, max_new_tokens=30)
            assert res.tokens == expected
    for threshold in (0.01, 0.5, 0.99):  # the confidence gate: fewer drafts verified, the same output
        res = speculative_decode(target, drafters[-1], PROMPT_IDS, k=4, max_new_tokens=30, min_confidence=threshold)
        assert res.tokens == expected


def test_a_gated_chain_stops_drafting_where_the_gate_cuts_and_decodes_the_same(tiny):
    """set_gate: the drafter skips the draft steps the gate would drop — the same tokens and the same
    verified drafts, fewer drafter forwards."""
    target, ref = tiny
    drafter = HFDrafter(tiny_llama(layers=2, seed=1))
    calls = []
    drafter.model.register_forward_hook(lambda *_: calls.append(1))
    runs = {}
    for stop in (False, True):
        if not stop:
            drafter.set_gate = lambda threshold: None  # the hook switched off: every chain drafts all k
        else:
            del drafter.set_gate
        calls.clear()
        res = speculative_decode(target, drafter, PROMPT_IDS, k=4, max_new_tokens=30, min_confidence=0.5)
        runs[stop] = (res.tokens, res.stats.drafted, res.stats.accepted, res.stats.rounds, len(calls))
    assert runs[True][0] == runs[False][0] == ref[:30]
    assert runs[True][1:4] == runs[False][1:4]  # the same drafts verified and accepted, round for round
    assert runs[True][4] < runs[False][4]  # fewer drafter forwards
    assert drafter.stop_below == 0.5
    drafter.reset()
    assert drafter.stop_below == 0.0  # a direct caller of propose (the report) drafts ungated


def test_metrics_arithmetic_with_known_acceptance(tiny, smollm2_tokenizer):
    target, ref = tiny
    pattern, k, max_new = [0, 2, 4, 1, 3], 4, 30
    drafter = ScriptedDrafter(ref, pattern, target.vocab_size)
    res = speculative_decode(target, drafter, PROMPT_IDS, k=k, max_new_tokens=max_new)
    assert res.tokens == ref[:max_new]
    rounds = expected_rounds(pattern, k, max_new)
    st = res.stats
    assert st.rounds == len(rounds) and st.target_forwards == len(rounds) + 1  # + the prefill
    assert st.drafted == sum(p for p, _ in rounds) and st.accepted == sum(n for _, n in rounds)
    assert st.new_tokens == max_new == 1 + st.rounds + st.accepted  # prefill token + (accepted + 1) per round
    assert st.tau == pytest.approx((st.accepted + st.rounds) / st.rounds)  # the bonus token counted
    hist = [0] * (k + 1)
    for _, n in rounds:
        hist[n] += 1
    assert st.accept_hist == hist and sum(st.accept_hist) == st.rounds
    assert st.accepted_at == [sum(n > i for _, n in rounds) for i in range(k)]
    assert st.proposed_at == [sum(p > i for p, _ in rounds) for i in range(k)]
    s = st.summary()
    assert s["acceptance_rate"] == pytest.approx(st.accepted / st.drafted, abs=1e-4)
    assert s["acceptance_at_position"] == [round(a / p, 4) for a, p in zip(st.accepted_at, st.proposed_at)]
    assert st.reached_at == [sum(p > i and n >= i for p, n in rounds) for i in range(k)]
    assert s["conditional_acceptance_at_position"] == [round(a / r, 4) for a, r in zip(st.accepted_at, st.reached_at)]
    assert st.eos_rounds == 0
    for key in ("new_tokens", "target_forwards", "tau_with_bonus", "tau_note", "acceptance_rate",
                "acceptance_at_position", "accepted_length_histogram", "tokens_per_s", "wall_s"):
        assert key in s
    assert "bonus" in s["tau_note"]


def test_sampling_with_scripted_drafter_keeps_output_of_target(tiny):
    """One-hot q at the target's greedy tokens, temperature tiny: the output is the greedy one."""
    target, ref = tiny
    drafter = ScriptedDrafter(ref, [1, 3, 0], target.vocab_size)
    res = speculative_decode(target, drafter, PROMPT_IDS, k=3, max_new_tokens=20, warp=Warp(temperature=0.0001))
    assert res.tokens == ref[:20]
    assert res.stats.accepted > 0


@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 12])
def test_max_new_tokens_respected_exactly(tiny, max_new):
    target, ref = tiny
    drafter = ScriptedDrafter(ref, [4], target.vocab_size)  # accepts everything it may
    res = speculative_decode(target, drafter, PROMPT_IDS, k=4, max_new_tokens=max_new)
    assert res.tokens == ref[:max_new] and res.finish_reason == "length"
    assert res.stats.drafted == sum(p for p, _ in expected_rounds([4], 4, max_new))


def _first_new_at(ref: list[int], start: int) -> int:
    """An index ≥ start whose token does not occur earlier in ref (usable as an EOS id)."""
    return next(i for i in range(start, len(ref)) if ref[i] not in ref[:i])


@pytest.mark.parametrize("inside_block", [False, True])
def test_stops_on_eos_even_inside_an_accepted_block(smollm2_tokenizer, tiny, inside_block):
    _, ref = tiny
    j = _first_new_at(ref, 6)
    target = make_target(smollm2_tokenizer, eos=ref[j])
    assert target.eos_token_ids & set(ref[:j]) == set()
    pattern = [4] if inside_block else [0]
    drafter = ScriptedDrafter(ref, pattern, target.vocab_size)
    res = speculative_decode(target, drafter, PROMPT_IDS, k=4, max_new_tokens=30)
    assert res.tokens == ref[: j + 1] and res.finish_reason == "eos"
    # no round after the one that produced EOS
    rounds = expected_rounds(pattern, 4, 30)
    done, used = 1, 0
    for _, n in rounds:
        used += 1
        done += n + 1
        if done > j:
            break
    assert res.stats.rounds == used
    if inside_block:
        assert any(n == 4 and start <= j < start + n for start, n in _round_spans(rounds)), "EOS was not inside a block"


def test_an_eos_inside_an_accepted_block_ends_the_counts_where_the_output_ends(smollm2_tokenizer, tiny):
    """Rounds accept 4, 1, 4, … drafts (k = 4); EOS is ref[10], draft 3 of round 2, and the target
    accepts draft 4 after it too. Only what is emitted counts: round 2 proposed and accepted drafts
    1..3 (8, 9, EOS) and has no bonus token, so τ · rounds = new tokens − the prefill token."""
    _, ref = tiny
    target = make_target(smollm2_tokenizer, eos=ref[10])
    assert ref[10] not in ref[:10]
    res = speculative_decode(target, ScriptedDrafter(ref, [4, 1], target.vocab_size), PROMPT_IDS, k=4,
                             max_new_tokens=30)
    assert res.tokens == ref[:11] and res.finish_reason == "eos"
    st = res.stats
    # round 0: 4/4 + bonus (tokens 1-5); round 1: 1/4 + bonus (6, 7); round 2: drafts 8, 9, EOS of 4 verified
    assert (st.rounds, st.accepted, st.drafted, st.eos_rounds, st.new_tokens) == (3, 8, 12, 1, 11)
    assert st.tau == pytest.approx(10 / 3) and st.tau * st.rounds == pytest.approx(st.new_tokens - 1)
    assert st.proposed_at == [3, 3, 3, 2] and st.accepted_at == [3, 2, 2, 1] and st.reached_at == [3, 3, 2, 1]
    assert st.accept_hist == [0, 1, 0, 1, 1]
    s = st.summary()
    assert s["tau_with_bonus"] == pytest.approx(3.3333, abs=1e-4) and s["acceptance_rate"] == pytest.approx(0.6667)
    assert s["acceptance_at_position"] == [1.0, 0.6667, 0.6667, 0.5]  # cumulative
    assert s["conditional_acceptance_at_position"] == [1.0, 0.6667, 1.0, 1.0]
    assert s["eos_rounds"] == 1


def test_bad_round_counts_are_refused():
    from draftsmith.decode.stats import DecodeStats

    with pytest.raises(ValueError, match="accepted 3 of 2 drafts"):
        DecodeStats(k=4).record_round(2, 3)


def _round_spans(rounds):
    start = 1
    for _, n in rounds:
        yield start, n
        start += n + 1


class FeedLog:
    """Records (start position, tokens) of every forward of a model through its KV cache."""

    def __init__(self, model: torch.nn.Module):
        self.feeds: list[tuple[int, list[int]]] = []
        self.handle = model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, _m, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache")
        self.feeds.append((cache.get_seq_length() if cache is not None else 0, ids[0].tolist()))

    def times_fed(self, seq: list[int], upto: int) -> list[int]:
        """How often each position < upto was fed with the token it finally holds."""
        counts = [0] * upto
        for start, ids in self.feeds:
            for off, tok in enumerate(ids):
                if start + off < upto and seq[start + off] == tok:
                    counts[start + off] += 1
        return counts


def test_no_committed_token_is_fed_twice(tiny):
    target, ref = tiny
    drafter = layer_skip_drafter(target.model, 3)
    t_log, d_log = FeedLog(target.model), FeedLog(drafter.model)
    try:
        res = speculative_decode(target, drafter, PROMPT_IDS, k=3, max_new_tokens=25)
    finally:
        t_log.handle.remove()
        d_log.handle.remove()
    seq = PROMPT_IDS + res.tokens
    assert res.stats.accepted > 0 and res.stats.accepted < res.stats.drafted  # both paths happened
    # every committed position but the last went through the target exactly once
    assert t_log.times_fed(seq, len(seq) - 1) == [1] * (len(seq) - 1)
    assert sum(len(ids) for _, ids in t_log.feeds) == len(PROMPT_IDS) + res.stats.rounds + res.stats.drafted
    # and through the drafter at most once
    assert max(d_log.times_fed(seq, len(seq) - 1)) == 1


class LayerFeeds:
    """Counts the positions that go through one decoder layer."""

    def __init__(self, layer: torch.nn.Module):
        self.tokens = 0
        self.handle = layer.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, _m, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        self.tokens += h.shape[1]


def test_self_speculation_runs_each_verified_position_through_each_layer_once(tiny):
    """Drafting work is reused: layer 0 and the last layer see exactly the tokens a plain verification would."""
    target, ref = tiny
    drafter = layer_skip_drafter(target.model, 3, share_cache=True)
    first, last = LayerFeeds(target.model.model.layers[0]), LayerFeeds(target.model.model.layers[-1])
    try:
        res = speculative_decode(target, drafter, PROMPT_IDS, k=3, max_new_tokens=25)
    finally:
        first.handle.remove()
        last.handle.remove()
    assert res.tokens == ref[:25] and 0 < res.stats.accepted < res.stats.drafted
    plain = len(PROMPT_IDS) + res.stats.rounds + res.stats.drafted  # prefill + (last token + drafts) per round
    assert first.tokens == plain  # drafting through layer 0 IS the verification's layer-0 work
    assert last.tokens == plain


def test_self_speculative_needs_bind(tiny):
    target, _ = tiny
    drafter = layer_skip_drafter(target.model, 3, share_cache=True)
    drafter.update(torch.tensor(PROMPT_IDS), None)
    with pytest.raises(DraftsmithError, match="bind"):
        drafter.propose(2, Warp(), None)


def _cache_tensors(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("share_cache", [False, True])
def test_caches_equal_a_fresh_forward_after_rollbacks(tiny, share_cache):
    """After every round, target and drafter caches hold exactly what a fresh forward over the committed tokens gives.

    With ``share_cache`` the drafter writes into the target's cache (first 3 of 4 layers) and the
    verification reuses its states; the cache must still equal a plain forward's.
    """
    target, ref = tiny
    drafter = layer_skip_drafter(target.model, 3, share_cache=share_cache)
    assert isinstance(drafter, SelfSpeculativeDrafter) == share_cache
    caches = []
    new_cache = target.new_cache
    checked = []

    def spy_cache():
        caches.append(new_cache())
        return caches[-1]

    update = drafter.update

    def checked_update(tokens, features):
        update(tokens, features)
        cache = caches[0]  # the decoder's (one decode, one cache)
        n = cache.get_seq_length()
        committed = drafter.tokens
        assert n == len(committed) - 1  # every committed token but the last (fed at the next round)
        fresh = new_cache()
        target.forward(torch.tensor([committed[:n]]), fresh)
        for a, b in zip(_cache_tensors(cache), _cache_tensors(fresh)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)  # fp32: batched vs one-by-one sums
        m = 0 if share_cache else drafter.cache.get_seq_length()
        if m > 0:  # the drafter fills its cache lazily, at its first proposal
            dc = DynamicCache(config=drafter.model.config)
            drafter.model(input_ids=torch.tensor([committed[:m]]), cache=dc, use_cache=True)
            for a, b in zip(_cache_tensors(drafter.cache), _cache_tensors(dc)):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)  # fp32: batched vs one-by-one sums
        checked.append(n)

    target.new_cache = spy_cache
    drafter.update = checked_update
    try:
        res = speculative_decode(target, drafter, PROMPT_IDS, k=3, max_new_tokens=20)
    finally:
        del target.new_cache
    assert res.tokens == ref[:20] and len(caches) == 1
    assert len(checked) >= res.stats.rounds  # checked after the prefill and after every round
    assert res.stats.drafted > res.stats.accepted  # rejections (rollbacks) happened


@pytest.mark.parametrize("share_cache", [False, True])
def test_sampled_decoding_is_reproducible_and_seed_dependent(tiny, share_cache):
    target, _ = tiny
    drafter = layer_skip_drafter(target.model, 3, share_cache=share_cache)
    runs = {}
    for seed in (3, 3, 4):
        cfg = dict(k=3, max_new_tokens=20, warp=Warp(temperature=1.0, top_p=0.95), seed=seed)
        runs.setdefault(seed, []).append(speculative_decode(target, drafter, PROMPT_IDS, **cfg).tokens)
    assert runs[3][0] == runs[3][1]
    assert runs[3][0] != runs[4][0]


# ------------------------------------------------------------------ bad input


def test_prompt_longer_than_context_is_a_clear_error(tiny):
    target, _ = tiny
    drafter = layer_skip_drafter(target.model, 3)
    with pytest.raises(DraftsmithError, match="exceeds the target's context of 512 positions; shorten the prompt"):
        speculative_decode(target, drafter, [5] * 500, k=2, max_new_tokens=20)
    with pytest.raises(DraftsmithError, match="empty"):
        speculative_decode(target, drafter, [], k=4, max_new_tokens=128)


@pytest.mark.parametrize("field,value,match", [
    ("k", 0, "decode.k = 0"), ("k", -2, "at least 1"), ("max_new_tokens", 0, "max_new_tokens"),
    ("temperature", -1.0, "temperature"), ("top_p", 0.0, "top_p"), ("top_k", -1, "top_k"),
])
def test_bad_decode_values(tiny, field, value, match):
    """The recipe's decode section names the bad key; the decoder itself refuses a bad k or max_new_tokens too."""
    target, _ = tiny
    with pytest.raises(ConfigError, match=match):
        DecodeConfig(**{field: value}).validate()
    if field in ("k", "max_new_tokens"):
        with pytest.raises(DraftsmithError, match=f"{field} = {value}"):
            speculative_decode(target, layer_skip_drafter(target.model, 3), PROMPT_IDS,
                               **{"k": 2, "max_new_tokens": 5, field: value})


def test_drafter_without_probs_in_sampling_mode_is_a_clear_error(tiny):
    target, ref = tiny

    class NoProbs(ScriptedDrafter):
        def propose(self, k, warp, generator):
            return Proposal(super().propose(k, warp, generator).tokens, None)

    with pytest.raises(DraftsmithError, match="warped distributions"):
        speculative_decode(target, NoProbs(ref, [1], target.vocab_size), PROMPT_IDS,
                           k=2, max_new_tokens=5, warp=Warp(temperature=1.0))


def test_all_outcomes_enumerated():
    """The enumerated law is a distribution (guards the reference used by the chi-square tests)."""
    law = sequence_law(random_table(1), PROMPT, 3, Warp(temperature=1.0, top_k=3))
    assert sum(law.values()) == pytest.approx(1.0)
    assert all(s[-1] == EOS or len(s) == 3 for s in law)
    assert max(len(s) for s in law) == 3 and any(len(s) < 3 for s in law)
    assert set(itertools.chain.from_iterable(law)) <= set(range(V))
