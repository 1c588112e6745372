"""Draft-OPD's on-policy states replayed offline (``train.replay_weight``): the (row, step) pairs greedy chains reach on
hand-built acceptance patterns (exact masks), the key's checks, and the EAGLE-3 recipe with it on (the weights land
on exactly the pairs chains reach, the unweighted parts stay those without it, the shares are logged)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from draftsmith.config import load_recipe
from draftsmith.errors import ConfigError
from draftsmith.train import eagle3
from draftsmith.train.eagle3 import reached_by_chains
from draftsmith.train.run import run_training

pytestmark = pytest.mark.usefixtures("one_thread")


def rows(mask: torch.Tensor) -> list[list[int]]:
    """[B, S] bool → per sequence, the rows set."""
    return [torch.nonzero(m).flatten().tolist() for m in mask]


def test_chains_of_two_on_hand_built_acceptance():
    """Sequence 0: the round at row 0 accepts both drafts (next round at 3), the round at 3 misses its second draft
    (drafted, next at 5), the round at 5 misses its first (next at 6), the round at 6 accepts both and runs past the
    end. Sequence 1: every first draft missed: a round at every row, no second draft. Sequence 2: every draft right."""
    step0 = torch.tensor([[1, 1, 0, 1, 0, 0, 1, 1], [0] * 8, [1] * 8], dtype=torch.bool)
    step1 = torch.tensor([[1, 0, 0, 0, 1, 1, 1, 0], [1] * 8, [1] * 8], dtype=torch.bool)
    reached = reached_by_chains([step0, step1])
    assert len(reached) == 2 and all(r.dtype == torch.bool and r.shape == (3, 8) for r in reached)
    assert rows(reached[0]) == [[0, 3, 5, 6], list(range(8)), [0, 3, 6]]
    assert rows(reached[1]) == [[0, 3, 6], [], [0, 3, 6]]


def test_chains_of_one_and_three():
    """K = 1: an accepted draft skips the next row (the target's bonus token follows it). K = 3: the round at 0 takes
    all three (next at 4), the one at 4 misses its third draft (drafted) and the next starts at 7."""
    one = reached_by_chains([torch.tensor([[1, 0, 1, 1, 0, 1]], dtype=torch.bool)])
    assert rows(one[0]) == [[0, 2, 4, 5]]
    ok = [torch.tensor([[1, 0, 0, 0, 1, 0, 0, 0]], dtype=torch.bool),
          torch.tensor([[1, 0, 0, 0, 1, 0, 0, 0]], dtype=torch.bool),
          torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)]
    assert [rows(r)[0] for r in reached_by_chains(ok)] == [[0, 4, 7], [0, 4], [0, 4]]


def test_the_key_is_checked_and_eagle3s():
    with pytest.raises(ConfigError, match=r"^train.replay_weight = -1.0 must be ≥ 0 \(0 = off\)$"):
        load_recipe(None, ["train.replay_weight=-1"])
    assert load_recipe(None, []).train.replay_weight == 0.0  # off by default
    with pytest.raises(ConfigError, match=r"^train.replay_weight is read by the eagle3 recipe\(s\) only: "
                                          r"drafter.type = 'dflash' would ignore it"):
        run_training(load_recipe("smollm2-135m-dflash", ["run_dir=unused", "train.replay_weight=1"]))


def train_log(run_dir, target_dir: str, data_dir: str, vocab: str, *extra: str) -> list[dict]:
    """Two steps of the EAGLE-3 recipe on the tiny target (two TTT steps, every token a target, a reduced draft
    vocabulary); the loss lines of its log."""
    run_training(load_recipe(None, [
        f"target.name={target_dir}", "target.dtype=float32", "drafter.type=eagle3", "drafter.feature_layers=[0,1,2]",
        f"drafter.draft_vocab={vocab}", f"train.dataset={data_dir}", "train.batch_size=4", "train.max_length=48",
        "train.eval.heldout=8", "train.deepspeed=zero0", "train.logging.wandb=disabled", "train.logging.progress=false",
        "train.logging.every=1", "train.ttt_steps=2", "train.loss_positions=all", "train.steps=2",
        "train.optimizer.lr=0.003", "train.eval.decoder_at_end=false", f"run_dir={run_dir}", *extra]))
    with open(os.path.join(run_dir, "logs", "train.rank0.jsonl")) as f:
        return [{k: v for k, v in r.items() if "loss" in k or "replay" in k} for r in map(json.loads, f)]


def test_the_weights_land_on_the_pairs_chains_reach(tmp_path, monkeypatch, tiny_target_dir, tiny_train_data,
                                                     draft_vocab):
    """With every pair reached, every row weighs 1 + λ: the first step's total is (1 + λ) times the one without
    replay, its unweighted parts are the same and its shares are 1; with none reached it is the total without replay.
    With the real walk the untrained head's chains reach fewer second drafts than first ones, and the weights change
    the second step (their gradient was used). The held-out loss stays unweighted: uniform weights (every pair) leave
    Adam's steps as they were, so the held-out loss after them is the one without replay."""
    data = (tiny_target_dir, tiny_train_data, draft_vocab)
    off = train_log(tmp_path / "off", *data)
    real = train_log(tmp_path / "real", *data, "train.replay_weight=2")
    calls: list[list[tuple[int, ...]]] = []

    def every_pair(correct):
        calls.append([tuple(c.shape) for c in correct])
        return [torch.ones_like(c) for c in correct]

    monkeypatch.setattr(eagle3, "reached_by_chains", every_pair)
    every = train_log(tmp_path / "every", *data, "train.replay_weight=2")
    monkeypatch.setattr(eagle3, "reached_by_chains", lambda correct: [torch.zeros_like(c) for c in correct])
    none = train_log(tmp_path / "none", *data, "train.replay_weight=2")

    assert calls and all(len(c) == 2 and c[0] == c[1] for c in calls)  # one [B, S] mask per unrolled step
    assert [len(log) for log in (off, real, every, none)] == [3, 3, 3, 3]  # steps 1, 2, then the held-out figures
    first_off, first_every, first_none, first_real = off[0], every[0], none[0], real[0]
    assert first_every["loss"] == pytest.approx(3.0 * first_off["loss"], rel=1e-6)
    assert first_none["loss"] == pytest.approx(first_off["loss"], rel=1e-6)
    for j in range(2):
        for run in (first_every, first_none, first_real):
            assert run[f"loss/step{j}"] == pytest.approx(first_off[f"loss/step{j}"], rel=1e-6)
        assert first_every[f"replay/step{j}"] == 1.0 and first_none[f"replay/step{j}"] == 0.0
        assert f"replay/step{j}" not in first_off
    assert 0.0 <= first_real["replay/step1"] < first_real["replay/step0"] <= 1.0
    assert first_off["loss"] < first_real["loss"] < first_every["loss"]
    assert real[1]["loss/step0"] != pytest.approx(off[1]["loss/step0"], rel=1e-6)
    assert sorted(k for k in real[2] if "loss" in k) == ["heldout/loss"]  # unweighted: comparable with the other's
    assert real[2]["heldout/loss"] != pytest.approx(off[2]["heldout/loss"], rel=1e-6)
    assert every[2]["heldout/loss"] == pytest.approx(off[2]["heldout/loss"], rel=1e-5)  # uniform weights: Adam's step
