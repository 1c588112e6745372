"""``draftsmith prepare``: run the asked-for stages of the data pipeline and print what each did.

Stages run in pipeline order, each reading what the previous one wrote:

1. read      sources → ``<out>/conversations/`` (always, when regenerate or tokenize is asked)
2. regenerate  → ``<out>/regenerate/`` shards → ``<out>/conversations_regenerated/`` (with
   ``data.regenerate.max_conversations`` N, the first N answered by the target, the rest with their own answers)
3. tokenize  conversations (regenerated ones when 'regenerate' is in the stages) → ``<out>/tokenized/``
4. features  tokenized → ``<out>/features/``
5. vocab     tokenized → ``<out>/draft_vocab.safetensors``

Every stage records the spec it was made from and is skipped when nothing changed, so
re-running prepare is cheap; the long stages (regenerate, features) resume after a kill,
extend when the data grows, and never discard finished shards for a setting that does not
change them; a change that would discard finished work stops with one line unless
``--restart`` (:mod:`draftsmith.data.shards`).

Under torchrun or the deepspeed launcher (``torchrun --nproc_per_node 8 $(which draftsmith)
prepare …``) every process loads the target on its own device and regenerate / features
split their shards between the processes; the cheap stages run on process 0 while the
others wait, then read its output. The files are the same as a one-process run's.
The summary (also written to ``<out>/summary.json``) counts records in, kept, skipped by
reason, tokens, loss-masked tokens, sizes and times.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from itertools import chain
from typing import Any

from ..decode.protocol import BuildsDrafter
from ..errors import DraftsmithError, writing
from ..files import changed_files, write_json
from ..schema import save_recipe
from ..tables import WIDTH, text_table, wrapped
from ..target import TargetConfig
from .config import STAGE_ORDER, DataConfig, PrepareRecipe
from .conversations import FORMAT as CONVERSATIONS_FORMAT
from .conversations import conversations_manifest, load_conversations, write_conversations
from .normalize import SKIP_REASONS, ReadStats, iter_conversations
from .shards import MANIFEST, SOLO, Workers, read_json
from .sources import SourceReport, repairs_note, source_identity


@dataclass(frozen=True)
class PreparedPaths:
    """Where ``draftsmith prepare`` writes, under one output folder: ``PreparedPaths.at(root)``."""

    root: str
    tokenized: str
    """The training dataset (see :mod:`draftsmith.data.tokenized`)."""
    features: str
    """The offline feature cache (see :mod:`draftsmith.data.feature_cache`)."""
    vocab: str
    """The EAGLE-3 draft vocabulary (see :mod:`draftsmith.data.vocab`)."""
    conversations: str
    regenerate: str
    regenerated: str
    cache: str

    @classmethod
    def at(cls, root: str) -> PreparedPaths:
        names = {"tokenized": "tokenized", "features": "features", "vocab": "draft_vocab.safetensors",
                 "conversations": "conversations", "regenerate": "regenerate",
                 "regenerated": "conversations_regenerated", "cache": ".cache"}
        return cls(root=root, **{k: os.path.join(root, v) for k, v in names.items()})


@dataclass
class StageRow:
    stage: str
    records_in: int | None = None
    kept: int | None = None
    skipped: int | None = None
    tokens: int | None = None
    loss_tokens: int | None = None
    size_bytes: int | None = None
    seconds: float = 0.0
    note: str = ""


@dataclass
class PrepareSummary:
    out_dir: str
    rows: list[StageRow] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    sources: list[dict[str, Any]] = field(default_factory=list)

    def add_skips(self, counts: dict[str, int], examples: dict[str, str]) -> None:
        """Count skipped records by reason, keeping the first example of each."""
        self.skipped.update(counts)
        for reason, where in examples.items():
            self.examples.setdefault(reason, where)

    def to_dict(self) -> dict[str, Any]:
        return {"out_dir": self.out_dir, "stages": [asdict(r) for r in self.rows],
                "skipped": dict(self.skipped), "skip_examples": self.examples, "sources": self.sources}


def run_prepare_recipe(recipe: PrepareRecipe, restart: bool = False,
                       workers: Callable[[], AbstractContextManager[Workers]] = lambda: nullcontext(SOLO)) -> dict[str, Any]:
    """``draftsmith prepare``: the whole command (the CLI and the demo call it). Opens ``workers`` for the run,
    writes the resolved recipe to ``<run_dir>/config.yaml`` (process 0), runs :func:`run_prepare` and returns
    its summary (``summary.json``'s content).

    workers: opens the processes that share regenerate and features — one process by default; under a
    launcher the CLI hands in ``train.distributed.sharing``, which opens the process group: data/ never
    touches the process group itself (``shards.Workers``)."""
    with workers() as w:
        if w.is_main:
            save_recipe(recipe)
        return run_prepare(recipe, workers=w, restart=restart).to_dict()


def run_prepare(recipe: PrepareRecipe, progress: bool = True, workers: Workers = SOLO, restart: bool = False) -> PrepareSummary:
    """Run ``recipe.data.stages`` for ``recipe.target``; print and return the summary (process 0 prints
    and writes it when several ``workers`` share the job). ``restart``: let regenerate and features discard
    finished shards that changed settings or inputs invalidate (without it they stop and say what changed)."""
    cfg: DataConfig = recipe.data
    paths = PreparedPaths.at(cfg.resolve_out_dir(recipe.run_dir))
    stages = [s for s in STAGE_ORDER if s in cfg.stages]
    summary = PrepareSummary(out_dir=paths.root)
    env = _Env(recipe.target)

    conv_folder = conv_hash = None
    if "regenerate" in stages or "tokenize" in stages:
        from ..chat import require_template

        require_template(env.tokenizer(), recipe.target.name)  # before reading anything: one line, no traceback
        with _main_first(workers):
            conv_folder, conv_hash = _read_stage(cfg, paths, summary)
    if "regenerate" in stages:
        conv_folder, conv_hash = _regenerate_stage(cfg, paths, env, recipe.drafter, conv_folder, summary, progress,
                                                   workers, restart)
    if "tokenize" in stages:
        with _main_first(workers):
            _tokenize_stage(cfg, paths, env, conv_folder, conv_hash, summary)
    if "features" in stages:
        _features_stage(cfg, paths, env, summary, progress, workers, restart)
    if "vocab" in stages and workers.is_main:
        _vocab_stage(cfg, paths, env, summary)
    if workers.is_main:
        write_json(os.path.join(paths.root, "summary.json"), summary.to_dict())
        print_summary(summary)
    workers.barrier()
    return summary


@contextmanager
def _main_first(workers: Workers) -> Iterator[None]:
    """Process 0 runs the block first; the others run it after (finding its output up to date)."""
    if not workers.is_main:
        workers.barrier()
    yield
    if workers.is_main:
        workers.barrier()


class _Env:
    """The target, loaded once, when the first stage that needs the model starts (regenerate in process,
    features); what its files say (tokenizer, config, fingerprint) for the stages that need no model
    (tokenize, vocab, regenerate through a server)."""

    def __init__(self, target_config: TargetConfig):
        self.target_config = target_config
        self._target = None
        self._files = None
        self._tokenizer = None

    @property
    def folder(self) -> str:
        from ..target import resolve_target_folder

        return resolve_target_folder(self.target_config.name)

    def target(self) -> Any:
        if self._target is None:
            from ..target import load_target

            self._target = load_target(self.target_config)
        return self._target

    def files(self) -> Any:
        """The loaded target if a stage loaded it, else the target as its files describe it (no model built)."""
        if self._target is not None:
            return self._target
        if self._files is None:
            from ..target import load_target_files

            self._files = load_target_files(self.target_config)
        return self._files

    def tokenizer(self) -> Any:
        if self._target is not None or self._files is not None:
            return self.files().tokenizer
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from ..chat import apply_option

            try:
                self._tokenizer = apply_option(AutoTokenizer.from_pretrained(self.folder), self.target_config.chat_template)
            except (OSError, ValueError) as e:
                raise DraftsmithError(f"could not load the tokenizer of target '{self.target_config.name}': {e}") from e
        return self._tokenizer

    def vocab_size(self) -> int:
        if self._target is not None:
            return self._target.vocab_size
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(self.folder).vocab_size)


def _damage(folder: str, manifest: dict[str, Any] | None, spec: Any) -> str:
    """Why an output made with ``spec`` cannot be reused although nothing it depends on changed: its files are not
    those its manifest records (a truncated or altered file, or an older draftsmith's manifest that records none);
    '' when it can, or when it is not this spec's output anyway."""
    if not isinstance(manifest, dict) or manifest.get("spec") != spec:
        return ""
    problems = changed_files(folder, manifest.get("files"))
    return f"{folder}: {'; '.join(problems)}" if problems else ""


def sample_folder(paths: PreparedPaths, i: int) -> str:
    """The job folder of the i-th more answer per prompt (``data.regenerate.samples``; i from 1)."""
    return f"{paths.regenerate}-sample{i}"


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- stages


def _read_stage(cfg: DataConfig, paths: PreparedPaths, summary: PrepareSummary) -> tuple[str, str]:
    start = time.perf_counter()
    spec = {"format": CONVERSATIONS_FORMAT, "sources": [source_identity(s) for s in cfg.sources],
            "max_conversations": cfg.max_conversations}
    manifest = conversations_manifest(paths.conversations)
    note = "up to date (reused)"
    damage = _damage(paths.conversations, manifest, spec)
    if manifest is None or manifest.get("spec") != spec or damage:
        stats = ReadStats()
        manifest = write_conversations(
            paths.conversations, iter_conversations(cfg.sources, cfg.max_conversations, stats), spec=spec,
            records_in=lambda: stats.records_in, skipped=lambda: dict(stats.skipped),
            examples=lambda: stats.examples, sources=lambda: [asdict(r) for r in stats.sources],
        )
        note = f"{damage}: read again" if damage else ""
    if manifest["num_conversations"] == 0:
        raise DraftsmithError(f"no usable conversation in data.sources (skipped: {manifest['skipped']}); "
                              f"check the paths, formats and role names")
    summary.add_skips(manifest["skipped"], manifest["examples"])
    summary.sources = manifest["sources"]
    stops = "; ".join(f"{s['name']}: {why}" for s in manifest["sources"]
                      for why in (s["stopped"], repairs_note(s)) if why)
    summary.rows.append(StageRow("read", manifest["records_in"], manifest["num_conversations"],
                                 sum(manifest["skipped"].values()), seconds=time.perf_counter() - start,
                                 note="; ".join(x for x in (note, stops) if x)))
    return paths.conversations, manifest["hash"]


def _regenerate_stage(cfg: DataConfig, paths: PreparedPaths, env: _Env, drafter_config: BuildsDrafter, conv_folder: str,
                      summary: PrepareSummary, progress: bool, workers: Workers, restart: bool) -> tuple[str, str]:
    from .regenerate import METHODS, own_answers, regenerate_conversations, regenerated_records

    from ..target import load_target

    r = cfg.regenerate
    method = METHODS[r.method]
    if not method.loads_target:
        # the client needs the tokenizer, the template, the end-of-turn ids and the fingerprint, not the model:
        # no weights in memory, every GPU of the node left to the server (vLLM, SGLang) that answers
        target = env.files()
    else:
        target = env.target()
    if method.loads_target and r.dtype != "target" and str(target.dtype) != f"torch.{r.dtype}":
        spec = env.target_config
        target = load_target(spec.name, r.dtype, str(target.device), spec.chat_template)  # this stage only
    drafter = drafter_config.build(target) if method.drafter else None
    conversations = load_conversations(conv_folder)
    own = []  # data.regenerate.max_conversations: the rest keep their own answers (keep_own_answers: all do)
    if r.max_conversations and r.max_conversations < len(conversations):
        own = [conversations.select(range(r.max_conversations, len(conversations)))]
        conversations = conversations.select(range(r.max_conversations))
    if r.keep_own_answers:
        own = [conversations, *own]
    report = regenerate_conversations(conversations, paths.regenerate, target, r,
                                      max_length=cfg.render.max_length, drafter=drafter, restart=restart,
                                      progress=progress, workers=workers)
    samples = [sample_folder(paths, i) for i in range(1, r.samples + 1)]  # more target answers per prompt, sampled
    for i, folder in enumerate(samples, 1):
        settings = replace(r, temperature=r.sample_temperature, seed=r.seed + i * 1_000_003, samples=0)
        more = regenerate_conversations(conversations, folder, target, settings, max_length=cfg.render.max_length,
                                        drafter=drafter, restart=restart, progress=progress, workers=workers)
        report.add(more)
    start = time.perf_counter()
    job = read_json(os.path.join(paths.regenerate, MANIFEST))
    if own:
        job = {"job": job, "own_answers": [conversations_manifest(conv_folder)["hash"], r.max_conversations, r.max_turns]
               + ([True] if r.keep_own_answers else [])}  # the digest of every mix recorded before the key stays
    if samples:
        job = {"job": job, "samples": [read_json(os.path.join(f, MANIFEST)) for f in samples]}
    job_digest = _digest(job)
    with _main_first(workers):
        manifest = conversations_manifest(paths.regenerated)
        damage = _damage(paths.regenerated, manifest, job_digest)
        if manifest is None or manifest.get("spec") != job_digest or damage:
            report.note += f"; {damage}: written again from the shards" if damage else ""
            with writing(paths.regenerated, kept=lambda: f"every shard in {paths.regenerate} (all finished); "
                                                         f"{paths.regenerated} is written whole or not at all"):
                records = chain(*(regenerated_records(f) for f in (paths.regenerate, *samples)))
                manifest = write_conversations(paths.regenerated, chain(records, *(own_answers(o, r.max_turns) for o in own)),
                                               spec=job_digest)
    summary.add_skips(report.skipped, report.examples)
    if samples:
        report.note = "; ".join(x for x in (report.note, f"{r.samples} more answer(s) per prompt sampled at temperature "
                                            f"{r.sample_temperature:g} (data.regenerate.samples)") if x)
    if own:
        why = "data.regenerate.keep_own_answers" if r.keep_own_answers else "data.regenerate.max_conversations"
        report.note = "; ".join(x for x in (report.note, f"{manifest['num_conversations'] - report.kept} more keep "
                                            f"their own answers ({why})") if x)
    finish = ", ".join(f"{k} {v}" for k, v in sorted(report.finish.items()))
    if report.render_back.get("differs"):
        finish += f"; {report.render_back['differs']} answer(s) do not render back to their ids"
    rate = f"{report.run_tokens / report.seconds:.1f} new tok/s" if report.seconds else ""  # this run's tokens only
    if rate and report.new_tokens > report.run_tokens:
        rate += (f" ({report.run_tokens:,} tokens generated now; {report.new_tokens - report.run_tokens:,} reused from "
                 f"an earlier run)")
    summary.rows.append(StageRow("regenerate", report.conversations_in, report.kept, sum(report.skipped.values()),
                                 tokens=report.new_tokens, seconds=report.seconds + time.perf_counter() - start,
                                 note="; ".join(x for x in (report.note, f"{report.turns} turns ({finish})", rate) if x)))
    return paths.regenerated, manifest["hash"]


def _tokenize_stage(cfg: DataConfig, paths: PreparedPaths, env: _Env, conv_folder: str, conv_hash: str,
                    summary: PrepareSummary) -> None:
    from ..target import tokenizer_fingerprint
    from .render import stop_token_ids
    from .tokenized import FORMAT as TOKENIZED_FORMAT
    from .tokenized import tokenize_conversations, tokenized_manifest

    start = time.perf_counter()
    tokenizer = env.tokenizer()
    stops = stop_token_ids(tokenizer, env.folder)
    spec = {"format": TOKENIZED_FORMAT, "conversations": conv_hash,
            "tokenizer_hash": tokenizer_fingerprint(tokenizer), "max_length": cfg.render.max_length,
            "last_turn_only": cfg.render.last_turn_only, "stop_ids": stops}
    try:
        manifest = tokenized_manifest(paths.tokenized)
    except DraftsmithError:
        manifest = None
    note = "up to date (reused)"
    damage = _damage(paths.tokenized, manifest, spec)
    if manifest is None or manifest.get("spec") != spec or damage:
        conversations = load_conversations(conv_folder)
        kept = f"the conversations in {conv_folder}; {paths.tokenized} is written whole or not at all"
        with writing(paths.tokenized, kept=lambda: kept):
            manifest = tokenize_conversations(
                conversations, paths.tokenized, tokenizer,
                max_length=cfg.render.max_length, last_turn_only=cfg.render.last_turn_only, stop_ids=stops,
                num_proc=cfg.render.num_proc, map_batch_size=cfg.render.map_batch_size, cache_dir=paths.cache,
                fingerprint=_digest(spec),
                manifest={"spec": spec, "tokenizer_hash": spec["tokenizer_hash"], "target": env.target_config.name,
                          "vocab_size": env.vocab_size(), "num_conversations": len(conversations)},
            )
        note = f"{damage}: tokenized again" if damage else ""
    if manifest["num_samples"] == 0:
        raise DraftsmithError(f"every conversation was skipped while rendering ({manifest['skipped']}); "
                              f"raise data.render.max_length or check the chat template")
    summary.add_skips(manifest["skipped"], manifest["skip_examples"])
    summary.rows.append(StageRow("tokenize", manifest["num_conversations"], manifest["num_samples"],
                                 sum(manifest["skipped"].values()), manifest["num_tokens"],
                                 manifest["num_loss_tokens"], _folder_bytes(paths.tokenized),
                                 time.perf_counter() - start, note))


def _features_stage(cfg: DataConfig, paths: PreparedPaths, env: _Env, summary: PrepareSummary,
                    progress: bool, workers: Workers, restart: bool) -> None:
    from .feature_cache import write_feature_cache
    from .tokenized import load_tokenized, tokenized_manifest

    start = time.perf_counter()
    target = env.target()
    data = load_tokenized(paths.tokenized, target)
    f = cfg.features
    manifest = write_feature_cache(data, paths.features, target, layer_ids=f.layer_ids, topk=f.topk,
                                   shard_size=f.shard_size, batch_tokens=f.batch_tokens,
                                   source_data_hash=tokenized_manifest(paths.tokenized)["data_hash"],
                                   progress=progress, workers=workers, restart=restart)
    rate = manifest.get("target_tokens_per_s")
    note = "; ".join(x for x in (
        manifest["note"], f"layers {manifest['layer_ids']}", f"{manifest['bytes_per_token']:.0f} bytes/token",
        f"{rate:.0f} target tok/s" if rate else "",
    ) if x)
    summary.rows.append(StageRow("features", len(data), manifest["num_samples"], None, manifest["num_tokens"],
                                 None, manifest["bytes"], time.perf_counter() - start, note))


def _vocab_stage(cfg: DataConfig, paths: PreparedPaths, env: _Env, summary: PrepareSummary) -> None:
    from .tokenized import load_tokenized, tokenized_manifest
    from .vocab import build_draft_vocab

    start = time.perf_counter()
    manifest = tokenized_manifest(paths.tokenized)
    data = load_tokenized(paths.tokenized, env.tokenizer())
    size = min(cfg.vocab.size, manifest["vocab_size"])
    vocab = build_draft_vocab(data, manifest["vocab_size"], size)
    vocab.tokenizer_hash = manifest["tokenizer_hash"]
    vocab.save(paths.vocab)
    summary.rows.append(StageRow("vocab", None, None, None, None, manifest["num_loss_tokens"],
                                 os.path.getsize(paths.vocab), time.perf_counter() - start,
                                 f"{size} of {manifest['vocab_size']} ids cover {vocab.coverage:.2%} of loss tokens"))


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


# ---------------------------------------------------------------- printing


def _fmt(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_summary(summary: PrepareSummary, width: int = WIDTH) -> list[str]:
    """The summary as lines of at most ``width`` columns: one row per stage, each stage's note under the
    table, then skipped records by reason with their meaning and first example (all of it is in
    ``summary.json`` too)."""
    lines = wrapped(f"draftsmith prepare → {summary.out_dir}", width)
    lines += text_table(["stage", "in", "kept", "skipped", "tokens", "loss tok.", "size", "time"],
                        [[r.stage, _fmt(r.records_in), _fmt(r.kept), _fmt(r.skipped), _fmt(r.tokens),
                          _fmt(r.loss_tokens), _size(r.size_bytes), f"{r.seconds:.1f}s"] for r in summary.rows], width)
    for r in summary.rows:
        if r.note:
            lines += wrapped(f"{r.stage}: {r.note}", width)
    if summary.skipped:
        lines += ["", "skipped records by reason:"]
        for reason, count in summary.skipped.most_common():
            lines += wrapped(f"{count:,} {reason}: {SKIP_REASONS.get(reason, '')}", width)
            if summary.examples.get(reason):
                lines += wrapped(f"first: {summary.examples[reason]}", width, indent="    ")
    for s in summary.sources:
        if s.get("stopped"):
            lines += wrapped(f"source {s['name']} ({s['path']}): read {s['records']:,} records; {s['stopped']}", width)
        if repairs_note(s):
            lines += wrapped(f"source {s['name']} ({s['path']}): kept {repairs_note(s)}", width)
    return lines


def print_summary(summary: PrepareSummary) -> None:
    print("\n".join(format_summary(summary)), flush=True)


__all__ = ["PrepareSummary", "PreparedPaths", "SourceReport", "run_prepare"]
