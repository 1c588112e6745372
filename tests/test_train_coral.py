"""CORAL's cross-step representation alignment (``train.coral_weight``): the InfoNCE term on hand-built states (golden
value, masking, its minimum, where its gradient goes), the key's checks, and the EAGLE-3 recipe with it off (the
training of before, to the last digit) and on (every lever it must work beside: TTT, every token, feature noise,
a reduced draft vocabulary, GRIFFIN's mask)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from draftsmith.config import load_recipe
from draftsmith.errors import ConfigError
from draftsmith.train.losses import cross_step_alignment
from draftsmith.train.run import run_training

pytestmark = pytest.mark.usefixtures("one_thread")


def hand_built() -> tuple[torch.Tensor, torch.Tensor]:
    """Two steps, one sequence, rows 0 and 1, H = 2: step 0 = ([1, 0], [0, 1]), step 1 = ([1, 1], [0, 3]); all counted.
    Returns (states [2, 1, 2, 2], mask [2, 1, 2])."""
    states = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]], [[[1.0, 1.0], [0.0, 3.0]]]])
    return states, torch.ones(2, 1, 2, dtype=torch.bool)


def test_golden_value_on_a_hand_built_case():
    """Views a = (step 0, row 0), b = (0, 1), c = (1, 0), d = (1, 1); cosines: a·c = b·c = c·d = 1/√2 = s, b·d = 1,
    a·b = a·d = 0. τ = 1: anchor a picks c among {b, c, d}: log(2 + e^s) − s; c picks a among {a, b, d}, all at s:
    log 3; b picks d among {a, c, d}: log(1 + e^s + e) − 1, and d picks b the same. Row 0 is the mean of a's and c's,
    row 1 of b's and d's."""
    s = 1 / math.sqrt(2)
    row0 = (math.log(2 + math.exp(s)) - s + math.log(3)) / 2
    row1 = math.log(1 + math.exp(s) + math.e) - 1
    states, mask = hand_built()
    assert float(cross_step_alignment(states, mask, temperature=1.0)) == pytest.approx(row0 + row1, rel=1e-6)
    assert float(cross_step_alignment(states, mask, temperature=1.0)) == pytest.approx(1.6409750304, rel=1e-6)
    assert float(cross_step_alignment(states, mask, 1.0, reduction="mean")) == pytest.approx((row0 + row1) / 2, rel=1e-6)
    # τ sharpens it: at τ = 0.5 every similarity doubles
    sharp = (math.log(2 + math.exp(2 * s)) - 2 * s + math.log(3)) / 2 + math.log(1 + math.exp(2 * s) + math.e ** 2) - 2
    assert float(cross_step_alignment(states, mask, temperature=0.5)) == pytest.approx(sharp, rel=1e-6)


def test_only_the_counted_views_take_part():
    """A third step whose views are all masked out, and a padded row counted nowhere, change nothing; a row counted at
    one step only has no positive (no loss of its own) but is a negative of the others."""
    states, mask = hand_built()
    expected = float(cross_step_alignment(states, mask, 1.0))
    junk = torch.randn(1, 1, 2, 2)
    padded = torch.cat([torch.cat([states, junk]), torch.randn(3, 1, 1, 2)], dim=2)  # [3, 1, 3, 2]: step 2, row 2
    padded_mask = torch.zeros(3, 1, 3, dtype=torch.bool)
    padded_mask[:2, :, :2] = True
    assert float(cross_step_alignment(padded, padded_mask, 1.0)) == pytest.approx(expected, rel=1e-6)
    # row 1 counted at step 0 only: row 0 alone has a loss, with b = [0, 1] as its only negative
    one_step = mask.clone()
    one_step[1, 0, 1] = False
    s = 1 / math.sqrt(2)
    # anchor a = [1, 0] picks c (cos s) among b (cos 0) and c; anchor c = [1, 1] picks a (cos s) among a and b (cos s)
    row0 = ((math.log(1 + math.exp(s)) - s) + math.log(2)) / 2
    assert float(cross_step_alignment(states, one_step, 1.0)) == pytest.approx(row0, rel=1e-6)
    assert float(cross_step_alignment(states, torch.zeros_like(mask), 1.0)) == 0.0  # nothing to align: a sum of nothing


def test_equal_states_across_steps_are_its_minimum():
    """With every step's state equal at each row (and the rows orthogonal), the term is 0 up to the negatives'
    exp(−1/τ) share, and its gradient vanishes; moving one step's state off raises it. One row over two equal steps,
    nothing to contrast, is exactly 0."""
    rows = torch.eye(4)  # [S=4, H=4], orthogonal rows
    equal = rows.expand(3, 1, 4, 4).clone().requires_grad_(True)  # [K=3, B=1, S=4, H=4]
    mask = torch.ones(3, 1, 4, dtype=torch.bool)
    loss = cross_step_alignment(equal, mask, temperature=0.05)
    loss.backward()
    loss = loss.detach()
    # each anchor: 2 positives at cos 1, 9 negatives at cos 0; SupCon's floor with 2 equal positives is log 2
    floor = 4 * math.log(2)
    assert float(loss) == pytest.approx(floor + 4 * 9 * math.exp(-20) / 2, rel=1e-6)
    assert float(equal.grad.abs().max()) < 1e-6
    moved = equal.detach().clone()
    moved[2, 0, 0] = torch.tensor([1.0, 0.3, 0.0, 0.0])
    assert float(cross_step_alignment(moved, mask, temperature=0.05)) > float(loss) + 1e-3
    one_row = torch.tensor([0.3, -1.2, 2.0]).expand(2, 1, 1, 3)
    assert float(cross_step_alignment(one_row, torch.ones(2, 1, 1, dtype=torch.bool))) == 0.0


def test_gradient_reaches_every_counted_view_and_no_other():
    """No side is detached (the paper's views are symmetric, as in SimCLR): the teacher-forced step 0 and the unrolled
    steps both move towards each other; views the token loss does not count get exactly zero gradient."""
    torch.manual_seed(0)
    states = torch.randn(3, 2, 5, 8, requires_grad=True)  # [K, B, S, H]
    mask = torch.rand(3, 2, 5) > 0.3
    mask[:, 0, 0] = True  # row 0 of sequence 0 counted at every step
    cross_step_alignment(states, mask, temperature=0.1).backward()
    norms = states.grad.norm(dim=-1)  # [K, B, S]
    assert bool((norms[~mask] == 0).all())
    has_positive = mask & (mask.sum(0, keepdim=True) >= 2)
    assert bool((norms[has_positive] > 0).all())
    assert float(norms[0, 0, 0]) > 0 and float(norms[2, 0, 0]) > 0  # step 0's state learns as the unrolled ones do
    # in float32 whatever the states' dtype: a bf16 head gets a float32 value, its gradient in bf16
    half = states.detach().bfloat16().requires_grad_(True)
    value = cross_step_alignment(half, mask, temperature=0.1)
    value.backward()
    assert value.dtype == torch.float32 and half.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("override, message", [
    ("train.coral_weight=-0.1", "train.coral_weight = -0.1 must be ≥ 0 (0 = off)"),
    ("train.coral_weight=nan", "'train.coral_weight' must be a finite number, got nan"),  # schema.py, every float
    ("train.coral_temperature=0", "train.coral_temperature = 0.0 must be > 0"),
])
def test_a_bad_weight_or_temperature_is_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_recipe(None, [override])
    assert str(e.value) == message


def test_alignment_without_a_second_step_is_refused():
    with pytest.raises(ConfigError, match=r"^train.coral_weight = 0.1 aligns .* it needs train.ttt_steps ≥ 2, got 1$"):
        load_recipe(None, ["train.coral_weight=0.1", "train.ttt_steps=1"])
    assert load_recipe(None, ["train.coral_weight=0.1", "train.ttt_steps=2"]).train.coral_weight == 0.1
    assert load_recipe(None, []).train.coral_weight == 0.0  # off by default


def train_log(run_dir, target_dir: str, data_dir: str, vocab: str, *extra: str) -> list[dict]:
    """Two steps of the EAGLE-3 recipe on the tiny target with every lever CORAL must work beside: a third TTT step,
    every token a target, feature noise, a reduced draft vocabulary; the loss lines of its log."""
    run_training(load_recipe(None, [
        f"target.name={target_dir}", "target.dtype=float32", "drafter.type=eagle3", "drafter.feature_layers=[0,1,2]",
        f"drafter.draft_vocab={vocab}", f"train.dataset={data_dir}", "train.batch_size=4", "train.max_length=48",
        "train.eval.heldout=8", "train.deepspeed=zero0", "train.logging.wandb=disabled", "train.logging.progress=false",
        "train.logging.every=1", "train.ttt_steps=3", "train.loss_positions=all", "train.feature_noise=0.05",
        "train.steps=2", "train.optimizer.lr=0.003", "train.eval.decoder_at_end=false", f"run_dir={run_dir}", *extra]))
    with open(os.path.join(run_dir, "logs", "train.rank0.jsonl")) as f:
        return [{k: v for k, v in r.items() if "loss" in k} for r in map(json.loads, f)]


BEFORE_CORAL = [
    {"loss": 8.506457407540138, "loss/step0": 4.562454586937314, "loss/step1": 4.547901199524661,
     "loss/step2": 4.610843565405869},
    {"loss": 8.950079824410233, "loss/step0": 5.063829752604167, "loss/step1": 5.02554651208826,
     "loss/step2": 5.042992160744863},
    {"heldout/loss": 8.662521077979425},
]
""":func:`train_log`'s losses at 670994f, the commit before CORAL (equal to the last digit on the machine that wrote
this test; the tolerance below is for other CPUs' float rounding only)."""


def test_weight_0_trains_as_before(tmp_path, tiny_target_dir, tiny_train_data, draft_vocab):
    log = train_log(tmp_path, tiny_target_dir, tiny_train_data, draft_vocab, "train.coral_weight=0")
    assert [sorted(r) for r in log] == [sorted(r) for r in BEFORE_CORAL]  # no loss/coral part either
    for got, want in zip(log, BEFORE_CORAL):
        assert got == {k: pytest.approx(v, rel=1e-9) for k, v in want.items()}


@pytest.mark.parametrize("extra", [[], ["train.align_top_k=600"]])  # GRIFFIN: the untrained head keeps ~⅓ of the rows
def test_the_recipe_adds_the_term_beside_every_lever(tmp_path, monkeypatch, tiny_target_dir, tiny_train_data,
                                                      draft_vocab, extra):
    """The term reads exactly the rows the token loss counts at each step (out of the draft vocabulary and, with
    GRIFFIN's mask, past a miss: dropped from both). The untrained head's held-out loss and the first step's token
    losses are those without it (same weights, same noise) and the totals grow by the term, ``loss/coral`` is logged,
    and the second step differs (its gradient was used)."""
    from draftsmith.train import losses

    token_rows: list[int] = []
    view_rows: list[list[int]] = []
    token_loss, alignment = losses.token_loss, losses.cross_step_alignment

    def counting_token_loss(kind, draft_logits, target_logits, mask, *args, **kwargs):
        token_rows.append(int(mask.sum()))
        return token_loss(kind, draft_logits, target_logits, mask, *args, **kwargs)

    def counting_alignment(states, mask, *args, **kwargs):
        view_rows.append(mask.sum((1, 2)).tolist())
        return alignment(states, mask, *args, **kwargs)

    off = train_log(tmp_path / "off", tiny_target_dir, tiny_train_data, draft_vocab, "train.eval.every=2", *extra)
    monkeypatch.setattr(losses, "token_loss", counting_token_loss)
    monkeypatch.setattr(losses, "cross_step_alignment", counting_alignment)
    on = train_log(tmp_path / "on", tiny_target_dir, tiny_train_data, draft_vocab, "train.eval.every=2",
                   "train.coral_weight=0.1", *extra)
    assert len(view_rows) > 2 and token_rows == [n for rows in view_rows for n in rows]  # every objective, every step
    assert any(rows[2] < rows[0] for rows in view_rows)  # steps do count different rows
    steps = ["loss", "loss/step0", "loss/step1", "loss/step2"]
    assert [sorted(r) for r in off] == [["heldout/loss"], steps, steps, ["heldout/loss"]]
    (base_on, first_on, second_on, _), (base_off, first_off, second_off, _) = on, off
    assert base_on["heldout/loss"] > base_off["heldout/loss"]  # step 0: the same head, its objective with the term
    for j in range(3):
        assert first_on[f"loss/step{j}"] == pytest.approx(first_off[f"loss/step{j}"], rel=1e-12)
    assert 0 < first_on["loss/coral"] < math.inf
    assert first_on["loss"] > first_off["loss"]
    assert second_on["loss/step0"] != pytest.approx(second_off["loss/step0"], rel=1e-9)
