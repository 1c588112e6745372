"""A conversation answered turn by turn, and a shard's counters: what every regeneration method shares (the
in-process engines of ``regenerate.py`` and the server client of ``regenerate_server.py``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..target import TargetFiles
from .config import RegenerateConfig


class Conversation:
    """One conversation answered turn by turn, as every method walks it: the user turns and the target's own
    answers so far (``done``), the turns still to answer (``todo``), and the answers cut at max_new_tokens."""

    def __init__(self, conv: dict[str, Any]):
        self.conv = conv
        self.done: list[dict[str, str]] = []
        self.todo: list[dict[str, str]] = list(conv["messages"])
        self.open = True
        self.cut: list[int] = []
        self.ended_by = "prompt_too_long"
        """Why a conversation left with no answer is skipped."""

    @property
    def answered(self) -> int:
        return sum(m["role"] == "assistant" for m in self.done)

    def next_prompt(self, target: TargetFiles, st: RegenerateConfig, max_length: int) -> list[int] | None:
        """The prompt ids of the next turn to answer, or None when the conversation ends here (no turn left,
        ``max_turns`` reached, or no room for an answer within ``max_length`` / the target's positions)."""
        while self.todo and self.todo[0]["role"] != "assistant":
            self.done.append(self.todo.pop(0))
        if self.todo and not (st.max_turns and self.answered >= st.max_turns):
            prompt = target.render_chat(self.done, add_generation_prompt=True)
            if len(prompt) < max_length and len(prompt) + st.max_new_tokens <= target.max_positions:
                return prompt
        return None

    def close(self) -> int:
        """End the conversation with the turns answered so far; return how many assistant turns it drops."""
        dropped = sum(m["role"] == "assistant" for m in self.todo)
        self.open, self.todo = False, []
        return dropped

    def answer(self, text: str, finish: str) -> None:
        self.todo.pop(0)
        if finish == "length":
            self.cut.append(len(self.done))
        self.done.append({"role": "assistant", "content": text})

    def record(self, stats: dict[str, Any]) -> dict[str, Any] | None:
        """The regenerated record, or None (counted in ``stats``) when no turn was answered."""
        while self.done and self.done[-1]["role"] != "assistant":
            self.done.pop()
        if not self.done:
            stats["skipped"][self.ended_by] += 1
            stats["examples"].setdefault(self.ended_by, f"{self.conv['source']}:{self.conv['conv_id']}")
            return None
        return {"conv_id": self.conv["conv_id"], "source": self.conv["source"], "messages": self.done,
                "truncated_turns": self.cut}


def new_stats(convs: list[dict[str, Any]]) -> dict[str, Any]:
    """A shard's counters (its ``.json`` record adds the file's size and hash)."""
    return {"turns_in": sum(sum(m["role"] == "assistant" for m in c["messages"]) for c in convs),
            "turns": 0, "new_tokens": 0, "finish": Counter(), "skipped": Counter(), "examples": {}}


def answer_text(target: TargetFiles, tokens: list[int]) -> str:
    """The text stored for an answer's ids: decoded without its EOS and special tokens."""
    return target.tokenizer.decode([t for t in tokens if t not in target.eos_token_ids], skip_special_tokens=True)


def finish_shard(convs: list[Conversation], stats: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The shard's records in conversation order, and its counters as plain JSON."""
    out = [r for r in (c.record(stats) for c in convs) if r is not None]
    stats["kept"] = len(out)
    stats["finish"] = dict(stats["finish"])
    stats["skipped"] = dict(stats["skipped"])
    return out, stats
