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

Two engines (``method``): batched generation (default) — a shard's prompts sorted by length
into left-padded batches of ``batch_size`` (the records keep their order), greedy in a loop
of its own where a row that reached EOS leaves the batch (:func:`greedy_batch`), sampled with
HF ``generate`` — or the built-in speculative decoder with any drafter (batch size 1,
lossless). Batched generation is the faster one on the SmolLM2 target on 2 CPU cores, with
identical greedy tokens (benchmarks/RESULTS.md, "prepare"); batching gains more on a GPU.
A conversation whose next prompt no longer fits ``max_length`` keeps the turns already
answered; one whose first prompt does not fit is skipped as ``prompt_too_long``.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from ..errors import DraftsmithError
from ..target import Target
from .config import RegenerateConfig
from .shards import MANIFEST, SOLO, ShardedJob, Workers, read_json, record_digest


@dataclass
class RegenReport:
    conversations_in: int = 0
    kept: int = 0
    turns: int = 0
    new_tokens: int = 0
    finish: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    """The first skipped conversation per reason (source:conv_id)."""
    seconds: float = 0.0
    """Generation time of this run (0 when every shard was already done)."""
    note: str = ""


def regenerate_conversations(
    conversations: Any,
    folder: str,
    target: Target,
    settings: RegenerateConfig,
    max_length: int,
    drafter: Any = None,
    progress: bool = True,
    workers: Workers = SOLO,
    restart: bool = False,
) -> RegenReport:
    """Regenerate every assistant turn of ``conversations`` (a Dataset of {conv_id, source, messages})
    into JSONL shards under ``folder``; resumable. A prompt must leave room for an answer within
    ``max_length`` tokens. ``drafter`` is needed for method='speculative'. With several ``workers``
    each process answers its share of the shards (see :mod:`~draftsmith.data.shards`, which also says what
    a re-run keeps; ``restart`` lets it discard finished shards that changed settings or inputs invalidate)."""
    spec = {"target": target.fingerprint, "tokenizer": target.tokenizer_hash, "dtype": str(target.dtype),
            "data.render.max_length": max_length,
            **{f"data.regenerate.{k}": v for k, v in asdict(settings).items() if k in _changes_records(settings)}}
    records = [record_digest([c, src, m]) for c, src, m in
               zip(conversations["conv_id"], conversations["source"], conversations["messages"])]
    job = ShardedJob(folder, spec, ".jsonl", records, settings.shard_size)
    report = RegenReport(conversations_in=len(conversations))
    finished = job.finished()
    if finished is not None:
        return _report_from(finished["shards"], report, note="up to date (reused)")
    report.note = job.start(workers, restart)
    mine = [s for s in job.shards if workers.owns(s.index)]
    bar = tqdm(total=_count_turns(conversations) if workers.size == 1 else None, unit="turn",
               desc="regenerate" if workers.size == 1 else f"regenerate (process {workers.rank} of {workers.size})",
               disable=not progress or not workers.is_main, dynamic_ncols=True)
    new_tokens = 0
    start = time.perf_counter()
    for shard in mine:
        meta = job.done(shard)
        if meta is None:
            rows = conversations[shard.start: shard.stop]
            convs = [dict(conv_id=c, source=src, messages=m) for c, src, m in
                     zip(rows["conv_id"], rows["source"], rows["messages"])]
            out, stats = _regenerate_shard(convs, target, settings, max_length, settings.seed + shard.index, drafter,
                                           bar)
            payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out).encode()
            meta = job.commit(shard, payload, {**stats, "process": workers.rank})
        else:
            bar.update(meta["turns_in"])
        new_tokens += meta["new_tokens"]
        bar.set_postfix_str(f"{new_tokens / max(time.perf_counter() - start, 1e-9):.0f} new tok/s")
    bar.close()
    shards = job.collect(workers)
    report.seconds = time.perf_counter() - start
    job.finish(shards, workers, num_conversations=sum(m["kept"] for m in shards))
    return _report_from(shards, report, note=report.note)


def _changes_records(settings: RegenerateConfig) -> set[str]:
    """The settings that change a regenerated record. Not: batch and shard sizes, ``dtype`` (the dtype it
    resolves to is in the spec), and ``k`` unless the speculative decoder samples with it. A record
    sampled in another batch is another draw from the same distribution, as valid as this one."""
    out = {"method", "max_new_tokens", "max_turns", "temperature", "top_p", "seed"}
    return out | {"k"} if settings.method == "speculative" else out


def regenerated_records(folder: str) -> Iterator[dict[str, Any]]:
    """The regenerated conversations, in order, from a finished job folder."""
    manifest = read_json(os.path.join(folder, MANIFEST))
    if manifest is None:
        raise DraftsmithError(f"regeneration in '{folder}' has not finished; run prepare with 'regenerate' in data.stages")
    for meta in manifest["shards"]:
        with open(os.path.join(folder, meta["file"]), encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)


def _report_from(shards: list[dict[str, Any]], report: RegenReport, note: str) -> RegenReport:
    report.note = note
    for m in shards:
        report.kept += m["kept"]
        report.turns += m["turns"]
        report.new_tokens += m["new_tokens"]
        report.finish.update(m["finish"])
        report.skipped.update(m["skipped"])
        for reason, where in m["examples"].items():
            report.examples.setdefault(reason, where)
    return report


def _count_turns(conversations: Any) -> int:
    return sum(sum(1 for m in msgs if m["role"] == "assistant") for msgs in conversations["messages"])


def _regenerate_shard(
    convs: list[dict[str, Any]], target: Target, st: RegenerateConfig, max_length: int, seed: int, drafter: Any,
    bar: tqdm,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Answer every assistant turn of ``convs``, turn by turn, batched across conversations."""
    torch.manual_seed(seed)  # generate() samples from the global generator: one fixed stream per shard
    tok = target.tokenizer
    state = [{"done": [], "todo": list(c["messages"]), "open": True, "cut": []} for c in convs]
    stats: dict[str, Any] = {"turns_in": sum(sum(m["role"] == "assistant" for m in c["messages"]) for c in convs),
                             "turns": 0, "new_tokens": 0, "finish": Counter(), "skipped": Counter(), "examples": {}}
    while True:
        asks: list[tuple[int, list[int]]] = []  # (conversation, prompt ids)
        for j, s in enumerate(state):
            if not s["open"]:
                continue
            while s["todo"] and s["todo"][0]["role"] != "assistant":
                s["done"].append(s["todo"].pop(0))
            answered = sum(m["role"] == "assistant" for m in s["done"])
            prompt = None
            if s["todo"] and not (st.max_turns and answered >= st.max_turns):
                prompt = target.render_chat(s["done"], add_generation_prompt=True)
                if len(prompt) >= max_length or len(prompt) + st.max_new_tokens > target.max_positions:
                    prompt = None  # no room for an answer: the conversation ends with the turns answered so far
            if prompt is None:
                bar.update(sum(m["role"] == "assistant" for m in s["todo"]))
                s["open"], s["todo"] = False, []
                continue
            asks.append((j, prompt))
        if not asks:
            break
        for j, tokens, finish in _answer(asks, target, st, seed, drafter):
            s = state[j]
            s["todo"].pop(0)
            text = tok.decode([t for t in tokens if t not in target.eos_token_ids], skip_special_tokens=True)
            if finish == "length":
                s["cut"].append(len(s["done"]))
            s["done"].append({"role": "assistant", "content": text})
            stats["turns"] += 1
            stats["new_tokens"] += len(tokens)
            stats["finish"][finish] += 1
            bar.update(1)
    out = []
    for c, s in zip(convs, state):
        while s["done"] and s["done"][-1]["role"] != "assistant":
            s["done"].pop()
        if not s["done"]:
            stats["skipped"]["prompt_too_long"] += 1
            stats["examples"].setdefault("prompt_too_long", f"{c['source']}:{c['conv_id']}")
            continue
        out.append({"conv_id": c["conv_id"], "source": c["source"], "messages": s["done"],
                    "truncated_turns": s["cut"]})
    stats["kept"] = len(out)
    stats["finish"] = dict(stats["finish"])
    stats["skipped"] = dict(stats["skipped"])
    return out, stats


def _answer(
    asks: list[tuple[int, list[int]]], target: Target, st: RegenerateConfig, seed: int, drafter: Any
) -> Iterator[tuple[int, list[int], str]]:
    """(conversation, new tokens ending with EOS if any, finish reason) for every prompt."""
    if st.method == "speculative":
        from ..decode.chain import speculative_decode
        from ..decode.sampling import Warp

        warp = Warp(temperature=st.temperature, top_p=st.top_p)
        for j, prompt in asks:
            result = speculative_decode(target, drafter, prompt, k=st.k, max_new_tokens=st.max_new_tokens, warp=warp,
                                        seed=seed * 1_000_003 + j)
            yield j, result.tokens, result.finish_reason
        return
    asks = sorted(asks, key=lambda a: len(a[1]))  # similar lengths together: less padding
    for b in range(0, len(asks), st.batch_size):
        batch = asks[b: b + st.batch_size]
        for (j, _), tokens in zip(batch, generate_batch(target, [p for _, p in batch], st)):
            finish = "eos" if tokens and tokens[-1] in target.eos_token_ids else "length"
            yield j, tokens, finish


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
