"""A long job split into numbered shard files in one folder, resumable after a kill.

Each shard is committed atomically (temp file + rename), then its small ``.json``
record (rows, bytes, sha256) is written the same way; a shard counts as done only
when both exist and the sizes agree. Once every shard is done the caller writes
``manifest.json``, which readers use.

What is kept. A shard covers a range of the job's input records and records a digest of
them; ``job.json`` holds the job's *spec*: only the settings that change what a record
becomes (the target, sampling settings, ...), never batch or shard sizes. A re-run walks
the inputs from the start and keeps every finished shard whose records are the inputs at
its place, cutting what follows into new shards of the current size: a killed run
resumes, a grown input (``data.max_conversations`` 200 → 1000) is extended, a new shard
size applies to new shards only. When the spec changed, or a finished shard's records are
no longer the inputs at its place, going on would discard finished work: the job stops
with a one-line error that says what changed and how much would be lost, unless it was
started with ``restart`` (``draftsmith prepare --restart``), which discards exactly those
shards.

Several processes (``draftsmith prepare`` under torchrun or the deepspeed launcher) share
one job through :class:`Workers`: process r computes the shards i with i % size == r,
process 0 alone prepares the folder and writes the manifest, and they meet at barriers.
A shard's content depends on that shard alone (its own seed), so the files are the same
whatever the number of processes, and a resumed run may use another number.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import DraftsmithError, writing
from ..files import atomic_path, sha256_file, write_json

JOB = "job.json"
MANIFEST = "manifest.json"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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


def record_digest(obj: Any) -> str:
    """A short digest of one input record (JSON-able), for :class:`ShardedJob`'s ``records``."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode())[:16]


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` covers the job's input records ``start:stop``, whose digest is ``inputs``."""

    index: int
    start: int
    stop: int
    inputs: str


class ShardedJob:
    """A job over ``records`` (one :func:`record_digest` per input record) in shards of ``shard_size``
    records (new shards; finished ones keep theirs). ``spec``: the settings that change a record."""

    def __init__(self, folder: str, spec: dict[str, Any], suffix: str, records: list[str], shard_size: int):
        self.folder = folder
        self.spec = json.loads(json.dumps(spec, default=str))  # as it will read back from disk
        self.suffix = suffix
        self.records = records
        self.shard_size = shard_size
        self.shards: list[Shard] = []
        """The plan, set by :meth:`start` (and :meth:`finished` when it returns a manifest)."""
        self.corrupt: list[int] = []
        """Shards :meth:`finished` found altered (sha256) and deleted, to be computed again."""

    def shard_path(self, i: int) -> str:
        return os.path.join(self.folder, f"shard-{i:05d}{self.suffix}")

    def _meta_path(self, i: int) -> str:
        return os.path.join(self.folder, f"shard-{i:05d}.json")

    def _inputs(self, start: int, stop: int) -> str:
        return sha256_bytes("".join(self.records[start:stop]).encode())[:16]

    def plan(self) -> list[Shard]:
        """Finished shards whose records are the inputs at their place, in order; new shards for the rest."""
        shards: list[Shard] = []
        start = 0
        while start < len(self.records):
            i = len(shards)
            meta = self._whole(i)
            size = meta.get("records") if meta else None
            if isinstance(size, int) and 0 < size <= len(self.records) - start and meta.get("first_index") == start \
                    and meta.get("inputs") == self._inputs(start, start + size):
                stop = start + size
            else:
                stop = min(start + self.shard_size, len(self.records))
            shards.append(Shard(i, start, stop, self._inputs(start, stop)))
            start = stop
        return shards

    def finished(self) -> dict[str, Any] | None:
        """The manifest when this exact job already ran to the end and every shard is still whole, else None."""
        manifest = read_json(os.path.join(self.folder, MANIFEST))
        if not isinstance(manifest, dict) or manifest.get("spec") != self.spec:
            return None
        shards = self.plan()
        if len(manifest["shards"]) != len(shards) or any(self.done(s) is None for s in shards):
            return None  # a shard was deleted (e.g. after a checksum error), or the inputs grew: resume
        # "up to date" is a promise about the bytes: an altered shard (same size) is deleted and computed again
        self.corrupt = [s.index for s in shards if sha256_file(self.shard_path(s.index)) != self.done(s).get("sha256")]
        for i in self.corrupt:
            for path in (self._meta_path(i), self.shard_path(i)):
                with contextlib.suppress(FileNotFoundError):  # another process may have been first
                    os.remove(path)
        if self.corrupt:
            return None
        self.shards = shards
        return manifest

    def start(self, workers: Workers = SOLO, restart: bool = False) -> str:
        """Prepare the folder (process 0: refuse to discard finished work unless ``restart``) and plan the
        shards (every process); return a one-line note (empty on the other processes)."""
        note = error = ""
        if workers.is_main:
            try:
                note = self._prepare_folder(restart)
            except DraftsmithError as e:
                error = str(e)
        if workers.all_sum([float(bool(error))])[0]:  # every process stops, none waits at a barrier
            raise DraftsmithError(error or f"process 0 refused to go on with '{self.folder}' (see its message)")
        self.shards = self.plan()
        if self.corrupt and note:
            note = (f"shard(s) {', '.join(map(str, self.corrupt))} no longer matched their sha256 and are computed "
                    f"again; {note}")
        return note

    def _prepare_folder(self, restart: bool) -> str:
        os.makedirs(self.folder, exist_ok=True)
        old = read_json(os.path.join(self.folder, JOB))
        old_spec = old.get("spec") if isinstance(old, dict) else None
        whole = {i: m for i in self._indices() if (m := self._whole(i)) is not None}
        if old_spec != self.spec:
            lost, why = sorted(whole), _changes(old_spec, self.spec)
        else:
            plan = self.plan()
            lost = [s.index for s in plan if s.index in whole and self.done(s) is None]
            why = (f"the inputs of shard {lost[0]} are no longer the records it was made from (data.sources, "
                   f"data.max_conversations, data.render or an earlier stage's output changed)") if lost else ""
        if lost and not restart:
            sizes = [whole[i].get("records") for i in lost]  # unknown in an older draftsmith's shards
            records = f" ({sum(sizes)} input records)" if all(isinstance(n, int) for n in sizes) else ""
            raise DraftsmithError(f"'{self.folder}': {why}; going on would discard {len(lost)} finished shard(s)"
                                  f"{records}. Restore what changed, or re-run prepare with --restart to discard them")
        for i in lost:
            for path in (self.shard_path(i), self._meta_path(i)):
                if os.path.exists(path):
                    os.remove(path)
        manifest = os.path.join(self.folder, MANIFEST)
        if os.path.exists(manifest):
            os.remove(manifest)  # it is rewritten when the job ends; never left pointing at stale shards
        write_json(os.path.join(self.folder, JOB), {"spec": self.spec})
        if lost:
            return f"--restart: {len(lost)} finished shard(s) discarded ({why})"
        kept = sum(self.done(s) is not None for s in self.plan())
        return f"resuming: {kept} finished shard(s) kept" if kept else "starting"

    def _indices(self) -> list[int]:
        return sorted(int(os.path.basename(m)[6:11]) for m in glob.glob(os.path.join(self.folder, "shard-*.json")))

    def _whole(self, i: int) -> dict[str, Any] | None:
        """The record of shard i when it was committed and its file is whole, else None."""
        meta = read_json(self._meta_path(i))
        path = self.shard_path(i)
        if not isinstance(meta, dict) or not os.path.isfile(path) or os.path.getsize(path) != meta.get("bytes"):
            return None
        return meta

    def done(self, shard: Shard) -> dict[str, Any] | None:
        """The record of ``shard`` when it was committed over exactly its records and its file is whole, else None."""
        meta = self._whole(shard.index)
        if meta is None or (meta.get("first_index"), meta.get("records"), meta.get("inputs")) != \
                (shard.start, shard.stop - shard.start, shard.inputs):
            return None
        return meta

    def writing(self) -> contextlib.AbstractContextManager[None]:
        """Computing and committing shards: a write the system refuses (a full disk) is one line naming the folder and
        the finished shards a rerun keeps (a refused shard leaves no file a rerun would trust: :meth:`commit`)."""
        def kept() -> str:
            done = sum(self.done(s) is not None for s in self.shards)
            return f"{done} finished shard(s) of {len(self.shards)} in {self.folder}, nothing half-written"

        return writing(self.folder, kept=kept)

    def commit(self, shard: Shard, payload: bytes, meta: dict[str, Any]) -> dict[str, Any]:
        """Write ``shard`` (atomically) and then its record; return the record. A record an earlier run left is removed
        first: a new file is never paired with an old record (a write refused between the two leaves it unrecorded,
        which a rerun computes again)."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._meta_path(shard.index))
        with atomic_path(self.shard_path(shard.index)) as tmp:
            with open(tmp, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
        record = {"file": os.path.basename(self.shard_path(shard.index)), **meta, "first_index": shard.start,
                  "records": shard.stop - shard.start, "inputs": shard.inputs, "bytes": len(payload),
                  "sha256": sha256_bytes(payload)}
        write_json(self._meta_path(shard.index), record)
        return record

    def collect(self, workers: Workers = SOLO) -> list[dict[str, Any]]:
        """Once every process has committed its shards: the records of all planned shards, in order."""
        workers.barrier()
        shards = [self.done(s) for s in self.shards]
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


def _changes(old: dict[str, Any] | None, new: dict[str, Any]) -> str:
    """What differs between two flat specs, as 'key: old then, new now'."""
    if not isinstance(old, dict):
        return "the settings the finished shards were made with are unknown (no job.json, or an older draftsmith's)"
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return "; ".join(f"{k}: {old.get(k)!r} then, {new.get(k)!r} now" for k in keys)
