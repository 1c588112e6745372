"""Raw records → normalized conversations ``[{"role", "content"}, …]``, every skip counted by reason.

Role names are mapped explicitly (:data:`ROLE_MAP`, extended per source by
``data.sources[].roles``); nothing is guessed. A record is skipped, and counted under
one of :data:`SKIP_REASONS`, when it cannot become a training conversation. Trailing
non-assistant messages are dropped (they carry no loss), the record is kept.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .config import SourceConfig
from .sources import Invalid, SourceReport, read_source, resolve_source

ROLE_MAP: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}

SKIP_REASONS: dict[str, str] = {
    "invalid_json": "a JSONL line or a JSON array element that is not valid JSON (where: its line or byte offset)",
    "no_conversation": "no 'conversations' / 'messages' list in the record",
    "empty": "no messages, or every message is blank",
    "unknown_role": "a message role that is not in the role mapping (add it to data.sources[].roles)",
    "non_text_content": "a message whose content is not text (image parts, null, numbers)",
    "starts_with_assistant": "the first non-system message is the assistant's",
    "no_assistant_turn": "no assistant message to train on",
    # rendering (render.py)
    "template_error": "the chat template refused the conversation",
    "template_not_prefix_stable": "rendering a turn is not a prefix of rendering the whole conversation",
    "no_loss_tokens_in_max_length": "no assistant token left within data.render.max_length",
    # regeneration (regenerate.py)
    "prompt_too_long": "the first prompt alone does not fit max_length for regeneration",
}

_FIELDS = {"sharegpt": ("conversations",), "messages": ("messages",), "auto": ("conversations", "messages")}


@dataclass
class ReadStats:
    """Counts over all sources: what came in, what was kept, what was skipped and why."""

    records_in: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    sources: list[SourceReport] = field(default_factory=list)
    examples: dict[str, str] = field(default_factory=dict)
    """One example location per skip reason (the first seen), to help a user look."""

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        self.examples.setdefault(reason, where)


def normalize_messages(record: Any, fmt: str = "auto", roles: dict[str, str] | None = None) -> list[dict[str, str]] | str:
    """The conversation of one raw record, or the skip reason (a key of :data:`SKIP_REASONS`)."""
    if not isinstance(record, dict):
        return "no_conversation"
    raw = next((record[k] for k in _FIELDS[fmt] if k in record), None)
    if not isinstance(raw, list):
        return "no_conversation"
    if not raw:
        return "empty"
    mapping = {**ROLE_MAP, **{k.lower(): v for k, v in (roles or {}).items()}}
    messages: list[dict[str, str]] = []
    for m in raw:
        if not isinstance(m, dict):
            return "no_conversation"
        role_name = m.get("from", m.get("role"))
        role = mapping.get(str(role_name).lower()) if isinstance(role_name, str) else None
        if role is None:
            return "unknown_role"
        content = _text(m.get("value", m.get("content")))
        if content is None:
            return "non_text_content"
        messages.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in messages):
        return "empty"
    first = next((m["role"] for m in messages if m["role"] != "system"), None)
    if first == "assistant":
        return "starts_with_assistant"
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not messages:
        return "no_assistant_turn"
    return messages


def _text(content: Any) -> str | None:
    """Text content, or None when it is not text. A list of text parts (OpenAI style) is joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return None


def record_id(record: Any, index: int) -> str:
    """The record's own id when it has one, else its 0-based position in its source."""
    if isinstance(record, dict):
        for key in ("id", "conversation_id", "prompt_id", "conv_id"):
            value = record.get(key)
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                return str(value)
    return str(index)


def iter_conversations(
    sources: Iterable[SourceConfig], max_conversations: int, stats: ReadStats
) -> Iterator[dict[str, Any]]:
    """Normalized conversations ``{conv_id, source, messages, truncated_turns}`` of all sources, in order.

    Stops after ``max_conversations`` kept conversations (0 = no limit); ``stats`` counts the rest.
    """
    for src in sources:
        name, location = resolve_source(src)
        report = SourceReport(name=name, path=location)
        stats.sources.append(report)
        kept_here = 0
        for index, record in enumerate(read_source(src, report)):
            stats.records_in += 1
            if isinstance(record, Invalid):
                stats.skip(record.reason, record.where)
                continue
            conv_id = record_id(record, index)
            messages = normalize_messages(record, src.format, src.roles)
            if isinstance(messages, str):
                stats.skip(messages, f"{name}:{conv_id}")
                continue
            stats.kept += 1
            kept_here += 1
            yield {"conv_id": conv_id, "source": name, "messages": messages, "truncated_turns": []}
            if max_conversations and stats.kept >= max_conversations or src.limit and kept_here >= src.limit:
                report.stopped = f"stopped after {kept_here:,} conversations (data.max_conversations or the source's limit)"
                break
        if max_conversations and stats.kept >= max_conversations:
            break
