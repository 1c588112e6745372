"""The P-EAGLE recipe: COD sampling (golden layout, the reference's rollout invariants and depth counts), and on a
tiny target in one process: it learns (held-out loss and acceptance by depth), saves a drafter that decodes exactly
like the target, and refuses bad settings in one line."""

from __future__ import annotations

import pytest
import torch

from draftsmith.config import load_recipe
from draftsmith.errors import ConfigError
from draftsmith.train.peagle import cod_layout
from draftsmith.train.run import run_training

from .test_train_recipes import decodes_like_the_target, heldout, read_log, tiny_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["drafter.feature_layers=[0,1,3]", "drafter.num_depths=4", "train.loss.kind=soft_ce"]


def entries(anchor: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor, row: int = 0) -> set[tuple[int, int, bool]]:
    return {(int(a), int(d), bool(v)) for a, d, v in zip(anchor[row], depth[row], valid[row]) if a >= 0}


def test_cod_layout_golden_when_every_rollout_is_kept():
    """Answer tokens x_3 … x_7 of 9 (x_8 is a prompt token): rows 1 … 5 predict one (x_{p+2}). With ratio 1 and
    ratio_min 1, depth d keeps all but d of the 5 seeds' n − d: the rollouts that reach depth d are those of the
    rows p − d whose p stays valid, the first dropped at random at depth 1 (5 seeds, 4 kept)."""
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    anchor, depth, valid = cod_layout(loss_mask, None, 4, 1.0, 1.0, 0, torch.Generator().manual_seed(0))
    got = entries(anchor, depth, valid)
    assert {(a, 0) for a, d, _ in got if d == 0} == {(a, 0) for a in range(9)}
    assert {a for a, d, v in got if d == 0 and v} == {1, 2, 3, 4, 5}
    per_depth = [sorted(a for a, d, _ in got if d == k) for k in range(4)]
    assert [len(x) for x in per_depth[1:]] == [4, 3, 2]  # n_d = (5 − d) · 1
    for k in range(1, 4):  # a rollout at depth k continues one at depth k − 1, and predicts an answer token
        assert all(a + k <= 5 and (k == 1 or a in per_depth[k - 1]) for a in per_depth[k]), per_depth
    assert all(v for _, d, v in got if d > 0)


def test_cod_layout_counts_per_depth_are_the_references():
    from speculators.models.peagle.data import generate_cod_sample_indices

    loss_mask = torch.zeros(1, 64, dtype=torch.bool)
    loss_mask[0, 10:60] = True
    ours_ok = torch.zeros(64)
    ours_ok[8:58] = 1  # the reference's mask is over the rows that count: ours shifted by 2
    for seed in range(3):  # 7 depths: each depth's pool is larger than what it keeps, so the counts are fixed
        anchor, depth, valid = cod_layout(loss_mask, None, 7, 0.7, 0.2, 0, torch.Generator().manual_seed(seed))
        torch.manual_seed(seed)
        _, theirs = generate_cod_sample_indices(64, ours_ok[None], num_depths=7)
        assert torch.bincount(depth[0][anchor[0] >= 0]).tolist() == torch.bincount(theirs).tolist()
    few, d, v = cod_layout(loss_mask, None, 8, 0.7, 0.2, 5, torch.Generator().manual_seed(0))
    assert int((d[0][few[0] >= 0] == 1).sum()) == 2  # max_anchors = 5 seeds: ⌊(5 − 1) · 0.7⌋ rollouts at depth 1


def test_cod_layout_pads_a_batch_and_leaves_padding_out():
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    attention = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    anchor, depth, valid = cod_layout(loss_mask, attention, 3, 1.0, 1.0, 0, torch.Generator().manual_seed(1))
    assert anchor.shape == depth.shape == valid.shape and anchor.shape[0] == 2
    # row 1: rows 0 and 1 predict answer tokens x_2, x_3; one rollout (anchor 0) reaches depth 1 (it predicts x_3)
    assert entries(anchor, depth, valid, 1) == {(0, 0, True), (1, 0, True), (2, 0, False), (3, 0, False), (0, 1, True)}
    assert not valid[anchor < 0].any()


def test_peagle_learns_and_saves_a_drafter_that_decodes_like_the_target(tmp_path, tiny_target_dir, tiny_train_data):
    summary = run_training(tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "peagle", "train.steps=10",
                                       "train.eval.every=5", "train.optimizer.lr=0.003", *ARGS))
    log = read_log(tmp_path)
    loss, first, last = heldout(log, "loss"), heldout(log, "expected_accept_step0"), heldout(log, "top1_step3")
    assert len(loss) == 3 and loss[-1] < loss[0], loss
    assert first[-1] > first[0], first
    assert len(last) == 3 and "heldout/expected_accept_step4" not in log[-1]  # a figure per depth (K = 4)
    assert "sim_tau" in log[-1] and summary["method"] == "peagle" and summary["steps"] == 10
    assert {"loss/depth0", "loss/depth3"} <= {k for r in log for k in r}

    drafter = decodes_like_the_target(summary["drafter"], tiny_target_dir, k=4)
    assert drafter.config.num_depths == 4 and drafter.config.feature_layers == [0, 1, 3]


@pytest.mark.parametrize("override, field", [
    ("train.peagle.down_sample_ratio=0", "train.peagle.down_sample_ratio"),
    ("train.peagle.down_sample_ratio_min=1.5", "train.peagle.down_sample_ratio_min"),
    ("train.peagle.max_anchors=-1", "train.peagle.max_anchors"),
    ("drafter.num_depths=0", "drafter.num_depths"),
    ("drafter.norm_output=true", "drafter.norm_output"),
])
def test_bad_settings_are_refused_in_one_line(override, field):
    with pytest.raises(ConfigError, match=field) as e:
        load_recipe("smollm2-135m-peagle", [override])
    assert "\n" not in str(e.value)
