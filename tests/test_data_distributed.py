"""`draftsmith prepare` under torchrun: two processes split regenerate and features and write
exactly the files one process writes (sampled regeneration included: each shard has its own seed)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import yaml

from draftsmith.data.regenerate import regenerated_records
from draftsmith.data.vocab import DraftVocab

pytestmark = pytest.mark.slow

BIN = os.path.dirname(sys.executable)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_two_processes_write_what_one_process_writes(tmp_path, tiny_target_dir):
    src = tmp_path / "convs.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "messages": [
        {"role": "user", "content": f"Question {i}: say something about {i}."}, {"role": "assistant", "content": "old"},
        {"role": "user", "content": "And more?"}, {"role": "assistant", "content": "old"}]}) + "\n" for i in range(9)))

    def config(out) -> str:
        path = tmp_path / f"{os.path.basename(out)}.yaml"
        path.write_text(yaml.safe_dump({
            "target": {"name": tiny_target_dir, "dtype": "float32"},
            "data": {"sources": [{"path": str(src)}], "stages": ["regenerate", "tokenize", "features", "vocab"],
                     "out_dir": str(out), "render": {"max_length": 128}, "vocab": {"size": 500},
                     "regenerate": {"max_new_tokens": 12, "batch_size": 2, "shard_size": 2, "temperature": 1.0},
                     "features": {"shard_size": 3, "layer_ids": [0, 3]}},
            "run_dir": str(tmp_path / "run"),
        }))
        return str(path)

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one", tmp_path / "two"
    draftsmith = os.path.join(BIN, "draftsmith")
    single = subprocess.run([draftsmith, "prepare", "--config", config(one)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    pair = subprocess.run([os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", _free_port(),
                           draftsmith, "prepare", "--config", config(two)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert pair.returncode == 0, pair.stderr[-3000:]
    assert pair.stdout.count("draftsmith prepare →") == 1  # process 0 prints the summary

    def shards(folder):
        return [(m["file"], m["sha256"]) for m in json.loads((folder / "manifest.json").read_text())["shards"]]

    assert len(shards(one / "regenerate")) == 5 and len(shards(one / "features")) == 3
    for stage in ("regenerate", "features"):
        assert shards(two / stage) == shards(one / stage), stage
        computed_by = [m["process"] for m in json.loads((two / stage / "manifest.json").read_text())["shards"]]
        assert computed_by == [i % 2 for i in range(len(computed_by))], stage  # the work was split
    assert list(regenerated_records(str(two / "regenerate"))) == list(regenerated_records(str(one / "regenerate")))
    assert all(m["content"] != "old" for r in regenerated_records(str(two / "regenerate")) for m in r["messages"])
    tokenized = [json.loads((d / "tokenized" / "draftsmith_manifest.json").read_text())["data_hash"] for d in (one, two)]
    assert tokenized[0] == tokenized[1]
    vocabs = [DraftVocab.load(str(d / "draft_vocab.safetensors")) for d in (one, two)]
    assert torch.equal(vocabs[0].d2t, vocabs[1].d2t) and vocabs[0].coverage == vocabs[1].coverage
    summary = json.loads((two / "summary.json").read_text())
    assert [r["stage"] for r in summary["stages"]] == ["read", "regenerate", "tokenize", "features", "vocab"]
    assert summary["stages"][3]["kept"] == 9
