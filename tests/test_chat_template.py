"""Base models (no chat template): ``target.chat_template: auto | none | plain | PATH``.

A tiny random target whose tokenizer has no template: ``draftsmith eval`` decodes raw prompts
(it used to end in transformers' ValueError traceback), ``draftsmith prepare`` refuses in one line
naming the option, and renders conversations with the plain or a user-given template with an
exact assistant-only loss mask."""

from __future__ import annotations

import json
import os

import pytest

from draftsmith.chat import PLAIN_TEMPLATE, apply_option
from draftsmith.cli import main
from draftsmith.config import load_recipe
from draftsmith.data.render import render_conversation, stop_token_ids
from draftsmith.data.tokenized import MANIFEST
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.target import Target, load_target

from .conftest import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, since 1871."},
]


@pytest.fixture(scope="module")
def base_target_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """A 4-layer tiny Llama saved with the SmolLM2 tokenizer minus its chat template (a base model)."""
    import copy

    path = str(tmp_path_factory.mktemp("base_target"))
    tiny_llama(layers=4).save_pretrained(path)
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = None
    tok.save_pretrained(path)
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_saved_base_tokenizer_has_no_template(base_target_dir):
    target = load_target(base_target_dir, dtype="float32", device="cpu")
    assert not target.tokenizer.chat_template
    with pytest.raises(ValueError, match="chat template"):  # what eval used to hit
        target.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)


def test_eval_renders_raw_prompts_for_a_base_model(capsys, tmp_path, base_target_dir, smollm2_tokenizer):
    from draftsmith.measure.prompts import load_questions

    run_dir = tmp_path / "run"
    code, out, err = run(capsys, "eval", "-c", "smollm2-135m-layerskip", f"target.name={base_target_dir}",
                         "target.dtype=float32", "drafter.num_layers=2", f"run_dir={run_dir}", "eval.num_prompts=2",
                         "decode.max_new_tokens=6", "eval.check_identity=true")
    assert code == 0, err
    records = [json.loads(x) for x in (run_dir / "eval_outputs.jsonl").read_text().splitlines()]
    questions = load_questions("mtbench", 2)
    for rec, q in zip(records, questions):
        assert rec["prompt_tokens"] == len(smollm2_tokenizer(q.turns[0])["input_ids"])  # the text alone, raw
        assert rec["identical_to_target"]


def test_none_renders_raw_even_when_the_tokenizer_has_a_template(smollm2_tokenizer):
    import copy

    tok = apply_option(copy.deepcopy(smollm2_tokenizer), "none")
    target = Target(tiny_llama(layers=2), tok, name="raw")
    assert target.render_chat([{"role": "user", "content": "def fib(n):"}]) == smollm2_tokenizer("def fib(n):")["input_ids"]
    with pytest.raises(DraftsmithError, match=r"target 'raw' has no chat template, and rendering 2 messages needs one: "
                                              r"set target.chat_template=plain"):
        target.render_chat(CONVERSATION[1:3], add_generation_prompt=False)


def test_prepare_refuses_in_one_line_naming_the_option(capsys, tmp_path, base_target_dir):
    code, _, err = run(capsys, "prepare", "-c", "smollm2-135m-prepare", f"target.name={base_target_dir}",
                       f"run_dir={tmp_path}", "data.stages=[tokenize]")
    assert code == 2
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert "has no chat template, and rendering conversations needs one: set target.chat_template=plain" in err


def masked_text(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded runs of consecutive loss-masked tokens."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    if cur:
        runs.append(tokenizer.decode(cur))
    return runs


def test_plain_template_loss_mask_is_exact(smollm2_tokenizer):
    import copy

    tok = apply_option(copy.deepcopy(smollm2_tokenizer), "plain")
    assert tok.chat_template == PLAIN_TEMPLATE
    eos = tok.eos_token
    ids, mask = render_conversation(tok, CONVERSATION, 512, stop_ids=stop_token_ids(tok))
    assert tok.decode(ids) == (f"{tok.bos_token or ''}Be brief.\n\nUser: Capital of France?\n\nAssistant: Paris.{eos}\n\n"
                               f"User: And of Italy?\n\nAssistant: Rome, since 1871.{eos}\n\n")
    assert masked_text(tok, ids, mask) == [f" Paris.{eos}", f" Rome, since 1871.{eos}"]  # the answers and their EOS
    # eval's prompt is the training render's prefix: the model answers where the mask starts
    prompt = Target(tiny_llama(layers=2), tok, name="plain").render_chat(CONVERSATION[:2])
    first = mask.index(1)
    assert ids[:first] == prompt


def test_a_user_template_file(tmp_path, smollm2_tokenizer):
    import copy

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m['role'] == 'assistant' %}"
                    "{{ eos_token }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = apply_option(copy.deepcopy(smollm2_tokenizer), str(path))
    ids, mask = render_conversation(tok, CONVERSATION[1:], 512, stop_ids=stop_token_ids(tok))
    assert masked_text(tok, ids, mask) == [f"Paris.{tok.eos_token}", f"Rome, since 1871.{tok.eos_token}"]


def test_prepare_with_the_plain_template_end_to_end(capsys, tmp_path, base_target_dir):
    from datasets import load_from_disk

    src = tmp_path / "conv.jsonl"
    src.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    code, out, err = run(capsys, "prepare", "-c", "smollm2-135m-prepare", f"target.name={base_target_dir}",
                         "target.chat_template=plain", f"run_dir={tmp_path / 'run'}", "data.stages=[tokenize]",
                         f"data.sources=[{{path: {src}}}]")
    assert code == 0, err
    ds = load_from_disk(os.path.join(tmp_path, "run", "data", "tokenized"))
    tok = load_target(base_target_dir, dtype="float32", device="cpu", chat_template="plain").tokenizer
    expected = render_conversation(tok, CONVERSATION, 1024, stop_ids=stop_token_ids(tok, base_target_dir))
    assert (ds[0]["input_ids"], ds[0]["loss_mask"]) == expected
    # training reads it with the same template: the tokenizer fingerprints agree
    recipe = load_recipe("smollm2-135m-eagle3", [f"target.name={base_target_dir}", "target.chat_template=plain"])
    with open(os.path.join(tmp_path, "run", "data", "tokenized", MANIFEST)) as f:
        assert load_target(recipe.target).tokenizer_hash == json.load(f)["tokenizer_hash"]


def test_a_bad_option_names_the_key():
    with pytest.raises(ConfigError, match=r"target.chat_template = 'chatml' is neither one of auto, none, plain nor an "
                                          r"existing Jinja template file"):
        load_recipe("smollm2-135m-layerskip", ["target.chat_template=chatml"])

