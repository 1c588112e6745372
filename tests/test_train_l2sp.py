"""``train.l2sp_weight``: the pull ½ λ Σ‖w − w₀‖² toward the weights training started from joins each optimizer step's
gradient exactly once, whatever the gradient accumulation; bad settings are refused in one line."""

from __future__ import annotations

import pytest
import torch

from draftsmith.errors import ConfigError
from draftsmith.train.l2sp import L2SP
from draftsmith.train.run import run_training

from .test_train_step import engine_json, read_log, recipe, uneven_data  # noqa: F401 — uneven_data is a fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_penalty_is_half_lambda_times_the_squared_distance_and_its_gradient_lambda_times_it():
    layer = torch.nn.Linear(3, 2)
    layer.bias.requires_grad_(False)  # frozen weights are not pulled
    pull = L2SP(layer, 0.5)
    assert set(pull.start) == {"weight"} and float(pull.penalty().detach()) == 0.0
    start = layer.weight.detach().clone()
    delta = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])
    with torch.no_grad():
        layer.weight.add_(delta)
        layer.bias.add_(7.0)
    r = pull.penalty()
    assert float(r) == pytest.approx(0.5 * 0.5 * float((delta**2).sum()))  # ½ · λ · 15.25
    r.backward()
    assert torch.allclose(layer.weight.grad, 0.5 * delta) and layer.bias.grad is None
    assert pull.distance() == pytest.approx(float((delta**2).sum()) ** 0.5)
    assert torch.equal(pull.start["weight"], start)


def step_inputs(monkeypatch, run) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """(weights before the step, gradients) the optimizer sees at every step, in parameter order."""
    seen: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    real = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        seen.append(([p.detach().clone() for p in params], [p.grad.detach().clone() for p in params]))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    run()
    monkeypatch.undo()
    return seen


def test_the_pull_adds_lambda_times_the_distance_to_each_steps_gradient_once(tmp_path, monkeypatch, tiny_target_dir,
                                                                             uneven_data):  # noqa: F811
    """Two micro-batches per step (gas = 2): the first step starts at w₀ and is the plain run's, bit for bit; at the
    second the gradient is the plain run's plus exactly λ·(w₁ − w₀) (added once, not once per micro-batch), and the
    distance moved is logged."""
    data, _ = uneven_data

    def run(name: str, *extra: str):
        return lambda: run_training(recipe(tmp_path / name, tiny_target_dir, data, "train.batch_size=1", "train.steps=2",
                                           f"train.deepspeed={engine_json(tmp_path, 2)}", "train.optimizer.lr=0.01",
                                           *extra))

    plain = step_inputs(monkeypatch, run("plain"))
    pulled = step_inputs(monkeypatch, run("pulled", "train.l2sp_weight=3.0"))
    assert len(plain) == len(pulled) == 2
    (w0, g0_plain), (w0_again, g0_pulled) = plain[0], pulled[0]
    assert all(torch.equal(a, b) for a, b in zip(w0, w0_again)) and all(torch.equal(a, b) for a, b in zip(g0_plain, g0_pulled))
    (w1, g1_plain), (w1_again, g1_pulled) = plain[1], pulled[1]
    assert all(torch.equal(a, b) for a, b in zip(w1, w1_again))  # the same first step
    moved = [a - b for a, b in zip(w1, w0)]
    assert sum(float(m.abs().sum()) for m in moved) > 0
    for got, base, m in zip(g1_pulled, g1_plain, moved):
        assert torch.allclose(got - base, 3.0 * m, rtol=1e-4, atol=1e-6)
    distances = [r["l2sp_distance"] for r in read_log(tmp_path / "pulled") if "l2sp_distance" in r]
    want = sum(float((m**2).sum()) for m in moved) ** 0.5
    assert distances[0] == pytest.approx(want, rel=1e-5)  # logged after step 1: ‖w₁ − w₀‖
    assert all("l2sp_distance" not in r for r in read_log(tmp_path / "plain"))


def test_zero3_and_a_negative_weight_are_refused_in_one_line(tmp_path, tiny_target_dir, uneven_data):  # noqa: F811
    data, _ = uneven_data
    with pytest.raises(ConfigError, match=r"^train.l2sp_weight pulls the whole drafter toward its start on every rank, "
                                          r"which ZeRO-3 \(train.deepspeed = 'zero3'\) partitions; use zero2"):
        run_training(recipe(tmp_path / "z3", tiny_target_dir, data, "train.l2sp_weight=0.1", "train.deepspeed=zero3"))
    with pytest.raises(ConfigError, match=r"^train.l2sp_weight = -1.0 must be ≥ 0 \(0 = off\)$"):
        run_training(recipe(tmp_path / "neg", tiny_target_dir, data, "train.l2sp_weight=-1"))
