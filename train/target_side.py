"""The target's side of a training batch: its features and logits, online or from the feature cache.

Online, the frozen target runs once per micro-batch (no gradient); offline (``train.features``),
the same tensors are read from the feature cache that ``draftsmith prepare`` wrote, and the
target's logits are rebuilt from its cached last layer (or its cached top-k logits).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import DraftsmithError
from ..target import Target, TargetOutput
from .data import Batch
from .setup import Run


@torch.no_grad()
def target_forward(run: Run, batch: Batch, feature_layers: tuple[int, ...] = ()) -> TargetOutput:
    """The frozen target on a batch: logits [B, S, V] and the features of ``feature_layers``."""
    return run.target.forward(batch.input_ids, feature_layers=feature_layers, attention_mask=batch.attention_mask)


def features_and_logits(run: Run, batch: Batch, layers: tuple[int, ...],
                        rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The target's features of ``layers`` [B, S, len(layers)·H] and its logits [B, S, V], or with
    ``rows`` ([B, S] bool) its logits at those positions only, [N, V] in row-major order.

    Online: one forward of the frozen target. Offline: read from the feature cache. The logits are
    the widest tensor of a step (V = 49152 for SmolLM2): rebuilt from the cache at the rows a loss
    reads (the answer tokens, no padding), they cost a third of rebuilding every row on the demo's data.
    """
    if not run.offline:
        out = target_forward(run, batch, layers)
        return out.features, out.logits if rows is None else out.logits[rows]
    if batch.hidden is None:
        raise DraftsmithError("offline training needs the feature cache's hidden states in every batch")
    cached = list(run.rows.layer_ids)
    features = cached_layers(batch.hidden, cached, layers, run.target.hidden_size)
    return features.to(run.target.dtype), cached_logits(run.target, batch, cached, rows)


def cached_layers(hidden: Tensor, cached: list[int], wanted: tuple[int, ...], hidden_size: int) -> Tensor:
    """The ``wanted`` layers' slices of cached features [B, S, len(cached)·H] → [B, S, len(wanted)·H]."""
    missing = [layer for layer in wanted if layer not in cached]
    if missing:
        raise DraftsmithError(f"the feature cache holds target layers {cached}, but this drafter needs {list(wanted)} "
                              f"(missing {missing}); rebuild it with those layers (data.features.layer_ids) or train "
                              f"online (train.features empty)")
    cols = [cached.index(layer) for layer in wanted]
    return torch.cat([hidden[..., c * hidden_size : (c + 1) * hidden_size] for c in cols], dim=-1)


@torch.no_grad()
def cached_logits(target: Target, batch: Batch, cached: list[int], rows: Tensor | None = None) -> Tensor:
    """The target's logits [B, S, V] (or [N, V] at ``rows``) without running it: its final norm and
    lm_head on the cached last layer (exact up to the cache's bf16), else the cached top-k logits with
    −inf elsewhere."""
    from ..drafters.common import target_parts

    last = target.num_layers - 1
    pick = (lambda x: x) if rows is None else (lambda x: x[rows])
    if last in cached:
        parts = target_parts(target.model)
        h = pick(cached_layers(batch.hidden, cached, (last,), target.hidden_size)).to(target.dtype)
        return parts.lm_head(parts.norm(h))
    if batch.topk_ids is not None and batch.topk_logits is not None:
        ids, values = pick(batch.topk_ids), pick(batch.topk_logits)
        full = torch.full((*ids.shape[:-1], target.vocab_size), float("-inf"), device=values.device)
        return full.scatter(-1, ids, values.float())
    raise DraftsmithError(f"the feature cache has neither the target's last layer ({last}) nor top-k logits, so it "
                          f"gives no target distribution; rebuild it with layer {last} in data.features.layer_ids "
                          f"or data.features.topk > 0")


def rows_ahead(x: Tensor, n: int, mask: Tensor) -> Tensor:
    """``shift_left(x, n)[mask]`` without building the shifted copy: the rows ``x[b, t + n]`` for
    every ``mask[b, t]``. x: [B, S, ...] (e.g. the target's logits [B, S, V]); mask: [B, S] bool,
    False in its last n columns (they have no row n ahead). Returns [N, ...], N = mask.sum()."""
    return x[:, n:][mask[:, : max(x.shape[1] - n, 0)]]


def uniform_noise(x: Tensor, amplitude: float) -> Tensor:
    """x + U(−a, a) elementwise (EAGLE's feature noise); x itself when a = 0."""
    if amplitude <= 0:
        return x
    return x + (torch.rand_like(x) * 2 - 1) * amplitude
