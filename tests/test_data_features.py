"""Offline feature cache: values identical to the target's own forward, refusal of corrupt or foreign caches, resume."""

from __future__ import annotations

import json
import os
import types

import datasets
import pytest
import torch

from draftsmith.data.feature_cache import FeatureCache, default_layer_ids, write_feature_cache
from draftsmith.data.tokenized import tokenized_features
from draftsmith.errors import DraftsmithError
from draftsmith.target import Target

from .conftest import tiny_llama

LAYERS = [1, 3]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    lengths = [9, 23, 5, 17, 12]
    ids = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]
    masks = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    return datasets.Dataset.from_dict(
        {"conv_id": [str(i) for i in range(5)], "source": ["t"] * 5, "input_ids": ids, "loss_mask": masks},
        features=tokenized_features(),
    )


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, data, tiny_target):
    path = str(tmp_path_factory.mktemp("features") / "cache")
    write_feature_cache(data, path, tiny_target, layer_ids=LAYERS, topk=3, shard_size=2, batch_tokens=40,
                        source_data_hash="d0", progress=False)
    return path


def test_default_layers_follow_eagle3():
    assert default_layer_ids(30) == [1, 14, 26, 29]  # SmolLM2-135M
    assert default_layer_ids(32) == [1, 15, 28, 31]  # Llama-3.1-8B: SpecForge's [1, 15, 28] + the last layer


def test_cache_holds_the_targets_own_features_and_topk(cache_dir, data, tiny_target):
    cache = FeatureCache.open(cache_dir, tiny_target)
    assert len(cache) == 5 and cache.layer_ids == LAYERS and cache.topk == 3
    assert len(cache.manifest["shards"]) == 3 and cache.manifest["source_data_hash"] == "d0"
    assert cache.num_tokens == sum(len(x) for x in data["input_ids"])
    for i in range(5):
        item = cache[i]
        ids = torch.tensor(data[i]["input_ids"])
        assert torch.equal(item["input_ids"], ids) and item["input_ids"].dtype == torch.long
        assert item["loss_mask"].tolist() == data[i]["loss_mask"] and item["loss_mask"].dtype == torch.long
        ref = tiny_target.forward(ids[None], feature_layers=tuple(LAYERS))  # one sample alone, no padding
        assert item["hidden"].dtype == torch.bfloat16 and item["hidden"].shape == (len(ids), 2 * 64)
        # batched with right padding vs alone: equal up to fp32 kernel noise, then rounded to bf16
        expected = ref.features[0].bfloat16()
        torch.testing.assert_close(item["hidden"].float(), expected.float(), rtol=1e-2, atol=1e-2)
        assert (item["hidden"] == expected).float().mean() > 0.99  # bit-identical but for rare rounding flips
        top = ref.logits[0].topk(3, dim=-1)
        assert torch.equal(item["topk_ids"], top.indices)
        torch.testing.assert_close(item["topk_logits"], top.values, rtol=1e-4, atol=1e-4)
    assert cache[-1]["input_ids"].shape[0] == len(data[4]["input_ids"])
    with pytest.raises(IndexError):
        cache[5]


def test_a_flipped_byte_is_refused(tmp_path, data, tiny_target):
    path = str(tmp_path / "cache")
    write_feature_cache(data, path, tiny_target, layer_ids=LAYERS, shard_size=2, progress=False)
    shard = os.path.join(path, "shard-00001.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)  # inside the hidden-state bytes
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    cache = FeatureCache.open(path, tiny_target)  # sizes are fine; the checksum is checked on first read
    cache[0]  # shard 0 is intact
    with pytest.raises(DraftsmithError, match="shard-00001.safetensors is corrupt.*Delete that file and re-run"):
        cache[2]
    with pytest.raises(DraftsmithError, match="corrupt"):
        FeatureCache.open(path, tiny_target, verify="all")
    # the fix the message names: delete the shard, re-run; only that shard is recomputed
    mtime0 = os.path.getmtime(os.path.join(path, "shard-00000.safetensors"))
    os.remove(shard)
    manifest = write_feature_cache(data, path, tiny_target, layer_ids=LAYERS, shard_size=2, progress=False)
    assert manifest["note"] == "resuming: 2 finished shard(s) kept"
    assert os.path.getmtime(os.path.join(path, "shard-00000.safetensors")) == mtime0
    FeatureCache.open(path, tiny_target, verify="all")


def test_prepare_is_not_up_to_date_over_an_altered_shard(tmp_path, data, tiny_target):
    """A shard altered in place (its size intact): the re-run computes that shard again instead of reporting the
    cache up to date (train would refuse it later)."""
    path = str(tmp_path / "cache")
    write_feature_cache(data, path, tiny_target, layer_ids=LAYERS, shard_size=2, progress=False)
    shard = os.path.join(path, "shard-00001.safetensors")
    good = open(shard, "rb").read()
    with open(shard, "r+b") as f:
        f.seek(len(good) // 2)
        f.write(bytes([good[len(good) // 2] ^ 0x01]))
    mtime0 = os.path.getmtime(os.path.join(path, "shard-00000.safetensors"))
    manifest = write_feature_cache(data, path, tiny_target, layer_ids=LAYERS, shard_size=2, progress=False)
    assert manifest["note"] == ("shard(s) 1 no longer matched their sha256 and are computed again; resuming: 2 "
                                "finished shard(s) kept")
    assert open(shard, "rb").read() == good  # the same bytes again
    assert os.path.getmtime(os.path.join(path, "shard-00000.safetensors")) == mtime0
    FeatureCache.open(path, tiny_target, verify="all")


def test_a_full_disk_during_prepare_is_one_line_leaves_no_partial_file_and_keeps_finished_shards(
        tmp_path, data, tiny_target, monkeypatch):
    """The disk fills while the second shard is written (as `prepare` runs it, inside errors.writing): one line,
    no temporary file, and the next run keeps the first shard."""
    import errno

    from draftsmith.errors import writing

    path = str(tmp_path / "cache")
    fsync, calls = os.fsync, []

    def full(fd):
        calls.append(fd)
        if len(calls) == 4:  # job.json, shard 0, its record, then shard 1
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DraftsmithError, match=f"^no space left on {path}: free some space"):
        with writing(path):
            write_feature_cache(data, path, tiny_target, layer_ids=LAYERS, shard_size=2, progress=False)
    assert len(calls) == 4
    assert sorted(os.listdir(path)) == ["job.json", "shard-00000.json", "shard-00000.safetensors"]
    monkeypatch.setattr(os, "fsync", fsync)
    manifest = write_feature_cache(data, path, tiny_target, layer_ids=LAYERS, shard_size=2, progress=False)
    assert "1 finished shard(s) kept" in manifest["note"]


def test_a_cache_from_another_target_or_tokenizer_is_refused(cache_dir, tiny_target, smollm2_tokenizer):
    other = Target(tiny_llama(layers=4, seed=1), smollm2_tokenizer, name="other-tiny")
    with pytest.raises(DraftsmithError, match="made by target 'tiny-llama'.*not by this target 'other-tiny'"):
        FeatureCache.open(cache_dir, other)
    same_model_other_tokenizer = types.SimpleNamespace(name="x", fingerprint=tiny_target.fingerprint,
                                                       tokenizer_hash="0123456789abcdef")
    with pytest.raises(DraftsmithError, match="made with tokenizer"):
        FeatureCache.open(cache_dir, same_model_other_tokenizer)
    with pytest.raises(DraftsmithError, match="not a finished feature cache"):
        FeatureCache.open(os.path.dirname(cache_dir), tiny_target)


def test_finished_cache_is_reused_and_a_new_spec_stops_unless_restart(tmp_path, data, tiny_target):
    path = str(tmp_path / "cache")
    first = write_feature_cache(data, path, tiny_target, layer_ids=LAYERS, shard_size=4, progress=False)
    assert first["note"] == "starting" and first["bytes_per_token"] > 2 * 64 * 2
    again = write_feature_cache(data, path, tiny_target, layer_ids=LAYERS, shard_size=4, progress=False)
    assert again["note"] == "up to date (reused)" and again["shards"] == first["shards"]
    with pytest.raises(DraftsmithError, match=r"data.features.layer_ids: \[1, 3\] then, \[2\] now; going on would "
                                              r"discard 2 finished shard\(s\) \(5 input records\).*--restart"):
        write_feature_cache(data, path, tiny_target, layer_ids=[2], shard_size=4, progress=False)
    assert FeatureCache.open(path, tiny_target)[0]["hidden"].shape[-1] == 2 * 64  # refused: nothing touched
    other = write_feature_cache(data, path, tiny_target, layer_ids=[2], shard_size=4, progress=False, restart=True)
    assert other["note"].startswith("--restart: 2 finished shard(s) discarded (data.features.layer_ids")
    assert FeatureCache.open(path, tiny_target)[0]["hidden"].shape[-1] == 64
    # shards of an older draftsmith (job.json is the bare spec, no input digests): what they hold is unknown
    with open(os.path.join(path, "job.json"), "w") as f:
        json.dump({**other["spec"], "shard_size": 4}, f)
    os.remove(os.path.join(path, "manifest.json"))  # it held that older spec too
    with pytest.raises(DraftsmithError, match=r"settings the finished shards were made with are unknown \(no job.json, "
                                              r"or an older draftsmith's\); going on would discard 2 finished shard\(s\)"):
        write_feature_cache(data, path, tiny_target, layer_ids=[2], shard_size=4, progress=False)


def _mtimes(path: str) -> dict[str, float]:
    return {f: os.path.getmtime(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors")}


def test_sizes_keep_every_shard_and_more_samples_extend_the_cache(tmp_path, data, tiny_target):
    """batch_tokens and shard_size change no value: the finished cache is reused as it is. Samples added
    at the end extend it: the finished shards stay, the new samples get new shards."""
    path = str(tmp_path / "cache")
    first = write_feature_cache(data.select(range(3)), path, tiny_target, layer_ids=LAYERS, shard_size=2,
                                batch_tokens=40, progress=False)
    before = _mtimes(path)
    for sizes in ({"shard_size": 4, "batch_tokens": 40}, {"shard_size": 2, "batch_tokens": 8}):
        again = write_feature_cache(data.select(range(3)), path, tiny_target, layer_ids=LAYERS, progress=False, **sizes)
        assert again["note"] == "up to date (reused)" and again["shards"] == first["shards"]
    grown = write_feature_cache(data, path, tiny_target, layer_ids=LAYERS, shard_size=4, progress=False)
    assert grown["note"] == "resuming: 2 finished shard(s) kept"
    assert [(m["first_index"], m["records"]) for m in grown["shards"]] == [(0, 2), (2, 1), (3, 2)]
    assert {f: t for f, t in _mtimes(path).items() if f in before} == before
    cache = FeatureCache.open(path, tiny_target, verify="all")
    fresh = str(tmp_path / "fresh")
    write_feature_cache(data, fresh, tiny_target, layer_ids=LAYERS, shard_size=5, progress=False)
    whole = FeatureCache.open(fresh, tiny_target)
    assert len(cache) == 5
    for i in range(5):
        assert torch.equal(cache[i]["input_ids"], whole[i]["input_ids"])
        assert torch.allclose(cache[i]["hidden"].float(), whole[i]["hidden"].float(), atol=2e-2), i


def test_a_changed_sample_stops_and_restart_recomputes_only_its_shard(tmp_path, data, tiny_target):
    path = str(tmp_path / "cache")
    write_feature_cache(data, path, tiny_target, layer_ids=LAYERS, shard_size=2, progress=False)
    before = _mtimes(path)
    edited = data.map(lambda row, i: {"input_ids": row["input_ids"][:-1] + [7] if i == 3 else row["input_ids"]},
                      with_indices=True)
    with pytest.raises(DraftsmithError, match=r"the inputs of shard 1 are no longer the records it was made from.*"
                                              r"discard 1 finished shard\(s\) \(2 input records\)"):
        write_feature_cache(edited, path, tiny_target, layer_ids=LAYERS, shard_size=2, progress=False)
    again = write_feature_cache(edited, path, tiny_target, layer_ids=LAYERS, shard_size=2, progress=False, restart=True)
    assert again["note"].startswith("--restart: 1 finished shard(s) discarded (the inputs of shard 1")
    after = _mtimes(path)
    assert [f for f in before if after[f] != before[f]] == ["shard-00001.safetensors"]
    assert FeatureCache.open(path, tiny_target)[3]["input_ids"][-1] == 7
