"""The recipe's ``decode`` and ``eval`` sections: how to decode, and what to evaluate on.

``decode/`` takes plain values (k, max_new_tokens, a :class:`~draftsmith.decode.sampling.Warp`,
a seed); these sections are where a recipe names them, validated with the key that is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    """The confidence gate — chains: verify only the leading drafts whose running product of the
    drafter's own probabilities is ≥ this; dynamic trees: draft only the slots whose path confidence is
    ≥ this (0 = off; lossless either way, see ``decode/chain.py`` and ``decode/tree.py``).
    On a CPU where verifying one more token costs v(1) − 1 ≈ 0.35 of a step (bf16, 2 cores), a draft
    less likely than that to be accepted costs more than it gives."""
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
    before ``kernels/cpu_linear.py``, when verification cost grew with the nodes. With it, and with
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
                return DynamicTree(self.tree_depth, self.tree_top_k, self.tree_budget, self.min_confidence)
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


@dataclass
class EvalConfig:
    prompts: str = "mtbench"
    """"mtbench" (first turns of the 80 MT-bench questions), "copyheavy" (24 fix / rewrite / summarize prompts
    built from ShareGPT, eval/prompts/copyheavy.jsonl) or a JSONL path with 'turns' or 'prompt'."""
    num_prompts: int = 10
    """How many prompts to decode (from the start of the set)."""
    check_identity: bool = False
    """Greedy only: check every output token for token against the target's own greedy decoding and fail on
    any difference. Checked in fp32 (where it is exact): in the same run when target.dtype is float32, else
    in a second pass with the target reloaded in float32."""
    time_target: bool = True
    """Also decode every prompt with the target alone (its greedy ``generate``, same process, dtype and threads,
    interleaved after a warm-up) and report target_tokens_per_s and speedup_vs_target. Speed is meant to be
    measured in bf16 on CPU (target.dtype=bfloat16: verifying a few tokens costs about one token there;
    benchmarks/RESULTS.md, "cpu_linear" and "ceiling")."""
    repeats: int = 2
    """Timed runs of each prompt per method (the target alone, the drafter, each baseline), in an order that
    rotates from run to run; each method's fastest run counts. On a small shared CPU one prompt's speed moves
    a lot between identical runs, and the fastest of 2 paired runs narrowed that most for its cost, hence the
    default (benchmarks/RESULTS.md, "timing"). 1 halves the timed work."""
    baselines: list[str] = field(default_factory=lambda: ["prompt_lookup"])
    """Model-free drafters (default settings) also run on the same prompts, reported as baseline rows
    under "baselines" in eval_metrics.json (with their speedup against the same run's target-alone timing);
    [] turns them off."""
    engine: Literal["none", "llamacpp"] = "none"
    """llamacpp: also serve the drafter (drafter.type=saved) in llama.cpp, exported to GGUF by llama.cpp's own
    converter, and measure it there against llama.cpp's target alone on the same prompts, beside llama.cpp's
    n-gram methods (``eval/engine.py``; written under "engine" in eval_metrics.json)."""
    engine_threads: int = 0
    """llama.cpp's threads (0 = every core; set 1 on a loaded machine: its spinning threads slow 10-15× there)."""
    engine_target_type: str = "as-loaded"
    """The target's GGUF in llama.cpp: as-loaded (the GGUF it came from, e.g. the builtin's Q4_1), f32, bf16, f16, q8_0."""
    engine_draft_type: str = "auto"
    """The drafter's GGUF type: auto (its stored dtype), f32, bf16, f16, q8_0."""
    engine_k: list[int] = field(default_factory=list)
    """Draft lengths served (one llama-server each); [] = [decode.k]."""
    engine_ngram: list[str] = field(default_factory=lambda: ["ngram-simple", "ngram-mod"])
    """llama.cpp's model-free methods measured beside (ngram-simple, ngram-cache, ngram-mod)."""

    def validate(self) -> None:
        if self.num_prompts < 1:
            raise ConfigError(f"eval.num_prompts = {self.num_prompts} must be at least 1")
        if self.repeats < 1:
            raise ConfigError(f"eval.repeats = {self.repeats} must be at least 1")
        if self.engine not in ("none", "llamacpp"):
            raise ConfigError(f"eval.engine = {self.engine!r}: choose none or llamacpp")
        if self.engine_threads < 0:
            raise ConfigError(f"eval.engine_threads = {self.engine_threads} must be ≥ 0 (0 = every core)")
        if self.engine_target_type not in ("as-loaded", "f32", "bf16", "f16", "q8_0"):
            raise ConfigError(f"eval.engine_target_type = {self.engine_target_type!r}: choose as-loaded, f32, bf16, f16 "
                              f"or q8_0")
        if self.engine_draft_type not in ("auto", "f32", "bf16", "f16", "q8_0"):
            raise ConfigError(f"eval.engine_draft_type = {self.engine_draft_type!r}: choose auto, f32, bf16, f16 or q8_0")
        if any(k < 1 for k in self.engine_k):
            raise ConfigError(f"eval.engine_k = {self.engine_k}: every draft length must be at least 1")
        unknown = sorted(set(self.engine_ngram) - {"ngram-simple", "ngram-cache", "ngram-mod"})
        if unknown:
            raise ConfigError(f"eval.engine_ngram names {unknown}; choose among ngram-simple, ngram-cache, ngram-mod")
        if len(set(self.baselines)) != len(self.baselines):
            raise ConfigError(f"eval.baselines = {self.baselines} names a drafter twice")
