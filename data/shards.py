"""A long job split into numbered shard files in one folder, resumable after a kill.

Each shard is committed atomically (temp file + rename), then its small ``.json``
record (rows, bytes, sha256) is written the same way; a shard counts as done only
when both exist and the sizes agree. ``job.json`` holds the job's spec (inputs,
settings, target): re-running with the same spec keeps every finished shard, a
different spec starts over (the old shards are deleted, and the run says so).
Once every shard is done the caller writes ``manifest.json``, which readers use.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Any

from ..files import atomic_path, write_json

JOB = "job.json"
MANIFEST = "manifest.json"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_json(path: str) -> dict[str, Any] | None:
    """A JSON file, or None when it is missing or unreadable (a torn write cannot happen: writes are atomic)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


class ShardedJob:
    def __init__(self, folder: str, spec: dict[str, Any], suffix: str):
        self.folder = folder
        self.spec = json.loads(json.dumps(spec, default=str))  # as it will read back from disk
        self.suffix = suffix

    def shard_path(self, i: int) -> str:
        return os.path.join(self.folder, f"shard-{i:05d}{self.suffix}")

    def _meta_path(self, i: int) -> str:
        return os.path.join(self.folder, f"shard-{i:05d}.json")

    def finished(self) -> dict[str, Any] | None:
        """The manifest when this exact job already ran to the end and every shard is still whole, else None."""
        manifest = read_json(os.path.join(self.folder, MANIFEST))
        if manifest is None or manifest.get("spec") != self.spec:
            return None
        if any(self.done(i) is None for i in range(len(manifest["shards"]))):
            return None  # a shard was deleted (e.g. after a checksum error): resume recomputes it
        return manifest

    def start(self) -> str:
        """Prepare the folder; return a one-line note (resuming, restarting, or starting)."""
        os.makedirs(self.folder, exist_ok=True)
        old = read_json(os.path.join(self.folder, JOB))
        manifest = os.path.join(self.folder, MANIFEST)
        if os.path.exists(manifest):
            os.remove(manifest)  # it is rewritten when the job ends; never left pointing at stale shards
        if old is not None and old != self.spec:
            self._clear()
            write_json(os.path.join(self.folder, JOB), self.spec)
            return "settings or inputs changed since the last run: finished shards discarded, starting over"
        write_json(os.path.join(self.folder, JOB), self.spec)
        metas = glob.glob(os.path.join(self.folder, "shard-*.json"))
        done = sum(self.done(int(os.path.basename(m)[6:11])) is not None for m in metas)
        return f"resuming: {done} finished shard(s) kept" if done else "starting"

    def _clear(self) -> None:
        for path in glob.glob(os.path.join(self.folder, "shard-*")):
            os.remove(path)

    def done(self, i: int) -> dict[str, Any] | None:
        """The record of shard i when it was committed and its file is whole, else None."""
        meta = read_json(self._meta_path(i))
        path = self.shard_path(i)
        if meta is None or not os.path.isfile(path) or os.path.getsize(path) != meta.get("bytes"):
            return None
        return meta

    def commit(self, i: int, payload: bytes, meta: dict[str, Any]) -> dict[str, Any]:
        """Write shard i (atomically) and then its record; return the record."""
        with atomic_path(self.shard_path(i)) as tmp:
            with open(tmp, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
        record = {"file": os.path.basename(self.shard_path(i)), **meta, "bytes": len(payload),
                  "sha256": sha256_bytes(payload)}
        write_json(self._meta_path(i), record)
        return record

    def finish(self, shards: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        """Write ``manifest.json`` (spec, shard records, extra fields); return it."""
        manifest = {"spec": self.spec, **fields, "shards": shards}
        write_json(os.path.join(self.folder, MANIFEST), manifest)
        return manifest
