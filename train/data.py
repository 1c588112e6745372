"""Training data for the recipes: records, the held-out split, a resumable batch order, collation.

Records come from a tokenized ``datasets.Dataset`` (``draftsmith prepare``: columns
``input_ids``, ``loss_mask``, …) or, offline, from a feature cache whose rows also
carry the target's hidden states (``hidden`` [S, L·H]) and optionally its top-k
logits. Either way a record is ``rows[i] -> dict``.

The batch order is a pure function of (seed, epoch, micro-step, rank), so the data
position of a run is one integer — the number of micro-batches consumed — and a
resumed run continues with exactly the batches the uninterrupted run would have seen.
Each epoch drops the remainder that does not fill a micro-batch on every rank, so all
ranks always take the same number of steps (a collective never waits on a missing rank).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import DraftsmithError


@dataclass
class Batch:
    input_ids: Tensor
    """[B, S] long, right-padded."""
    attention_mask: Tensor
    """[B, S] long, 1 on real tokens."""
    loss_mask: Tensor
    """[B, S] bool: the token at this position is a training target (an assistant token)."""
    hidden: Tensor | None = None
    """[B, S, F] cached target features (offline), or None (online)."""
    topk_ids: Tensor | None = None
    """[B, S, K] long: ids of the target's top-k logits (offline, optional)."""
    topk_logits: Tensor | None = None
    """[B, S, K] the target's top-k logits (offline, optional)."""
    empty_rows: int = 0
    """Records in this batch left with no loss token after truncation (they contribute nothing)."""

    @property
    def tokens(self) -> int:
        """Real (non-pad) tokens in the batch."""
        return int(self.attention_mask.sum())

    def to(self, device: torch.device) -> Batch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        moved = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in moved.items()}
        return replace(self, **moved)


def load_rows(dataset: str, features: str, target: Any) -> Sequence[dict[str, Any]]:
    """The records to train on: the feature cache when ``features`` is set (offline), else the dataset."""
    if features:
        from ..data.feature_cache import FeatureCache

        return FeatureCache.open(features, target)
    if not dataset:
        raise DraftsmithError("train.dataset is empty: name the tokenized dataset folder written by "
                              "`draftsmith prepare` (or train.features for an offline feature cache)")
    from ..data.tokenized import load_tokenized

    # refuses data rendered with another tokenizer, and files that are not the bytes `prepare` wrote
    ds = load_tokenized(dataset, target, verify="all")
    return ds.with_format("numpy", columns=["input_ids", "loss_mask"])


@dataclass
class Split:
    train: list[int]
    heldout: list[int]


def split_heldout(n: int, heldout: int, seed: int, max_records: int = 0) -> Split:
    """Hold ``heldout`` records out of ``n``, chosen by ``seed``; train on the rest, or on the first
    ``max_records`` of the rest (in record order), so that every subset size holds out the same records."""
    if heldout >= n:
        raise DraftsmithError(f"train.eval.heldout = {heldout} leaves no training records out of {n}; lower it")
    order = np.random.default_rng(seed).permutation(n).tolist()
    train = sorted(order[heldout:])
    return Split(train=train[:max_records] if max_records else train, heldout=sorted(order[:heldout]))


@dataclass
class BatchOrder:
    """Which records micro-batch ``step`` of ``rank`` holds: a pure function, so resuming is exact.

    With ``lengths`` and ``group`` > 0, records of similar length share a micro-batch (HF's
    ``group_by_length``): each epoch's shuffled order is cut into groups of ``group`` optimizer steps'
    records, each group sorted by length and dealt into steps, and the steps of the epoch shuffled
    again. A micro-batch is padded to its longest record, so random batches of records of very
    different lengths (the demo's) spend much of their rows on padding; grouping keeps the
    randomness of which records meet from epoch to epoch, and the ranks of a step get records of
    similar length (no rank waits on one long sequence)."""

    ids: list[int]
    batch_size: int
    world_size: int
    rank: int
    seed: int
    lengths: Sequence[int] | None = None
    """Tokens of every record (indexed like the rows, not like ``ids``); None = random batches."""
    group: int = 0
    """Optimizer steps per length group; 0 = random batches."""
    _epoch: int = field(default=-1, repr=False)
    _order: list[int] = field(default_factory=list, repr=False)

    @property
    def steps_per_epoch(self) -> int:
        per = len(self.ids) // (self.batch_size * self.world_size)
        if per == 0:
            raise DraftsmithError(
                f"{len(self.ids)} training records cannot fill one micro-batch of {self.batch_size} on each of "
                f"{self.world_size} processes; add data or lower train.batch_size"
            )
        return per

    def at(self, step: int) -> list[int]:
        epoch, i = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.ids))
            self._order, self._epoch = [self.ids[j] for j in perm], epoch
            if self.group > 0 and self.lengths is not None:
                self._order = self._grouped(self._order, epoch)
        start = (i * self.world_size + self.rank) * self.batch_size
        return self._order[start : start + self.batch_size]

    def _grouped(self, order: list[int], epoch: int) -> list[int]:
        block = self.batch_size * self.world_size  # the records of one optimizer step, every rank
        used = order[: self.steps_per_epoch * block]
        span = self.group * block
        steps: list[list[int]] = []
        for g in range(0, len(used), span):
            chunk = sorted(used[g : g + span], key=lambda i: -self.lengths[i])  # type: ignore[index]
            steps += [chunk[b : b + block] for b in range(0, len(chunk), block)]
        shuffle = np.random.default_rng([self.seed, epoch, 1]).permutation(len(steps))
        return [i for j in shuffle for i in steps[j]] + order[len(used) :]

    def from_step(self, start: int) -> Iterator[tuple[int, list[int]]]:
        step = start
        while True:
            yield step, self.at(step)
            step += 1


def record_lengths(rows: Sequence[dict[str, Any]]) -> list[int]:
    """Tokens of every record, without reading cached features where the rows can say (``lengths()``)."""
    if hasattr(rows, "lengths"):
        return list(rows.lengths())
    if hasattr(rows, "column_names") and "input_ids" in rows.column_names:
        return [len(x) for x in rows["input_ids"]]
    return [len(r["input_ids"]) for r in rows]


def heldout_batches(ids: list[int], batch_size: int, world_size: int, rank: int) -> list[list[int]]:
    """This rank's share of the held-out records, in the same number of batches on every rank."""
    per_rank = len(ids) // world_size
    mine = ids[rank * per_rank : (rank + 1) * per_rank]
    return [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]


def collate(rows: list[dict[str, Any]], pad_id: int, max_length: int) -> Batch:
    """Cut each record to ``max_length``, right-pad to the longest; cached features padded with zeros."""
    if not rows:
        raise DraftsmithError("cannot collate an empty list of records")
    ids = [torch.as_tensor(np.asarray(r["input_ids"]), dtype=torch.long)[:max_length] for r in rows]
    masks = [torch.as_tensor(np.asarray(r["loss_mask"]), dtype=torch.bool)[:max_length] for r in rows]
    for i, (a, m) in enumerate(zip(ids, masks)):
        if a.shape != m.shape:
            raise DraftsmithError(f"record {i} of a batch has {a.numel()} input_ids but {m.numel()} loss_mask entries")
    width = max(a.numel() for a in ids)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (a, m) in enumerate(zip(ids, masks)):
        input_ids[i, : a.numel()] = a
        attention[i, : a.numel()] = 1
        loss_mask[i, : m.numel()] = m
    extra = {name: _pad_stack([r[name] for r in rows], width, max_length) for name in ("hidden", "topk_ids", "topk_logits")
             if name in rows[0] and rows[0][name] is not None}
    return Batch(input_ids, attention, loss_mask, empty_rows=int((loss_mask.sum(-1) == 0).sum()), **extra)


def _pad_stack(values: list[Any], width: int, max_length: int) -> Tensor:
    ts = [torch.as_tensor(v)[:max_length] for v in values]
    out = ts[0].new_zeros((len(ts), width, *ts[0].shape[1:]))
    for i, t in enumerate(ts):
        out[i, : t.shape[0]] = t
    return out
