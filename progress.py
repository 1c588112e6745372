"""Progress bars: tqdm's, opened through :func:`progress_bar` so that the CLI can end those a failing stage left open.

A stage stopped by an error (a full disk, a failing server, SIGTERM) leaves its bar open, held by the traceback:
the CLI's error line was written into the bar's line and the bar drawn again below it when it was collected, so the
last line a user saw was the bar. :func:`end_open_bars` closes every bar opened here first. Libraries' bars
(datasets' map and save_to_disk, the hub's downloads) are opened in ``with`` blocks and end with their block.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

_OPEN: weakref.WeakSet[tqdm] = weakref.WeakSet()


def progress_bar(iterable: Iterable[Any] | None = None, **kwargs: Any) -> tqdm:
    """A tqdm bar (tqdm's arguments), remembered until it is collected."""
    opened = tqdm(iterable, **kwargs)
    _OPEN.add(opened)
    return opened


def end_open_bars() -> None:
    """Close the bars :func:`progress_bar` opened that are still open (closing a closed bar does nothing)."""
    for opened in list(_OPEN):
        opened.close()
