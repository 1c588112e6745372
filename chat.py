"""How prompts and conversations are rendered for a target: ``target.chat_template``.

* ``auto`` (default): the tokenizer's own chat template. A target without one (a base model,
  say a GGUF of a code model) gets its prompts **raw** in ``draftsmith eval`` (the prompt text,
  tokenized with the tokenizer's own special tokens such as BOS); conversations, which need a
  template (``draftsmith prepare``), are refused with a one-line error naming this option.
* ``none``: ignore the tokenizer's template and render prompts raw (completion-style serving);
  conversations are refused as with ``auto`` on a template-less tokenizer.
* ``plain``: :data:`PLAIN_TEMPLATE`, a minimal ``User: … / Assistant: …<eos>`` template, for base
  models trained and served as chat models without a template of their own.
* a path to a Jinja file: that template (the same syntax as HF's ``chat_template``).

The template in use becomes the tokenizer's ``chat_template``, so it enters the tokenizer
fingerprint: data rendered with one template is refused by a run that uses another.

A drafter records the template its target rendered with (:func:`template_record`: the option and a hash of
the text, in ``config.json``'s ``target``), and loading it where the target renders with another prints a
warning (:func:`template_mismatch`) rather than refusing: decoding stays lossless whatever the template —
the target verifies every draft — so only acceptance suffers, and evaluating a head on prompts of another
form (raw completions, say) is a measurement a user may want; the warning makes sure it is never unnoticed.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from .errors import ConfigError, DraftsmithError

CHOICES = ("auto", "none", "plain")
OPTION = "target.chat_template"

# Turns separated by a blank line; an assistant turn ends with EOS (the stop token the loss mask
# includes), and the generation prompt is "Assistant:" (the answer starts with its space).
PLAIN_TEMPLATE = (
    "{{ bos_token or '' }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] + '\n\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{%- else -%}{{ 'Assistant: ' + message['content'] + (eos_token or '') + '\n\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}"
)


def check_option(value: str) -> None:
    """A ConfigError naming the option when ``value`` is neither a choice nor an existing file."""
    if value not in CHOICES and not os.path.isfile(value):
        raise ConfigError(f"{OPTION} = '{value}' is neither one of {', '.join(CHOICES)} nor an existing Jinja "
                          f"template file")


def apply_option(tokenizer: Any, value: str) -> Any:
    """Set ``tokenizer.chat_template`` as ``value`` asks (see the module docstring); return the tokenizer."""
    check_option(value)
    if value == "none":
        tokenizer.chat_template = None
    elif value == "plain":
        tokenizer.chat_template = PLAIN_TEMPLATE
    elif value != "auto":
        with open(value, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    return tokenizer


def has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def missing_template(target_name: str, what: str = "rendering conversations") -> DraftsmithError:
    """The one-line error for a template that is needed and missing."""
    return DraftsmithError(
        f"target '{target_name}' has no chat template, and {what} needs one: set {OPTION}=plain (a minimal "
        f"'User: … / Assistant: …' template) or {OPTION}=PATH (a Jinja template file)"
    )


def require_template(tokenizer: Any, target_name: str, what: str = "rendering conversations") -> None:
    if not has_template(tokenizer):
        raise missing_template(target_name, what)


def render_prompt(
    tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True, target_name: str = ""
) -> list[int]:
    """Token ids of ``messages`` with the chat template, or of a single user prompt raw when there is none."""
    if has_template(tokenizer):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        return list(out)
    if len(messages) != 1 or messages[0]["role"] != "user" or not add_generation_prompt:
        raise missing_template(target_name or getattr(tokenizer, "name_or_path", "?"), f"rendering {len(messages)} messages")
    return list(tokenizer(messages[0]["content"])["input_ids"])  # raw, with the tokenizer's own BOS if any


def template_record(tokenizer: Any, option: str | None = None) -> dict[str, Any]:
    """The chat template a tokenizer renders with: ``option`` (``target.chat_template`` as given, when known;
    else ``none`` / ``plain`` / ``custom`` read from the text) and the sha256 of its text (16 hex; None: prompts
    are rendered raw)."""
    text = getattr(tokenizer, "chat_template", None) or None
    if option is None:
        option = "none" if text is None else "plain" if text == PLAIN_TEMPLATE else "custom"
    return {"option": option, "sha256": hashlib.sha256(str(text).encode()).hexdigest()[:16] if text else None}


def template_mismatch(trained: dict[str, Any] | None, now: dict[str, Any], drafter: str) -> str | None:
    """One line when a drafter trained with the template ``trained`` is used with ``now`` (None: the same, or
    a drafter saved before templates were recorded)."""
    if not isinstance(trained, dict) or trained.get("sha256") == now.get("sha256"):
        return None

    def name(record: dict[str, Any]) -> str:
        return f"'{record.get('option')}' (" + (f"sha256 {record['sha256']}" if record.get("sha256") else "raw prompts") + ")"

    return (f"drafter '{drafter}' was trained on prompts rendered with chat template {name(trained)}, but the target "
            f"now renders with {name(now)}: its drafts will be accepted less often (the output is unchanged, decoding "
            f"stays lossless); set {OPTION} as in training to use it as trained")
