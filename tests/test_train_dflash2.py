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


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_the_selector_loss_is_the_references_under_either_position_weighting(weighting):
    """``train.dflash.weighting``: the selector's CE weighed as speculators' ``compute_selector_loss`` weighs it (per
    valid row, over the valid rows): the unary weights under decay, D-PACE from the selector's own confidence under
    dpace. Blocks of 4 (the anchor and one more row out), scores wide enough for the two weightings to differ."""
    from speculators.models.dflash2.metrics import compute_selector_loss

    from draftsmith.train.dflash import position_weights
    from draftsmith.train.dflash2 import selector_loss

    gen = torch.Generator().manual_seed(0)
    blocks, bs, top_k = 3, 4, 5
    scores = torch.randn(blocks * bs, top_k, generator=gen) * 3  # [N·Bs, K]
    place = torch.randint(0, top_k, (blocks * bs,), generator=gen)
    valid = torch.ones(1, blocks, bs, dtype=torch.bool)
    valid[..., 0] = False  # the anchors
    valid[0, 1, 2] = False  # a row past the answer
    rows = valid.flatten()
    w = torch.tensor(position_weights(bs, 4.0))[torch.arange(bs).repeat(blocks)][rows]  # the decay's (unary) weights
    ours, ce = selector_loss(scores[rows], place[rows], valid, w, weighting, 0.3)
    theirs = compute_selector_loss(scores[None], place[None], rows[None].float(), bs, gamma=4.0, dpace_alpha=0.3,
                                   per_position_loss_weight="dpace" if weighting == "dpace" else "fixed-exp-decay")
    torch.testing.assert_close(ours / rows.sum(), theirs)
    other = selector_loss(scores[rows], place[rows], valid, w, "decay" if weighting == "dpace" else "dpace", 0.3)[0]
    assert abs(float(other - ours)) > 0.1 * float(ours)  # the branch is what makes it equal
    assert ce.shape == (int(rows.sum()),)


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
