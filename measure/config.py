"""The recipe's ``decode`` and ``eval`` sections, and :class:`EvalRecipe`, what a measured run reads of a recipe.

``decode`` says how to decode (chains or trees, k, max_new_tokens, sampling, the gate). ``decode/`` takes plain values (k, max_new_tokens, a :class:`~draftsmith.decode.sampling.Warp`,
a seed); this section is where a recipe names them, validated with the key that is wrong. Here in the
measurement layer, since every measurement decodes by it (``draftsmith eval``, ``report``, training-time
evaluation, the benchmarks). ``eval`` says what to measure on and how to time it (the prompt set, repeats,
baselines, the serving engine): read by ``draftsmith eval``, by ``report`` and ``train``'s decoder evaluation,
and by the served measurement (``engine_eval.py``), so it lives here below them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from ..decode.sampling import Warp
from ..decode.tree import DynamicTree, StaticTree, TreeShape
from ..drafters.registry import DrafterConfig
from ..engines import Launch
from ..engines.llamacpp import DraftGGUFType, NgramMethod, TargetGGUFType
from ..errors import ConfigError, DraftsmithError
from ..target import TargetConfig


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
    either way, see ``decode/rounds.py`` and ``decode/tree.py``).
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


@dataclass
class EvalConfig:
    prompts: str = "mtbench"
    """"mtbench" (first turns of the 80 MT-bench questions), "copyheavy" (24 fix / rewrite / summarize prompts
    built from ShareGPT, measure/prompts/copyheavy.jsonl) or a JSONL path with 'turns' or 'prompt'."""
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
    engine: Launch = "none"
    """llamacpp: also serve the drafter (drafter.type=saved) in llama.cpp, exported to GGUF by llama.cpp's own
    converter, and measure it there against llama.cpp's target alone on the same prompts, beside llama.cpp's
    n-gram methods (``measure/engine_eval.py``; written under "engine" in eval_metrics.json)."""
    engine_threads: int = 0
    """llama.cpp's threads (0 = every core; set 1 on a loaded machine: its spinning threads slow it many times there)."""
    engine_target_type: TargetGGUFType = "as-loaded"
    """The target's GGUF in llama.cpp: as-loaded (the GGUF it came from, e.g. the builtin's Q4_1) or a converted one."""
    engine_draft_type: DraftGGUFType = "auto"
    """The drafter's GGUF type: auto (its stored dtype) or a converted one."""
    engine_k: list[int] = field(default_factory=list)
    """Draft lengths served (one llama-server each); [] = [decode.k]."""
    engine_p_min: list[float] = field(default_factory=lambda: [0.0, 0.5])
    """llama.cpp's confidence gate ``--spec-draft-p-min`` (drafting stops at the first position whose top draft
    probability is below it; 0 = none), swept with engine_k: one llama-server per (k, p-min). The fastest setting
    is recorded under "best" (and in the export's draftsmith_export.json) with the llama-server command that
    serves it (docs/eval.md)."""
    engine_ngram: list[NgramMethod] = field(default_factory=lambda: ["ngram-simple", "ngram-mod"])
    """llama.cpp's model-free methods measured beside the drafter, and the drafter mixed with ngram-simple; [] =
    the drafter alone against the target."""

    def validate(self) -> None:
        if self.num_prompts < 1:
            raise ConfigError(f"eval.num_prompts = {self.num_prompts} must be at least 1")
        if self.repeats < 1:
            raise ConfigError(f"eval.repeats = {self.repeats} must be at least 1")
        if self.engine_threads < 0:
            raise ConfigError(f"eval.engine_threads = {self.engine_threads} must be ≥ 0 (0 = every core)")
        if any(k < 1 for k in self.engine_k):
            raise ConfigError(f"eval.engine_k = {self.engine_k}: every draft length must be at least 1")
        if not self.engine_p_min or not all(0.0 <= p < 1.0 for p in self.engine_p_min):
            raise ConfigError(f"eval.engine_p_min = {self.engine_p_min}: give one or more gates, each in [0, 1)")
        if len(set(self.baselines)) != len(self.baselines):
            raise ConfigError(f"eval.baselines = {self.baselines} names a drafter twice")


class EvalRecipe(Protocol):
    """What a stage that measures a drafter reads of the recipe: ``draftsmith eval``'s whole input, and the part
    of it ``report`` (``report.config.ReportRecipe``), ``train`` (``train.config.TrainRecipe``) and the served
    measurement (``measure/engine_eval.py``) read. The top-level ``config.Recipe`` has these sections and satisfies it;
    the stages name this protocol because ``config`` lies above them (it imports their sections)."""

    run_dir: str
    target: TargetConfig
    drafter: DrafterConfig
    decode: DecodeConfig
    eval: EvalConfig
