"""EAGLE-3 draft vocabulary: d2t offsets and t2d mask in the SGLang / SpecForge convention, coverage."""

from __future__ import annotations

import datasets
import pytest
import torch

from draftsmith.data.tokenized import tokenized_features
from draftsmith.data.vocab import DraftVocab, build_draft_vocab
from draftsmith.errors import DraftsmithError


def _dataset(ids, masks):
    n = len(ids)
    return datasets.Dataset.from_dict(
        {"conv_id": [str(i) for i in range(n)], "source": ["t"] * n, "input_ids": ids, "loss_mask": masks},
        features=tokenized_features(),
    )


# loss-masked counts: 7→4, 3→3, 9→2, 5→2, 1→1 ; token 8 appears only unmasked (6 times)
DATA = _dataset(
    [[8, 8, 8, 7, 7, 3, 9], [8, 8, 8, 7, 7, 3, 3, 5, 5, 9, 1]],
    [[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]],
)


def test_top_tokens_sorted_ascending_with_offsets():
    vocab = build_draft_vocab(DATA, target_vocab_size=12, size=4)
    # the 4 most frequent masked tokens are 7, 3, then the tie 5/9 (both 2) and 1 (1): 5 and 9 win, lower id first
    used = [3, 5, 7, 9]
    assert vocab.d2t.tolist() == [u - i for i, u in enumerate(used)] == [3, 4, 5, 6]
    assert vocab.d2t.dtype == torch.int64 and vocab.t2d.dtype == torch.bool
    assert vocab.t2d.nonzero().flatten().tolist() == used and vocab.t2d.shape == (12,)
    assert vocab.draft_to_target(torch.arange(4)).tolist() == used  # target_id = draft_id + d2t[draft_id]
    assert vocab.target_to_draft(torch.tensor([7, 8, 3])).tolist() == [2, -1, 0]
    assert vocab.coverage == pytest.approx(11 / 12)  # 12 masked tokens, token 1 left out


def test_ties_break_to_the_lower_id_and_unseen_ids_fill_the_size():
    vocab = build_draft_vocab(DATA, target_vocab_size=12, size=3)
    assert vocab.t2d.nonzero().flatten().tolist() == [3, 5, 7]  # 5 beats 9 at equal counts
    assert vocab.coverage == pytest.approx(9 / 12)
    full = build_draft_vocab(DATA, target_vocab_size=12, size=8)
    # 5 distinct masked tokens, then the lowest unseen ids 0, 2, 4 (8 is only ever unmasked: no priority)
    assert full.t2d.nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 7, 9]
    assert full.coverage == 1.0


def test_save_load_roundtrip(tmp_path):
    vocab = build_draft_vocab(DATA, target_vocab_size=12, size=4)
    vocab.tokenizer_hash = "abc"
    vocab.save(str(tmp_path / "v.safetensors"))
    back = DraftVocab.load(str(tmp_path / "v.safetensors"))
    assert torch.equal(back.d2t, vocab.d2t) and torch.equal(back.t2d, vocab.t2d)
    assert back.coverage == vocab.coverage and back.tokenizer_hash == "abc" and back.size == 4


def test_errors():
    with pytest.raises(DraftsmithError, match="exceeds the target vocabulary"):
        build_draft_vocab(DATA, target_vocab_size=12, size=13)
    with pytest.raises(DraftsmithError, match="outside the target vocabulary"):
        build_draft_vocab(DATA, target_vocab_size=8, size=2)
    with pytest.raises(DraftsmithError, match="does not exist"):
        DraftVocab.load("/nonexistent/v.safetensors")


def test_check_draft_vocab_is_the_one_check_of_the_convention():
    """data/vocab.py's check, used by EAGLE-3 heads (ConfigError naming drafter.draft_vocab) and by exports
    (DraftsmithError naming the folder): what it accepts and each refusal's message."""
    from draftsmith.data.vocab import check_draft_vocab
    from draftsmith.errors import ConfigError

    vocab = build_draft_vocab(DATA, target_vocab_size=12, size=4)  # target ids 3, 5, 7, 9
    d2t, t2d = vocab.d2t, vocab.t2d
    check_draft_vocab(d2t, t2d, 12, "v")
    twice = torch.tensor([3, 4, 5, 5])  # draft ids 2 and 3 both → target id 8 … and 7, 8: two onto one
    cases = [
        ((d2t.int(), t2d), "v: d2t must be a 1-D int64 tensor of offsets, got torch.int32 (4,)"),
        ((d2t, t2d.long()), "v: t2d must be a 1-D bool mask over the target ids, got torch.int64 (12,)"),
        ((d2t, t2d[:10]), "v: t2d covers 10 tokens but the target's vocabulary has 12"),
        ((d2t[:0], t2d), "v: d2t is empty; a draft vocabulary holds at least one token"),
        ((d2t + 3, t2d), "v: d2t maps draft ids outside the target vocabulary 0 … 11"),
        ((torch.tensor([3, 4, 4, 3]), t2d), "v: d2t maps two draft ids onto the same target id"),
        ((twice, t2d), "v: t2d does not mark exactly the 4 target ids that d2t maps to"),
    ]
    for (a, b), msg in cases:
        with pytest.raises(DraftsmithError) as e:
            check_draft_vocab(a, b, 12, "v")
        assert str(e.value) == msg and type(e.value) is DraftsmithError
    with pytest.raises(ConfigError, match="^drafter.draft_vocab: d2t maps two draft ids"):
        check_draft_vocab(torch.tensor([3, 4, 4, 3]), t2d, 12, "drafter.draft_vocab", ConfigError)
