"""Atomic file writes: a reader never sees a half-written file, a kill loses nothing committed.

Temporary files and folders are created with the modes an ordinary ``open`` / ``os.makedirs``
would give (0666 / 0777 less the umask), not ``mkstemp``'s owner-only 0600 / 0700: an export
or a drafter must be readable by a serving container that runs as another user.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` only if the block succeeds."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = _create_unique(directory, path, lambda p: os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)))
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text(path: str, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def write_json(path: str, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


@contextlib.contextmanager
def atomic_dir(path: str) -> Iterator[str]:
    """Yield a temporary folder; it replaces ``path`` only if the block succeeds.

    An existing ``path`` is replaced as a whole, never merged.
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = _create_unique(parent, path, lambda p: os.mkdir(p, 0o777))
    try:
        yield tmp
        if os.path.isdir(path):
            old = tmp + ".old"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _create_unique(directory: str, path: str, create: Callable[[str], None]) -> str:
    """``create`` a new hidden ``.NAME.RANDOM.tmp`` next to ``path`` in ``directory`` (the umask applies); its path."""
    for _ in range(100):
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
        try:
            create(tmp)
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name next to {path}")
