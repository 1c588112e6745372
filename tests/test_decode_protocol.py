"""The drafter protocol's optional abilities (``decode/protocol.py``): a drafter without one is decoded
without it, one with it has it used — by the chain and the tree decoder, directly and through
``TimedDrafter``, which passes on exactly the abilities of the drafter it wraps."""

from __future__ import annotations

import pytest
import torch

from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.protocol import ABILITIES, BindsTargetCache, Drafter, Gated, TreeDrafter, ability_methods
from draftsmith.decode.tree import DynamicTree, tree_decode
from draftsmith.measure.costs import TimedDrafter
from draftsmith.errors import DraftsmithError
from draftsmith.decode.reference import target_greedy

from .test_decode_tree import SCRIPT_SHAPE, ScriptedTreeDrafter
from .test_decoder import PROMPT_IDS, ScriptedDrafter, make_target, reference

pytestmark = pytest.mark.usefixtures("one_thread")


class GatedScripted(ScriptedDrafter):
    """The scripted chain drafter plus ``set_gate``, logging the calls it gets."""

    def reset(self):
        super().reset()
        self.log = ["reset"]

    def set_gate(self, min_confidence):
        self.log.append(("set_gate", min_confidence))

    def update(self, tokens, features):
        self.log.append("update")
        super().update(tokens, features)


class SharingScripted(ScriptedDrafter):
    """The scripted chain drafter plus ``bind``/``verify``: its verification is the target's forward in the
    bound cache, counted."""

    def __init__(self, target, *args):
        super().__init__(*args)
        self.target, self.bound, self.verified = target, [], 0

    def bind(self, cache):
        self.bound.append(cache)

    def verify(self, input_ids):
        self.verified += 1
        return self.target.forward(input_ids, self.bound[-1])


class BindOnly(ScriptedDrafter):
    """Half of an ability is none: ``bind`` without ``verify`` is not :class:`BindsTargetCache`."""

    def bind(self, cache):
        raise AssertionError("a drafter without verify is never bound")


class GatedTree(ScriptedTreeDrafter):
    def set_gate(self, min_confidence):
        self.gates = getattr(self, "gates", []) + [min_confidence]


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    target = make_target(smollm2_tokenizer)
    return target, reference(target, 40)


def abilities(drafter) -> list[str]:
    return [a.__name__ for a in ABILITIES if isinstance(drafter, a)]


def test_each_drafter_has_exactly_the_abilities_it_defines(tiny):
    target, ref = tiny
    plain = ScriptedDrafter(ref, [2], target.vocab_size)
    assert isinstance(plain, Drafter) and abilities(plain) == [] and ability_methods(plain) == {}
    assert abilities(BindOnly(ref, [2], target.vocab_size)) == []
    sharing = SharingScripted(target, ref, [2], target.vocab_size)
    assert abilities(sharing) == ["BindsTargetCache"]
    assert ability_methods(sharing) == {"bind": sharing.bind, "verify": sharing.verify}
    tree = GatedTree(ref, [[0]], target.vocab_size)
    assert abilities(tree) == ["Gated", "TreeDrafter"] and sorted(ability_methods(tree)) == ["propose_tree", "set_gate"]


def test_the_chain_decoder_uses_an_ability_only_where_the_drafter_has_it(tiny):
    target, ref = tiny
    expected = target_greedy(target, PROMPT_IDS, 20)
    assert expected == ref[:20]
    for drafter in (ScriptedDrafter(ref, [2, 0, 4], target.vocab_size), BindOnly(ref, [2, 0, 4], target.vocab_size)):
        assert speculative_decode(target, drafter, PROMPT_IDS, k=4, max_new_tokens=20).tokens == expected

    gated = GatedScripted(ref, [2, 0, 4], target.vocab_size)
    res = speculative_decode(target, gated, PROMPT_IDS, k=4, max_new_tokens=20, min_confidence=0.25)
    assert res.tokens == expected
    assert gated.log[:3] == ["reset", ("set_gate", 0.25), "update"]  # after reset, before the prefill's update
    assert gated.log.count("update") == res.stats.rounds + 1

    sharing = SharingScripted(target, ref, [2, 0, 4], target.vocab_size)
    res = speculative_decode(target, sharing, PROMPT_IDS, k=4, max_new_tokens=20)
    assert res.tokens == expected
    assert len(sharing.bound) == 1 and sharing.verified == res.stats.rounds  # every verification went through it
    assert sharing.bound[0].get_seq_length() == len(PROMPT_IDS) + 20 - 1  # the decoder's own cache, kept in step


def test_the_tree_decoder_uses_an_ability_only_where_the_drafter_has_it(tiny):
    target, ref = tiny
    expected = ref[:20]
    shape = DynamicTree(depth=3, top_k=1, budget=3)
    chain = ScriptedDrafter(ref, [2, 0, 3], target.vocab_size)  # no propose_tree: its chains, the one-branch tree
    assert tree_decode(target, chain, PROMPT_IDS, tree=shape, max_new_tokens=20, min_confidence=0.3).tokens == expected
    gated = GatedScripted(ref, [2, 0, 3], target.vocab_size)
    assert tree_decode(target, gated, PROMPT_IDS, tree=shape, max_new_tokens=20, min_confidence=0.3).tokens == expected
    assert gated.log[:3] == ["reset", ("set_gate", 0.3), "update"]  # the decoder's gate cuts its chains

    tree = GatedTree(ref, [[1, 2], [0], [2, 0, 1]], target.vocab_size)  # its propose raises: propose_tree is used
    res = tree_decode(target, tree, PROMPT_IDS, tree=SCRIPT_SHAPE, max_new_tokens=20)
    assert res.tokens == expected and tree.round == res.stats.rounds - res.stats.tree_sizes.get(0, 0)
    assert tree.gates == [0.0]  # its trees are not gated by the decoder: neither are its chains

    with pytest.raises(DraftsmithError, match="cannot draft trees"):
        tree_decode(target, SharingScripted(target, ref, [2], target.vocab_size), PROMPT_IDS, tree=shape,
                    max_new_tokens=8)


def test_timed_drafter_passes_on_exactly_the_abilities_of_the_drafter_it_wraps(tiny):
    target, ref = tiny
    plain = TimedDrafter(ScriptedDrafter(ref, [2], target.vocab_size))
    assert abilities(plain) == [] and not hasattr(plain, "propose_tree")
    inner = GatedTree(ref, [[1, 2], [0], [2, 0, 1]], target.vocab_size)
    timed = TimedDrafter(inner)
    assert abilities(timed) == ["Gated", "TreeDrafter"] and timed.set_gate == inner.set_gate
    res = tree_decode(target, timed, PROMPT_IDS, tree=SCRIPT_SHAPE, max_new_tokens=20)
    assert res.tokens == ref[:20] and inner.gates == [0.0]
    assert timed.drafted == res.stats.drafted > 0 and 0 < timed.seconds < res.stats.wall_s  # propose_tree timed
    sharing = SharingScripted(target, ref, [2, 0, 4], target.vocab_size)
    assert isinstance(TimedDrafter(sharing), BindsTargetCache) and not isinstance(TimedDrafter(sharing), (Gated, TreeDrafter))
    res = speculative_decode(target, TimedDrafter(sharing), PROMPT_IDS, k=4, max_new_tokens=12)
    assert res.tokens == ref[:12] and sharing.verified == res.stats.rounds
