"""Regeneration with the frozen target: identical to the target's own decoding, seeded, and resumable after a kill."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import datasets
import pytest
import torch
import yaml

from draftsmith.data.config import RegenerateConfig
from draftsmith.data.conversations import conversation_features
from draftsmith.data.regenerate import regenerate_conversations, regenerated_records
from draftsmith.drafters.layer_skip import layer_skip_drafter
from draftsmith.errors import DraftsmithError
from draftsmith.decode.reference import target_greedy
from draftsmith.target import load_target

USERS = [["Tell me a story.", "Shorter."], ["Hi"], ["Name a color. Any color you like.", "Another."]]
NEW = 8  # max_new_tokens


def _conversations(users=USERS):
    rows = []
    for i, turns in enumerate(users):
        msgs = []
        for u in turns:
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": "(original answer)"}]
        rows.append({"conv_id": f"c{i}", "source": "test", "messages": msgs, "truncated_turns": []})
    return datasets.Dataset.from_list(rows, features=conversation_features())


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(tiny_target_dir, dtype="float32", device="cpu")


def _run(folder, target, drafter=None, max_length=512, users=USERS, restart=False, **kw):
    cfg = RegenerateConfig(**{"max_new_tokens": NEW, "batch_size": 2, "shard_size": 2, **kw})
    report = regenerate_conversations(_conversations(users), str(folder), target, cfg, max_length=max_length,
                                      drafter=drafter, progress=False, restart=restart)
    return report, list(regenerated_records(str(folder)))


def _reference(target, turns, max_new_tokens):
    """The target answering each turn alone (batch 1, HF generate), given its own earlier answers;
    and the indices of the answers it did not finish within max_new_tokens."""
    msgs, cut = [], []
    for u in turns:
        msgs.append({"role": "user", "content": u})
        tokens = target_greedy(target, target.render_chat(msgs), max_new_tokens)
        text = target.tokenizer.decode([t for t in tokens if t not in target.eos_token_ids], skip_special_tokens=True)
        if tokens[-1] not in target.eos_token_ids:
            cut.append(len(msgs))
        msgs.append({"role": "assistant", "content": text})
    return msgs, cut


@pytest.fixture(scope="module")
def plain(tmp_path_factory, target):
    """Greedy regeneration, batched (batch 2, left padding), all turns."""
    return _run(tmp_path_factory.mktemp("plain"), target)


def test_every_regenerate_method_has_its_implementation():
    """``data.regenerate.method``'s choices and the table of implementations are one list, in one order: a method
    named in the config without an implementation (or the reverse) fails here, not in a run."""
    from typing import get_args

    from draftsmith.data.config import RegenerateMethod
    from draftsmith.data.regenerate import METHODS

    assert tuple(METHODS) == get_args(RegenerateMethod)
    assert [name for name, m in METHODS.items() if not m.loads_target] == ["server"]
    assert [name for name, m in METHODS.items() if m.drafter] == ["speculative"]


def test_batched_greedy_regeneration_is_the_targets_own_greedy_answer(plain, target):
    report, records = plain
    assert [r["conv_id"] for r in records] == ["c0", "c1", "c2"]
    for r, turns in zip(records, USERS):
        assert (r["messages"], r["truncated_turns"]) == _reference(target, turns, NEW), r["conv_id"]
    assert report.turns == 5 and report.kept == 3 and sum(report.finish.values()) == 5
    assert all(m["content"] != "(original answer)" for r in records for m in r["messages"])


def test_speculative_method_gives_the_same_answers(tmp_path, target, plain):
    _, spec = _run(tmp_path / "spec", target, drafter=layer_skip_drafter(target.model, 2), method="speculative")
    assert spec == plain[1]


def test_sampling_is_seeded_per_shard_so_a_recomputed_shard_is_identical(tmp_path, target, plain):
    _, first = _run(tmp_path / "a", target, temperature=1.0, seed=7)
    os.remove(tmp_path / "a" / "shard-00000.jsonl")  # as if killed while writing it
    report, resumed = _run(tmp_path / "a", target, temperature=1.0, seed=7)
    assert report.note == "resuming: 1 finished shard(s) kept"
    assert resumed == first
    _, other_seed = _run(tmp_path / "b", target, temperature=1.0, seed=8)
    assert other_seed != first and first != plain[1]


def test_a_conversation_ends_where_the_next_prompt_no_longer_fits(tmp_path, target, plain):
    second_prompts = [len(target.render_chat(r["messages"][:3])) for r in plain[1] if len(r["messages"]) == 4]
    max_length = min(second_prompts)  # the shortest second prompt no longer fits; every first prompt does
    _, cut = _run(tmp_path / "cut", target, max_length=max_length)
    for full, r in zip(plain[1], cut):
        n = len(full["messages"])
        fits = n == 4 and len(target.render_chat(full["messages"][:3])) < max_length
        assert r["messages"] == full["messages"][: 4 if fits else 2]
    assert [len(r["messages"]) for r in cut] != [len(r["messages"]) for r in plain[1]]
    _, one = _run(tmp_path / "one", target, max_turns=1)
    assert [r["messages"] for r in one] == [r["messages"][:2] for r in plain[1]]
    report, _ = _run(tmp_path / "none", target, max_length=20)  # even the first prompt is too long
    assert report.kept == 0 and report.skipped == {"prompt_too_long": 3}


def test_settings_that_change_no_record_keep_every_shard_and_more_conversations_extend(tmp_path, target, plain):
    """k (method=generate), batch and shard sizes leave the finished shards as they are; more
    conversations add shards after them; a sampling setting would discard them: refused unless restart."""
    folder = tmp_path / "job"
    first, _ = _run(folder, target, users=USERS[:2])
    assert first.note == "starting"
    shard0 = os.path.getmtime(folder / "shard-00000.jsonl")
    for change in ({"k": 5}, {"batch_size": 1}, {"shard_size": 3}):
        report, records = _run(folder, target, users=USERS[:2], **change)
        assert report.note == "up to date (reused)" and records == plain[1][:2], change
    report, records = _run(folder, target, shard_size=3)
    assert report.note == "resuming: 1 finished shard(s) kept" and records == plain[1]
    assert os.path.getmtime(folder / "shard-00000.jsonl") == shard0
    with pytest.raises(DraftsmithError, match=r"data.regenerate.temperature: 0.0 then, 1.0 now; going on would discard "
                                              r"2 finished shard\(s\) \(3 input records\)\. .*--restart"):
        _run(folder, target, temperature=1.0)
    assert os.path.getmtime(folder / "shard-00000.jsonl") == shard0  # refused: nothing touched
    report, _ = _run(folder, target, temperature=1.0, restart=True)
    assert report.note.startswith("--restart: 2 finished shard(s) discarded (data.regenerate.temperature")


def test_prepare_stops_on_a_change_that_discards_work_and_goes_on_with_restart(tmp_path, tiny_target_dir, capsys):
    """The CLI: data.max_conversations 2 → 3 extends, data.regenerate.k=5 reuses, data.render.max_length
    would discard the shards: one line, exit 2, until --restart."""
    from draftsmith.cli import main

    src = tmp_path / "convs.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": t[0]},
                                                                   {"role": "assistant", "content": "old"}]}) + "\n"
                           for i, t in enumerate(USERS)))
    job = tmp_path / "out" / "regenerate"

    def prepare(*extra: str) -> tuple[int, str]:
        code = main(["prepare", f"target.name={tiny_target_dir}", "target.dtype=float32", "target.device=cpu",
                     f"data.sources=[{{path: {src}}}]", "data.stages=[regenerate]", f"data.out_dir={tmp_path / 'out'}",
                     f"data.regenerate.max_new_tokens={NEW}", "data.regenerate.shard_size=1", f"run_dir={tmp_path / 'run'}",
                     *extra])
        err = capsys.readouterr().err
        return code, json.loads((tmp_path / "out" / "summary.json").read_text())["stages"][1]["note"] if code == 0 else err

    assert prepare("data.max_conversations=2")[1].startswith("starting; 2 turns")
    shard0 = os.path.getmtime(job / "shard-00000.jsonl")
    assert prepare("data.max_conversations=3")[1].startswith("resuming: 2 finished shard(s) kept")
    assert prepare("data.max_conversations=3", "data.regenerate.k=5")[1].startswith("up to date (reused)")
    code, err = prepare("data.max_conversations=3", "data.render.max_length=300")
    assert code == 2 and err.count("\n") == 1 and err.startswith("draftsmith: error: ")
    assert "data.render.max_length: 1024 then, 300 now; going on would discard 3 finished shard(s) (3 input " in err
    assert os.path.getmtime(job / "shard-00000.jsonl") == shard0
    code, note = prepare("data.max_conversations=3", "data.render.max_length=300", "--restart")
    assert code == 0 and note.startswith("--restart: 3 finished shard(s) discarded")


def test_a_resumed_prepare_reports_the_rate_of_the_tokens_it_generated(tmp_path, tiny_target_dir, monkeypatch):
    """Resumed with one more conversation, prepare generates one shard: its rate is that shard's tokens over this
    run's time (a clock that says 10 s), and the note says how many tokens the finished shards already held (the
    rate over every shard's tokens was the bug: 27,510 tok/s printed for ~6k real)."""
    import types

    from draftsmith.cli import main
    from draftsmith.data import regenerate

    src = tmp_path / "convs.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": t[0]},
                                                                   {"role": "assistant", "content": "old"}]}) + "\n"
                           for i, t in enumerate(USERS)))
    out = tmp_path / "out"

    def prepare(n: int) -> str:
        assert main(["prepare", f"target.name={tiny_target_dir}", "target.dtype=float32", "target.device=cpu",
                     f"data.sources=[{{path: {src}}}]", "data.stages=[regenerate]", f"data.out_dir={out}",
                     f"data.regenerate.max_new_tokens={NEW}", "data.regenerate.shard_size=1",
                     f"data.max_conversations={n}", f"run_dir={tmp_path / 'run'}"]) == 0
        return json.loads((out / "summary.json").read_text())["stages"][1]["note"]

    prepare(2)
    clock = iter([100.0])
    monkeypatch.setattr(regenerate, "time", types.SimpleNamespace(perf_counter=lambda: next(clock, 110.0)))
    note = prepare(3)
    shards = [json.loads((out / "regenerate" / f"shard-0000{i}.json").read_text())["new_tokens"] for i in range(3)]
    assert note.startswith("resuming: 2 finished shard(s) kept") and all(shards)
    assert note.endswith(f"; {shards[2] / 10:.1f} new tok/s ({shards[2]:,} tokens generated now; "
                         f"{shards[0] + shards[1]:,} reused from an earlier run)")


@pytest.mark.parametrize("fails, kept, left", [
    (4, 1, ["job.json", "shard-00000.json", "shard-00000.jsonl"]),  # job.json, shard 0, its record, then shard 1
    (3, 0, ["job.json", "shard-00000.jsonl"]),  # shard 0's record: its file is there, unrecorded, so not trusted
], ids=["second-shard", "first-record"])
def test_a_full_disk_mid_regeneration_is_one_line_naming_what_the_rerun_keeps(tmp_path, target, plain, monkeypatch,
                                                                              fails, kept, left):
    """The disk fills while a shard or its record is written: one line naming the folder and the finished shards the
    rerun keeps, no temporary file left, and the rerun resumes to the records of an uninterrupted run."""
    import errno

    folder = tmp_path / "regen"
    fsync, calls = os.fsync, []

    def full(fd):
        calls.append(fd)
        if len(calls) == fails:
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DraftsmithError) as e:
        _run(folder, target)
    assert str(e.value) == (f"no space left on {folder}: free some space (or write elsewhere: run_dir, --out) and "
                            f"rerun; kept for the rerun: {kept} finished shard(s) of 2 in {folder}, nothing half-written")
    assert sorted(os.listdir(folder)) == left
    monkeypatch.setattr(os, "fsync", fsync)
    report, got = _run(folder, target)
    assert report.note == ("resuming: 1 finished shard(s) kept" if kept else "starting") and got == plain[1]


@pytest.mark.slow
def test_killed_mid_way_and_rerun_gives_exactly_the_uninterrupted_records(tmp_path, tiny_target_dir):
    """A real SIGKILL to a real `draftsmith prepare` subprocess; the re-run resumes and matches a clean run."""
    users = [[f"Question number {i}: tell me something about the number {i}.", "And more?"] for i in range(30)]
    src = tmp_path / "convs.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "messages": [
        {"role": r, "content": c} for u in t for r, c in (("user", u), ("assistant", "old"))]}) + "\n"
        for i, t in enumerate(users)))

    def config(out):
        path = tmp_path / f"{os.path.basename(out)}.yaml"
        path.write_text(yaml.safe_dump({
            "target": {"name": tiny_target_dir, "dtype": "float32", "device": "cpu"},
            "data": {"sources": [{"path": str(src)}], "stages": ["regenerate"], "out_dir": str(out),
                     "render": {"max_length": 256},
                     "regenerate": {"max_new_tokens": 24, "batch_size": 2, "shard_size": 2}},
            "run_dir": str(tmp_path / "run"),
        }))
        return [sys.executable, "-m", "draftsmith.cli", "prepare", "--config", str(path)]

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    subprocess.run(config(clean), env=env, check=True, capture_output=True, timeout=300)

    proc = subprocess.Popen(config(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    job = killed / "regenerate"
    deadline = time.time() + 240
    while not (job / "shard-00001.json").exists():  # two shards finished
        assert proc.poll() is None and time.time() < deadline, "the job ended before it could be killed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    done_before = len(glob.glob(str(job / "shard-*.json")))
    assert not (job / "manifest.json").exists() and 2 <= done_before < 15

    subprocess.run(config(killed), env=env, check=True, capture_output=True, timeout=300)
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["stages"][1]["stage"] == "regenerate"
    assert summary["stages"][1]["note"].startswith(f"resuming: {done_before} finished shard(s) kept")
    assert list(regenerated_records(str(job))) == list(regenerated_records(str(clean / "regenerate")))
    assert len(list(regenerated_records(str(job)))) == 30


def test_regenerate_dtype_answers_with_a_bfloat16_copy_of_an_fp32_target(tmp_path, tiny_target_dir):
    """data.regenerate.dtype=bfloat16 with target.dtype=float32: the answers are the bf16 target's own
    greedy ones (the fp32 target stays for the later stages), and the job records the dtype it ran in."""
    from draftsmith.config import load_recipe
    from draftsmith.data import run_prepare

    src = tmp_path / "convs.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": u},
                                                                   {"role": "assistant", "content": "old"}]}) + "\n"
                           for i, u in enumerate(["Tell me a story.", "Hi", "Name a color."])))
    recipe = load_recipe(None, [f"target.name={tiny_target_dir}", "target.dtype=float32", "target.device=cpu",
                                f"data.sources=[{{path: {src}}}]", "data.stages=[regenerate]",
                                f"data.out_dir={tmp_path / 'out'}", "data.regenerate.dtype=bfloat16",
                                f"data.regenerate.max_new_tokens={NEW}", "data.regenerate.batch_size=1",
                                f"run_dir={tmp_path / 'run'}"])
    run_prepare(recipe, progress=False)
    job = tmp_path / "out" / "regenerate"
    assert json.loads((job / "manifest.json").read_text())["spec"]["dtype"] == "torch.bfloat16"
    bf16 = load_target(tiny_target_dir, dtype="bfloat16", device="cpu")
    fp32 = load_target(tiny_target_dir, dtype="float32", device="cpu")
    records = list(regenerated_records(str(job)))
    assert len(records) == 3
    differ = 0
    for rec in records:
        prompt = bf16.render_chat(rec["messages"][:1])
        tokens = target_greedy(bf16, prompt, NEW)
        assert rec["messages"][1]["content"] == bf16.tokenizer.decode(
            [t for t in tokens if t not in bf16.eos_token_ids], skip_special_tokens=True)
        differ += tokens != target_greedy(fp32, prompt, NEW)
    print(f"{differ} of 3 bf16 answers differ from the fp32 target's")


def test_greedy_batch_drops_finished_rows_and_matches_the_target_alone(smollm2):
    """Prompts of different lengths whose answers end at different points (some by EOS within the
    budget, some cut): the batched loop gives each prompt the target's own batch-1 greedy answer."""
    from draftsmith.data.regenerate import greedy_batch

    asks = ["Answer with one word: is the sky blue?", "Hi", "Write a long poem about the sea and the wind.",
            "What is 2+2? Reply with the number only."]
    prompts = [smollm2.render_chat([{"role": "user", "content": a}]) for a in asks]
    got = greedy_batch(smollm2, prompts, 20)
    want = [target_greedy(smollm2, p, 20) for p in prompts]
    assert got == want
    ended = [len(t) < 20 and t[-1] in smollm2.eos_token_ids for t in got]
    assert any(ended) and not all(ended), [len(t) for t in got]  # rows left the batch while others ran on


def _prepare_own_answers(tmp_path, tiny_target_dir, *extra: str) -> tuple[list[dict], dict]:
    """``draftsmith prepare`` (the regenerate stage, first turns) of USERS' conversations, each assistant turn
    ``own <i>`` in the source, into ``tmp_path/out``: the regenerated records and the stage's summary row."""
    from draftsmith.cli import main
    from draftsmith.data.conversations import load_conversations

    src, out = tmp_path / "convs.jsonl", tmp_path / "out"
    src.write_text("".join(json.dumps({"id": f"q{i}", "messages": [m for u in turns for m in (
        {"role": "user", "content": u}, {"role": "assistant", "content": f"own {i}"})]}) + "\n"
        for i, turns in enumerate(USERS)))
    assert main(["prepare", f"target.name={tiny_target_dir}", "target.dtype=float32", "target.device=cpu",
                 f"data.sources=[{{path: {src}}}]", "data.stages=[regenerate]", f"data.out_dir={out}",
                 f"data.regenerate.max_new_tokens={NEW}", "data.regenerate.max_turns=1", f"run_dir={tmp_path / 'run'}",
                 *extra]) == 0
    row = json.loads((out / "summary.json").read_text())["stages"][1]
    return load_conversations(str(out / "conversations_regenerated")).to_list(), row


def test_regenerate_max_conversations_keeps_the_rest_with_their_own_answers(tmp_path, tiny_target_dir):
    """data.regenerate.max_conversations=1 of 3: the first conversation is the target's (the same shard, reused, as a
    run of that one conversation alone), the other two keep their source's answers, cut after max_turns as a
    regenerated one is; the summary says how many kept their own. With keep_own_answers the regenerated ones keep
    theirs too, as records after every regenerated one."""
    def prepare(*extra: str) -> tuple[list[dict], str]:
        records, row = _prepare_own_answers(tmp_path, tiny_target_dir, "data.regenerate.shard_size=1", *extra)
        return records, row["note"]

    alone, _ = prepare("data.max_conversations=1")
    mixed, note = prepare("data.regenerate.max_conversations=1")
    assert note.startswith("up to date (reused)") and "2 more keep their own answers" in note
    assert mixed[0] == alone[0] and alone[0]["messages"][1]["content"] != "own 0"
    assert [r["messages"] for r in mixed[1:]] == [[{"role": "user", "content": USERS[i][0]},
                                                   {"role": "assistant", "content": f"own {i}"}] for i in (1, 2)]
    assert [r["truncated_turns"] for r in mixed[1:]] == [[], []]
    everything, _ = prepare()  # back to regenerating all three: the target answers the other two as well
    assert everything[0] == alone[0] and all(r["messages"][1]["content"] != f"own {i}"
                                             for i, r in enumerate(everything))
    own = [[{"role": "user", "content": USERS[i][0]}, {"role": "assistant", "content": f"own {i}"}] for i in range(3)]
    both, note = prepare("data.regenerate.keep_own_answers=true")  # two answers per prompt, the target's first
    assert both[:3] == everything and [r["messages"] for r in both[3:]] == own
    assert note.startswith("up to date (reused)") and "3 more keep their own answers (data.regenerate.keep_own" in note
    both, _ = prepare("data.regenerate.keep_own_answers=true", "data.regenerate.max_conversations=1")
    assert both[0] == alone[0] and [r["messages"] for r in both[1:]] == own  # the first one's own, then the rest


def test_regenerate_samples_add_sampled_answers_per_prompt(tmp_path, tiny_target_dir):
    """data.regenerate.samples=2: every conversation is answered twice more by the target, sampled at
    sample_temperature, as records after the greedy ones (each sample exactly what a job of its own at that temperature
    and seed writes) and before kept own answers; a re-run reuses every job; the summary counts the answers."""
    from draftsmith.data.conversations import load_conversations

    def prepare(*extra: str) -> tuple[list[dict], dict]:
        return _prepare_own_answers(tmp_path, tiny_target_dir, "data.regenerate.shard_size=2", *extra)

    greedy, _ = prepare()
    records, row = prepare("data.regenerate.samples=2")
    assert records[:3] == greedy and len(records) == 9 and row["kept"] == 9
    assert row["note"].startswith("up to date (reused)")  # the greedy job is kept as it was
    assert "2 more answer(s) per prompt sampled at temperature 0.7 (data.regenerate.samples)" in row["note"]
    conversations = load_conversations(str(tmp_path / "out" / "conversations"))
    target = load_target(tiny_target_dir, "float32", "cpu")
    for i in (1, 2):  # each sample: a job of its own at the sample temperature and its own seed
        alone = RegenerateConfig(max_new_tokens=NEW, max_turns=1, shard_size=2, temperature=0.7, seed=i * 1_000_003)
        regenerate_conversations(conversations, str(tmp_path / f"alone{i}"), target, alone, max_length=512,
                                 progress=False)
        assert records[3 * i: 3 * i + 3] == list(regenerated_records(str(tmp_path / f"alone{i}")))
    assert [r["conv_id"] for r in records] == [r["conv_id"] for r in greedy] * 3
    answers = [[r["messages"][1]["content"] for r in records[3 * i: 3 * i + 3]] for i in range(3)]
    assert answers[1] != answers[0] and answers[2] != answers[1]  # sampled, and drawn anew for each sample
    again, row = prepare("data.regenerate.samples=2")
    assert again == records and "new tok/s" not in row["note"]  # no job answered anything again
    both, _ = prepare("data.regenerate.samples=2", "data.regenerate.keep_own_answers=true")
    assert both[:9] == records and [r["messages"][1]["content"] for r in both[9:]] == ["own 0", "own 1", "own 2"]


def test_regenerate_samples_need_a_temperature():
    with pytest.raises(Exception, match="sample_temperature = 0.0 > 0 with samples"):
        RegenerateConfig(samples=1, sample_temperature=0.0).validate()
    with pytest.raises(Exception, match="data.regenerate.samples = -1 must be ≥ 0"):
        RegenerateConfig(samples=-1).validate()


def test_regenerate_max_conversations_below_zero_is_refused():
    with pytest.raises(Exception, match="data.regenerate.max_conversations = -1 must be ≥ 0"):
        RegenerateConfig(max_conversations=-1).validate()
