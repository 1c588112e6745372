"""Tree decoding (decode/tree.py): exact sampling law, greedy identity, cache compaction, stats.

* The toy second-order Markov LM of test_decoder.py is the target (its forward reads a 4-D tree
  mask: a node's predecessor is the last row it attends, so a wrong mask or a wrongly compacted
  cache changes the output law); a first-order Markov drafter drafts trees through the production
  ``build_tree`` (static trees with i.i.d. or distinct children, EAGLE-2 dynamic trees). Sampled
  outputs are chi-squared against the exact sequence law; a deliberately wrong residual update
  (SpecInfer's q-unchanged rule on children drawn without replacement) fails the same check.
* Tiny random Llamas check greedy identity with the EAGLE-1 / EAGLE-3 / Medusa tree runtimes and
  chain drafters, and that after every round the target's cache equals a fresh forward over the
  committed tokens, with a scripted drafter whose accepted paths leave the first branch.
"""

from __future__ import annotations

import pytest
import torch

from draftsmith.decode import tree as tree_mod
from draftsmith.decode.sampling import Warp
from draftsmith.decode.tree import (
    DraftTree,
    DynamicTree,
    StaticTree,
    build_tree,
    tree_attention_mask,
    tree_decode,
    tree_position_ids,
    verify_greedy,
    with_chain,
)
from draftsmith.drafters.eagle1 import Eagle1Config
from draftsmith.drafters.eagle3 import Eagle3Config
from draftsmith.drafters.hf_lm import HFDrafter
from draftsmith.drafters.hybrid import HybridDrafter
from draftsmith.drafters.layer_skip import layer_skip_drafter
from draftsmith.drafters.medusa import MedusaConfig
from draftsmith.drafters.prompt_lookup import PromptLookupDrafter
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.measure.config import DecodeConfig
from draftsmith.decode.reference import target_greedy
from draftsmith.target import Target

from .conftest import tiny_llama
from .test_decoder import (
    PROMPT,
    PROMPT_IDS,
    V,
    MarkovLM,
    ScriptedDrafter,
    ToyTokenizer,
    make_target,
    pooled_chi2,
    random_table,
    reference,
    sequence_law,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ the tree itself


def hand_tree() -> DraftTree:
    #   root ─ a(0) ─ c(2) ─ d(3)
    #        └ b(1) ─ e(4)
    return DraftTree(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, -1, 0, 2, 1]), None)


def test_mask_positions_and_children_of_a_hand_tree():
    t = hand_tree()
    assert t.depths() == [1, 1, 2, 3, 2]
    assert t.children() == [[0, 1], [2], [4], [3], [], []]
    mask = tree_attention_mask(t, past=3, dtype=torch.float32, device=torch.device("cpu"))
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 1, 1, 1, 0, 0, 0, 0, 0],  # root t: the cache and itself
        [1, 1, 1, 1, 1, 0, 0, 0, 0],  # a
        [1, 1, 1, 1, 0, 1, 0, 0, 0],  # b
        [1, 1, 1, 1, 1, 0, 1, 0, 0],  # c: t, a, c
        [1, 1, 1, 1, 1, 0, 1, 1, 0],  # d: t, a, c, d
        [1, 1, 1, 1, 0, 1, 0, 0, 1],  # e: t, b, e
    ]
    assert tree_position_ids(t, 3, torch.device("cpu")).tolist() == [[3, 4, 4, 5, 6, 5]]
    # greedy: the argmax per row (root, a, b, c, d, e) decides the path
    assert verify_greedy(t, torch.tensor([11, 0, 14, 0, 0, 7])) == ([1, 4], 7)  # b, e, then e's argmax
    assert verify_greedy(t, torch.tensor([10, 12, 0, 13, 9, 0])) == ([0, 2, 3], 9)
    assert verify_greedy(t, torch.tensor([5, 0, 0, 0, 0, 0])) == ([], 5)
    cut = t.truncated(2)
    assert cut.tokens.tolist() == [10, 11, 12, 14] and cut.parents.tolist() == [-1, -1, 0, 1]


def test_a_chain_grafted_onto_a_tree_shares_the_nodes_it_matches():
    t = hand_tree()
    g = with_chain(t, torch.tensor([10, 12, 7, 8]))  # follows a, c, then leaves the tree under c
    assert g.tokens.tolist() == [10, 11, 12, 13, 14, 7, 8] and g.parents.tolist() == [-1, -1, 0, 2, 1, 2, 5]
    assert verify_greedy(g, torch.tensor([10, 12, 0, 7, 0, 0, 8, 3])) == ([0, 2, 5, 6], 3)  # the grafted path
    g = with_chain(t, torch.tensor([9]))  # a new child of the root, after the tree's nodes
    assert g.tokens.tolist() == [10, 11, 12, 13, 14, 9] and g.parents.tolist() == [-1, -1, 0, 2, 1, -1]
    assert with_chain(t, torch.tensor([11, 14])).tokens.tolist() == t.tokens.tolist()  # already in the tree
    with pytest.raises(DraftsmithError, match="greedy"):
        with_chain(DraftTree(t.tokens, t.parents, torch.zeros(6, 16)), torch.tensor([9]))


@pytest.mark.parametrize("paths,match", [
    ([[0, 0]], "no parent path"), ([[0], [2]], "elder sibling"), ([], "at least one"), ([[0], [0]], "distinct"),
])
def test_bad_static_trees_are_refused(paths, match):
    with pytest.raises(DraftsmithError, match=match):
        StaticTree.named_or_given(paths)


def test_recipe_tree_settings():
    assert DecodeConfig().tree_shape() is None
    assert DecodeConfig(tree="static").tree_shape().size == 16
    assert DecodeConfig(tree="dynamic", tree_depth=3, tree_top_k=2, tree_budget=5).tree_shape() == DynamicTree(3, 2, 5)
    assert DecodeConfig(tree="dynamic", tree_depth=3).depth == 3 and DecodeConfig(k=6).depth == 6
    with pytest.raises(ConfigError, match="decode.tree_paths.*elder sibling"):
        DecodeConfig(tree="static", tree_paths=[[1]]).validate()
    with pytest.raises(ConfigError, match="unknown static tree 'nope'"):
        DecodeConfig(tree="static", tree_paths="nope").validate()
    with pytest.raises(ConfigError, match="decode.tree_budget = 0"):
        DecodeConfig(tree="dynamic", tree_budget=0).validate()


def test_a_chain_drafter_in_tree_decoding_is_gated_as_in_the_chain_decoder(smollm2_tokenizer):
    """A drafter without propose_tree drafts chains in tree decoding: the dynamic shape's gate cuts them
    (set_gate stops the drafter there), the output stays the target's greedy one, and the nodes verified
    are those the chain decoder verifies at the same gate."""
    from draftsmith.decode.rounds import speculative_decode

    target = make_target(smollm2_tokenizer)
    ref = reference(target, 30)
    drafter = HFDrafter(tiny_llama(layers=2, seed=1))
    open_tree = tree_decode(target, drafter, PROMPT_IDS, tree=DynamicTree(depth=4, top_k=1, budget=4),
                            max_new_tokens=30)
    gated = tree_decode(target, drafter, PROMPT_IDS, tree=DynamicTree(depth=4, top_k=1, budget=4), max_new_tokens=30,
                        min_confidence=0.5)
    assert drafter.stop_below == 0.5  # set_gate reached the chain drafter
    chain = speculative_decode(target, drafter, PROMPT_IDS, k=4, max_new_tokens=30, min_confidence=0.5)
    assert open_tree.tokens == gated.tokens == chain.tokens == ref[:30]
    assert gated.stats.drafted < open_tree.stats.drafted  # the gate cut some chains
    assert (gated.stats.drafted, gated.stats.accepted) == (chain.stats.drafted, chain.stats.accepted)


def test_a_gated_dynamic_tree_drafts_only_the_slots_at_or_above_the_gate():
    """Every node's path confidence (the product of softmax probabilities along its path) is ≥ the gate;
    a gate above the root's best probability leaves the round without drafts (a plain target step)."""
    torch.manual_seed(0)
    table = torch.randn(V, V)

    def expand(new, tokens, parents):
        return table[[tokens[n] for n in new]]

    root = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    full = build_tree(DynamicTree(depth=3, top_k=2, budget=7), root, expand, Warp(), None)
    gate = 0.15
    t = build_tree(DynamicTree(depth=3, top_k=2, budget=7), root, expand, Warp(), None, min_confidence=gate)
    score: dict[int, float] = {}
    for i, (tok, par) in enumerate(zip(t.tokens.tolist(), t.parents.tolist())):
        logits = root if par < 0 else table[t.tokens[par]]
        score[i] = (1.0 if par < 0 else score[par]) * float(logits.softmax(-1)[tok])
    assert 0 < t.size < full.size and min(score.values()) >= gate
    assert sorted(t.tokens[t.parents < 0].tolist()) == [0, 1]  # the root's two slots above the gate (p 0.61, 0.22; the third is 0.14)
    empty = build_tree(DynamicTree(depth=3, top_k=2, budget=7), root, expand, Warp(), None, min_confidence=0.7)
    assert empty.size == 0
    with pytest.raises(DraftsmithError, match="min_confidence"):
        build_tree(DynamicTree(), root, expand, Warp(), None, min_confidence=1.0)


def test_dynamic_tree_is_eagle2_in_greedy_mode():
    """Greedy: level 1 = top-k of the root, level d = the top-k children of level d−1 by path score, then
    the best leftover slots up to the budget; every node's score = product of softmax probabilities."""
    torch.manual_seed(0)
    table = torch.randn(V, V)  # logits of the next token given the current one

    def expand(new, tokens, parents):
        return table[[tokens[n] for n in new]]

    root = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    t = build_tree(DynamicTree(depth=3, top_k=2, budget=7), root, expand, Warp(), None)
    assert t.size == 7
    probs = lambda logits: logits.softmax(-1)  # noqa: E731
    # brute force: all paths up to depth 3 scored by the product of softmax probs
    score = {}
    for a in range(V):
        score[(a,)] = float(probs(root)[a])
        for b in range(V):
            score[(a, b)] = score[(a,)] * float(probs(table[a])[b])
    got = {}
    for i, (tok, par) in enumerate(zip(t.tokens.tolist(), t.parents.tolist())):
        got[i] = (got[par] if par >= 0 else ()) + (tok,)
    level1 = [p for p in got.values() if len(p) == 1]
    assert sorted(level1) == sorted(sorted(((a,) for a in range(V)), key=lambda p: -score[p])[:2])
    level2 = [p for p in got.values() if len(p) == 2]
    best2 = sorted((p + (b,) for p in level1 for b in range(V)), key=lambda p: -score[p])
    assert set(best2[:2]) <= set(level2)  # the frontier of level 2
    assert len(set(got.values())) == 7  # distinct children everywhere


# ------------------------------------------------------------------ exact sampling law (toy Markov LM)


class MarkovTreeDrafter:
    """A first-order Markov drafter (table[x] = logits of the next token) that drafts trees with the
    production builder; q = 0 for token ``never`` (which the target samples with p > 0)."""

    feature_layers = ()

    def __init__(self, table: torch.Tensor, never: int = 1, replacement: bool = False):
        logits = table[0].log()  # a first-order table [V, V, V] ignores x_{t-1}: [cur, next]
        logits[..., never] = float("-inf")
        self.logits = logits  # [V, V]
        self.replacement = replacement
        self.duplicates = 0
        self.trees = 0

    def reset(self):
        self.tokens: list[int] = []

    def update(self, tokens, features):
        self.tokens += tokens.tolist()

    def propose(self, k, warp, generator):
        raise AssertionError("the tree runtime is used")

    def propose_tree(self, shape, warp, generator, min_confidence=0.0):
        def expand(new, tokens, parents):
            return self.logits[[tokens[n] for n in new]]

        t = build_tree(shape, self.logits[self.tokens[-1]], expand, warp, generator, replacement=self.replacement,
                       min_confidence=min_confidence)
        self.trees += 1
        for kids in t.children():
            toks = t.tokens[kids].tolist()
            self.duplicates += len(toks) - len(set(toks))
        return t


@pytest.fixture(scope="module")
def markov_target():
    return Target(MarkovLM(random_table(1)), ToyTokenizer(), name="markov")


DRAWS = 2000
WIDE = StaticTree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0)))  # 3 children at the root, 2 under the first


def sample_counts(target, drafter, shape, warp, draws=DRAWS, length=4, min_confidence=0.0):
    counts: dict[tuple[int, ...], int] = {}
    accepted = deep = 0
    for seed in range(draws):
        res = tree_decode(target, drafter, PROMPT, tree=shape, max_new_tokens=length, warp=warp, seed=seed,
                          min_confidence=min_confidence)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
        accepted += res.stats.accepted
        deep += sum(res.stats.accept_hist[2:])
    return counts, accepted, deep


@pytest.mark.parametrize("shape,replacement,warp", [
    (WIDE, True, Warp(temperature=1.0)),  # i.i.d. children: duplicated candidates, SpecInfer's rule
    (WIDE, False, Warp(temperature=1.0)),  # distinct children: recursive rejection without replacement
    (DynamicTree(depth=2, top_k=2, budget=5), False, Warp(temperature=1.0)),
    ((DynamicTree(depth=2, top_k=2, budget=5), 0.15), False, Warp(temperature=1.0)),  # gated
    (WIDE, False, Warp(temperature=0.7, top_k=3)),
])
def test_tree_sampling_matches_the_exact_sequence_law(markov_target, shape, replacement, warp):
    drafter = MarkovTreeDrafter(random_table(2, second_order=False), replacement=replacement)
    shape, gate = shape if isinstance(shape, tuple) else (shape, 0.0)
    counts, accepted, deep = sample_counts(markov_target, drafter, shape, warp, min_confidence=gate)
    assert accepted > DRAWS // 5 and deep > 0  # accepted paths, some of depth 2
    if replacement:
        assert drafter.duplicates > drafter.trees // 4  # duplicated siblings were drafted
    law = sequence_law(markov_target.model.table.exp(), PROMPT, 4, warp)
    if warp.top_k == 0:
        assert sum(pr for seq, pr in law.items() if seq[0] == 1) > 0.01  # p > 0 where the drafter's q = 0
    assert pooled_chi2(counts, law) > 1e-3


def test_a_wrong_residual_update_fails_the_same_check(markov_target, monkeypatch):
    """SpecInfer's rule (q unchanged after a rejection) is exact for i.i.d. children only; applied to
    children drawn without replacement it biases the output, and the chi-square test sees it."""
    drafter = MarkovTreeDrafter(random_table(2, second_order=False), replacement=False)
    real = tree_mod.reject_update
    monkeypatch.setattr(tree_mod, "reject_update", lambda p, q, x, replacement: real(p, q, x, True))  # keeps x in q
    wide = StaticTree(((0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1)))
    counts, _, _ = sample_counts(markov_target, drafter, wide, Warp(temperature=1.0), draws=3000)
    law = sequence_law(markov_target.model.table.exp(), PROMPT, 4, Warp(temperature=1.0))
    assert pooled_chi2(counts, law) < 1e-6


def test_tree_sampling_is_reproducible(markov_target):
    drafter = MarkovTreeDrafter(random_table(2, second_order=False))
    run = lambda s: tree_decode(markov_target, drafter, PROMPT, tree=WIDE, max_new_tokens=20,  # noqa: E731
                                warp=Warp(temperature=1.0), seed=s).tokens
    assert run(4) == run(4) and len({tuple(run(s)) for s in range(5, 10)}) >= 3


# ------------------------------------------------------------------ tiny Llamas: greedy identity, caches


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    target = make_target(smollm2_tokenizer)
    return target, reference(target, 40)


SHAPES = [(StaticTree.named_or_given("default"), 0.0), (DynamicTree(depth=3, top_k=3, budget=8), 0.0),
          (StaticTree.named_or_given("chain4"), 0.0), (DynamicTree(depth=3, top_k=3, budget=8), 0.05)]


@pytest.mark.parametrize("shape,gate", SHAPES, ids=["static", "dynamic", "chain4", "dynamic-gated"])
def test_greedy_tree_decoding_is_the_targets_greedy_output(tiny, shape, gate):
    target, _ = tiny
    expected = target_greedy(target, PROMPT_IDS, 24)
    drafters = [Eagle1Config().build(target), Eagle3Config(feature_layers=[0, 1, 2]).build(target), MedusaConfig(num_heads=3).build(target),
                HFDrafter(tiny_llama(layers=2, seed=1)), layer_skip_drafter(target.model, 3, share_cache=False)]
    for drafter in drafters:
        res = tree_decode(target, drafter, PROMPT_IDS, tree=shape, max_new_tokens=24, min_confidence=gate)
        assert res.tokens == expected, type(drafter).__name__


@pytest.mark.parametrize("combine", ["either", "both"])
def test_a_hybrid_of_a_head_and_prompt_lookup_keeps_the_greedy_output(tiny, combine):
    """Per round the lookup's chain or the head's tree (either), or the head's tree with the chain grafted on (both)."""
    target, _ = tiny
    expected = target_greedy(target, PROMPT_IDS, 24)
    lookup = PromptLookupDrafter(target.vocab_size, target.eos_token_ids, max_ngram=3, min_ngram=1)
    hybrid = HybridDrafter(Eagle3Config(feature_layers=[0, 1, 2]).build(target), lookup, min_confidence=0.0, combine=combine)
    res = tree_decode(target, hybrid, PROMPT_IDS, tree=DynamicTree(depth=3, top_k=3, budget=6), max_new_tokens=24)
    assert res.tokens == expected
    rounds = hybrid.counts.rounds
    assert rounds["lookup"] > 0 and rounds["model"] > 0
    if combine == "both":  # the head drafted every round, the lookup's chain rode along in some
        assert rounds["model"] == res.stats.rounds - res.stats.tree_sizes.get(0, 0)  # every round with room to draft
        assert rounds["lookup"] <= rounds["model"]
        assert max(res.stats.tree_sizes) > 6  # a grafted chain made a tree larger than the head's budget
    shallow = HybridDrafter(Eagle3Config(feature_layers=[0, 1, 2]).build(target), lookup, min_confidence=0.0,
                            combine=combine, model_depth=1)
    res = tree_decode(target, shallow, PROMPT_IDS, tree=DynamicTree(depth=3, top_k=3, budget=6), max_new_tokens=24)
    assert res.tokens == expected  # the head drafts depth 1 only; the lookup's chains still reach depth 3
    assert shallow.counts.drafted["model"] <= 3 * shallow.counts.rounds["model"] and res.stats.proposed_at[2] > 0


class ScriptedTreeDrafter(ScriptedDrafter):
    """Drafts trees with the target's greedy continuation hidden at child rank
    ``pattern[r][d]`` at depth d of round r (other children: other tokens), so round r accepts a
    path that leaves the first branch: the verification and the compaction gather scattered rows."""

    def __init__(self, ref: list[int], pattern: list[list[int]], vocab: int, width: int = 3, depth: int = 3):
        super().__init__(ref, pattern, vocab)
        self.width, self.depth = width, depth

    def propose(self, k, warp, generator):
        raise AssertionError("the tree runtime is used")

    def propose_tree(self, shape, warp, generator, min_confidence=0.0):
        pos = len(self.committed) - len(PROMPT_IDS)
        ranks = self.pattern[self.round % len(self.pattern)]
        self.round += 1
        tokens, parents = [], []
        parent, on_path = -1, True
        for d in range(self.depth):  # a full `width`-ary tree would be big: branch only along the true path
            first = len(tokens)
            for c in range(self.width):
                hit = on_path and d < len(ranks) and c == ranks[d]
                tokens.append(self.ref[pos + d] if hit else (self.ref[pos + d] + 1 + c) % self.vocab)
                parents.append(parent)
            if not (on_path and d < len(ranks)):
                break
            parent = first + ranks[d]
        q = None
        if not warp.greedy:
            t = torch.tensor(tokens)
            q = torch.zeros(len(tokens) + 1, self.vocab)
            for row in range(len(tokens) + 1):  # children drawn i.i.d. from the uniform law over themselves
                kids = [i for i, p in enumerate(parents) if p + 1 == row]
                if kids:
                    q[row, t[kids]] = 1.0 / len(kids)
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), q, replacement=True)


SCRIPT_SHAPE = StaticTree(((0,), (0, 0), (0, 0, 0)))  # only its depth (3) matters to the scripted drafter


def scripted_rounds(pattern: list[list[int]], max_new: int, depth: int = 3) -> list[tuple[int, int, int]]:
    """(tree depth, tree size, accepted) per round of the scripted drafter, with width 3, no EOS."""
    out, have, r = [], 1, 0
    while have < max_new:
        room = min(depth, max_new - have - 1)
        if room == 0:
            out.append((0, 0, 0))
            have += 1
            continue
        ranks = pattern[r % len(pattern)]
        r += 1
        d = min(len(ranks) + 1, depth, room)
        n = min(len(ranks), room)
        out.append((d, 3 * d, n))
        have += n + 1
    return out


def _cache_tensors(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def test_cache_after_any_accepted_path_equals_a_fresh_forward(tiny):
    target, ref = tiny
    pattern = [[1, 2], [0], [2, 0, 1], [], [2, 2]]  # accepted path ranks per round
    drafter = ScriptedTreeDrafter(ref, pattern, target.vocab_size)
    caches, checked = [], []
    new_cache = target.new_cache
    update = drafter.update

    def spy_cache():
        caches.append(new_cache())
        return caches[-1]

    def checked_update(tokens, features):
        update(tokens, features)
        cache = caches[0]
        committed = drafter.committed
        n = cache.get_seq_length()
        assert n == len(committed) - 1
        fresh = new_cache()
        target.forward(torch.tensor([committed[:n]]), fresh)
        for a, b in zip(_cache_tensors(cache), _cache_tensors(fresh)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
        checked.append(n)

    target.new_cache = spy_cache
    drafter.update = checked_update
    try:
        res = tree_decode(target, drafter, PROMPT_IDS, tree=SCRIPT_SHAPE, max_new_tokens=30)
    finally:
        del target.new_cache
    assert res.tokens == ref[:30]
    st = res.stats
    rounds = scripted_rounds(pattern, 30)
    assert st.accept_hist == [sum(1 for _, _, n in rounds if n == i) for i in range(4)]
    assert st.accept_hist[2] > 0 and st.accept_hist[3] > 0 and st.accept_hist[0] > 0
    assert len(checked) >= st.rounds == len(rounds)


def test_tree_stats_count_depth_size_and_path(tiny):
    target, ref = tiny
    pattern = [[1, 2], [0]]
    drafter = ScriptedTreeDrafter(ref, pattern, target.vocab_size)
    res = tree_decode(target, drafter, PROMPT_IDS, tree=SCRIPT_SHAPE, max_new_tokens=12)
    st = res.stats
    # rounds: 9 nodes (depth 3) accepting 2; 6 nodes (depth 2) accepting 1; 9/2; 6/1 (cut to depth 2); 0/0
    assert scripted_rounds(pattern, 12) == [(3, 9, 2), (2, 6, 1), (3, 9, 2), (2, 6, 1), (0, 0, 0)]
    assert (st.rounds, st.new_tokens, st.accepted, st.drafted) == (5, 12, 6, 30)
    assert st.tree_sizes == {9: 2, 6: 2, 0: 1}
    assert st.accept_hist == [1, 2, 2, 0]
    assert st.proposed_at == [4, 4, 2] and st.accepted_at == [4, 2, 0]  # acceptance by depth
    s = st.summary()
    assert s["tree_size_histogram"] == {"0": 1, "6": 2, "9": 2} and s["tau_with_bonus"] == pytest.approx(11 / 5)
    assert s["acceptance_at_position"] == [1.0, 0.5, 0.0]


def test_an_eos_on_the_accepted_path_ends_the_counts_where_the_output_ends(smollm2_tokenizer, tiny):
    """Round 0 accepts a path of 3, round 1 of 1, round 2 would accept 3 but its second node is EOS
    (ref[8]): that round counts 2 proposed and accepted, its 9 nodes verified, no bonus token."""
    _, ref = tiny
    target = make_target(smollm2_tokenizer, eos=ref[8])
    assert ref[8] not in ref[:8]
    drafter = ScriptedTreeDrafter(ref, [[0, 1, 2], [1]], target.vocab_size)
    res = tree_decode(target, drafter, PROMPT_IDS, tree=SCRIPT_SHAPE, max_new_tokens=30)
    assert res.tokens == ref[:9] and res.finish_reason == "eos"
    st = res.stats
    assert (st.rounds, st.accepted, st.drafted, st.eos_rounds, st.new_tokens) == (3, 6, 24, 1, 9)
    assert st.tau == pytest.approx(8 / 3) and st.tau * st.rounds == pytest.approx(st.new_tokens - 1)
    assert st.proposed_at == [3, 3, 1] and st.accepted_at == [3, 2, 1] and st.reached_at == [3, 3, 1]
    assert st.tree_sizes == {9: 2, 6: 1} and st.accept_hist == [0, 1, 1, 1]
    s = st.summary()
    assert s["acceptance_at_position"] == [1.0, 0.6667, 1.0]
    assert s["conditional_acceptance_at_position"] == [1.0, 0.6667, 1.0]


def test_tree_sampling_with_one_hot_truth_keeps_the_output(tiny):
    """Sampling path on the tiny Llama: temperature tiny, the truth among i.i.d. uniform children."""
    target, ref = tiny
    drafter = ScriptedTreeDrafter(ref, [[1, 2], [2], [0, 1]], target.vocab_size)
    res = tree_decode(target, drafter, PROMPT_IDS, tree=SCRIPT_SHAPE, max_new_tokens=20,
                      warp=Warp(temperature=1e-4), seed=3)
    assert res.tokens == ref[:20] and res.stats.accepted > 0


def test_self_speculative_drafter_is_refused_for_trees(tiny):
    target, _ = tiny
    with pytest.raises(DraftsmithError, match="share_cache=false"):
        tree_decode(target, layer_skip_drafter(target.model, 3, share_cache=True), PROMPT_IDS,
                    tree=DynamicTree(), max_new_tokens=5)
