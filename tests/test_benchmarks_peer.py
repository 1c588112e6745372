"""``benchmarks/peer.py``: what speculators' own data pipeline reads from the converted folder is draftsmith's
records to the token — the same ids, loss mask, the three feature layers in order, and the target's last layer as
speculators' verifier state, aligned by speculators' own ``shift_batch``."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from draftsmith.data.feature_cache import FeatureCache, write_feature_cache
from draftsmith.data.tokenized import load_tokenized
from draftsmith.target import load_target

from .conftest import benchmark_script

pytestmark = pytest.mark.usefixtures("one_thread")


def test_speculators_reads_back_draftsmiths_records(tmp_path, tiny_target_dir, tiny_train_data):
    pytest.importorskip("speculators")
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset

    peer = benchmark_script("peer")
    try:
        target = load_target(tiny_target_dir, "float32", "cpu")
        cache = str(tmp_path / "features")
        write_feature_cache(load_tokenized(tiny_train_data, target), cache, target, layer_ids=[2, 0, 1, 3], progress=False)
        rows = FeatureCache.open(cache, target)
        vd = 100
        d2t, t2d = torch.zeros(vd, dtype=torch.long), torch.arange(target.vocab_size) < vd
        data = peer.Data(rows, heldout=[0], batches=[[1, 2]], layers=(0, 1, 2), d2t=d2t, t2d=t2d)
        out, cut = str(tmp_path / "speculators-data"), 20
        peer.convert(data, SimpleNamespace(train=SimpleNamespace(max_length=cut)), target, out)
        ds = ArrowDataset(max_len=0, datapath=out, on_missing="raise", train_ratio=1.0, split="train")
        assert len(ds) == len(rows)
        h = target.hidden_size
        for i in (0, 7, len(rows) - 1):
            got, row = shift_batch(ds[i]), rows[i]
            x, mask, hidden = row["input_ids"][:cut], row["loss_mask"][:cut], row["hidden"][:cut]  # cache: layers 2, 0, 1, 3
            layer = {n: hidden[:, c * h:(c + 1) * h] for c, n in enumerate([2, 0, 1, 3])}
            assert torch.equal(got["input_ids"], x[1:]) and torch.equal(got["loss_mask"], mask[1:])
            assert torch.equal(got["hidden_states"], torch.cat([layer[0], layer[1], layer[2]], -1)[:-1])  # g_t beside x_{t+1}
            assert torch.equal(got["verifier_last_hidden_states"], layer[3][1:])  # the target at t+1: x_{t+2}'s p
    finally:
        del sys.modules["draftsmith_bench_peer"]
