"""Self-distillation data: every assistant turn rewritten by the frozen target.

A drafter learns to predict the *target's* continuation, so training on the target's
own answers (EAGLE, Medusa-2, DistillSpec) rather than ShareGPT's ChatGPT answers is
what raises acceptance. Turns are regenerated in order: turn j is answered given the
user turns and the target's own answers to turns < j, rendered with the chat template.

Work is split into shards of ``shard_size`` conversations written as JSONL as they
finish (:class:`~draftsmith.data.shards.ShardedJob`). A killed run, re-run with the
same settings, keeps the finished shards and recomputes the rest from scratch; each
shard seeds its sampler with ``seed + shard`` and batches the same conversations, so
the result is exactly the set an uninterrupted run writes. More conversations extend the
job; settings that do not change a record (batch and shard sizes) keep every shard.

Three engines (``method``): batched generation (default) — a shard's prompts sorted by length
into left-padded batches of ``batch_size`` (the records keep their order), greedy in a loop
of its own where a row that reached EOS leaves the batch (:func:`greedy_batch`), sampled with
HF ``generate`` — or the built-in speculative decoder with any drafter (batch size 1,
lossless). Batched generation is the faster one on the SmolLM2 target on 2 CPU cores, with
identical greedy tokens (benchmarks/RESULTS.md, "prepare"); batching gains more on a GPU.
The third, ``server``, sends the same prompts to an OpenAI-compatible server (vLLM, SGLang, or a
llama-server started for the run) and writes the same shards; see :mod:`~draftsmith.data.regenerate_server`
(it also journals every answered turn, so a killed run re-asks none of them).
A conversation whose next prompt no longer fits ``max_length`` keeps the turns already
answered; one whose first prompt does not fit is skipped as ``prompt_too_long``.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from ..progress import progress_bar
from ..errors import DraftsmithError
from ..target import Target, TargetFiles
from .config import RegenerateConfig, RegenerateMethod
from .shards import MANIFEST, SOLO, ShardedJob, Workers, read_json, record_digest
from .turns import Conversation, answer_text, finish_shard, new_stats


def retry_failed(meta: dict[str, Any]) -> bool:
    """Whether a committed shard (its ``.json`` record) holds failed requests (method server), which a new run asks
    again (:mod:`~draftsmith.data.regenerate_server`)."""
    return bool(meta.get("finish", {}).get("failed"))


def check_failures(turns: int, failures: dict[str, int], example: str) -> None:
    """Stop the stage (non-zero) when most of its requests failed: ``turns`` answered, ``failures`` by reason."""
    failed = sum(failures.values())
    if failed > turns:  # most of them
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(failures.items(), key=lambda kv: -kv[1]))
        raise DraftsmithError(f"{failed} of {failed + turns} requests to the regeneration server failed ({why}; "
                              f"first: {example}); the {turns} answered are kept: fix the server (or "
                              f"data.regenerate.server) and run prepare again, which asks only the failed ones again")


@dataclass
class RegenReport:
    conversations_in: int = 0
    kept: int = 0
    turns: int = 0
    new_tokens: int = 0
    finish: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    """method=server: failed requests by reason (each also counted as ``finish: failed``; asked again next run)."""
    render_back: Counter = field(default_factory=Counter)
    """method=server: answers whose text, rendered back in the conversation, gives their ids (``ok``) or not."""
    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    """The first skipped conversation per reason (source:conv_id)."""
    seconds: float = 0.0
    """Generation time of this run (0 when every shard was already done)."""
    run_tokens: int = 0
    """The tokens generated in this run, every process together (``new_tokens`` counts every shard, those a killed run
    finished included, and the answers a server's journal held): what the rate is over."""
    note: str = ""

    def add(self, more: RegenReport) -> None:
        """Count another job's answers of the same conversations in (``data.regenerate.samples``): its records,
        turns, tokens and time; not its skips, which are this job's conversations skipped again."""
        self.kept += more.kept
        self.turns += more.turns
        self.new_tokens += more.new_tokens
        self.finish.update(more.finish)
        self.failures.update(more.failures)
        self.render_back.update(more.render_back)
        self.seconds += more.seconds
        self.run_tokens += more.run_tokens


def regenerate_conversations(
    conversations: Any,
    folder: str,
    target: TargetFiles,
    settings: RegenerateConfig,
    max_length: int,
    drafter: Any = None,
    progress: bool = True,
    workers: Workers = SOLO,
    restart: bool = False,
) -> RegenReport:
    """Regenerate every assistant turn of ``conversations`` (a Dataset of {conv_id, source, messages})
    into JSONL shards under ``folder``; resumable. ``target``: a loaded :class:`~draftsmith.target.Target` for the
    in-process methods; for method='server' its files are enough (``load_target_files``). A prompt must leave
    room for an answer within ``max_length`` tokens. ``drafter`` is needed for method='speculative'. With several
    ``workers`` each process answers its share of the shards (see :mod:`~draftsmith.data.shards`, which also says what
    a re-run keeps; ``restart`` lets it discard finished shards that changed settings or inputs invalidate)."""
    spec = {"target": target.fingerprint, "tokenizer": target.tokenizer_hash, "data.render.max_length": max_length,
            **_answer_settings(settings, target)}
    records = [record_digest([c, src, m]) for c, src, m in
               zip(conversations["conv_id"], conversations["source"], conversations["messages"])]
    job = ShardedJob(folder, spec, ".jsonl", records, settings.shard_size)
    report = RegenReport(conversations_in=len(conversations))
    finished = job.finished()
    if finished is not None and not any(map(retry_failed, finished["shards"])):
        return _report_from(finished["shards"], report, note="up to date (reused)")
    report.note = job.start(workers, restart)
    mine = [s for s in job.shards if workers.owns(s.index)]
    bar = progress_bar(total=_count_turns(conversations) if workers.size == 1 else None, unit="turn",
               desc="regenerate" if workers.size == 1 else f"regenerate (process {workers.rank} of {workers.size})",
               disable=not progress or not workers.is_main, dynamic_ncols=True)
    new_tokens = 0
    start = time.perf_counter()
    by_index = {shard.index: shard for shard in mine}

    def rows(s: int) -> list[dict[str, Any]]:
        part = conversations[by_index[s].start: by_index[s].stop]
        return [dict(conv_id=c, source=src, messages=m) for c, src, m in
                zip(part["conv_id"], part["source"], part["messages"])]

    def commit(s: int, out: list[dict[str, Any]], stats: dict[str, Any]) -> None:
        nonlocal new_tokens
        payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out).encode()
        replayed = stats.pop("replayed_tokens", 0)  # answered in an earlier run (a server's journal)
        new_tokens += job.commit(by_index[s], payload, {**stats, "process": workers.rank})["new_tokens"] - replayed
        bar.set_postfix_str(f"{new_tokens / max(time.perf_counter() - start, 1e-9):.0f} new tok/s")

    todo = []
    for shard in mine:
        meta = job.done(shard)
        if meta is None or retry_failed(meta):
            todo.append(shard.index)
        else:
            bar.update(meta["turns_in"])
    retried = {s: meta["finish"]["failed"] for s in todo if (meta := job.done(by_index[s])) is not None}
    if retried:
        report.note += f"; asking again the {sum(retried.values())} failed request(s) of {len(retried)} shard(s)"
    answer = METHODS[settings.method].answer
    with job.writing():  # a full disk: one line, saying which shards the rerun keeps
        if answer is None:
            from .regenerate_server import regenerate_through_server

            regenerate_through_server(todo, rows, commit, job.folder, target, settings, max_length, bar,
                                      tags={i: by_index[i].inputs for i in todo})
        else:
            for s in todo:
                commit(s, *_regenerate_shard(rows(s), target, settings, max_length, settings.seed + s, answer, drafter,
                                             bar))
    bar.close()
    shards = job.collect(workers)
    report.seconds = time.perf_counter() - start
    report.run_tokens = int(workers.all_sum([float(new_tokens)])[0])
    done = _report_from(shards, RegenReport(), note="")
    check_failures(done.turns, done.failures, done.examples.get("failed", ""))  # before the manifest: a re-run retries
    job.finish(shards, workers, num_conversations=sum(m["kept"] for m in shards))
    return _report_from(shards, report, note=report.note)


def _answer_settings(st: RegenerateConfig, target: TargetFiles) -> dict[str, Any]:
    """The settings that change a regenerated record, recorded in the job's spec (a change keeps no shard
    it invalidates; see :mod:`~draftsmith.data.shards`). Not: batch and shard sizes, ``dtype`` (the dtype it
    resolves to is recorded instead), and ``k`` unless the speculative decoder samples with it — a record
    sampled in another batch is another draw from the same distribution, as valid as this one. For the server
    method, the server's address and its transport (concurrency, timeouts, slots, threads) are left out, so a
    job resumes against another server of the same model (a launched llama-server's port changes every run);
    the model name and the GGUF type stay in."""
    method = METHODS[st.method]
    keep = {"method", "max_new_tokens", "max_turns", "temperature", "top_p", "seed", *method.settings}
    out = {f"data.regenerate.{k}": v for k, v in asdict(st).items() if k in keep}
    if method.loads_target:
        return {**out, "dtype": str(target.dtype)}  # the dtype it runs in
    out["data.regenerate.server"] = {"model": st.server.model or target.name, "launch": st.server.launch,
                                     **({"gguf_type": st.server.gguf_type} if st.server.launch == "llamacpp" else {})}
    return out


def regenerated_records(folder: str) -> Iterator[dict[str, Any]]:
    """The regenerated conversations, in order, from a finished job folder."""
    manifest = read_json(os.path.join(folder, MANIFEST))
    if manifest is None:
        raise DraftsmithError(f"regeneration in '{folder}' has not finished; run prepare with 'regenerate' in data.stages")
    for meta in manifest["shards"]:
        with open(os.path.join(folder, meta["file"]), encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)


def own_answers(conversations: Any, max_turns: int) -> Iterator[dict[str, Any]]:
    """The conversations ``data.regenerate.max_conversations`` leaves unanswered, as regenerated records: their
    source's own answers, cut after ``max_turns`` assistant turns (0 = all) as a regenerated conversation is."""
    for conv_id, source, messages in zip(conversations["conv_id"], conversations["source"], conversations["messages"]):
        kept, answers = [], 0
        for m in messages:
            if max_turns and answers == max_turns:
                break
            kept.append(m)
            answers += m["role"] == "assistant"
        if answers:
            yield {"conv_id": conv_id, "source": source, "messages": kept, "truncated_turns": []}


def _report_from(shards: list[dict[str, Any]], report: RegenReport, note: str) -> RegenReport:
    report.note = note
    for m in shards:
        report.kept += m["kept"]
        report.turns += m["turns"]
        report.new_tokens += m["new_tokens"]
        report.finish.update(m["finish"])
        report.failures.update(m.get("failures", {}))
        report.render_back.update(m.get("render_back", {}))
        report.skipped.update(m["skipped"])
        for reason, where in m["examples"].items():
            report.examples.setdefault(reason, where)
    return report


def _count_turns(conversations: Any) -> int:
    """Every assistant turn of the input: the progress bar's total. A turn is counted when it is answered or dropped
    (``max_turns`` reached, no room left: ``Conversation.close``), so the bar ends at this total."""
    return sum(sum(1 for m in msgs if m["role"] == "assistant") for msgs in conversations["messages"])


def _regenerate_shard(
    convs: list[dict[str, Any]], target: Target, st: RegenerateConfig, max_length: int, seed: int, answer: Answer,
    drafter: Any, bar: tqdm,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Answer every assistant turn of ``convs``, turn by turn, batched across conversations (``answer``: the
    method's :attr:`Method.answer`)."""
    torch.manual_seed(seed)  # generate() samples from the global generator: one fixed stream per shard
    state = [Conversation(c) for c in convs]
    stats = new_stats(convs)
    while True:
        asks: list[tuple[int, list[int]]] = []  # (conversation, prompt ids)
        for j, s in enumerate(state):
            if not s.open:
                continue
            prompt = s.next_prompt(target, st, max_length)
            if prompt is None:
                bar.update(s.close())
                continue
            asks.append((j, prompt))
        if not asks:
            break
        for j, tokens, finish in answer(asks, target, st, seed, drafter):
            state[j].answer(answer_text(target, tokens), finish)
            stats["turns"] += 1
            stats["new_tokens"] += len(tokens)
            stats["finish"][finish] += 1
            bar.update(1)
    return finish_shard(state, stats)


Answer = Callable[[list[tuple[int, list[int]]], Target, RegenerateConfig, int, Any], Iterator[tuple[int, list[int], str]]]
"""An in-process method: (prompts as (conversation, ids), target, settings, shard seed, drafter) → (conversation, new
tokens ending with EOS if any, finish reason) for every prompt."""


def _answer_speculative(
    asks: list[tuple[int, list[int]]], target: Target, st: RegenerateConfig, seed: int, drafter: Any
) -> Iterator[tuple[int, list[int], str]]:
    """The built-in speculative decoder with the recipe's drafter, one prompt at a time."""
    from ..decode.rounds import speculative_decode
    from ..decode.sampling import Warp

    warp = Warp(temperature=st.temperature, top_p=st.top_p)
    for j, prompt in asks:
        result = speculative_decode(target, drafter, prompt, k=st.k, max_new_tokens=st.max_new_tokens, warp=warp,
                                    seed=seed * 1_000_003 + j)
        yield j, result.tokens, result.finish_reason


def _answer_batched(
    asks: list[tuple[int, list[int]]], target: Target, st: RegenerateConfig, seed: int, drafter: Any
) -> Iterator[tuple[int, list[int], str]]:
    """The target alone, ``batch_size`` prompts of similar lengths together (:func:`generate_batch`)."""
    asks = sorted(asks, key=lambda a: len(a[1]))  # similar lengths together: less padding
    for b in range(0, len(asks), st.batch_size):
        batch = asks[b: b + st.batch_size]
        for (j, _), tokens in zip(batch, generate_batch(target, [p for _, p in batch], st)):
            finish = "eos" if tokens and tokens[-1] in target.eos_token_ids else "length"
            yield j, tokens, finish


@dataclass(frozen=True)
class Method:
    """What one ``data.regenerate.method`` is: how it answers, and what the prepare stage gives it."""

    answer: Answer | None
    """How it answers in this process; None: a server answers (:mod:`~draftsmith.data.regenerate_server`), which
    needs the target's files (tokenizer, template, fingerprint) and not its weights."""
    drafter: bool = False
    """It drafts with the recipe's drafter (prepare builds it on the target and passes it as ``drafter``)."""
    settings: tuple[str, ...] = ()
    """Its own ``data.regenerate`` settings that change a record (recorded in the job's spec beside the shared ones;
    the server's own part is written by :func:`_answer_settings`)."""

    @property
    def loads_target(self) -> bool:
        return self.answer is not None


METHODS: dict[RegenerateMethod, Method] = {
    "generate": Method(_answer_batched),
    "speculative": Method(_answer_speculative, drafter=True, settings=("k",)),
    "server": Method(None),
}
"""Each ``data.regenerate.method`` (``data.config.RegenerateMethod``) and its implementation."""


@torch.inference_mode()
def generate_batch(target: Target, prompts: list[list[int]], st: RegenerateConfig) -> list[list[int]]:
    """New tokens for each prompt (cut after the first EOS), generated together from one left-padded batch.

    Greedy: :func:`greedy_batch` (rows that reached EOS leave the batch). Sampling: HF ``generate``
    (it samples from the global generator, seeded per shard).
    """
    if st.temperature <= 0:
        return greedy_batch(target, prompts, st.max_new_tokens)
    eos = sorted(target.eos_token_ids)
    pad = eos[0] if eos else 0
    ids, mask = _left_padded(prompts, pad)
    out = target.model.generate(
        ids.to(target.device),
        attention_mask=mask.to(target.device),
        max_new_tokens=st.max_new_tokens,
        do_sample=True,
        temperature=st.temperature,
        top_p=st.top_p,
        top_k=None,
        eos_token_id=eos or None,
        pad_token_id=pad,
    )
    result = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in target.eos_token_ids), len(row))
        result.append(row[:cut])
    return result


@torch.inference_mode()
def greedy_batch(target: Target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt (new tokens, ending with EOS if reached), batched.

    One left-padded prefill that computes logits at the last position only, then one token per
    row per forward with the KV cache; a row that emits EOS leaves the batch (its cache rows are
    dropped), so finished answers cost nothing while the longest one runs on. Token for token
    what HF ``generate`` gives greedily, up to batched floating-point rounding.
    """
    from transformers import DynamicCache

    eos = target.eos_token_ids
    ids, mask = _left_padded(prompts, min(eos) if eos else 0)
    ids, mask = ids.to(target.device), mask.to(target.device)  # [B, S]
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # [B, S]: left padding does not shift positions
    cache = DynamicCache(config=target.model.config)
    logits = target.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                          use_cache=True, logits_to_keep=1).logits[:, -1]  # [B, V]
    alive = list(range(len(prompts)))  # prompt index of each batch row
    new: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        token = logits.argmax(-1)  # [b]
        keep = []
        for row, (i, t) in enumerate(zip(alive, token.tolist())):
            new[i].append(t)
            if t not in eos:
                keep.append(row)
        if not keep or step + 1 == max_new_tokens:
            break
        if len(keep) < len(alive):
            rows = torch.tensor(keep, device=ids.device)
            cache.batch_select_indices(rows)
            token, mask, positions = token[rows], mask[rows], positions[rows]
            alive = [alive[r] for r in keep]
        mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=1)  # [b, S + step + 1]
        positions = positions[:, -1:] + 1  # [b, 1]
        logits = target.model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                              cache=cache, use_cache=True).logits[:, -1]
    return new


def _left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, S], attention mask [B, S]) with every prompt right-aligned, so all rows' next token is at column S."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask
