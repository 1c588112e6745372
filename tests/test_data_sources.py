"""Sources and normalization: every skip reason counted, truncated JSON recovered, formats and limits."""

from __future__ import annotations

import json

import pytest

from draftsmith.data.config import DataConfig, SourceConfig
from draftsmith.data.normalize import SKIP_REASONS, ReadStats, iter_conversations, normalize_messages
from draftsmith.data.sources import sharegpt_path
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.schema import from_dict


def _sg(*turns):
    return {"conversations": [{"from": f, "value": v} for f, v in turns]}


def _read(sources, max_conversations=0):
    stats = ReadStats()
    return list(iter_conversations(sources, max_conversations, stats)), stats


# one record per read-time skip reason, and the expected reason
SKIPPED = [
    ({"text": "no conversation here"}, "no_conversation"),
    ({"conversations": "not a list"}, "no_conversation"),
    ({"conversations": []}, "empty"),
    (_sg(("human", "  "), ("gpt", "")), "empty"),
    (_sg(("human", "hi"), ("robot", "beep")), "unknown_role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x.png"}]},
                   {"role": "assistant", "content": "a cat"}]}, "non_text_content"),
    (_sg(("human", None), ("gpt", "ok")), "non_text_content"),
    (_sg(("gpt", "I start"), ("human", "hi"), ("gpt", "hello")), "starts_with_assistant"),
    (_sg(("system", "sys"), ("gpt", "I start after the system prompt")), "starts_with_assistant"),
    (_sg(("human", "anyone?")), "no_assistant_turn"),
]


def test_every_read_skip_reason_is_counted(tmp_path):
    path = tmp_path / "mixed.jsonl"
    kept_records = [
        {"id": "sg", **_sg(("system", "Be brief."), ("human", "Hi"), ("gpt", "Hello!"), ("human", "trailing"))},
        {"id": "msg", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                                   {"role": "assistant", "content": "Hey."}]},
        {"id": "custom", **_sg(("Human", "Hi"), ("Bot", "Hey."))},
    ]
    lines = [json.dumps(r) for r, _ in SKIPPED] + ["{not json"] + [json.dumps(r) for r in kept_records]
    path.write_text("\n".join(lines) + "\n")
    convs, stats = _read([SourceConfig(path=str(path), roles={"bot": "assistant"})])
    expected = {"invalid_json": 1}
    for _, reason in SKIPPED:
        expected[reason] = expected.get(reason, 0) + 1
    assert dict(stats.skipped) == expected
    assert stats.records_in == len(lines) and stats.kept == 3
    assert set(stats.skipped) | {"template_error", "template_not_prefix_stable", "no_loss_tokens_in_max_length",
                                 "prompt_too_long", "request_failed"} == set(SKIP_REASONS)  # later stages' reasons
    assert stats.examples["invalid_json"].startswith(f"{path}:{len(SKIPPED) + 1}:")
    assert [c["conv_id"] for c in convs] == ["sg", "msg", "custom"]
    assert convs[0]["messages"] == [  # roles mapped, trailing user turn dropped (it carries no loss)
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}]
    assert convs[1]["messages"][0] == {"role": "user", "content": "Hi there"}
    assert convs[2]["messages"][1] == {"role": "assistant", "content": "Hey."}
    assert {c["source"] for c in convs} == {"mixed"}


@pytest.mark.parametrize("role,expected", [("human", "user"), ("user", "user"), ("gpt", "assistant"),
                                           ("chatgpt", "assistant"), ("bard", "assistant"), ("bing", "assistant"),
                                           ("assistant", "assistant")])
def test_role_mapping_is_explicit(role, expected):
    first = "user" if expected == "assistant" else role
    msgs = normalize_messages(_sg(("human" if first == "user" else first, "q"), (role, "a"), ("gpt", "b")))
    assert msgs[1]["role"] == expected


def test_format_is_respected():
    rec = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert normalize_messages(rec, "sharegpt") == "no_conversation"
    assert normalize_messages(rec, "messages")[1] == {"role": "assistant", "content": "a"}


def _truncated_json(tmp_path, n_complete: int):
    records = [{"id": f"r{i}", **_sg(("human", f"question {i}"), ("gpt", f"answer {i} " + "x" * 50))}
               for i in range(n_complete + 1)]
    text = json.dumps(records, indent=2)
    last = text.index('"r%d"' % n_complete)
    cut = text[: last + 60]  # inside the last record's conversation
    path = tmp_path / "cut.json"
    path.write_text(cut)
    return path, len(cut.encode())


def test_truncated_json_array_recovers_every_complete_record(tmp_path):
    path, size = _truncated_json(tmp_path, n_complete=5)
    convs, stats = _read([SourceConfig(path=str(path))])
    assert [c["conv_id"] for c in convs] == [f"r{i}" for i in range(5)]
    assert convs[4]["messages"][1]["content"].startswith("answer 4 ")
    report = stats.sources[0]
    assert report.records == 5
    assert "truncated" in report.stopped and "record 6" in report.stopped and f"{size:,}" in report.stopped


def test_a_malformed_record_far_from_the_end_costs_only_itself(tmp_path):
    records = [_sg(("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(3)]
    text = json.dumps(records)
    broken = text.replace('"q2"', 'q2')  # a bare word mid-file
    path = tmp_path / "bad.json"
    path.write_text(broken + " " * 100_000)  # the error is far from the end of the file
    convs, stats = _read([SourceConfig(path=str(path))])
    assert len(convs) == 2 and dict(stats.skipped) == {"invalid_json": 1}
    assert stats.examples["invalid_json"] == f"{path}: record 3 at byte {broken.index('q2'):,}: Expecting value"
    assert stats.sources[0].stopped == ""  # not "truncated": the file ends where it should


def _records(n: int) -> list[dict]:
    return [{"id": f"r{i}", **_sg(("human", f"question {i}"), ("gpt", f"answer {i}"))} for i in range(n)]


def test_a_missing_comma_or_a_bad_byte_skips_one_record_and_reading_goes_on(tmp_path):
    """301 records: a missing comma inside record 10 and a byte that breaks record 200 each cost that
    record (counted, with its byte offset); a missing comma between two records and an invalid UTF-8
    byte inside a text cost nothing (the text keeps U+FFFD), and each is counted as a repair, never silent."""
    text = json.dumps(_records(301), indent=1).encode()
    text = text.replace(b'"r10",', b'"r10"')  # inside record 10
    text = text.replace(b'"r200",', b'"r200"\x01')  # a control byte where the comma was
    text = text.replace(b'answer 50', b'answer \xff50')  # inside a string
    end_of_100 = text.index(b'"id": "r101"')
    text = text[:end_of_100] + text[end_of_100:].replace(b"},\n {", b"}\n {", 1)  # between records 101 and 102
    path = tmp_path / "sharegpt-like.json"
    path.write_bytes(text)
    convs, stats = _read([SourceConfig(path=str(path))])
    assert stats.records_in == 301 and stats.kept == 299 and dict(stats.skipped) == {"invalid_json": 2}
    assert [c["conv_id"] for c in convs] == [f"r{i}" for i in range(301) if i not in (10, 200)]
    at = text.index(b'"r10"') + len(b'"r10"\n  ')
    assert stats.examples["invalid_json"] == f"{path}: record 11 at byte {at:,}: Expecting ',' delimiter"
    assert convs[49]["messages"][1]["content"] == "answer \ufffd50"
    assert stats.sources[0].stopped == ""
    assert stats.sources[0].repaired == {"invalid_utf8": 1, "missing_comma": 1}


def test_invalid_utf8_in_jsonl_is_kept_and_counted(tmp_path):
    path = tmp_path / "c.jsonl"
    lines = [json.dumps(r).encode() for r in _records(3)]
    lines[1] = lines[1].replace(b"answer 1", b"answer \xff1")
    path.write_bytes(b"\n".join(lines) + b"\n")
    convs, stats = _read([SourceConfig(path=str(path))])
    assert len(convs) == 3 and convs[1]["messages"][1]["content"] == "answer \ufffd1"
    assert stats.sources[0].repaired == {"invalid_utf8": 1}


def test_a_stray_quote_costs_its_record_and_a_file_that_stops_early_is_an_error_unless_cut_off(tmp_path):
    text = json.dumps(_records(20))
    path = tmp_path / "bad.json"
    bad = text.replace('"question 5"', '"question" 5"')  # a stray quote: where the next records begin is hidden
    path.write_text(bad)
    convs, stats = _read([SourceConfig(path=str(path))])  # reading resumes where record 7 begins
    assert [c["conv_id"] for c in convs] == [f"r{i}" for i in range(20) if i != 5] and stats.sources[0].stopped == ""
    assert stats.examples["invalid_json"] == f"{path}: record 6 at byte {bad.index(' 5') + 1:,}: Expecting ',' delimiter"
    path.write_text(text.replace('"question 19"', '"question" 19"'))  # in the last record: nothing to resume at
    with pytest.raises(DraftsmithError, match=r"malformed JSON at byte [\d,]+ of [\d,]+ \(Expecting .*\) in record 20, "
                                              r"after which no record begins as the first one did; fix the file"):
        _read([SourceConfig(path=str(path))])
    path.write_text(text + "\n[]")
    with pytest.raises(DraftsmithError, match=f"the JSON array ends at byte {len(text):,} of {len(text) + 3:,} and more "
                                              f"data follows; 20 records were read"):
        _read([SourceConfig(path=str(path))])
    path.write_text(text[:-1] + ",")  # every record complete, no closing bracket
    convs, stats = _read([SourceConfig(path=str(path))])
    assert len(convs) == 20 and stats.sources[0].stopped.startswith("file is truncated: it ends before the array's")
    for cut in ('"question 7', '"question 7"', 'tr', '12'):  # inside a string, after one, in a literal, a number
        path.write_text(text[: text.index('"r7"') + 4] + ', "x": ' + cut if cut in ("tr", "12") else
                        text[: text.index(cut) + len(cut)])
        convs, stats = _read([SourceConfig(path=str(path))])
        assert len(convs) == 7 and stats.sources[0].stopped.startswith("file is truncated: it ends inside record 8"), cut


def test_sharegpt_package_file_is_truncated_and_recovered():
    """The embedded ShareGPT V3 file ends mid-record; all 17,671 complete records before the cut are read."""
    stats = ReadStats()
    for _ in iter_conversations([SourceConfig(path="sharegpt")], 0, stats):
        pass
    assert stats.records_in == 17671
    assert stats.sources[0].stopped.startswith("file is truncated: it ends inside record 17672")
    assert stats.kept + sum(stats.skipped.values()) == stats.records_in
    assert stats.skipped["starts_with_assistant"] > 6000  # ShareGPT splits long chats; the later parts start with gpt
    assert sharegpt_path().endswith("ShareGPT_V3_unfiltered_cleaned_split.json")


def test_parquet_and_limits(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    jsonl = tmp_path / "more.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    sources = [SourceConfig(path=str(tmp_path / "chat.parquet"), limit=4), SourceConfig(path=str(jsonl), name="extra")]
    convs, stats = _read(sources, max_conversations=5)
    assert [(c["source"], c["conv_id"]) for c in convs] == [("chat", "p0"), ("chat", "p1"), ("chat", "p2"),
                                                             ("chat", "p3"), ("extra", "0")]
    assert stats.records_in == 5 and "stopped after 4" in stats.sources[0].stopped


def test_datasets_loader_path_with_a_local_dataset_folder(tmp_path):
    """Hub names go through `datasets.load_dataset`; a local folder of data files takes the same path offline."""
    folder = tmp_path / "hub_clone"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"id": f"h{i}", **_sg(("human", "q"), ("gpt", f"a{i}"))}) + "\n"
                                                for i in range(3)))
    convs, stats = _read([SourceConfig(path=str(folder))])
    assert [(c["source"], c["conv_id"], c["messages"][1]["content"]) for c in convs] == [
        ("hub_clone", f"h{i}", f"a{i}") for i in range(3)]
    with pytest.raises(DraftsmithError, match="(?s)could not load the hub dataset 'someorg/chats'.*local .jsonl"):
        _read([SourceConfig(path="someorg/chats")])  # no hub here (HF_HUB_OFFLINE=1)


def test_bad_sources_and_config_are_clear_errors(tmp_path):
    with pytest.raises(DraftsmithError, match="does not exist"):
        _read([SourceConfig(path=str(tmp_path / "missing.jsonl"))])
    with pytest.raises(ConfigError, match="user, assistant, system"):
        from_dict(SourceConfig, {"path": "x.jsonl", "roles": {"bot": "model"}})
    with pytest.raises(ConfigError, match="unknown config key 'data.sources\\[0\\].colour'"):
        from_dict(DataConfig, {"sources": [{"path": "x", "colour": 1}]}, "data")
