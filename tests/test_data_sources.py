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
                                 "prompt_too_long"} == set(SKIP_REASONS)
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


def test_malformed_json_array_stops_and_says_where(tmp_path):
    records = [_sg(("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(3)]
    text = json.dumps(records)
    broken = text.replace('"q2"', 'q2"')  # a bare word mid-file
    path = tmp_path / "bad.json"
    path.write_text(broken + " " * 100_000)  # the error is far from the end of the file
    convs, stats = _read([SourceConfig(path=str(path))])
    assert len(convs) == 2
    assert stats.sources[0].stopped.startswith("malformed JSON after record 2")


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
