"""Model-free drafters (prompt lookup, suffix decoding, hybrid) and the family registry.

* The suffix trie's counts equal brute-force substring counts, and building it token by token
  equals building it at once; proposals on known strings are exact.
* Prompt lookup proposes exactly what HF transformers' PromptLookupCandidateGenerator does.
* In sampled mode the suffix and hybrid drafters keep the target's exact sequence law (the toy
  Markov chi-square check of test_decoder.py).
* The registry: one spec per family, the Protocol contract checked, the train recipes resolved.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from typing import Literal

import pytest
import torch

from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.sampling import Warp
from draftsmith.decode.tree import DynamicTree, tree_decode
from draftsmith.drafters.hf_lm import HFDrafter
from draftsmith.drafters.hybrid import HybridDrafter
from draftsmith.drafters.model_free import Continuation, to_proposal
from draftsmith.drafters.prompt_lookup import PromptLookupDrafter
from draftsmith.drafters.suffix import SuffixDrafter, SuffixTrie, build_corpus, read_corpus
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.target import Target

from .test_decode_tree import MarkovTreeDrafter
from .test_decoder import DRAWS, V, MarkovLM, ToyTokenizer, pooled_chi2, random_table, sequence_law

GREEDY = Warp()


def strings_of(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every node's string → count, by walking the trie."""
    out: dict[tuple[int, ...], int] = {}

    def walk(node: int, prefix: tuple[int, ...]) -> None:
        for c in trie.kids[node]:
            s = prefix + (trie.token_of(c),)
            out[s] = trie.count[c]
            walk(c, s)

    walk(0, ())
    return out


def brute_counts(docs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    c: Counter = Counter()
    for doc in docs:
        for i in range(len(doc)):
            for n in range(1, depth + 1):
                if i + n <= len(doc):
                    c[tuple(doc[i:i + n])] += 1
    return dict(c)


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)


# ---------------------------------------------------------------- suffix trie


def test_suffix_trie_counts_equal_substring_counts():
    rng = random.Random(0)
    docs = [[rng.randrange(4) for _ in range(rng.randrange(1, 40))] for _ in range(5)]
    trie = build_corpus(docs, max_depth=6, vocab_size=4)
    assert strings_of(trie) == brute_counts(docs, 6)
    assert (2, 3) not in strings_of(build_corpus([[1, 2], [3, 4]], 4, 5))  # no suffix crosses two documents


def test_suffix_trie_incremental_update_equals_rebuild():
    rng = random.Random(1)
    seq = [rng.randrange(6) for _ in range(200)]
    whole = SuffixTrie(8, 6)
    whole.extend(seq)
    pieces = SuffixTrie(8, 6)
    i = 0
    while i < len(seq):
        n = rng.randrange(1, 7)
        pieces.extend(seq[i:i + n])
        i += n
    assert strings_of(pieces) == strings_of(whole) == brute_counts([seq], 8)
    assert pieces.active == whole.active


def test_suffix_follow_tracks_the_context_in_a_corpus():
    trie = build_corpus([[5, 1, 2, 3, 9]], 6, 10)
    matched: list[int] = []
    for t in (7, 1, 2):
        matched = trie.follow(matched, t)
    assert [trie.depth[n] for n in matched] == [1, 2]  # "2" and "1 2"; "7 1 2" is not in the corpus
    assert trie.count[matched[-1]] == 1


def test_suffix_proposes_the_most_frequent_continuation_of_the_longest_match():
    d = SuffixDrafter(vocab_size=10, max_depth=16, max_spec_factor=2.0, min_prob=0.0)
    d.reset()
    d.update(ids(5, 1, 7, 5, 1, 7, 5, 1, 8, 2, 5, 1))
    cont = d.continuations(k=8)[0]
    # longest suffix seen before with a continuation: "5 1" (3 earlier times: → 7, 7, 8) — "2 5 1" is new
    assert cont.match_length == 2 and cont.tokens == [7, 5, 1, 7]  # limit 2 × 2 = 4 tokens
    assert cont.confidence == pytest.approx(2 / 4)  # count("5 1 7") / count("5 1"), the current occurrence counted
    assert d.propose(8, GREEDY, None).tokens.tolist() == [7, 5, 1, 7]


def test_suffix_draft_length_bounded_by_confidence_and_match_length():
    d = SuffixDrafter(vocab_size=10, max_depth=16, max_spec_factor=1.0, min_prob=0.3)
    d.reset()
    d.update(ids(1, 2, 3, 4, 1, 2, 3, 6, 1, 2, 3))
    cont = d.continuations(k=8)[0]
    # match "1 2 3" (depth 3): children 4 and 6 once each, p = 1/3 each; 1/3 ≥ 0.3 then 1/3 · 1 stays ≥ 0.3
    assert cont.match_length == 3 and cont.tokens == [4, 1, 2]  # α·m = 3 tokens
    d.min_prob = 0.4
    assert d.continuations(k=8) == []  # the first step is already below min_prob


def test_suffix_corpus_drafts_and_request_resets():
    corpus = build_corpus([[9, 8, 7, 6, 5, 4]], 12, 10)
    d = SuffixDrafter(vocab_size=10, max_depth=12, max_spec_factor=4.0, min_prob=0.1, corpus=corpus)
    d.reset()
    d.update(ids(1, 2, 9, 8))
    best = d.continuations(k=3)[0]
    assert (best.source, best.tokens, best.confidence) == ("corpus", [7, 6, 5], 1.0)
    d.reset()
    d.update(ids(3, 1, 2))
    assert d.continuations(k=3) == []  # the last sequence's "1 2 9 8" is gone; the corpus has no "2"


def test_suffix_grow_corpus_adds_finished_outputs():
    d = SuffixDrafter(vocab_size=10, max_depth=8, max_spec_factor=4.0, min_prob=0.0, grow_corpus=True)
    d.reset()
    d.update(ids(1, 2, 3, 4))  # prompt 1 2 3, first output token 4
    d.update(ids(5, 6))
    d.reset()  # output 4 5 6 joins the corpus, the prompt does not
    d.update(ids(7, 4, 5))
    assert d.continuations(k=2)[0].tokens == [6]
    assert (1, 2) not in strings_of(d.corpus)


def test_sampled_proposal_q_is_the_empirical_distribution():
    cont = Continuation([7, 3], confidence=0.5, dists=[([7, 8], [2.0, 1.0]), ([3], [1.0])])
    q = to_proposal(cont, 10, greedy=False, device=torch.device("cpu")).probs
    assert q.shape == (2, 10) and torch.allclose(q.sum(-1), torch.ones(2))
    assert q[0, 7] == pytest.approx(2 / 3) and q[0, 8] == pytest.approx(1 / 3) and q[1, 3] == 1.0
    point = to_proposal(Continuation([4], confidence=1.0), 10, greedy=False, device=torch.device("cpu")).probs
    assert point.tolist() == [[0.0] * 4 + [1.0] + [0.0] * 5]


def test_read_corpus_formats(tmp_path, smollm2_tokenizer):
    f = tmp_path / "c.jsonl"
    f.write_text('{"tokens": [1, 2, 3]}\n{"text": "hello world"}\n'
                 '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "an answer"}]}\n')
    docs = read_corpus(str(f), smollm2_tokenizer)
    assert docs == [[1, 2, 3], smollm2_tokenizer.encode("hello world", add_special_tokens=False),
                    smollm2_tokenizer.encode("an answer", add_special_tokens=False)]
    (tmp_path / "bad.jsonl").write_text('{"other": 1}\n')
    with pytest.raises(DraftsmithError, match="none of"):
        read_corpus(str(tmp_path / "bad.jsonl"), smollm2_tokenizer)
    with pytest.raises(DraftsmithError, match="does not exist"):
        read_corpus(str(tmp_path / "missing.jsonl"), smollm2_tokenizer)


# ---------------------------------------------------------------- prompt lookup


@pytest.mark.parametrize("max_ngram,num", [(2, 10), (3, 4), (1, 6)])
def test_prompt_lookup_proposes_what_hf_proposes(max_ngram, num):
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    eos = 5
    rng = random.Random(max_ngram * 100 + num)
    proposed = 0
    for trial in range(40):
        seq = [rng.randrange(6 if trial % 2 else 4) for _ in range(rng.randrange(2, 60))]
        hf = PromptLookupCandidateGenerator(eos_token_id=torch.tensor([eos]), num_output_tokens=num,
                                            max_matching_ngram_size=max_ngram, max_length=1000)
        out, _ = hf.get_candidates(torch.tensor([seq]))
        expected = out[0, len(seq):].tolist()
        d = PromptLookupDrafter(vocab_size=6, eos={eos}, max_ngram=max_ngram, min_ngram=1)
        d.reset()
        cut = rng.randrange(1, len(seq) + 1)  # fed in two updates: the index is incremental
        d.update(torch.tensor(seq[:cut]))
        d.update(torch.tensor(seq[cut:]))
        assert d.propose(num, GREEDY, None).tokens.tolist() == expected, seq
        proposed += bool(expected)
    assert proposed > 20  # most trials propose something (and some cut before EOS or find nothing)


def test_prompt_lookup_latest_and_min_ngram():
    d = PromptLookupDrafter(vocab_size=10, eos=set(), max_ngram=2, min_ngram=2, match="latest")
    d.reset()
    d.update(ids(1, 2, 3, 1, 2, 4, 0, 1, 2))
    assert d.propose(2, GREEDY, None).tokens.tolist() == [4, 0]  # the most recent "1 2" (earliest: 3 1)
    d.reset()
    d.update(ids(7, 1, 9, 1))
    assert d.propose(2, GREEDY, None).tokens.tolist() == []  # only a 1-gram matches; min_ngram = 2


# ---------------------------------------------------------------- sampled mode keeps the target's law


MARKOV_PROMPT = [1, 2, 3, 1, 2, 0, 1, 2, 3, 1, 3, 2, 1, 2]
LENGTH = 4  # new tokens: rounds after the first may draft 2 (max_new_tokens caps each round)


@pytest.fixture(scope="module")
def markov_target():
    return Target(MarkovLM(random_table(1)), ToyTokenizer(), name="markov")


def markov_corpus(target: Target, n: int = 60) -> SuffixTrie:
    """Samples of the target itself, so the corpus's empirical distributions resemble p."""
    docs = [speculative_decode(target, SuffixDrafter(V), MARKOV_PROMPT, k=1, max_new_tokens=12,
                               warp=Warp(temperature=1.0), seed=1000 + s).tokens for s in range(n)]
    return build_corpus(docs, 8, V)


def law_check(target: Target, drafter, warp: Warp, k: int) -> tuple[float, int]:
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(DRAWS):
        res = speculative_decode(target, drafter, MARKOV_PROMPT, k=k, max_new_tokens=LENGTH, warp=warp, seed=seed)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
        accepted += res.stats.accepted
    return pooled_chi2(counts, sequence_law(target.model.table.exp(), MARKOV_PROMPT, LENGTH, warp)), accepted


@pytest.mark.parametrize("warp,corpus", [(Warp(temperature=1.0), True), (Warp(temperature=1.0), False),
                                         (Warp(temperature=0.7, top_p=0.8), True)])
def test_suffix_sampled_keeps_the_exact_sequence_law(markov_target, warp, corpus):
    drafter = SuffixDrafter(V, max_depth=8, max_spec_factor=2.0, min_prob=0.05,
                            corpus=markov_corpus(markov_target) if corpus else None)
    pvalue, accepted = law_check(markov_target, drafter, warp, k=3)
    assert accepted > DRAWS // 10
    assert drafter.counts.rounds.get("corpus" if corpus else "request", 0) > DRAWS // 2
    assert max(drafter.counts.drafted.values()) > max(drafter.counts.rounds.values())  # some rounds drafted ≥ 2
    assert pvalue > 1e-3


def test_hybrid_sampled_keeps_the_exact_sequence_law(markov_target):
    lookup = SuffixDrafter(V, max_depth=8, max_spec_factor=2.0, min_prob=0.05)  # request only: confidence varies
    hybrid = HybridDrafter(HFDrafter(MarkovLM(random_table(2, second_order=False))), lookup, min_confidence=0.55)
    pvalue, accepted = law_check(markov_target, hybrid, Warp(temperature=1.0), k=2)
    assert accepted > DRAWS // 10
    assert hybrid.counts.rounds["model"] > DRAWS // 5 and hybrid.counts.rounds["lookup"] > DRAWS // 20  # both drafted
    assert pvalue > 1e-3


def test_hybrid_in_tree_decoding_keeps_the_exact_sequence_law(markov_target):
    """Per tree round the lookup's chain or the model's gated tree: both kinds of round, sampled, exact."""
    lookup = SuffixDrafter(V, max_depth=8, max_spec_factor=2.0, min_prob=0.05)
    hybrid = HybridDrafter(MarkovTreeDrafter(random_table(2, second_order=False)), lookup, min_confidence=0.55)
    shape = DynamicTree(depth=2, top_k=2, budget=4)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(DRAWS):
        res = tree_decode(markov_target, hybrid, MARKOV_PROMPT, tree=shape, max_new_tokens=LENGTH,
                          warp=Warp(temperature=1.0), seed=seed, min_confidence=0.1)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
        accepted += res.stats.accepted
    assert accepted > DRAWS // 10
    assert hybrid.counts.rounds["model"] > DRAWS // 5 and hybrid.counts.rounds["lookup"] > DRAWS // 20
    assert hybrid.model.trees >= hybrid.counts.rounds["model"]  # the model's rounds were its trees
    law = sequence_law(markov_target.model.table.exp(), MARKOV_PROMPT, LENGTH, Warp(temperature=1.0))
    assert pooled_chi2(counts, law) > 1e-3


def test_suffix_with_a_wrong_q_fails_the_same_check(markov_target):
    """Power: reporting a uniform q for drafts that were sampled from the empirical distribution biases the law.

    (A point-mass claim would not do: accepting x with probability p(x) and otherwise sampling p without x is
    exact for any q — the test must lie in a way that changes the acceptance of the drafted tokens.)"""
    class UniformLiar(SuffixDrafter):
        def propose(self, k, warp, generator):
            prop = super().propose(k, warp, generator)
            if prop.probs is not None and prop.probs.shape[0]:
                prop.probs = torch.full_like(prop.probs, 1.0 / V)
            return prop

    liar = UniformLiar(V, max_depth=8, max_spec_factor=2.0, min_prob=0.05, corpus=markov_corpus(markov_target))
    pvalue, _ = law_check(markov_target, liar, Warp(temperature=1.0), k=3)
    assert pvalue < 1e-6


# ---------------------------------------------------------------- the registry


def test_every_family_has_one_spec_that_meets_its_protocol():
    from draftsmith import drafters
    from draftsmith.drafters.registry import FamilyConfig, TrainableConfig, missing_members, specs
    from draftsmith.train.run import recipes

    table = specs()
    assert set(table) == {"layer_skip", "hf", "draft_lm", "eagle1", "eagle3", "medusa", "dflash", "dflash2", "peagle", "prompt_lookup",
                          "suffix", "hybrid", "saved"}
    assert set(drafters.families()) == set(table)
    assert {n for n, s in table.items() if s.trainable} == set(recipes()) == {"draft_lm", "eagle1", "eagle3", "medusa", "dflash", "dflash2", "peagle"}
    assert {n for n, s in table.items() if s.model_free} == {"prompt_lookup", "suffix"}
    for s in table.values():
        assert missing_members(s.config, TrainableConfig if s.trainable else FamilyConfig) == []
        assert isinstance(s.config(), FamilyConfig)
    assert all(callable(m.train) for m in recipes().values())
    from draftsmith.train.config import FAMILY_KEYS  # each recipe names the family keys it reads; each key has a reader
    assert all(set(m.READS) <= set(FAMILY_KEYS) for m in recipes().values())
    assert set(FAMILY_KEYS) == {key for m in recipes().values() for key in m.READS}


def test_a_spec_that_breaks_the_contract_is_refused():
    from draftsmith.drafters.registry import FamilySpec

    @dataclasses.dataclass
    class NoBuild:
        type: Literal["nobuild"] = "nobuild"

    @dataclasses.dataclass
    class Untrainable:
        type: Literal["untrainable"] = "untrainable"

        def build(self, target):
            return None

    with pytest.raises(TypeError, match="lacks build"):
        FamilySpec(NoBuild)
    with pytest.raises(TypeError, match="build_module"):
        FamilySpec(Untrainable, recipe="some.module")
    assert FamilySpec(Untrainable).name == "untrainable"


def test_hybrid_and_baseline_configs_are_checked():
    from draftsmith.config import load_recipe
    from draftsmith.drafters.registry import model_free_config

    r = load_recipe(None, ["drafter.type=hybrid", "drafter.drafter.type=eagle3", "drafter.lookup.type=suffix",
                           "drafter.lookup.max_depth=12"])
    assert r.drafter.lookup.max_depth == 12 and r.drafter.drafter.type == "eagle3"
    # each part is parsed as the named section the registry defines for it: the valid types are listed
    with pytest.raises(ConfigError, match=r"'drafter.lookup.type' = 'eagle3' is not valid; choose one of: "
                                          r"prompt_lookup, suffix$"):
        load_recipe(None, ["drafter.type=hybrid", "drafter.lookup.type=eagle3"])
    models = "layer_skip, hf, draft_lm, eagle1, eagle3, medusa"
    with pytest.raises(ConfigError, match=rf"'drafter.drafter.type' = 'suffix' is not valid; choose one of: {models}"):
        load_recipe(None, ["drafter.type=hybrid", "drafter.drafter.type=suffix"])
    with pytest.raises(ConfigError, match="'drafter.drafter.type' = 'hybrid' is not valid"):
        load_recipe(None, ["drafter.type=hybrid", "drafter.drafter.type=hybrid"])
    # a config built in code is checked by validate, against the same sections
    from draftsmith.drafters import Eagle3Config, HybridConfig, PromptLookupConfig
    with pytest.raises(ConfigError, match="the hybrid's lookup must be model-free; choose one of: prompt_lookup, suffix$"):
        HybridConfig(lookup=Eagle3Config()).validate()
    with pytest.raises(ConfigError, match=rf"drafter.drafter.type = 'prompt_lookup': the hybrid's drafter must be a model; "
                                          rf"choose one of: {models}"):
        HybridConfig(drafter=PromptLookupConfig()).validate()
    with pytest.raises(ConfigError, match="lookup.max_depth' = 'x'|must be an integer"):
        load_recipe(None, ["drafter.type=hybrid", "drafter.lookup.type=suffix", "drafter.lookup.max_depth=x"])
    with pytest.raises(ConfigError, match="cannot be a baseline"):
        model_free_config("eagle3")
    with pytest.raises(ConfigError, match="not a drafter family"):
        model_free_config("nope")


def test_hybrid_refuses_a_drafter_inside_the_targets_cache(tiny_target):
    from draftsmith.config import load_recipe

    recipe = load_recipe(None, ["drafter.type=hybrid", "drafter.drafter.type=layer_skip", "drafter.drafter.num_layers=1"])
    with pytest.raises(ConfigError, match="share_cache=false"):
        recipe.drafter.build(tiny_target)
    recipe = load_recipe(None, ["drafter.type=hybrid", "drafter.drafter.type=layer_skip", "drafter.drafter.num_layers=1",
                                "drafter.drafter.share_cache=false"])
    assert isinstance(recipe.drafter.build(tiny_target), HybridDrafter)


# ---------------------------------------------------------------- the copy-heavy prompt set


def test_copyheavy_set_is_what_its_builder_writes():
    from draftsmith.measure import copyheavy
    from draftsmith.measure.prompts import load_questions

    with open(copyheavy.SHIPPED, encoding="utf-8") as f:
        assert f.read() == copyheavy.render(copyheavy.build())
    qs = load_questions("copyheavy")
    assert len(qs) == 24 and qs[0].id == "copy-001"
    assert {q.category.split("-")[0] for q in qs} == {"code", "text"}
    assert all("```" in q.turns[0] for q in qs if q.category.startswith("code"))
