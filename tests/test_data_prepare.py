"""`draftsmith prepare` end to end on the real SmolLM2 target and ShareGPT, and the data config."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from draftsmith.cli import main
from draftsmith.config import load_recipe
from draftsmith.data import DraftVocab, FeatureCache, PreparedPaths, load_tokenized
from draftsmith.data.conversations import load_conversations
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.decode.reference import target_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["data.max_conversations=3", "data.stages=[regenerate,tokenize,features,vocab]",
        "data.regenerate.max_turns=1", "data.regenerate.max_new_tokens=8", "data.render.max_length=384",
        "data.render.num_proc=1", "data.features.shard_size=2", "data.vocab.size=256"]


def test_prepare_yaml_loads_and_bad_keys_are_named():
    recipe = load_recipe("smollm2-135m-prepare")
    assert recipe.data.stages == ["regenerate", "tokenize", "features", "vocab"]
    assert recipe.data.resolve_out_dir(recipe.run_dir) == os.path.join(recipe.run_dir, "data")
    with pytest.raises(ConfigError, match="choose one of: regenerate, tokenize, features, vocab"):
        load_recipe("smollm2-135m-prepare", ["data.stages=[tokenise]"])
    with pytest.raises(ConfigError, match="unknown config key 'data.render.maxlen'"):
        load_recipe("smollm2-135m-prepare", ["data.render.maxlen=5"])
    with pytest.raises(ConfigError, match="data.regenerate.temperature"):
        load_recipe("smollm2-135m-prepare", ["data.regenerate.temperature=-1"])


@pytest.mark.e2e
def test_prepare_end_to_end_on_sharegpt(tmp_path, smollm2, capsys):
    run_dir = str(tmp_path / "run")
    assert main(["prepare", "--config", "smollm2-135m-prepare", *ARGS, f"run_dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    assert "draftsmith prepare" in out and "regenerate" in out and "vocab" in out
    paths = PreparedPaths.at(os.path.join(run_dir, "data"))
    summary = json.loads(open(os.path.join(paths.root, "summary.json")).read())
    rows = {r["stage"]: r for r in summary["stages"]}
    assert list(rows) == ["read", "regenerate", "tokenize", "features", "vocab"]
    assert rows["read"]["kept"] == 3 and rows["read"]["records_in"] == 3 + rows["read"]["skipped"]
    assert rows["regenerate"]["kept"] + rows["regenerate"]["skipped"] == 3
    assert sum(summary["skipped"].values()) == rows["read"]["skipped"] + rows["regenerate"]["skipped"] + rows[
        "tokenize"]["skipped"]

    # regenerated answers are the target's own greedy answers to the first user turn
    regenerated = load_conversations(paths.regenerated)
    for conv in regenerated:
        msgs = conv["messages"]
        assert len(msgs) == 2 + (msgs[0]["role"] == "system")
        tokens = target_greedy(smollm2, smollm2.render_chat(msgs[:-1]), 8)
        text = smollm2.tokenizer.decode([t for t in tokens if t not in smollm2.eos_token_ids], skip_special_tokens=True)
        assert msgs[-1]["content"] == text
        assert conv["truncated_turns"] == ([] if tokens[-1] in smollm2.eos_token_ids else [len(msgs) - 1])

    data = load_tokenized(paths.tokenized, smollm2)
    assert len(data) == rows["tokenize"]["kept"] == len(regenerated)
    assert rows["tokenize"]["tokens"] == sum(len(x) for x in data["input_ids"])
    with pytest.raises(DraftsmithError, match="rendered with tokenizer"):
        load_tokenized(paths.tokenized, "0000000000000000")

    cache = FeatureCache.open(paths.features, smollm2, verify="all")
    assert len(cache) == len(data) and cache.layer_ids == [1, 14, 26, 29]
    item = cache[0]
    assert item["hidden"].shape == (len(data[0]["input_ids"]), 4 * 576)
    ref = smollm2.forward(item["input_ids"][None], feature_layers=(1, 14, 26, 29)).features[0].bfloat16()
    assert (item["hidden"] == ref).float().mean() > 0.99

    vocab = DraftVocab.load(paths.vocab)
    ids = np.concatenate([np.asarray(x) for x in data["input_ids"]])
    mask = np.concatenate([np.asarray(x) for x in data["loss_mask"]]).astype(bool)
    assert vocab.size == 256 and vocab.target_vocab_size == 49152
    assert vocab.coverage == pytest.approx(np.isin(ids[mask], vocab.t2d.nonzero().flatten().numpy()).mean())
    assert torch.equal(vocab.draft_to_target(torch.arange(256)), vocab.t2d.nonzero().flatten())

    # a second run reuses every finished stage
    assert main(["prepare", "--config", "smollm2-135m-prepare", *ARGS, f"run_dir={run_dir}"]) == 0
    again = {r["stage"]: r for r in json.loads(open(os.path.join(paths.root, "summary.json")).read())["stages"]}
    for stage in ("read", "regenerate", "tokenize", "features"):
        assert again[stage]["note"].startswith("up to date (reused)"), stage


def test_the_printed_summary_fits_80_columns():
    """An earlier default-size prepare (benchmarks/history/2026.md, "demo", "The pipeline in native bf16"), with a
    skip and a long note: one line per stage within 80 columns (rich wrapped each cell into many lines when stdout
    was not a wide TTY)."""
    from draftsmith.data.prepare import PrepareSummary, StageRow, format_summary

    s = PrepareSummary("/home/someone/projects/draftsmith/runs/demo/prepare/data")
    s.rows = [StageRow("read", 281, 240, 41, note="sharegpt: 17,671 complete records recovered from a truncated file"),
              StageRow("regenerate", 240, 196, 44, 27_914, None, 12_345_678, 201.3,
                       "greedy, bf16, batch 32, shards of 96; 196 turns (finish: 150 length, 46 eos); 139 new tok/s"),
              StageRow("tokenize", 196, 196, 0, 48_815, 27_914, 1_234_567, 3.2),
              StageRow("features", 196, 196, None, 48_815, None, 225_000_000, 85.0),
              StageRow("vocab", None, None, None, None, 27_914, 98_304, 0.4, "8,192 ids cover 100.0 % of loss tokens")]
    s.add_skips({"starts_with_assistant": 41, "prompt_too_long": 44},
                {"starts_with_assistant": "sharegpt record 17 (id 'QWJhY2Rl'): first message from gpt",
                 "prompt_too_long": "sharegpt record 3: 1,873 prompt tokens > 1,024"})
    lines = format_summary(s)
    assert max(map(len, lines)) <= 80, [ln for ln in lines if len(ln) > 80]
    regen = next(ln for ln in lines if ln.startswith("regenerate "))
    assert regen.split() == ["regenerate", "240", "196", "44", "27,914", "-", "11.8", "MB", "201.3s"]
    text = " ".join(" ".join(lines).split())
    assert "regenerate: greedy, bf16, batch 32, shards of 96; 196 turns (finish: 150 length, 46 eos); 139 new tok/s" in text
    assert "44 prompt_too_long:" in text and "first: sharegpt record 3: 1,873 prompt tokens > 1,024" in text


def _tokenize(tmp_path, target_dir: str, capsys) -> tuple[int, str]:
    """`prepare` with the tokenize stage on three conversations; (exit code, stderr)."""
    src = tmp_path / "convs.jsonl"
    if not src.exists():
        src.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": f"Question {i}?"},
                                                                       {"role": "assistant", "content": f"Answer {i}."}]})
                               + "\n" for i in range(3)))
    code = main(["prepare", f"target.name={target_dir}", f"data.sources=[{{path: {src}}}]", "data.stages=[tokenize]",
                 f"data.out_dir={tmp_path / 'out'}", "data.render.num_proc=1", f"run_dir={tmp_path / 'run'}"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("names_the_file", [False, True], ids=["write", "open"])
def test_a_full_disk_while_tokenizing_is_one_line_naming_what_the_rerun_keeps(tmp_path, tiny_target_dir, capsys,
                                                                              monkeypatch, names_the_file):
    """The disk fills while the tokenized dataset is saved: one line naming the folder and what the rerun keeps (the
    conversations read), no temporary folder left; the rerun reuses the conversations and writes the dataset. The
    folder named exists: when the error carries the file that could not be written (``open`` does), that file's
    temporary folder is gone by the time the line is written, and the line names the output folder it was in."""
    import errno

    import datasets

    out = tmp_path / "out"

    def full(self, path, *args, **kwargs):
        file = os.path.join(path, "data-00000-of-00001.arrow")
        with open(file, "wb") as f:
            f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", *([file] if names_the_file else []))

    with monkeypatch.context() as m:
        m.setattr(datasets.Dataset, "save_to_disk", full)
        code, err = _tokenize(tmp_path, tiny_target_dir, capsys)
    assert code == 2 and err.splitlines()[-1] == (f"draftsmith: error: no space left on {out}: free some space (or write elsewhere: "
                                 f"run_dir, --out) and rerun; kept for the rerun: the conversations in "
                                 f"{out / 'conversations'}; {out / 'tokenized'} is written whole or not at all")
    assert sorted(os.listdir(out)) == [".cache", "conversations"]  # no temporary folder beside them
    assert all(n.startswith(("render-", "kept-")) for n in os.listdir(out / ".cache"))  # datasets' finished caches
    assert _tokenize(tmp_path, tiny_target_dir, capsys)[0] == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["stage"], s["note"]) for s in summary["stages"]] == [("read", "up to date (reused)"), ("tokenize", "")]
    assert len(load_tokenized(str(out / "tokenized"))) == 3


def test_a_truncated_or_altered_output_is_made_again_not_reused(tmp_path, tiny_target_dir, capsys):
    """The tokenized dataset and the read conversations are checked against the sha256 their manifests record before
    they are called up to date: a truncated Arrow file is tokenized (read) again, saying so, to the same data."""
    out = tmp_path / "out"
    assert _tokenize(tmp_path, tiny_target_dir, capsys)[0] == 0
    before = load_tokenized(str(out / "tokenized"))[:]

    def notes() -> list[str]:
        assert _tokenize(tmp_path, tiny_target_dir, capsys)[0] == 0
        return [s["note"] for s in json.loads((out / "summary.json").read_text())["stages"]]

    assert notes() == ["up to date (reused)", "up to date (reused)"]
    arrow = out / "tokenized" / "data-00000-of-00001.arrow"
    arrow.write_bytes(arrow.read_bytes()[:-100])
    assert notes() == ["up to date (reused)", f"{out / 'tokenized'}: data-00000-of-00001.arrow changed after it was "
                                              f"written (sha256): tokenized again"]
    assert load_tokenized(str(out / "tokenized"))[:] == before
    data = out / "conversations" / "data.arrow"
    data.write_bytes(data.read_bytes()[:-100])
    assert notes() == [f"{out / 'conversations'}: data.arrow changed after it was written (sha256): read again",
                       "up to date (reused)"]  # read again, the conversations hash the same: the dataset stands
    (out / "tokenized" / "state.json").unlink()
    assert notes()[1] == f"{out / 'tokenized'}: state.json is missing: tokenized again"
    assert load_tokenized(str(out / "tokenized"))[:] == before
