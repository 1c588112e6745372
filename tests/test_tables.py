"""Plain-text terminal tables: one line per row, within the width, numbers right-aligned."""

from __future__ import annotations

import pytest

from draftsmith.tables import text_table, wrapped


def test_columns_align_and_numbers_are_right_aligned():
    assert text_table(["name", "tok/s"], [["target", "20.5"], ["eagle3 head", "122.7"]]) == [
        "name         tok/s",
        "-----------  -----",
        "target        20.5",
        "eagle3 head  122.7",
    ]


def test_the_first_column_is_cut_to_fit_the_width():
    lines = text_table(["drafter", "x"], [["a" * 30, "1.00"]], width=20)
    assert lines[2] == "a" * 13 + "…  1.00" and max(map(len, lines)) == 20


def test_rows_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        text_table(["a", "b"], [["1"]])


def test_a_legend_entry_wraps_with_an_indent():
    lines = wrapped("word " * 30, width=24)
    assert all(len(ln) <= 24 for ln in lines) and lines[1].startswith("  word")
