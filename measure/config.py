"""The recipe's ``decode`` section: how to decode (chains or trees, k, max_new_tokens, sampling, the gate).

``decode/`` takes plain values (k, max_new_tokens, a :class:`~draftsmith.decode.sampling.Warp`,
a seed); this section is where a recipe names them, validated with the key that is wrong. Here in the
measurement layer, since every measurement decodes by it (``draftsmith eval``, ``report``, training-time
evaluation, the benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..decode.sampling import Warp
from ..decode.tree import DynamicTree, StaticTree, TreeShape
from ..errors import ConfigError, DraftsmithError


@dataclass
class DecodeConfig:
    k: int = 4
    """Draft tokens proposed per round."""
    max_new_tokens: int = 128
    temperature: float = 0.0
    """0 = greedy (token-identical to the target's own greedy decoding)."""
    top_k: int = 0
    """0 disables."""
    top_p: float = 1.0
    """1.0 disables."""
    seed: int = 0
    """Seeds the sampler: same seed, same output."""
    min_confidence: float = 0.0
    """The confidence gate, one parameter of both decoders — chains (and a chain verified as a tree): verify
    only the leading drafts whose running product of the drafter's own probabilities is ≥ this; dynamic
    trees: draft only the slots whose path confidence is ≥ this; a static tree is fixed (0 = off; lossless
    either way, see ``decode/chain.py`` and ``decode/tree.py``).
    A draft less likely to be accepted than verifying one more token costs, v(1) − 1 of a target step
    (benchmarks/RESULTS.md, "cpu_linear"), costs more than it gives."""
    tree: Literal["none", "static", "dynamic"] = "none"
    """none: chains of k drafts; static: the fixed tree tree_paths (Medusa-style); dynamic: EAGLE-2's
    tree (tree_depth levels, tree_top_k expanded per level, tree_budget nodes). Drafters without a tree
    runtime draft chains of the tree's depth (the degenerate tree)."""
    tree_paths: str | list[list[int]] = "default"
    """static: a named tree (default: 16 nodes, depth 4; chain4) or a list of child-rank paths, e.g.
    [[0], [1], [0, 0]] (every prefix a path; a rank c > 0 needs its elder sibling c − 1)."""
    tree_depth: int = 2
    """dynamic: levels below the last committed token (the most drafts accepted per round)."""
    tree_top_k: int = 2
    """dynamic: child slots expanded per level (and per node)."""
    tree_budget: int = 4
    """dynamic: drafted tokens verified per round. The defaults (depth 2, top-k 2, 4 nodes) were the CPU's
    before ``cpu_kernels/cpu_linear.py``, when verification cost grew with the nodes. With it, and with
    ``min_confidence`` gating the tree's slots, depth 1 / top-k 3 / 3 nodes at gate 0.1 ran fastest with
    the demo's head, ahead of the gated chain (bf16, 2-core CPU; benchmarks/RESULTS.md, "tree"): the demo
    uses that. GPU (EAGLE's reference decoder): depth 5, top-k 8, 63."""

    def validate(self) -> None:
        if self.k < 1:
            raise ConfigError(f"decode.k = {self.k}: the number of draft tokens per round must be at least 1")
        if self.max_new_tokens < 1:
            raise ConfigError(f"decode.max_new_tokens = {self.max_new_tokens} must be at least 1")
        if self.temperature < 0:
            raise ConfigError(f"decode.temperature = {self.temperature} must be ≥ 0 (0 = greedy)")
        if self.top_k < 0:
            raise ConfigError(f"decode.top_k = {self.top_k} must be ≥ 0 (0 disables)")
        if not 0.0 <= self.min_confidence < 1.0:
            raise ConfigError(f"decode.min_confidence = {self.min_confidence} must be in [0, 1) (0 = no gate)")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"decode.top_p = {self.top_p} must be in (0, 1]")
        for name in ("tree_depth", "tree_top_k", "tree_budget"):
            if getattr(self, name) < 1:
                raise ConfigError(f"decode.{name} = {getattr(self, name)} must be at least 1")
        self.tree_shape()  # a bad tree_paths fails at load

    def tree_shape(self) -> TreeShape | None:
        """The plain tree shape the decoder takes, or None for chains."""
        try:
            if self.tree == "static":
                return StaticTree.named_or_given(self.tree_paths)
            if self.tree == "dynamic":
                return DynamicTree(self.tree_depth, self.tree_top_k, self.tree_budget)
        except DraftsmithError as e:
            raise ConfigError(f"decode.tree_paths: {e}") from e
        return None

    @property
    def depth(self) -> int:
        """The most drafts a round can accept: k, or the tree's depth."""
        shape = self.tree_shape()
        return self.k if shape is None else shape.depth

    @property
    def warp(self) -> Warp:
        return Warp(self.temperature, self.top_k, self.top_p)
