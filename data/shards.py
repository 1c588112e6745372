"""A long job split into numbered shard files in one folder, resumable after a kill.

Each shard is committed atomically (temp file + rename), then its small ``.json``
record (rows, bytes, sha256) is written the same way; a shard counts as done only
when both exist and the sizes agree. ``job.json`` holds the job's spec (inputs,
settings, target): re-running with the same spec keeps every finished shard, a
different spec starts over (the old shards are deleted, and the run says so).
Once every shard is done the caller writes ``manifest.json``, which readers use.

Several processes (``draftsmith prepare`` under torchrun or the deepspeed launcher) share
one job through :class:`Workers`: process r computes the shards i with i % size == r,
process 0 alone prepares the folder and writes the manifest, and they meet at barriers.
A shard's content depends on that shard alone (its own seed), so the files are the same
whatever the number of processes, and a resumed run may use another number.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import DraftsmithError
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


def _alone() -> None:
    """The barrier of a single process."""


def _own(values: list[float]) -> list[float]:
    """The sum over a single process."""
    return list(values)


@dataclass(frozen=True)
class Workers:
    """This process's place among the processes sharing sharded jobs; ``Workers()`` is a single process.

    ``barrier`` and ``all_sum`` are supplied from outside (``train.distributed``): data code
    never touches the process group itself.
    """

    rank: int = 0
    size: int = 1
    barrier: Callable[[], None] = field(default=_alone, compare=False)
    all_sum: Callable[[list[float]], list[float]] = field(default=_own, compare=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def owns(self, shard: int) -> bool:
        return shard % self.size == self.rank


SOLO = Workers()


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
        if not isinstance(manifest, dict) or manifest.get("spec") != self.spec:
            return None
        if any(self.done(i) is None for i in range(len(manifest["shards"]))):
            return None  # a shard was deleted (e.g. after a checksum error): resume recomputes it
        return manifest

    def start(self, workers: Workers = SOLO) -> str:
        """Prepare the folder (process 0; the others wait); return a one-line note (resuming,
        restarting, or starting; empty on the other processes)."""
        note = self._prepare_folder() if workers.is_main else ""
        workers.barrier()
        return note

    def _prepare_folder(self) -> str:
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

    def collect(self, num_shards: int, workers: Workers = SOLO) -> list[dict[str, Any]]:
        """Once every process has committed its shards: the records of all ``num_shards``, in order."""
        workers.barrier()
        shards = [self.done(i) for i in range(num_shards)]
        missing = [i for i, meta in enumerate(shards) if meta is None]
        if missing:
            raise DraftsmithError(f"{len(missing)} shard(s) of '{self.folder}' (first: {missing[0]}) are missing after "
                                  f"every process finished; is the folder on storage all processes share? Re-run to "
                                  f"compute them")
        return shards

    def finish(self, shards: list[dict[str, Any]], workers: Workers = SOLO, **fields: Any) -> dict[str, Any]:
        """Write ``manifest.json`` (spec, shard records, extra fields; process 0) and return it."""
        manifest = {"spec": self.spec, **fields, "shards": shards}
        if workers.is_main:
            write_json(os.path.join(self.folder, MANIFEST), manifest)
        workers.barrier()
        return manifest
