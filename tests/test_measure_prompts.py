"""Prompt files: the common id fields are read, and one line says which fields gave the text and the ids."""

from __future__ import annotations

import json

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.measure.prompts import fields_note, load_questions


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_humaneval_task_ids_are_read_and_named(tmp_path):
    path = _jsonl(tmp_path / "humaneval.jsonl", [{"task_id": "HumanEval/0", "prompt": "def f():\n"},
                                                 {"task_id": "HumanEval/1", "prompt": "def g():\n"}])
    questions = load_questions(path)
    assert [q.id for q in questions] == ["HumanEval/0", "HumanEval/1"]
    assert fields_note(path, questions) == f"prompts: 2 from {path}, text from 'prompt', ids from 'task_id'"


def test_the_first_id_field_wins_and_a_record_without_one_is_numbered_by_its_line(tmp_path):
    path = _jsonl(tmp_path / "mixed.jsonl", [{"id": 7, "question_id": 81, "turns": ["a", "b"]}, {"id": "x", "prompt": "c"},
                                             {"prompt": "d", "id": ""}])
    questions = load_questions(path)
    assert [q.id for q in questions] == ["81", "x", "3"]
    assert fields_note(path, questions) == (f"prompts: 3 from {path}, text from 'prompt', 'turns', ids from 'id', "
                                            f"'question_id', the line number (no question_id / id / task_id / "
                                            f"prompt_id / problem_id / uid / idx field)")


def test_mtbench_reads_question_ids(tmp_path):
    questions = load_questions("mtbench", 2)
    assert [q.id for q in questions] == ["81", "82"]
    assert fields_note("mtbench", questions) == "prompts: 2 from mtbench, text from 'turns', ids from 'question_id'"


def test_a_line_that_is_not_an_object_is_refused(tmp_path):
    path = _jsonl(tmp_path / "list.jsonl", [["not", "an", "object"]])
    with pytest.raises(DraftsmithError, match=r"list.jsonl:1 is a JSON list; each line must be an object"):
        load_questions(path)


def test_a_repeated_prompt_id_is_refused_naming_both_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n{"id": "a", "prompt": "z"}\n')
    with pytest.raises(DraftsmithError, match=f"{path}:3: prompt id 'a' is also the id of line 1; give each prompt "
                                              f"its own id"):
        load_questions(str(path))
