"""Normalized conversations on disk: one Arrow file (``data.arrow``) + ``manifest.json``.

Columns: ``conv_id`` (str), ``source`` (str), ``messages`` (list of {role, content}), and
``truncated_turns`` (list of int): indices of assistant messages that were cut at a token limit
by regeneration (their end-of-turn token is not trained on: the model did not stop there).
Written in a stream (constant memory for any dataset size) into a temporary folder that
replaces the old one only when complete. The manifest holds the spec it was made from
(so an unchanged re-run reuses it, once its ``files`` — the sha256 of ``data.arrow`` — still match), the counts,
and a content hash that downstream stages record as their input.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from typing import Any

from ..files import atomic_dir, file_digests, write_json
from .shards import read_json

DATA_FILE = "data.arrow"
MANIFEST = "manifest.json"
FORMAT = "draftsmith-conversations/1"
"""Part of every spec that reads these files: bump it when the columns change, and old outputs are rebuilt."""


def conversation_features() -> Any:
    from datasets import Features, List, Value

    return Features({
        "conv_id": Value("string"),
        "source": Value("string"),
        "messages": List({"role": Value("string"), "content": Value("string")}),
        "truncated_turns": List(Value("int32")),
    })


def write_conversations(folder: str, records: Iterable[dict[str, Any]], **manifest: Any) -> dict[str, Any]:
    """Stream ``records`` to ``folder``; return the manifest (``manifest`` fields + count + hash).

    Fields whose value is a callable are called after the stream is consumed (for counts
    gathered while reading).
    """
    from datasets.arrow_writer import ArrowWriter

    h = hashlib.sha256()
    n = 0
    with atomic_dir(folder) as tmp:
        writer = ArrowWriter(features=conversation_features(), path=os.path.join(tmp, DATA_FILE))
        try:
            for rec in records:
                writer.write(rec)
                h.update(json.dumps(rec, sort_keys=True, ensure_ascii=False).encode())
                n += 1
            writer.finalize()
        finally:
            writer.close()
        resolved = {k: (v() if callable(v) else v) for k, v in manifest.items()}
        out = {**resolved, "num_conversations": n, "hash": h.hexdigest()[:16], "files": file_digests(tmp)}
        write_json(os.path.join(tmp, MANIFEST), out)
    return out


def conversations_manifest(folder: str) -> dict[str, Any] | None:
    if not os.path.isfile(os.path.join(folder, DATA_FILE)):
        return None
    return read_json(os.path.join(folder, MANIFEST))


def load_conversations(folder: str) -> Any:
    """The conversations as a memory-mapped `datasets.Dataset`."""
    from datasets import Dataset

    return Dataset.from_file(os.path.join(folder, DATA_FILE))
