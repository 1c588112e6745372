"""The DFlash2 recipe: the selector's training classes (golden, and the reference's), and on a tiny target in one
process: both losses drop (held-out loss, selector acceptance by block position), the saved drafter decodes exactly
like the target, and bad settings are refused in one line."""

from __future__ import annotations

import pytest
import torch

from draftsmith.config import load_recipe
from draftsmith.errors import ConfigError
from draftsmith.train.dflash2 import candidate_agreement, training_candidates
from draftsmith.train.run import run_training

from .test_train_recipes import decodes_like_the_target, heldout, read_log, tiny_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["drafter.num_layers=1", "drafter.block_size=4", "drafter.feature_layers=[1,2]", "drafter.conv_group_size=8",
        "drafter.selector_rank=16", "drafter.selector_top_k=8", "train.dflash.anchors=8", "train.loss.kind=soft_ce"]


def test_training_candidates_put_a_missing_target_last():
    top = torch.tensor([[4, 7, 1], [4, 7, 1], [9, 2, 5]])
    classes, place = training_candidates(top, torch.tensor([7, 3, 5]))
    assert classes.tolist() == [[4, 7, 1], [4, 7, 3], [9, 2, 5]] and place.tolist() == [1, 2, 2]
    assert top.tolist()[1] == [4, 7, 1]  # the runtime's candidates are left alone


def test_training_candidates_are_the_references():
    from speculators.models.dflash2.metrics import selector_training_candidates

    gen = torch.Generator().manual_seed(0)
    top = torch.stack([torch.randperm(50, generator=gen)[:6] for _ in range(40)])
    target = torch.randint(0, 50, (40,), generator=gen)
    theirs, place, _ = selector_training_candidates(top, target)
    ours = training_candidates(top, target)
    assert torch.equal(ours[0], theirs) and torch.equal(ours[1], place)


def test_candidate_agreement_is_the_overlap_of_q_over_the_candidates_with_p():
    p = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]]))
    candidates = torch.tensor([[1, 0], [0, 2]])
    scores = torch.log(torch.tensor([[0.75, 0.25], [0.5, 0.5]]))  # q = (0.25 at 0, 0.75 at 1) and (0.5, ·, 0.5, ·)
    accept, top1 = candidate_agreement(scores, candidates, p)
    torch.testing.assert_close(accept, torch.tensor([0.25 + 0.2, 0.1 + 0.1]))
    assert top1.tolist() == [False, False]
    assert candidate_agreement(scores.flip(-1), candidates, p)[1].tolist() == [True, False]


def test_dflash2_learns_and_saves_a_drafter_that_decodes_like_the_target(tmp_path, tiny_target_dir, tiny_train_data):
    summary = run_training(tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "dflash2", "train.steps=10",
                                       "train.eval.every=5", "train.optimizer.lr=0.003", *ARGS))
    log = read_log(tmp_path)
    loss, first = heldout(log, "loss"), heldout(log, "expected_accept_step0")
    assert len(loss) == 3 and loss[-1] < loss[0], loss
    assert first[-1] > first[0], first
    assert len(heldout(log, "top1_step2")) == 3 and "heldout/expected_accept_step3" not in log[-1]
    assert {"heldout/block_tau", "heldout/candidate_recall", "sim_tau"} <= set(log[-1])
    steps = [r for r in log if "selector_loss/pos1" in r]
    assert steps and steps[-1]["selector_loss/pos1"] < steps[0]["selector_loss/pos1"], steps  # the selector learns too
    assert summary["method"] == "dflash2" and summary["steps"] == 10
    drafter = decodes_like_the_target(summary["drafter"], tiny_target_dir, k=3)
    assert drafter.config.selector_top_k == 8 and drafter.module.block_size == 4


def test_bad_dflash2_settings_are_refused_in_one_line():
    for overrides, field in ((["train.dflash2.selector_alpha=-1"], "train.dflash2.selector_alpha"),
                             (["drafter.conv_kernel_size=9"], "drafter.conv_kernel_size")):
        with pytest.raises(ConfigError, match=field) as e:
            load_recipe(None, ["drafter.type=dflash2", *overrides])
        assert "\n" not in str(e.value)
