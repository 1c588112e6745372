"""Chat-template rendering and the assistant-only loss mask, on the real SmolLM2 tokenizer (ChatML)."""

from __future__ import annotations

import copy

import pytest

from draftsmith.data.render import render_conversation, stop_token_ids
from draftsmith.target import render_chat

EOS = [2]  # <|im_end|>

# system prompt, two turns, the second assistant turn empty
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": ""},
]
# <|im_start|> system \n Be Ġbrief . <|im_end|> \n <|im_start|> user \n Hi <|im_end|> \n
# <|im_start|> ass istant \n Hello ! <|im_end|> \n <|im_start|> user \n By e <|im_end|> \n
# <|im_start|> ass istant \n <|im_end|> \n
CONV_IDS = [1, 9690, 198, 6077, 5453, 30, 2, 198, 1, 4093, 198, 26843, 2, 198,
            1, 520, 9531, 198, 19556, 17, 2, 198, 1, 4093, 198, 3087, 85, 2, 198,
            1, 520, 9531, 198, 2, 198]
#            "Hello" "!" <|im_end|> of turn 1 ........ <|im_end|> of the empty turn 2
CONV_MASK = [0] * 18 + [1, 1, 1] + [0] * 12 + [1, 0]


def test_exact_mask_system_two_turns_and_an_empty_assistant_turn(smollm2_tokenizer):
    ids, mask = render_conversation(smollm2_tokenizer, CONV, max_length=4096, stop_ids=EOS)
    assert ids == CONV_IDS
    assert mask == CONV_MASK
    # the ids are exactly what the template renders (token by token, not our own concatenation)
    assert ids == render_chat(smollm2_tokenizer, CONV, add_generation_prompt=False)


def test_exact_mask_without_system_prompt_uses_the_templates_default(smollm2_tokenizer):
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there, friend."}]
    ids, mask = render_conversation(smollm2_tokenizer, conv, max_length=4096, stop_ids=EOS)
    tokens = smollm2_tokenizer.convert_ids_to_tokens(ids)
    # the template's default system prompt is context; only the answer and its <|im_end|> are trained
    assert [t for t, m in zip(tokens, mask) if m] == ["Hello", "Ġthere", ",", "Ġfriend", ".", "<|im_end|>"]
    assert tokens[-1] == "Ċ" and mask[-1] == 0  # the newline the template adds after the turn is not generated


def test_last_turn_only(smollm2_tokenizer):
    conv = CONV[:4] + [{"role": "assistant", "content": "Goodbye."}]
    ids, mask = render_conversation(smollm2_tokenizer, conv, max_length=4096, last_turn_only=True, stop_ids=EOS)
    assert smollm2_tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "Goodbye.<|im_end|>"
    _, every = render_conversation(smollm2_tokenizer, conv, max_length=4096, stop_ids=EOS)
    assert smollm2_tokenizer.decode([t for t, m in zip(ids, every) if m]) == "Hello!<|im_end|>Goodbye.<|im_end|>"


def test_an_answer_cut_at_the_token_limit_does_not_teach_the_model_to_stop(smollm2_tokenizer):
    """Regeneration marks answers cut at max_new_tokens; their <|im_end|> is context, not a target."""
    ids, mask = render_conversation(smollm2_tokenizer, CONV, max_length=4096, stop_ids=EOS, open_turns=[2])
    assert ids == CONV_IDS
    assert mask == [0] * 18 + [1, 1, 0] + [0] * 12 + [1, 0]  # "Hello" "!" trained, its <|im_end|> not


def test_truncation_keeps_every_mask_bit_on_its_token(smollm2_tokenizer):
    """At every cut, ids and mask are the untruncated ones cut at the same token; no trainable token → skipped."""
    for max_length in range(8, len(CONV_IDS) + 3):
        result = render_conversation(smollm2_tokenizer, CONV, max_length=max_length, stop_ids=EOS)
        if max_length <= 18:  # the first assistant token is token 18
            assert result == "no_loss_tokens_in_max_length", max_length
        else:
            assert result == (CONV_IDS[:max_length], CONV_MASK[:max_length]), max_length
    # right at the boundary: only the first assistant token survives
    ids, mask = render_conversation(smollm2_tokenizer, CONV, max_length=19, stop_ids=EOS)
    assert mask[-1] == 1 and sum(mask) == 1 and smollm2_tokenizer.decode(ids[-1:]) == "Hello"


def test_a_token_straddling_the_turn_boundary_belongs_to_the_assistant(smollm2_tokenizer):
    """The generation prompt ends in '\\n'; an answer starting with two spaces merges it into the token 'ĊĠ'."""
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Hello"}]
    ids, mask = render_conversation(smollm2_tokenizer, conv, max_length=4096, stop_ids=EOS)
    assert ids == render_chat(smollm2_tokenizer, conv, add_generation_prompt=False)
    prompt = render_chat(smollm2_tokenizer, conv[:1], add_generation_prompt=True)
    diverge = next(i for i, (a, b) in enumerate(zip(prompt, ids)) if a != b)
    assert diverge == len(prompt) - 1  # the prompt's last token is not a token of the full render
    assert mask[:diverge] == [0] * diverge and mask[diverge] == 1
    assert smollm2_tokenizer.convert_ids_to_tokens(ids[diverge]) == "ĊĠ"
    assert smollm2_tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "\n  Hello<|im_end|>"


def test_template_skip_reasons(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    # a template that rewrites history: the header counts the messages, so a turn's render is not a prefix
    tok.chat_template = ("{{ messages|length }} messages\n{% for m in messages %}<|im_start|>{{ m.role }}\n"
                         "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                         "{% endif %}")
    assert render_conversation(tok, CONV, 4096, stop_ids=EOS) == "template_not_prefix_stable"
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    assert render_conversation(tok, CONV, 4096, stop_ids=EOS) == "template_error"


def test_stop_ids_come_from_tokenizer_and_generation_config(smollm2_tokenizer, smollm2_folder):
    assert stop_token_ids(smollm2_tokenizer, smollm2_folder) == [2]


@pytest.mark.parametrize("last_turn_only", [False, True])
def test_text_divergence_equals_token_divergence_on_sharegpt(smollm2_tokenizer, last_turn_only):
    """The fast text-level divergence gives the same mask as comparing token renders turn by turn."""
    from draftsmith.data.config import SourceConfig
    from draftsmith.data.normalize import ReadStats, iter_conversations
    from draftsmith.decode.protocol import common_prefix

    convs = list(iter_conversations([SourceConfig(path="sharegpt")], 25, ReadStats()))
    for c in convs:
        m = c["messages"]
        ids, mask = render_conversation(smollm2_tokenizer, m, 10**9, last_turn_only, EOS)
        expected = [0] * len(ids)
        turns = [i for i, x in enumerate(m) if x["role"] == "assistant"]
        for i in turns[-1:] if last_turn_only else turns:
            prompt = render_chat(smollm2_tokenizer, m[:i], add_generation_prompt=True)
            turn = render_chat(smollm2_tokenizer, m[: i + 1], add_generation_prompt=False)
            start, end = common_prefix(prompt, turn), len(turn)
            while turn[end - 1] not in EOS:
                end -= 1
            expected[start:end] = [1] * (end - start)
        assert mask == expected, c["conv_id"]
