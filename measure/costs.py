"""What the decoder and a drafter cost, in units of one target step: the ceiling and c.

Speculative decoding's speed, per round, in units of one target step (one forward of one
token over the cache):

    speedup(k) = τ(k) / (v(k) + k · c)

* ``v(k)`` — one verification forward over k + 1 tokens, relative to a one-token step
  (:func:`verify_costs`). In bf16 on a 2-core CPU v(4) ≈ 1.0: verifying is nearly free.
* ``c`` — one draft step of the drafter, relative to a one-token target step
  (:func:`draft_cost`).
* ``τ(k)`` — tokens per round, bonus counted: 1 + Σ_{i≤k} Π_{j≤i} α_j with α_j the
  acceptance of draft j given drafts 1..j−1 were accepted (:func:`tau_from_acceptance`).

The decoder's ceiling is what a drafter that is always right and free gives: τ = k + 1,
c = 0, so ``bound(k) = (k + 1) / v(k)``. :class:`OracleDrafter` is that drafter: it
proposes the continuation the decoder will emit (its own greedy fixed point, computed
untimed before the timed run), so the measured speedup of the oracle against the target's
own ``generate`` shows how much of the bound the decoder loop keeps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..decode.chain import speculative_decode
from ..decode.protocol import Proposal, ability_methods
from ..decode.sampling import Warp
from ..decode.stats import conditional_acceptance, tau_from_acceptance  # noqa: F401 — conditional_acceptance re-exported
from ..target import Target, crop_cache


class OracleDrafter:
    """Proposes a known continuation at no cost (greedy only): the decoder's ceiling.

    ``reference`` is the full sequence (prompt + new tokens) the decoder is expected to emit;
    after each update the drafter proposes the next k tokens of it that follow the committed
    sequence, or nothing once the committed sequence has left the reference.
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(self, reference: Sequence[int]):
        self.reference = list(reference)
        self.reset()

    def reset(self) -> None:
        self.length = 0
        self.on_track = True

    def update(self, tokens: Tensor, features: Tensor | None = None) -> None:
        new = tokens.tolist()
        if self.on_track and self.reference[self.length : self.length + len(new)] != new:
            self.on_track = False
        self.length += len(new)

    def propose(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal:
        if not warp.greedy:
            raise ValueError("the oracle drafter proposes a greedy continuation only")
        drafts = self.reference[self.length : self.length + k] if self.on_track else []
        return Proposal(tokens=torch.tensor(drafts, dtype=torch.long), probs=None)


def oracle_reference(target: Target, prompt: list[int], k: int, max_new_tokens: int, tries: int = 4) -> list[int]:
    """The decoder's own greedy output under an oracle, iterated to a fixed point (untimed).

    In fp32 the target's ``generate`` output is already the fixed point. In bf16 a block
    verification rounds differently from one-token steps, so the oracle first proposes the
    decoder's previous output and is refined until the decoder emits exactly what it proposes.
    """
    from .reference import target_greedy

    new = target_greedy(target, prompt, max_new_tokens)
    for _ in range(tries):
        out = speculative_decode(target, OracleDrafter(prompt + new), prompt, k=k, max_new_tokens=max_new_tokens).tokens
        if out == new:
            break
        new = out
    return prompt + new


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


# ------------------------------------------------------------------ the ceiling benchmark


def bench_ceiling(
    target: Target,
    prompts: list[list[int]],
    ks: Sequence[int],
    max_new_tokens: int,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The oracle drafter at every k against the target's own greedy ``generate``, and the bound.

    Per prompt (after ``warmup`` untimed prompts): the target alone, the oracle at each k (the
    order rotates per prompt), the target alone again; a prompt's target speed is the mean of
    its two runs. The oracle's reference is computed untimed before (:func:`oracle_reference`).
    The bound (k+1)/v(k) comes from :func:`verify_costs` measured in the same run.

    The bound counts decoding rounds only, while both sides also pay the prompt's prefill — on a CPU a
    sizeable share of a short decode (benchmarks/RESULTS.md, "ceiling"). So each
    row also gives the **decode-phase** speedup, (t_alone − P) / (t_oracle − P), with P the prompt's
    prefill (one forward over it into a fresh cache, median of 3, same process), and its share of
    the bound: the loop's own efficiency, which the end-to-end figure dilutes toward 1.

    And the **end-to-end bound**, the bound with the prefill counted as the target alone pays it:
    t_alone / (P + (t_alone − P) · v(k) / (k+1)) per prompt — the fastest any decoder could run
    that prompt end to end, since no drafter shortens the prompt's forward. The oracle's end-to-end
    speedup over it is the share that compares like with like; (k+1)/v(k) itself holds only as the
    answers grow long next to the prompt.
    """
    from .reference import target_greedy

    def prefill_s(prompt: list[int]) -> float:
        ids, times = torch.tensor([prompt], device=target.device), []
        for _ in range(3):
            cache = target.new_cache()
            t0 = time.perf_counter()
            target.forward(ids, cache, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def oracle_run(prompt: list[int], k: int) -> tuple[float, float, int]:
        ref = oracle_reference(target, prompt, k, max_new_tokens)
        res = speculative_decode(target, OracleDrafter(ref), prompt, k=k, max_new_tokens=max_new_tokens)
        return res.stats.tokens_per_s, res.stats.tau, res.stats.new_tokens

    def alone(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        n = len(target_greedy(target, prompt, max_new_tokens))
        return n / (time.perf_counter() - t0)

    for p in prompts[:warmup]:
        alone(p)
        oracle_run(p, max(ks))
    rows: dict[int, list[dict[str, float]]] = {k: [] for k in ks}
    for i, p in enumerate(prompts[warmup:]):
        before = alone(p)
        order = list(ks)[i % len(ks):] + list(ks)[: i % len(ks)]
        runs = {k: oracle_run(p, k) for k in order}
        base = (before + alone(p)) / 2
        prefill = prefill_s(p)
        for k, (tps, tau, n) in runs.items():
            t_alone, t_oracle = n / base, n / tps  # both emit the same n in fp32 (and almost always in bf16)
            rows[k].append({"tokens_per_s": tps, "target_tokens_per_s": base, "speedup": tps / base, "tau": tau,
                            "new_tokens": n, "prefill_s": prefill,
                            "decode_speedup": (t_alone - prefill) / max(t_oracle - prefill, 1e-9),
                            "prefill_share": min(prefill / t_alone, 1.0)})  # f: the end-to-end bound's share
        if progress:
            progress(f"prompt {i + 1}: target {base:.1f} tok/s; oracle speedup "
                     + ", ".join(f"k={k} {runs[k][0] / base:.2f}x" for k in ks))
    v = verify_costs(target, prompts[0], ks)
    table = []
    for k in ks:
        speedup = statistics.median(r["speedup"] for r in rows[k])
        decode = statistics.median(r["decode_speedup"] for r in rows[k])
        bound = (k + 1) / v[k]
        # per prompt: the bound with the prefill (share f of the target's time) paid on both sides
        e2e_bounds = [1 / (r["prefill_share"] + (1 - r["prefill_share"]) / bound) for r in rows[k]]
        e2e = statistics.median(e2e_bounds)
        share_e2e = statistics.median(r["speedup"] / b for r, b in zip(rows[k], e2e_bounds))
        table.append({"k": k, "verify_cost": round(v[k], 3), "bound": round(bound, 3),
                      "oracle_speedup": round(speedup, 3), "share_of_bound": round(speedup / bound, 3),
                      "end_to_end_bound": round(e2e, 3), "share_of_end_to_end_bound": round(share_e2e, 3),
                      "decode_phase_speedup": round(decode, 3), "decode_phase_share_of_bound": round(decode / bound, 3),
                      "prefill_s": round(statistics.median(r["prefill_s"] for r in rows[k]), 4),
                      "oracle_tau": round(statistics.median(r["tau"] for r in rows[k]), 3),
                      "target_tokens_per_s": round(statistics.median(r["target_tokens_per_s"] for r in rows[k]), 2),
                      "oracle_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rows[k]), 2)})
    return {"max_new_tokens": max_new_tokens, "prompts": len(prompts) - warmup, "table": table}


def format_ceiling(res: dict[str, Any], dtype: str) -> str:
    lines = [f"| k ({dtype}) | v(k) | bound (k+1)/v(k) | oracle speedup vs target alone | share of bound | "
             f"end-to-end bound (prefill paid) | share of it | decode phase (prefill out) | its share of bound | "
             f"oracle τ |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["table"]:
        lines.append(f"| {r['k']} | {r['verify_cost']:.2f} | {r['bound']:.2f}× | {r['oracle_speedup']:.2f}× | "
                     f"{100 * r['share_of_bound']:.0f}% | {r['end_to_end_bound']:.2f}× | "
                     f"{100 * r['share_of_end_to_end_bound']:.0f}% | {r['decode_phase_speedup']:.2f}× | "
                     f"{100 * r['decode_phase_share_of_bound']:.0f}% | {r['oracle_tau']:.2f} |")
    return "\n".join(lines)
