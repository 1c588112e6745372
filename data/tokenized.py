"""The tokenized dataset: what every training recipe reads.

``<out>/tokenized/`` is a `datasets.Dataset` saved with ``save_to_disk`` whose columns are

* ``input_ids``  list of int32 — the conversation rendered with the target's chat template;
* ``loss_mask``  list of int8, same length — 1 on assistant tokens that are trained on
  (token t is predicted from position t-1; see :mod:`draftsmith.data.render`);
* ``source``     str — the source label; ``conv_id`` str — the record's id in its source.

Next to the Arrow files, ``draftsmith_manifest.json`` records the tokenizer fingerprint
(:func:`draftsmith.target.tokenizer_fingerprint`), the target's vocabulary size, the
render settings, counts, ``data_hash`` (a hash of every input_ids / loss_mask
value, which the feature cache records as its source-data hash) and ``files`` (the sha256 of each file
``save_to_disk`` wrote: ``prepare`` tokenizes again rather than reuse a folder whose files changed).
:func:`load_tokenized` checks the columns, refuses data rendered with another tokenizer and, with
``verify="all"`` (the default), a folder whose files are not those sha256s (a manifest of an older
draftsmith, which records none, is read unchecked).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from typing import Any, Literal

import numpy as np

from ..errors import DraftsmithError
from ..files import atomic_dir, changed_files, file_digests, write_json
from .render import render_batch
from .shards import read_json

MANIFEST = "draftsmith_manifest.json"
FORMAT = "draftsmith-tokenized/1"
COLUMNS = ("input_ids", "loss_mask", "source", "conv_id")


def tokenized_features() -> Any:
    from datasets import Features, List, Value

    return Features({
        "conv_id": Value("string"),
        "source": Value("string"),
        "input_ids": List(Value("int32")),
        "loss_mask": List(Value("int8")),
    })


def tokenize_conversations(
    conversations: Any,
    out: str,
    tokenizer: Any,
    *,
    max_length: int,
    last_turn_only: bool,
    stop_ids: list[int],
    num_proc: int,
    map_batch_size: int,
    cache_dir: str,
    fingerprint: str,
    manifest: dict[str, Any],
) -> dict[str, Any]:
    """Render every conversation (`datasets.map`, ``num_proc`` workers, cached under ``cache_dir``
    by ``fingerprint``) and save the kept ones to ``out`` atomically. Returns the manifest."""
    os.makedirs(cache_dir, exist_ok=True)
    rendered = conversations.map(
        render_batch,
        batched=True,
        batch_size=map_batch_size,
        num_proc=num_proc if num_proc > 1 and len(conversations) > map_batch_size else None,
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "last_turn_only": last_turn_only,
                   "stop_ids": list(stop_ids)},
        remove_columns=[c for c in ("messages", "truncated_turns") if c in conversations.column_names],
        features=_with_skip(tokenized_features()),
        cache_file_name=os.path.join(cache_dir, f"render-{fingerprint}.arrow"),
        new_fingerprint=f"render-{fingerprint}",
        desc="render",
    )
    skipped: Counter = Counter()
    examples: dict[str, str] = {}
    for reason, source, conv_id in zip(rendered["skip"], rendered["source"], rendered["conv_id"]):
        if reason:
            skipped[reason] += 1
            examples.setdefault(reason, f"{source}:{conv_id}")
    kept = rendered.filter(lambda s: s == "", input_columns="skip",
                           cache_file_name=os.path.join(cache_dir, f"kept-{fingerprint}.arrow"),
                           new_fingerprint=f"kept-{fingerprint}", desc="drop skipped")
    kept = kept.remove_columns("skip").select_columns(list(COLUMNS))
    tokens, loss_tokens, data_hash = dataset_stats(kept)
    full = {**manifest, "num_samples": len(kept), "num_tokens": tokens, "num_loss_tokens": loss_tokens,
            "data_hash": data_hash, "skipped": dict(skipped), "skip_examples": examples}
    with atomic_dir(out) as tmp:
        kept.save_to_disk(tmp)
        full["files"] = file_digests(tmp)
        write_json(os.path.join(tmp, MANIFEST), full)
    return full


def _with_skip(features: Any) -> Any:
    from datasets import Value

    features = features.copy()
    features["skip"] = Value("string")
    return features


def dataset_stats(ds: Any) -> tuple[int, int, str]:
    """(tokens, loss-masked tokens, data hash) of a tokenized dataset; independent of Arrow chunking."""
    values = hashlib.sha256()
    lengths = hashlib.sha256()
    tokens = loss = 0
    for name in ("input_ids", "loss_mask"):
        column = ds.data.column(name)
        for chunk in column.chunks:
            flat = chunk.flatten().to_numpy(zero_copy_only=False)
            sizes = np.diff(chunk.offsets.to_numpy()).astype(np.int64)
            values.update(np.ascontiguousarray(flat).tobytes())
            lengths.update(sizes.tobytes())
            if name == "input_ids":
                tokens += int(sizes.sum())
            else:
                loss += int(flat.astype(np.int64).sum())
    return tokens, loss, hashlib.sha256((values.hexdigest() + lengths.hexdigest()).encode()).hexdigest()[:16]


def tokenized_manifest(path: str) -> dict[str, Any]:
    """The manifest of a tokenized dataset folder; a clear error when there is none."""
    manifest = read_json(os.path.join(path, MANIFEST))
    if manifest is None:
        if not os.path.isdir(path):
            raise DraftsmithError(f"tokenized dataset '{path}' does not exist; run `draftsmith prepare` "
                                  f"with 'tokenize' in data.stages")
        raise DraftsmithError(f"'{path}' has no {MANIFEST}: it was not written by `draftsmith prepare`; "
                              f"re-run it with 'tokenize' in data.stages")
    return manifest


def load_tokenized(path: str, tokenizer: Any = None, verify: Literal["all", "none"] = "all") -> Any:
    """The tokenized `datasets.Dataset` at ``path`` (columns input_ids, loss_mask, source, conv_id).

    tokenizer: a tokenizer, a :class:`~draftsmith.target.Target`, or a tokenizer fingerprint
    string; when given, data rendered with a different tokenizer is refused.
    verify: "all" checks every file against the sha256 the manifest records before reading it (Arrow
    files are memory-mapped, so there is no first read to check lazily, as the feature cache does);
    "none" skips it. A manifest that records no sha256 (an older draftsmith) is read unchecked.
    """
    import datasets

    manifest = tokenized_manifest(path)
    if tokenizer is not None:
        expected = _tokenizer_hash(tokenizer)
        if manifest.get("tokenizer_hash") != expected:
            raise DraftsmithError(
                f"tokenized dataset '{path}' was rendered with tokenizer {manifest.get('tokenizer_hash')} "
                f"(target '{manifest.get('target')}'), not with this target's tokenizer {expected}; token ids "
                f"would not mean the same thing. Re-run `draftsmith prepare` with this target "
                f"(data.stages=[tokenize]) or point to data prepared for it"
            )
    if verify == "all" and manifest.get("files"):
        damage = changed_files(path, manifest["files"])
        if damage:
            raise DraftsmithError(f"tokenized dataset '{path}' is damaged: {'; '.join(damage)}. Re-run `draftsmith "
                                  f"prepare` with 'tokenize' in data.stages: it tokenizes again")
    ds = datasets.load_from_disk(path)
    missing = [c for c in COLUMNS if c not in ds.column_names]
    if missing:
        raise DraftsmithError(f"tokenized dataset '{path}' lacks column(s) {missing}; re-run `draftsmith prepare`")
    for name, dtype in (("input_ids", "int32"), ("loss_mask", "int8")):
        got = getattr(ds.features[name], "feature", None)
        if getattr(got, "dtype", None) != dtype:
            raise DraftsmithError(f"tokenized dataset '{path}': column {name} is {ds.features[name]}, expected a "
                                  f"list of {dtype}; re-run `draftsmith prepare`")
    return ds


def _tokenizer_hash(tokenizer: Any) -> str:
    if isinstance(tokenizer, str):
        return tokenizer
    if hasattr(tokenizer, "tokenizer_hash"):
        return tokenizer.tokenizer_hash
    from ..target import tokenizer_fingerprint

    return tokenizer_fingerprint(tokenizer)
