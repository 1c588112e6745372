"""EAGLE-3 reduced draft vocabulary: the N most frequent loss-masked target tokens.

An EAGLE-3 drafter predicts over a small vocabulary (32k of Llama-3's 128k) to save
its lm_head; the mapping to target ids follows EAGLE-3's reference code and SGLang /
SpecForge, so exported drafters load there unchanged:

* the draft vocabulary is the chosen target ids **sorted ascending**, draft id = rank;
* ``d2t`` [N] int64 holds **offsets**: ``target_id = draft_id + d2t[draft_id]``;
* ``t2d`` [V] bool marks the target ids that are in the draft vocabulary.

Tokens are ranked by their count at loss-masked positions (ties: lower id first); when
fewer than N distinct tokens occur, the rest is filled with the lowest unseen ids so the
size is always N. ``coverage`` is the fraction of loss-masked tokens of the data that
the draft vocabulary contains (the ceiling on what a drafter with it can accept there).
Saved as safetensors (``d2t``, ``t2d``) with coverage and sizes in the metadata.
:func:`check_draft_vocab` is the one check of a pair against this convention (EAGLE-3 and DFlash drafters
built from a file or a pair, and every export that writes one); :func:`resolve_draft_vocab` is the one reading of
a drafter's ``draft_vocab`` / ``draft_vocab_size`` fields (both families).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from ..errors import ConfigError, DraftsmithError
from ..files import atomic_path


def check_draft_vocab(d2t: Tensor, t2d: Tensor, target_vocab: int, where: str,
                      error: type[DraftsmithError] = DraftsmithError) -> None:
    """Refuse a (d2t, t2d) pair that breaks the convention above, which an engine (or a head) would misread:
    d2t not 1-D int64 offsets, t2d not a bool mask over the ``target_vocab`` target ids, no draft token,
    draft ids mapped outside the target vocabulary or two onto one target id, or a t2d that does not mark
    exactly the target ids d2t maps to. ``where`` names the file, folder or config key in the message;
    ``error``: the class raised (ConfigError for a recipe's ``drafter.draft_vocab``)."""
    if d2t.dtype != torch.int64 or d2t.dim() != 1:
        raise error(f"{where}: d2t must be a 1-D int64 tensor of offsets, got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        raise error(f"{where}: t2d must be a 1-D bool mask over the target ids, got {t2d.dtype} {tuple(t2d.shape)}")
    if t2d.shape[0] != target_vocab:
        raise error(f"{where}: t2d covers {t2d.shape[0]} tokens but the target's vocabulary has {target_vocab}")
    vd = d2t.shape[0]
    if vd == 0:
        raise error(f"{where}: d2t is empty; a draft vocabulary holds at least one token")
    ids = torch.arange(vd) + d2t.cpu()
    if int(ids.min()) < 0 or int(ids.max()) >= target_vocab:
        raise error(f"{where}: d2t maps draft ids outside the target vocabulary 0 … {target_vocab - 1}")
    if ids.unique().numel() != vd:
        raise error(f"{where}: d2t maps two draft ids onto the same target id")
    mask = t2d.cpu()
    if int(mask.sum()) != vd or not bool(mask[ids].all()):
        raise error(f"{where}: t2d does not mark exactly the {vd} target ids that d2t maps to")


def vocab_tensors(vocab: Any, tokenizer_hash: str = "") -> tuple[Tensor, Tensor]:
    """(d2t, t2d) from a DraftVocab-like object (``.d2t``, ``.t2d``), a pair, a dict, or the path of a
    file written by ``draftsmith prepare`` (refused when counted on another tokenizer than ``tokenizer_hash``)."""
    if isinstance(vocab, str):
        vocab = DraftVocab.load(vocab)
        if tokenizer_hash and vocab.tokenizer_hash and vocab.tokenizer_hash != tokenizer_hash:
            raise ConfigError(
                f"drafter.draft_vocab was counted on data rendered with tokenizer {vocab.tokenizer_hash}, not with "
                f"this target's ({tokenizer_hash}): its ids would name other tokens. Build it for this target "
                f"with `draftsmith prepare` (data.stages=[tokenize, vocab])")
    if isinstance(vocab, dict):
        if "d2t" not in vocab or "t2d" not in vocab:
            raise ConfigError(f"the draft vocabulary needs tensors 'd2t' and 't2d', found {sorted(vocab)}")
        return torch.as_tensor(vocab["d2t"]), torch.as_tensor(vocab["t2d"])
    if isinstance(vocab, (tuple, list)) and len(vocab) == 2:
        return torch.as_tensor(vocab[0]), torch.as_tensor(vocab[1])
    if hasattr(vocab, "d2t") and hasattr(vocab, "t2d"):
        return torch.as_tensor(vocab.d2t), torch.as_tensor(vocab.t2d)
    raise ConfigError(f"cannot read a draft vocabulary (d2t, t2d) from {type(vocab).__name__}")


def resolve_draft_vocab(vocab: Any, file: str, size: int, target_vocab: int, tokenizer_hash: str = "") -> tuple[Tensor, Tensor]:
    """A drafter's (d2t [Vd] int64, t2d [V] bool), checked: ``vocab`` (anything :func:`vocab_tensors` reads) or
    else the file ``file`` (``drafter.draft_vocab``), or else the full vocabulary (the identity: d2t zeros, t2d all
    true), which ``size`` (``drafter.draft_vocab_size``, 0 = taken from the vocabulary) must then allow."""
    if vocab is None and file:
        vocab = file
    if vocab is None:
        if size not in (0, target_vocab):
            raise ConfigError(
                f"drafter.draft_vocab_size = {size} needs a draft vocabulary: set drafter.draft_vocab to the file "
                f"written by draftsmith prepare (or 0 for the full vocabulary)")
        return torch.zeros(target_vocab, dtype=torch.long), torch.ones(target_vocab, dtype=torch.bool)
    d2t, t2d = vocab_tensors(vocab, tokenizer_hash)
    check_draft_vocab(d2t, t2d, target_vocab, "drafter.draft_vocab", ConfigError)
    if size and size != d2t.shape[0]:
        raise ConfigError(f"drafter.draft_vocab_size = {size} but the draft vocabulary has {d2t.shape[0]} tokens")
    return d2t.long(), t2d.bool()


@dataclass
class DraftVocab:
    d2t: Tensor
    """[N] int64 offsets: target_id = draft_id + d2t[draft_id]."""
    t2d: Tensor
    """[V] bool: target id is in the draft vocabulary."""
    coverage: float
    """Fraction of loss-masked target tokens (of the data it was built from) inside the draft vocabulary."""
    tokenizer_hash: str = ""
    """Fingerprint of the tokenizer the counted data was rendered with ('' when unknown)."""

    @property
    def size(self) -> int:
        return int(self.d2t.shape[0])

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.shape[0])

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Target ids of draft ids (any shape)."""
        d2t = self.d2t.to(draft_ids.device)
        return draft_ids + d2t[draft_ids]

    def target_to_draft(self, target_ids: Tensor) -> Tensor:
        """Draft ids of target ids (any shape); -1 where the target id is not in the draft vocabulary."""
        index = torch.full((self.target_vocab_size,), -1, dtype=torch.long)
        index[self.t2d] = torch.arange(self.size)
        return index.to(target_ids.device)[target_ids]

    def save(self, path: str) -> None:
        with atomic_path(path) as tmp:
            save_file({"d2t": self.d2t.contiguous(), "t2d": self.t2d.contiguous()}, tmp,
                      metadata={"coverage": repr(self.coverage), "size": str(self.size),
                                "target_vocab_size": str(self.target_vocab_size),
                                "tokenizer_hash": self.tokenizer_hash})

    @classmethod
    def load(cls, path: str) -> DraftVocab:
        if not os.path.isfile(path):
            raise DraftsmithError(f"draft vocabulary '{path}' does not exist; run `draftsmith prepare` with 'vocab' "
                                  f"in data.stages")
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        except Exception as e:  # not safetensors, truncated, or without d2t / t2d
            raise DraftsmithError(f"draft vocabulary '{path}' cannot be read as safetensors with tensors d2t and t2d "
                                  f"({e}); rebuild it with `draftsmith prepare`") from e
        vocab = cls(d2t=d2t.long(), t2d=t2d.bool(), coverage=float(meta.get("coverage", "nan")),
                    tokenizer_hash=meta.get("tokenizer_hash", ""))
        if int(vocab.t2d.sum()) != vocab.size:
            raise DraftsmithError(f"draft vocabulary '{path}' is inconsistent (t2d marks {int(vocab.t2d.sum())} ids, "
                                  f"d2t has {vocab.size}); rebuild it with `draftsmith prepare`")
        return vocab


def token_counts(dataset: Any, vocab_size: int) -> np.ndarray:
    """[V] int64 counts of each token id at loss-masked positions of a tokenized dataset."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    ids_col, mask_col = dataset.data.column("input_ids"), dataset.data.column("loss_mask")
    for ids_chunk, mask_chunk in zip(ids_col.chunks, mask_col.chunks):
        ids = ids_chunk.flatten().to_numpy(zero_copy_only=False)
        mask = mask_chunk.flatten().to_numpy(zero_copy_only=False)
        picked = ids[mask.astype(bool)].astype(np.int64)
        if picked.size and (picked.max() >= vocab_size or picked.min() < 0):
            raise DraftsmithError(f"token id {int(picked.max())} is outside the target vocabulary of {vocab_size}; "
                                  f"the data was tokenized for another target")
        counts += np.bincount(picked, minlength=vocab_size)
    return counts


def vocab_from_counts(counts: np.ndarray, size: int) -> DraftVocab:
    """The ``size`` most frequent ids of ``counts`` ([V]) as a :class:`DraftVocab`."""
    vocab_size = int(counts.shape[0])
    if size > vocab_size:
        raise DraftsmithError(f"data.vocab.size = {size} exceeds the target vocabulary of {vocab_size}; lower it")
    order = np.argsort(-counts, kind="stable")  # most frequent first, ties by lower id
    chosen = np.sort(order[:size])
    total = int(counts.sum())
    coverage = float(counts[chosen].sum() / total) if total else 0.0
    used = torch.from_numpy(chosen.astype(np.int64))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return DraftVocab(d2t=used - torch.arange(size, dtype=torch.int64), t2d=t2d, coverage=coverage)


def build_draft_vocab(dataset: Any, target_vocab_size: int, size: int) -> DraftVocab:
    """Draft vocabulary of ``size`` tokens from a tokenized dataset's loss-masked tokens."""
    return vocab_from_counts(token_counts(dataset, target_vocab_size), size)
