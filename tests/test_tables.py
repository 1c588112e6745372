"""Tables: plain text for the terminal (one line per row, within the width, numbers right-aligned) and Markdown
(label columns left, figures right, no cell breaks the table)."""

from __future__ import annotations

import pytest

from draftsmith.tables import markdown_row, markdown_table, text_table, wrapped


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


def test_a_markdown_table_aligns_labels_left_and_figures_right():
    assert markdown_table(["target", "drafter", "τ"], [["smollm2", "eagle3", 1.5], ["smollm2", "medusa", "1.2×"]],
                          left=2) == [
        "| target | drafter | τ |",
        "| --- | --- | ---: |",
        "| smollm2 | eagle3 | 1.5 |",
        "| smollm2 | medusa | 1.2× |",
    ]
    assert markdown_table(["k", "v(k)"], [], left=0) == ["| k | v(k) |", "| ---: | ---: |"]


def test_no_cell_breaks_a_markdown_table():
    assert markdown_row(["a|b", "line\nnext", None]) == "| a\\|b | line⏎next | None |"
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        markdown_table(["a", "b"], [["1", "2", "3"]])


def test_a_legend_entry_wraps_with_an_indent():
    lines = wrapped("word " * 30, width=24)
    assert all(len(ln) <= 24 for ln in lines) and lines[1].startswith("  word")


def test_the_eval_summary_fits_80_columns():
    """What `draftsmith eval` prints (an earlier full-size head as a chain of 4: benchmarks/history/2026.md, "demo",
    "The full size on the target's own answers") wraps within 80 columns and keeps every figure."""
    from draftsmith.eval.run import eval_lines

    m = {"sequences": 20, "new_tokens": 1920, "k": 4, "tau_with_bonus": 1.4831, "acceptance_rate": 0.2714,
         "acceptance_at_position": [0.35, 0.105, 0.0284, 0.0054],
         "conditional_acceptance_at_position": [0.35, 0.3, 0.27, 0.19],
         "speed": {"dtype": "bfloat16", "device": "cpu", "threads": 2, "tokens_per_s": 16.63,
                   "target_tokens_per_s": 15.92, "speedup_vs_target": 1.0691, "speedup_interval_90": [1.042, 1.092],
                   "cost_model": {"predicted_speedup": 1.21, "draft_cost_c": 0.055, "best_k": 3,
                                  "verify_cost_by_k": {"1": 1.08, "4": 1.13}}},
         "identity": {"dtype": "float32", "identical": 20, "prompts": 20}}
    lines = eval_lines(m)
    assert max(map(len, lines)) <= 80, [ln for ln in lines if len(ln) > 80]
    text = " ".join(" ".join(lines).split())
    assert "speedup_vs_target 1.069x [90% interval over prompts 1.042-1.092]" in text
    assert "predicted 1.21x from c=0.055, v(k)=1.13; best k by the cost model: 3" in text
    assert "cumulative [0.35, 0.105, 0.0284, 0.0054], conditional [0.35, 0.3, 0.27, 0.19]" in text
    assert text.endswith("decoding on 20/20 prompts")
