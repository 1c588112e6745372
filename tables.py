"""Tables, written once: plain text for the terminal that fits a width (80 columns unless told otherwise), and
Markdown for RESULTS, reports and docs.

A table printed by a long job (``draftsmith demo``, ``draftsmith prepare``) is read in whatever
terminal or log the user has; rich's tables wrap every cell into many lines when stdout is not a
wide TTY. These tables keep one line per row: short cells, numbers right-aligned, and the first
column cut with "…" when the whole would exceed the width. Details go in a legend under the table
(:func:`wrapped`) or in the job's JSON.

A Markdown table (:func:`markdown_table`) is what a benchmark prints for RESULTS.md, what ``draftsmith report`` writes
and what a doc page embeds: the same rule for alignment (label columns left, figures right) and for cells that would
break the table.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

WIDTH = 80
"""Columns a printed line may take: the terminal everyone has."""


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], width: int = WIDTH,
               left: int = 1) -> list[str]:
    """The lines of a table, none longer than ``width``.

    ``left`` leading columns are left-aligned, the rest right-aligned (numbers). Columns are
    separated by two spaces. When the natural width exceeds ``width``, the first column is cut
    (its cells end in "…") down to 6 characters; past that the table is wider than asked, which
    the caller's tests catch.
    """
    cols = len(header)
    if any(len(r) != cols for r in rows):
        raise ValueError(f"every row needs {cols} cells: {[len(r) for r in rows]}")
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    over = sum(widths) + 2 * (cols - 1) - width
    if over > 0:
        widths[0] = max(6, widths[0] - over)

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, (c, w) in enumerate(zip(cells, widths)):
            c = str(c)
            if len(c) > w:
                c = c[: w - 1] + "…"
            out.append(c.ljust(w) if i < left else c.rjust(w))
        return "  ".join(out).rstrip()

    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]], left: int = 1) -> list[str]:
    """The lines of a Markdown table: the header, the separator, one line per row.

    ``left`` leading columns are left-aligned (``---``), the rest right-aligned (``---:``: figures). A cell is
    ``str()`` of the value with ``|`` escaped and a newline shown as ⏎, so no value breaks the table.
    """
    cols = len(header)
    if any(len(r) != cols for r in rows):
        raise ValueError(f"every row needs {cols} cells: {[len(r) for r in rows]}")
    separator = "| " + " | ".join("---" if i < left else "---:" for i in range(cols)) + " |"
    return [markdown_row(header), separator, *(markdown_row(r) for r in rows)]


def markdown_row(cells: Sequence[object]) -> str:
    """One line of a Markdown table (:func:`markdown_table`'s cell rule): for a script that prints the header first
    (``markdown_table(header, [])``) and each row as it is measured."""
    return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", "⏎") for c in cells) + " |"


def wrapped(text: str, width: int = WIDTH, indent: str = "  ") -> list[str]:
    """One legend entry as lines of at most ``width`` columns, continuation lines indented."""
    return textwrap.wrap(text, width=width, subsequent_indent=indent, break_on_hyphens=False) or [""]
