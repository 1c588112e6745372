"""Pure sampling functions of speculative decoding (Chen et al. 2023, "Accelerating
Large Language Model Decoding with Speculative Sampling").

The rule, for target distribution p and draft distribution q, both *after* the same
temperature / top-k / top-p warp:

* accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i));
* at the first rejection, emit a token drawn from norm(max(0, p_i − q_i));
* if all k drafts are accepted, emit a bonus token drawn from p_{k+1}.

The emitted sequence is then distributed exactly as sampling from p alone.
Greedy mode (temperature 0) accepts while the draft equals the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Warp:
    """Temperature, top-k and top-p, applied identically to target and drafter logits."""

    temperature: float = 0.0
    """0 means greedy (argmax); otherwise logits are divided by it."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose mass reaches top_p; 1.0 disables."""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def probs(self, logits: Tensor) -> Tensor:
        """[..., V] logits → [..., V] float32 probabilities after the warp (one-hot if greedy)."""
        logits = logits.float()
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        logits = logits / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            # drop a token when the mass strictly before it already reaches top_p (keeps ≥ 1 token)
            drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= self.top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits.softmax(-1)

    def choose(self, logits: Tensor, generator: torch.Generator | None) -> tuple[int, Tensor | None]:
        """Pick one token from [V] logits. Returns (token, warped probs or None in greedy mode)."""
        if self.greedy:
            return int(logits.argmax(-1)), None
        probs = self.probs(logits)
        return int(torch.multinomial(probs, 1, generator=generator)), probs


def speculative_accept(
    p: Tensor, q: Tensor, draft: Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """One verification step of speculative sampling.

    p: [k+1, V] target probabilities at the positions of (last token, d_1 … d_k);
    q: [k, V] drafter probabilities that d_1 … d_k were sampled from;
    draft: [k] the drafted tokens.
    Returns (n_accepted in 0..k, next_token): the emitted tokens are draft[:n] + [next_token].
    """
    k = draft.shape[0]
    idx = torch.arange(k, device=p.device)
    p_x = p[idx, draft]  # [k]
    q_x = q[idx, draft]  # [k]
    u = torch.rand(k, generator=generator, device=p.device)
    # u < p/q written as u*q < p: exact for q == 0 too (then accept iff p > 0)
    rejected = (u * q_x >= p_x).nonzero()
    n = int(rejected[0]) if rejected.numel() else k
    if n == k:
        dist = p[k]
    else:
        residual = (p[n] - q[n]).clamp_min(0.0)
        total = residual.sum()
        # residual is all zero only when p == q, where rejection has probability 0
        dist = residual / total if total > 0 else p[n]
    return n, int(torch.multinomial(dist, 1, generator=generator))


def greedy_accept(target_argmax: Tensor, draft: Tensor) -> tuple[int, int]:
    """Greedy verification. target_argmax: [k+1]; draft: [k]. Returns (n_accepted, next_token)."""
    k = draft.shape[0]
    mismatch = (target_argmax[:k] != draft).nonzero()
    n = int(mismatch[0]) if mismatch.numel() else k
    return n, int(target_argmax[n])
