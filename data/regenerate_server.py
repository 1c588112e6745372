"""``data.regenerate.method: server``: every assistant turn answered by an OpenAI-compatible server.

The same job as the in-process methods (:mod:`~draftsmith.data.regenerate`): the same shard files,
records and counters, turn j answered given the target's own answers to turns < j. What changes is
who computes: requests to ``/v1/completions`` of a running server (``server.url``: vLLM or SGLang on
a cluster, see below) or of a ``llama-server`` started for the run (``server.launch: llamacpp``, on
the target's own GGUF or one converted from it, stopped at the end, errors included).

**Prompts are draftsmith's own token ids** (:mod:`~draftsmith.engines.openai_client`), so the server
evaluates exactly what ``prepare`` renders. **Answers** are read back as ids where the server returns
them (llama-server, vLLM), else re-tokenized from the text with the target's tokenizer; cut at the
target's first end-of-turn token and at ``max_new_tokens``; stored as text decoded as the in-process
methods decode it; and each is checked to render back: the conversation with the answer, rendered by
the chat template, must give the prompt's ids followed by the answer's (``render_back`` counts those
that do not — a tokenizer's non-canonical split or a template that rewrites history; the record is
kept). **A server whose tokenizer differs from the target's is refused before any request**: the text
of a probe conversation rendered with the target's template (special tokens, accents, CJK, emoji,
digits, code and whitespace runs) is tokenized through the server's ``/tokenize`` (llama-server and
vLLM have it) and must give the target tokenizer's ids. A tokenize probe rather than comparing a
short greedy completion: it needs no generation, covers the special tokens the template uses, and a
completion probe could only compare texts, which two tokenizers can agree on while their ids differ.

**Scheduling.** ``server.concurrency`` requests are in flight at once from a thread pool; the main
thread owns all state. Conversations open in order across this process's unfinished shards (a shard
commits as soon as its last conversation ends), so the pool never drains at a shard's end. Each
conversation has at most one request in flight (its turns are sequential). Sampling is seeded per
request (shard, conversation, turn); a server that batches several requests may still round a logit
differently with what shares the batch, so a resumed sampled run is the same job, not always the same
tokens (greedy F32 answers were identical in every test run).

**Resume without re-asking.** Every answered turn is appended (and flushed to disk) to the shard's
journal, ``shard-NNNNN.partial.jsonl``, before anything else is done with it; a re-run replays the
journal and requests only the turns it does not hold, so an answered turn is never requested twice,
even after a SIGKILL mid-shard. The journal is deleted once its shard is committed. A torn last line
(a kill mid-write) is dropped.

**Failures.** A request that still fails after its retries (the server refused it, e.g. a prompt
longer than its context, answered HTML, no ``choices``, ids that are not the target's, no token at all: anything
:mod:`~draftsmith.engines.openai_client` or :meth:`_Run.check_ids` cannot read as an answer) ends its
conversation with the turns answered so far; it is counted (``finish: failed`` and ``failures`` by
reason, ``skipped: request_failed`` when the conversation had no answer yet) and never journaled: the
shard is committed, its journal kept, and the next run re-opens every shard with a failed request,
replays its journal and asks again only the failed turns (no ``--restart``). When most requests of a
run fail, the stage stops non-zero saying how many and why, before the job's manifest is written
(:func:`~draftsmith.data.regenerate.check_failures`). A server that stops answering altogether stops the job with a clear error;
finished shards and the journals are kept, and a re-run (against the same server restarted, or another
of the same model: the address is not part of the job's identity) resumes.

**At scale** (the 8B recipes' headers), start one engine per node with data parallelism over its GPUs
and point ``server.url`` at it — vLLM: ``vllm serve meta-llama/Llama-3.1-8B-Instruct --data-parallel-size 8
--port 8000``; SGLang: ``python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct
--dp-size 8 --port 8000`` — with ``server.concurrency`` at a few hundred (both batch continuously).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from ..engines.openai_client import CompletionsClient, RequestFailed, ServedAnswer, ServerDown
from ..errors import DraftsmithError
from ..target import TargetFiles
from .config import RegenerateConfig
from .turns import Conversation, answer_text, finish_shard, new_stats

PROBE = [
    {"role": "system", "content": "Tokenizer probe. naïve café, Ünïcödé — “quotes”, 東京 and 서울, 🚀🙂"},
    {"role": "user", "content": "Compute 1234567 * 89 = ?\n\n```python\ndef f(x):\n\treturn x  # tab\n```   \n"},
]
"""A conversation whose rendered text exercises what tokenizers disagree on."""


def check_model(client: CompletionsClient) -> None:
    """Refuse a ``model`` name the server does not serve (vLLM and SGLang would answer every request 404; a
    llama-server serves its one model whatever the name)."""
    served = client.models()
    if not served or any(m.get("id") == client.model for m in served):
        return
    if all(m.get("owned_by") == "llamacpp" for m in served):
        return
    raise DraftsmithError(f"the server at {client.root} serves {', '.join(str(m.get('id')) for m in served)}, not "
                          f"'{client.model}': set data.regenerate.server.model to the name it serves the target under")


def check_tokenizer(client: CompletionsClient, target: TargetFiles) -> None:
    """Refuse a server whose tokenizer gives other ids than the target's for :data:`PROBE` (module docstring)."""
    from ..chat import has_template

    tok = target.tokenizer
    text = (tok.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True) if has_template(tok)
            else "\n".join(m["content"] for m in PROBE))
    want = tok.encode(text, add_special_tokens=False)
    got = client.tokenize(text)
    if got is None:
        raise DraftsmithError(f"the server at {client.root} has no /tokenize endpoint, so its tokenizer cannot be "
                              f"compared with the target's; if you know it is the target's, set "
                              f"data.regenerate.server.check_tokenizer: false")
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise DraftsmithError(
            f"the server at {client.root} tokenizes differently from the target '{target.name}' (probe ids differ "
            f"from position {at}: server {got[at:at + 4]}, target {want[at:at + 4]}; {len(got)} vs {len(want)} ids): "
            f"it serves another model or tokenizer; point data.regenerate.server at a server of the target")


@contextlib.contextmanager
def server_for(target: TargetFiles, st: RegenerateConfig, max_length: int) -> Iterator[tuple[CompletionsClient, Any]]:
    """(client, launched llama-server or None): the configured server, started here when ``launch: llamacpp``
    (on the target's GGUF of ``gguf_type``, one context of ``max_length + max_new_tokens`` per slot) and
    stopped on leaving, whatever happens."""
    srv = st.server
    if srv.launch == "none":
        yield CompletionsClient(srv.url, srv.model or target.name, srv.timeout_s, srv.retries, srv.backoff_s), None
        return
    from ..engines import llamacpp
    from ..engines.targets import target_gguf

    spec = llamacpp.ServerSpec(model=target_gguf(target, srv.gguf_type), threads=srv.threads, slots=srv.slots,
                               ctx=max_length + st.max_new_tokens, extra=("-fa", "on" if srv.flash_attn else "off"))
    with llamacpp.serving(spec) as server:
        yield CompletionsClient(server.url, srv.model or target.name, srv.timeout_s, srv.retries,
                                srv.backoff_s), server


def request_seed(shard_seed: int, conversation: int, turn: int) -> int:
    """The sampling seed of one request: fixed by (shard, conversation, turn), so a resumed run asks the same."""
    return (shard_seed * 1_000_003 + conversation * 1_009 + turn) % (2**31 - 1)


# ---------------------------------------------------------------- one shard's state and journal


@dataclass
class _Shard:
    index: int
    convs: list[Conversation]
    stats: dict[str, Any]
    journal_path: str
    replay: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    """(conversation, turn) → journaled outcome, for a resumed shard."""
    left: int = 0
    journal: Any = None

    def write(self, entry: dict[str, Any]) -> None:
        """Append one outcome to the journal and flush it to disk before it is used."""
        if self.journal is None:
            self.journal = open(self.journal_path, "a", encoding="utf-8")
        self.journal.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self.journal.flush()
        os.fsync(self.journal.fileno())

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None


def _read_journal(path: str) -> dict[tuple[int, int], dict[str, Any]]:
    """The journal's whole lines (a torn last line is dropped and the file rewritten without it)."""
    if not os.path.isfile(path):
        return {}
    entries, good = {}, []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                entry = json.loads(line) if line.endswith("\n") else None
            except json.JSONDecodeError:
                entry = None
            if entry is None:
                break
            entries[(entry["conv"], entry["turn"])] = entry
            good.append(line)
    with open(path, "w", encoding="utf-8") as f:  # appends must not follow a torn line
        f.writelines(good)
    return entries


# ---------------------------------------------------------------- the run


def regenerate_through_server(
    shards: list[int], rows: Callable[[int], list[dict[str, Any]]],
    commit: Callable[[int, list[dict[str, Any]], dict[str, Any]], None], folder: str, target: TargetFiles,
    st: RegenerateConfig, max_length: int, bar: tqdm, tags: dict[int, str] | None = None,
) -> None:
    """Answer every turn of ``shards`` (their conversations from ``rows(s)``) through the configured server and
    ``commit`` each shard as it completes (module docstring). tags: shard → the digest of its input records,
    part of its journal's name, so that a journal is replayed only onto the records it answered."""
    if not shards:
        return
    with server_for(target, st, max_length) as (client, launched):
        if not client.healthy():
            raise DraftsmithError(f"no server answers at {client.root}: start it (the 8B prepare recipes' headers give "
                                  f"the vLLM and SGLang commands), or set data.regenerate.server.launch: llamacpp")
        check_model(client)
        if st.server.check_tokenizer:
            check_tokenizer(client, target)
        try:
            _Run(client, folder, target, st, max_length, bar, commit, tags or {}).run(shards, rows)
        except ServerDown as e:
            log = f"\nllama-server's log ends with:\n{launched.log_tail()}" if launched is not None else ""
            raise DraftsmithError(f"{e}; finished shards and the answers of shards in progress are kept in {folder}: "
                                  f"restart the server and run prepare again to resume{log}") from None


class _Run:
    def __init__(self, client: CompletionsClient, folder: str, target: TargetFiles, st: RegenerateConfig,
                 max_length: int, bar: tqdm, commit: Callable[..., None], tags: dict[int, str] | None = None):
        self.client, self.folder, self.target, self.st = client, folder, target, st
        self.max_length, self.bar, self.commit, self.tags = max_length, bar, commit, tags or {}
        self.eos = sorted(target.eos_token_ids)
        self.in_flight: dict[Future, tuple[_Shard, int, list[int]]] = {}
        self.opened: dict[int, _Shard] = {}

    def run(self, shards: list[int], rows: Callable[[int], list[dict[str, Any]]]) -> None:
        # conversations in order; a shard is opened (rows read, journal replayed) when its first one comes up
        order = ((s, i) for s in shards for i in range(len(self.open_shard(s, rows).convs)))
        pool = ThreadPoolExecutor(self.st.server.concurrency, thread_name_prefix="regenerate")
        try:
            more = True
            while more or self.in_flight:
                while more and len(self.in_flight) < self.st.server.concurrency:
                    nxt = next(order, None)
                    if nxt is None:
                        more = False
                        break
                    s, i = nxt
                    self.advance(self.opened[s], i, pool)
                if not self.in_flight:
                    continue
                done, _ = wait(list(self.in_flight), return_when=FIRST_COMPLETED)
                for fut in done:
                    shard, i, prompt = self.in_flight.pop(fut)
                    self.settle(shard, i, prompt, fut)
                    self.advance(shard, i, pool)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            for shard in self.opened.values():
                shard.close()

    def open_shard(self, s: int, rows: Callable[[int], list[dict[str, Any]]]) -> _Shard:
        if s not in self.opened:
            convs = rows(s)
            tag = f"-{self.tags[s]}" if s in self.tags else ""
            path = os.path.join(self.folder, f"shard-{s:05d}{tag}.partial.jsonl")
            self.opened[s] = _Shard(s, [Conversation(c) for c in convs], new_stats(convs), path,
                                     replay=_read_journal(path), left=len(convs))
        return self.opened[s]

    def advance(self, shard: _Shard, i: int, pool: ThreadPoolExecutor) -> None:
        """Move conversation i as far as the journal allows, then ask for its next turn or end it."""
        conv = shard.convs[i]
        while conv.open:
            prompt = conv.next_prompt(self.target, self.st, self.max_length)
            if prompt is None:
                self.bar.update(conv.close())
                break
            entry = shard.replay.get((i, conv.answered))
            if entry is None or entry["finish"] == "failed":  # (an older draftsmith journaled failures)
                seed = request_seed(self.st.seed + shard.index, i, conv.answered)
                fut = pool.submit(self.client.complete, prompt, self.st.max_new_tokens, self.st.temperature,
                                  self.st.top_p, seed, self.eos)
                self.in_flight[fut] = (shard, i, prompt)
                return
            shard.stats["replayed_tokens"] = shard.stats.get("replayed_tokens", 0) + len(entry["tokens"])
            self.apply(shard, conv, entry)
        shard.left -= 1
        if shard.left == 0:
            shard.close()
            failed = shard.stats["finish"].get("failed", 0)
            self.commit(shard.index, *finish_shard(shard.convs, shard.stats))
            if not failed:  # else the next run replays it and asks only the failed turns again
                with contextlib.suppress(FileNotFoundError):
                    os.remove(shard.journal_path)  # the shard file holds its answers now
            del self.opened[shard.index]

    def settle(self, shard: _Shard, i: int, prompt: list[int], fut: Future) -> None:
        """Journal the answer to conversation i's request, then apply it; a failure is applied, never journaled
        (the next run asks again)."""
        conv = shard.convs[i]
        entry: dict[str, Any] = {"conv": i, "turn": conv.answered}
        try:
            tokens, finish = self.answer_tokens(fut.result())  # ServerDown propagates before anything is written
            self.check_ids(tokens)
        except RequestFailed as e:
            self.apply(shard, conv, {**entry, "finish": "failed", "reason": e.reason, "detail": e.detail[:200]})
            return
        entry.update(finish=finish, tokens=tokens, text=answer_text(self.target, tokens),
                     renders_back=self.renders_back(conv, prompt, tokens))
        shard.write(entry)
        self.apply(shard, conv, entry)

    def apply(self, shard: _Shard, conv: Conversation, entry: dict[str, Any]) -> None:
        stats = shard.stats
        stats["finish"][entry["finish"]] += 1
        if entry["finish"] == "failed":
            conv.ended_by = "request_failed"  # the record's skip reason if no turn was answered
            stats.setdefault("failures", Counter())[entry["reason"]] += 1
            stats["examples"].setdefault("failed", f"{conv.conv['source']}:{conv.conv['conv_id']} "
                                                   f"({entry['reason']}: {entry['detail']})")
            self.bar.update(conv.close())
            return
        conv.answer(entry["text"], entry["finish"])
        stats["turns"] += 1
        stats["new_tokens"] += len(entry["tokens"])
        stats.setdefault("render_back", Counter())["ok" if entry["renders_back"] else "differs"] += 1
        self.bar.update(1)

    def check_ids(self, tokens: list[int]) -> None:
        """RequestFailed unless every id is one of the target tokenizer's (an id past it decodes to nothing) and there
        is at least one (no token and no end of turn is no answer: a record would hold an empty one)."""
        if not tokens:
            raise RequestFailed("bad_answer", "no token and no end of turn (an empty answer; is the server's "
                                              "context full?)")
        size = len(self.target.tokenizer)
        outside = [t for t in tokens if not 0 <= t < size]
        if outside:
            raise RequestFailed("bad_answer", f"{len(outside)} id(s) outside the target's vocabulary of {size} "
                                              f"(first: {outside[0]}): the server serves another model")

    def answer_tokens(self, answer: ServedAnswer) -> tuple[list[int], str]:
        """(the answer's ids, cut after the target's first end-of-turn token and at max_new_tokens; finish)."""
        eos = self.target.eos_token_ids
        ids = (answer.tokens if answer.tokens is not None  # a text-only server: re-tokenized with the target's
               else self.target.tokenizer.encode(answer.text, add_special_tokens=False))
        end = next((k + 1 for k, t in enumerate(ids) if t in eos), None)
        if end is None and answer.finish == "stop" and self.eos:
            ids, end = [*ids, self.eos[0]], len(ids) + 1  # stopped at end-of-turn without listing it (text, or ids)
        ids = ids[: min(end or len(ids), self.st.max_new_tokens)]
        return ids, "eos" if ids and ids[-1] in eos else "length"

    def renders_back(self, conv: Conversation, prompt: list[int], tokens: list[int]) -> bool:
        """Whether the conversation with this answer, rendered by the chat template, gives the prompt's ids
        followed by the answer's (re-tokenized from the stored text)."""
        body = [t for t in tokens if t not in self.target.eos_token_ids]
        text = answer_text(self.target, tokens)
        full = self.target.render_chat([*conv.done, {"role": "assistant", "content": text}],
                                       add_generation_prompt=False)
        return full[: len(prompt) + len(body)] == prompt + body
