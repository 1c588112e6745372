"""The recipe's ``eval`` section: what ``draftsmith eval`` evaluates on, and how it times.

How to decode is the ``decode`` section (:class:`~draftsmith.measure.config.DecodeConfig`, in the
measurement layer that every stage decodes through).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from ..engines import Launch
from ..engines.llamacpp import DraftGGUFType, NgramMethod, TargetGGUFType
from ..errors import ConfigError


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
    n-gram methods (``measure/engine.py``; written under "engine" in eval_metrics.json)."""
    engine_threads: int = 0
    """llama.cpp's threads (0 = every core; set 1 on a loaded machine: its spinning threads slow 10-15× there)."""
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
    """llama.cpp's model-free methods measured beside."""

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
