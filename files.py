"""Atomic file writes: a reader never sees a half-written file, a kill loses nothing committed.

**Modes.** Everything draftsmith writes has the modes an ordinary ``open`` / ``os.makedirs`` would
give (0666 / 0777 less the umask), not ``mkstemp``'s owner-only 0600 / 0700 nor the 0600 that
``safetensors.save_file`` (and ``save_pretrained``, which ends in it) gives whatever the umask: an
export or a drafter must be readable by a serving container that runs as another user. The rule
lives here, once: :func:`atomic_path` and :func:`atomic_dir` give what they commit the umask's modes
(:func:`umask_modes`), whichever library wrote it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` only if the block succeeds."""
    path = _resolved(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = _create_unique(directory, path, lambda p: os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)))
    try:
        yield tmp
        _give_umask_modes(tmp)
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
    path = _resolved(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = _create_unique(parent, path, lambda p: os.mkdir(p, 0o777))
    try:
        yield tmp
        _give_umask_modes(tmp)
        swap_dir(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _resolved(path: str) -> str:
    """``path``, or where it points when it is a symbolic link (dangling or not): a write replaces what the link names
    and keeps the link. Replacing the link itself put the new files beside it instead of on the disk the user
    linked, and left the link, moved aside by the exchange, as a temporary name no one removes."""
    return os.path.realpath(path) if os.path.islink(path) else path


def swap_dir(new: str, path: str) -> None:
    """Put the folder ``new`` at ``path`` (same file system). An existing ``path`` is exchanged with ``new`` in one
    rename (Linux's ``renameat2(RENAME_EXCHANGE)``), so a kill at any moment leaves the old folder or the new one at
    ``path``, never neither; the old one, now at ``new``, is then removed. Where the exchange is not offered (another
    system, a file system without it), two renames, with the old folder at ``new + ".old"`` between them."""
    if not os.path.isdir(path):
        os.replace(new, path)
        return
    if not _exchange(new, path):
        old = new + ".old"
        os.replace(path, old)
        os.replace(new, path)
        os.replace(old, new)
    shutil.rmtree(new, ignore_errors=True)


_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Exchange the paths ``a`` and ``b`` atomically; False where the system cannot (nothing was changed)."""
    try:
        import ctypes

        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a libc without it (glibc < 2.28)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_cwd = -100
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a file system or kernel without the flag
        return False
    raise OSError(code, os.strerror(code), b)


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    """The sha256 of a file's bytes (hex), read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def folder_files(folder: str, skip: tuple[str, ...] = ()) -> list[str]:
    """Every file below ``folder`` but those named in ``skip``, as sorted paths relative to it."""
    out = [os.path.relpath(os.path.join(d, name), folder) for d, _, names in os.walk(folder) for name in names]
    return sorted(name for name in out if name not in skip)


def file_digests(folder: str, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """{path relative to ``folder``: sha256} of every file below it but ``skip`` (:func:`folder_files`)."""
    return {name: sha256_file(os.path.join(folder, name)) for name in folder_files(folder, skip)}


def changed_files(folder: str, digests: Any) -> list[str]:
    """What differs in ``folder`` from ``digests`` (:func:`file_digests` when it was written), one 'NAME is missing' /
    'NAME changed (sha256)' each; files added since (a ``datasets`` cache beside the data) are not looked at.
    ``digests`` that are not such a map (a manifest of an older draftsmith) give one entry saying so."""
    if not isinstance(digests, dict) or not digests:
        return ["its manifest records no sha256 of its files (an older draftsmith wrote it)"]
    out = []
    for name, digest in digests.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            out.append(f"{name} is missing")
        elif sha256_file(path) != digest:
            out.append(f"{name} changed after it was written (sha256)")
    return out


def umask_modes() -> tuple[int, int]:
    """(file mode, folder mode) that ``open`` / ``os.makedirs`` give under this process's umask: 0666 / 0777 less it."""
    mask = _umask()
    return 0o666 & ~mask, 0o777 & ~mask


def _umask() -> int:
    try:  # read, not set: setting it, even for a moment, would race with other threads creating files
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _give_umask_modes(path: str) -> None:
    """Give ``path`` (a file, or a folder and everything below it) the umask's modes; a file with an execute bit
    (a built tool) gets the folder mode, so it stays executable as far as the umask allows."""
    file_mode, dir_mode = umask_modes()
    paths = [(path, os.path.isdir(path))]
    if os.path.isdir(path):
        for root, dirs, files in os.walk(path):
            paths += [(os.path.join(root, n), True) for n in dirs] + [(os.path.join(root, n), False) for n in files]
    for p, is_dir in paths:
        if os.path.islink(p):
            continue
        os.chmod(p, dir_mode if is_dir or os.stat(p).st_mode & 0o111 else file_mode)


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
