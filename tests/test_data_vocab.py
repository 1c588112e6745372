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
