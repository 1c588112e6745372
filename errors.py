"""User-facing errors.

Anything a user can cause — bad config, bad input data, a missing package, a
checkpoint made for another target — raises a :class:`DraftsmithError` whose
message says what is wrong *and what to do*. The CLI prints these without a
traceback; everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Callable, Iterator


class DraftsmithError(Exception):
    """An error caused by the user's input, with a message naming the fix."""


class ConfigError(DraftsmithError):
    """A config key, value or combination that is not valid."""


class SaidElsewhere(DraftsmithError):
    """The refusal of a launch's other processes where its rank 0 has said why: the CLI exits as for any
    :class:`DraftsmithError` and prints nothing, so that a launch of N processes says it once, not N times."""


# ---------------------------------------------------------------- writes the system refused

FULL_DISK_BYTES = 1 << 20
"""A failed write with less than this free (for this user) on the folder's file system is taken as a full
disk: torch.save's C++ stream and safetensors' Rust writer do not pass the OS's errno on ("basic_ios::clear",
"unexpected pos …"), so the free space right after the failure is what tells."""


def write_refusal(e: BaseException, folder: str | None) -> str | None:
    """A one-line message when ``e`` is the system refusing a write under ``folder`` (a full disk, a
    read-only file system, no permission); None when it is anything else."""
    if not isinstance(e, (OSError, RuntimeError)) and type(e).__name__ != "SafetensorError":
        return None
    code = getattr(e, "errno", None)
    folder = getattr(e, "filename", None) or folder
    where = _existing(folder) if folder else None
    if code in (errno.ENOSPC, errno.EDQUOT) or "os error 28" in str(e) or (code is None and where and _nearly_full(where)):
        return f"no space left on {where or 'the disk'}: free some space (or write elsewhere: run_dir, --out) and rerun"
    if code == errno.EROFS or (code is None and where and _read_only(where)):
        return f"'{where}' is on a read-only file system: choose a writable folder (run_dir, data.out_dir, --out)"
    if code in (errno.EACCES, errno.EPERM):
        return f"permission denied on '{folder}': choose a folder you can write (run_dir, data.out_dir, --out)"
    return None


def refused_errno(path: str, output: str = "") -> int | None:
    """The errno of a write the system refused another program at ``path`` (llama.cpp's converter, llama-quantize),
    which reaches us as an exit code and some text, not an ``OSError``: ENOSPC or EROFS from what it printed ("No
    space left on device", numpy's short write "N requested and M written") or, where it printed nothing that tells,
    from the folder itself (nearly full, mounted read-only); None when the failure is something else."""
    where = _existing(path)
    if re.search(r"No space left on device|\[Errno 28\]|requested and \d+ written", output) or _nearly_full(where):
        return errno.ENOSPC
    if "Read-only file system" in output or _read_only(where):
        return errno.EROFS
    return None


@contextlib.contextmanager
def writing(folder: str, cleanup: str | None = None, kept: Callable[[], str] | None = None) -> Iterator[None]:
    """Run work that writes under ``folder``; a write the system refuses becomes a :class:`DraftsmithError`
    that names the folder (:func:`write_refusal`) instead of a library's traceback. On any failure the
    folder ``cleanup`` (a half-written temporary one) is removed — after the failure is classified, since
    removing it frees the space that tells a full disk. ``kept``: what the rerun keeps of the work done, said at the
    end of the line (called when a write was refused)."""
    try:
        yield
    except BaseException as e:
        message = None if isinstance(e, DraftsmithError) else write_refusal(e, folder)
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)
        if message is None:
            raise
        if kept is not None:
            message += f"; kept for the rerun: {kept()}"
        raise DraftsmithError(message) from e


def _existing(path: str) -> str:
    """``path`` when it is a folder, else the nearest folder above it that exists: where a refused write was, for a user
    to look at — not the file that could not be written, a temporary folder already removed, or an output folder
    (and its parents) not created yet."""
    if os.path.isdir(path):
        return path
    path = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path


def _read_only(folder: str) -> bool:
    """Whether ``folder`` is on a file system mounted read-only: DeepSpeed logs the refused ``mkdir`` of a checkpoint
    folder and goes on, and torch.save then says only "Parent directory … does not exist" (no errno)."""
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _nearly_full(folder: str) -> bool:
    try:
        return shutil.disk_usage(folder).free < FULL_DISK_BYTES
    except OSError:
        return False