"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024): draft the most frequent continuation of the
longest matching suffix, from the current request and from a corpus of earlier outputs.

Structure (:class:`SuffixTrie`): a suffix trie truncated at ``max_depth``, as in SuffixDecoding:
every substring of at most ``max_depth`` tokens of the inserted text is a node, and a node's count
is how often its substring occurs. Appending a token extends the (≤ max_depth) nodes of the current
suffixes by one child each: O(max_depth) per token, independent of how long the text is. Documents
of a corpus are inserted separately (no suffix crosses two documents).

Two tries: the *request* trie holds the prompt and output of the current sequence and is emptied
by ``reset``; the *corpus* trie (a file of earlier outputs, ``corpus:``) persists across sequences
and, with ``grow_corpus``, also receives every finished output. For the corpus, the nodes of the
context's suffixes are tracked as tokens arrive (O(max_depth) per token, nothing inserted).

Drafting, per trie: take the deepest node matching a suffix of the context (at most
``max_depth // 2`` tokens, leaving the other half of the depth to draft into) that has children;
walk down choosing the most frequent child (greedy) or sampling children by count (sampled),
while the running product of count(child)/count(node) stays ≥ ``min_prob``, for at most
min(k, ``max_spec_factor`` × match length) tokens (SuffixDecoding's adaptive length). The
candidate of each trie is scored by its expected accepted length Σ_i Π_{j≤i} p_j; the better one
drafts. q is that empirical distribution over children (sampled), so speculative sampling stays
exact. In the request trie, the current occurrence of the context counts as one occurrence with
no continuation yet, so a continuation seen once before starts at confidence 1/2.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from ..decode.protocol import Proposal
from ..decode.sampling import Warp
from ..errors import ConfigError, DraftsmithError
from ..target import Target
from .model_free import Continuation, SourceCounts, to_proposal

ROOT = 0


class SuffixTrie:
    """Depth-capped suffix trie with occurrence counts. Node 0 is the root (the empty string).

    Edges live in one dict keyed ``node << shift | token`` (a dict per node would cost ~5× the memory).
    """

    def __init__(self, max_depth: int, vocab_size: int):
        if max_depth < 2:
            raise ConfigError(f"drafter.max_depth = {max_depth} must be at least 2")
        self.max_depth = max_depth
        self.shift = max(1, int(vocab_size).bit_length())
        self.mask = (1 << self.shift) - 1
        self.edges: dict[int, int] = {}
        self.count: list[int] = [0]
        self.depth: list[int] = [0]
        self.kids: list[list[int]] = [[]]  # children node ids per node, in insertion order
        self._label: list[int] = [-1]  # the token on the edge into each node
        self.active: list[int] = []  # nodes of the current document's suffixes of length 1 … max_depth-1
        self.tokens_inserted = 0

    def __len__(self) -> int:
        return len(self.count)

    def child(self, node: int, token: int) -> int | None:
        return self.edges.get(node << self.shift | token)

    def token_of(self, node: int) -> int:
        """The last token of a node's string (the label of the edge into it)."""
        return self._label[node]

    def new_document(self) -> None:
        """Start a new document: later suffixes do not reach into the previous one."""
        self.active = []

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the current document: O(max_depth) per token."""
        edges, count, depth, shift, cap = self.edges, self.count, self.depth, self.shift, self.max_depth
        active = self.active
        for t in tokens:
            nxt = []
            for node in (ROOT, *active):
                key = node << shift | t
                c = edges.get(key)
                if c is None:
                    c = len(count)
                    edges[key] = c
                    count.append(0)
                    depth.append(depth[node] + 1)
                    self.kids[node].append(c)
                    self.kids.append([])
                    self._label.append(t)
                count[c] += 1
                if depth[c] < cap:
                    nxt.append(c)
            active = nxt
            self.tokens_inserted += 1
        self.active = active

    def follow(self, matched: list[int], token: int) -> list[int]:
        """The nodes of the context's suffixes after appending ``token``, given those before (``matched``,
        ascending depth): O(max_depth), inserting nothing. Suffixes absent from the trie are dropped."""
        out = []
        for node in (ROOT, *matched):
            c = self.edges.get(node << self.shift | token)
            if c is not None and self.depth[c] < self.max_depth:
                out.append(c)
        return out

    def walk(self, node: int, limit: int, min_prob: float, generator: torch.Generator | None, sample: bool,
             ) -> tuple[list[int], list[tuple[list[int], list[float]]], list[float]]:
        """Draft from ``node``: (tokens, per-draft (child tokens, child counts), per-draft count(child)/count(node))."""
        tokens: list[int] = []
        dists: list[tuple[list[int], list[float]]] = []
        probs: list[float] = []
        running = 1.0
        count, kids, label = self.count, self.kids, self._label
        while len(tokens) < limit and kids[node]:
            children = kids[node]
            weights = [count[c] for c in children]
            if sample:
                pick = int(torch.multinomial(torch.tensor(weights, dtype=torch.float64), 1, generator=generator))
            else:
                pick = max(range(len(children)), key=weights.__getitem__)  # most frequent, first inserted on ties
            c = children[pick]
            p = count[c] / count[node]
            if running * p < min_prob:
                break
            running *= p
            tokens.append(label[c])
            dists.append(([label[x] for x in children], [float(w) for w in weights]))
            probs.append(p)
            node = c
        return tokens, dists, probs


def expected_accepted(probs: list[float]) -> float:
    """Σ_i Π_{j≤i} p_j: the expected accepted length of a chain whose steps hold with probabilities p."""
    total, running = 0.0, 1.0
    for p in probs:
        running *= p
        total += running
    return total


class SuffixDrafter:
    """The drafter protocol over a request trie (reset per sequence) and an optional corpus trie."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, max_depth: int = 24, max_spec_factor: float = 1.0, min_prob: float = 0.1,
                 corpus: SuffixTrie | None = None, grow_corpus: bool = False, device: torch.device | str = "cpu"):
        self.vocab_size, self.max_depth, self.device = vocab_size, max_depth, torch.device(device)
        self.max_spec_factor, self.min_prob = max_spec_factor, min_prob
        self.corpus = corpus
        if grow_corpus and self.corpus is None:
            self.corpus = SuffixTrie(max_depth, vocab_size)
        self.grow_corpus = grow_corpus
        self.counts = SourceCounts()
        self.request = SuffixTrie(max_depth, vocab_size)
        self._prompt_len: int | None = None
        self.tokens: list[int] = []
        self._corpus_matched: list[int] = []

    def reset(self) -> None:
        if self.grow_corpus and self.corpus is not None and self._prompt_len is not None:
            self.corpus.new_document()
            self.corpus.extend(self.tokens[self._prompt_len:])  # the finished output joins the corpus
        self.request = SuffixTrie(self.max_depth, self.vocab_size)
        self.tokens = []
        self._prompt_len = None
        self._corpus_matched = []

    def update(self, tokens: Tensor, features: Tensor | None = None) -> None:
        new = tokens.tolist()
        if self._prompt_len is None:
            self._prompt_len = max(0, len(new) - 1)  # the first update: the prompt + the first sampled token
        self.tokens.extend(new)
        self.request.extend(new)
        if self.corpus is not None:
            for t in new:
                self._corpus_matched = self.corpus.follow(self._corpus_matched, t)

    def continuations(self, k: int, warp: Warp | None = None, generator: torch.Generator | None = None) -> list[Continuation]:
        """One greedy candidate per trie that matches (request first), best expected accepted length first."""
        found = []
        for name, trie, matched in self._sources():
            cont = self._draft(trie, matched, k, None, sample=False, source=name)
            if cont is not None:
                found.append(cont)
        return sorted(found, key=lambda c: -c.score)  # stable: the request trie wins ties

    def propose(self, k: int, warp: Warp, generator: torch.Generator | None) -> Proposal:
        found = self.continuations(k)
        best = found[0] if found else None
        if best is not None and not warp.greedy:  # sample the walk in the trie the greedy scores chose
            trie, matched = {n: (t, m) for n, t, m in self._sources()}[best.source]
            best = self._draft(trie, matched, k, generator, sample=True, source=best.source)
        if best is not None:
            self.counts.add(best.source, len(best.tokens))
        return to_proposal(best, self.vocab_size, warp.greedy, self.device)

    def _sources(self) -> list[tuple[str, SuffixTrie, list[int]]]:
        out = [("request", self.request, self.request.active)]
        if self.corpus is not None:
            out.append(("corpus", self.corpus, self._corpus_matched))
        return out

    def _draft(self, trie: SuffixTrie, matched: list[int], k: int, generator: torch.Generator | None, sample: bool,
               source: str) -> Continuation | None:
        longest = self.max_depth // 2
        for node in reversed(matched):  # deepest first
            m = trie.depth[node]
            if m > longest or not trie.kids[node]:
                continue
            limit = min(k, max(1, int(self.max_spec_factor * m)))
            tokens, dists, probs = trie.walk(node, limit, self.min_prob, generator, sample)
            if not tokens:
                return None
            return Continuation(tokens, confidence=probs[0], score=expected_accepted(probs),
                                dists=dists if sample else None, source=source, match_length=m)
        return None


def read_corpus(path: str, tokenizer: Any) -> list[list[int]]:
    """Token-id documents from ``path``.

    * a JSONL file whose lines hold ``tokens`` or ``input_ids`` (lists of ids, e.g. ``eval_outputs.jsonl``),
      ``text`` (a string), or ``messages`` (chat turns; the assistant turns are taken);
    * a folder written by ``draftsmith prepare``'s regenerate stage (its ``manifest.json`` and shards):
      the target's own answers.
    Texts are tokenized with the target's tokenizer, without special tokens.
    """
    if os.path.isdir(path):
        from ..data.regenerate import regenerated_records

        records: Iterable[dict[str, Any]] = regenerated_records(path)
    elif os.path.isfile(path):
        records = _jsonl(path)
    else:
        raise DraftsmithError(f"suffix corpus '{path}' does not exist (a JSONL file or a regenerate folder)")
    docs: list[list[int]] = []
    for i, rec in enumerate(records, 1):
        ids = rec.get("tokens", rec.get("input_ids")) if isinstance(rec, dict) else None
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            docs.append(ids)
        elif isinstance(rec, dict) and isinstance(rec.get("text"), str):
            docs.append(tokenizer.encode(rec["text"], add_special_tokens=False))
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            docs += [tokenizer.encode(m["content"], add_special_tokens=False) for m in rec["messages"]
                     if isinstance(m, dict) and m.get("role") == "assistant" and isinstance(m.get("content"), str)]
        else:
            raise DraftsmithError(f"{path}: record {i} has none of 'tokens', 'input_ids', 'text', 'messages'")
    return docs


def _jsonl(path: str) -> Iterable[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise DraftsmithError(f"{path}:{lineno} is not valid JSON: {e}") from e


def build_corpus(docs: Iterable[list[int]], max_depth: int, vocab_size: int) -> SuffixTrie:
    trie = SuffixTrie(max_depth, vocab_size)
    for doc in docs:
        trie.new_document()
        trie.extend(doc)
    return trie


@dataclass
class SuffixConfig:
    """suffix decoding: the most frequent continuation in suffix tries of the request and a corpus (no weights)."""

    type: Literal["suffix"] = "suffix"
    max_depth: int = 24
    """Depth of the suffix tries: matches use up to max_depth/2 tokens, the rest is room to draft."""
    max_spec_factor: float = 1.0
    """Draft at most this many tokens per matched token (and at most decode.k)."""
    min_prob: float = 0.1
    """Stop drafting when the product of count(child)/count(node) along the draft falls below this."""
    corpus: str = ""
    """Earlier outputs to draft from as well: a JSONL file (tokens / text / messages per line) or a
    regenerate folder of ``draftsmith prepare`` (``<data.out_dir>/regenerate``); empty = the request only."""
    grow_corpus: bool = False
    """Add every finished output to the corpus trie (SuffixDecoding's global tree). Off by default so
    that an evaluation's result for one prompt does not depend on the prompts before it."""

    def validate(self) -> None:
        if self.max_depth < 2:
            raise ConfigError(f"drafter.max_depth = {self.max_depth} must be at least 2")
        if self.max_spec_factor <= 0:
            raise ConfigError(f"drafter.max_spec_factor = {self.max_spec_factor} must be > 0")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ConfigError(f"drafter.min_prob = {self.min_prob} must be in [0, 1]")

    def build(self, target: Target) -> SuffixDrafter:
        self.validate()
        corpus = None
        if self.corpus:
            corpus = build_corpus(read_corpus(self.corpus, target.tokenizer), self.max_depth, target.vocab_size)
        return SuffixDrafter(target.vocab_size, self.max_depth, self.max_spec_factor, self.min_prob, corpus,
                             self.grow_corpus, target.device)
