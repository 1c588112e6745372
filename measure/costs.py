"""What the decoder and a drafter cost, in units of one target step: v(k), c and τ from acceptance.

Speculative decoding's speed, per round, in units of one target step (one forward of one
token over the cache):

    speedup(k) = τ(k) / (v(k) + k · c)

* ``v(k)`` — one verification forward over k + 1 tokens, relative to a one-token step
  (:func:`verify_costs`). In bf16 on a 2-core CPU verifying a few tokens costs about one step: nearly free
  (benchmarks/RESULTS.md, "cpu_linear" and "ceiling").
* ``c`` — one draft step of the drafter, relative to a one-token target step
  (:class:`TimedDrafter` adds up the drafter's seconds; :func:`target_step_seconds` is the unit).
* ``τ(k)`` — tokens per round, bonus counted: 1 + Σ_{i≤k} Π_{j≤i} α_j with α_j the
  acceptance of draft j given drafts 1..j−1 were accepted (:func:`tau_from_acceptance`).

The decoder's ceiling is what a drafter that is always right and free gives: τ = k + 1,
c = 0, so ``bound(k) = (k + 1) / v(k)``; ``benchmarks/ceiling.py`` measures how much of it the
decoder loop keeps, with an oracle drafter.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..decode.protocol import Proposal, ability_methods
from ..decode.sampling import Warp
from ..decode.stats import tau_from_acceptance
from ..target import Target, crop_cache


@torch.inference_mode()
def verify_costs(target: Target, prompt: list[int], ks: Sequence[int], context: int = 200, repeats: int = 7) -> dict[int, float]:
    """v(k): median time of one forward over k + 1 new tokens on a ``context``-token cache,
    relative to one over 1 token (the same cache, interleaved)."""
    ids = (prompt * (context // max(len(prompt), 1) + 1))[:context]
    cache = target.new_cache()
    target.forward(torch.tensor([ids], device=target.device), cache, logits_to_keep=1)
    sizes = sorted({1, *[k + 1 for k in ks]})
    times: dict[int, list[float]] = {s: [] for s in sizes}
    block = torch.tensor([ids[: max(sizes)]], device=target.device)
    for r in range(repeats + 1):
        for s in sizes if r % 2 else reversed(sizes):
            t0 = time.perf_counter()
            target.forward(block[:, :s], cache)
            dt = time.perf_counter() - t0
            crop_cache(cache, context)
            if r:  # the first pass warms up
                times[s].append(dt)
    one = statistics.median(times[1])
    return {k: statistics.median(times[k + 1]) / one for k in ks}


def predicted_speedup(conditional: Sequence[float], k: int, v: float, c: float) -> float:
    """τ(k) / (v(k) + k·c): the speedup over the target alone that the cost model predicts."""
    return tau_from_acceptance(conditional, k) / (v + k * c)


class TimedDrafter:
    """Wraps a drafter and adds up the seconds it spends drafting (``propose``, ``update`` and the drafting
    abilities, ``DRAFTING``); ``drafted`` counts the draft tokens proposed (a tree's nodes).

    Every optional ability of the wrapped drafter (``decode/protocol.py``) is passed on, so the decoders
    use the same abilities through the wrapper: the drafting ones timed, the others as they are (``verify``
    of a self-speculative drafter is the target's own forward).
    """

    DRAFTING = ("propose_tree",)

    def __init__(self, drafter: Any):
        self.inner = drafter
        self.feature_layers = drafter.feature_layers
        self.seconds = 0.0
        self.drafted = 0
        for name, method in ability_methods(drafter).items():
            setattr(self, name, self._timed(method) if name in self.DRAFTING else method)

    def reset(self) -> None:
        self.inner.reset()

    def update(self, tokens: Tensor, features: Tensor | None) -> None:
        t0 = time.perf_counter()
        self.inner.update(tokens, features)
        self.seconds += time.perf_counter() - t0

    def propose(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal:
        return self._timed(self.inner.propose)(k, warp, generator)

    def _timed(self, draft: Callable[..., Any]) -> Callable[..., Any]:
        """``draft`` (a method returning drafts with ``tokens``: a Proposal, a DraftTree), timed and counted."""
        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = draft(*args)
            _sync(out.tokens)
            self.seconds += time.perf_counter() - t0
            self.drafted += int(out.tokens.shape[0])
            return out

        return timed


def median_interval(ratios: Sequence[float], level: float = 0.9, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A percentile-bootstrap ``level`` interval for the median of per-prompt ratios (prompts resampled with
    replacement, a fixed seed: the same ratios give the same interval). On a shared or bursty machine the
    same work's per-prompt speed ratio spreads widely between identical runs (benchmarks/RESULTS.md,
    "timing"), so a median over a few prompts is worth reading with its interval."""
    if not ratios:
        raise ValueError("no per-prompt ratios to bootstrap")
    gen = torch.Generator().manual_seed(seed)
    x = torch.tensor([float(r) for r in ratios], dtype=torch.float64)
    picks = torch.randint(len(x), (resamples, len(x)), generator=gen)
    medians = x[picks].sort(dim=1).values  # [resamples, n]; statistics.median of each row:
    n = len(x)
    med = (medians[:, (n - 1) // 2] + medians[:, n // 2]) / 2
    lo, hi = torch.quantile(med, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return lo, hi


def _sync(t: Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)


@torch.inference_mode()
def target_step_seconds(target: Target, prompt: list[int], context: int = 200, repeats: int = 16) -> float:
    """Median seconds of one one-token target forward over a ``context``-token cache."""
    ids = (prompt * (context // max(len(prompt), 1) + 1))[:context]
    cache = target.new_cache()
    target.forward(torch.tensor([ids], device=target.device), cache, logits_to_keep=1)
    one = torch.tensor([ids[:1]], device=target.device)
    times = []
    for r in range(repeats + 2):
        t0 = time.perf_counter()
        out = target.forward(one, cache)
        _sync(out.logits)
        if r >= 2:
            times.append(time.perf_counter() - t0)
        crop_cache(cache, context)
    return statistics.median(times)
