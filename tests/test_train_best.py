"""Training keeps the drafter that serving would pick: ``sim_tau`` (the acceptance length the held-out
per-position acceptance predicts at decode.k) is logged at every held-out evaluation, and the best
one's drafter is ``drafter-best/`` — also across a resume that did not see it being written."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.config import load_recipe
from draftsmith.train import heldout
from draftsmith.train.heldout import sim_tau, simulated_alpha, with_chain_summary
from draftsmith.train.run import run_training

from .test_train_recipes import read_log, tiny_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

EAGLE3 = {"heldout/expected_accept_step0": 0.5, "heldout/expected_accept_step1": 0.4, "heldout/top1_step0": 0.8,
          "heldout/top1_step1": 0.6}


def test_sim_tau_chains_the_conditional_per_step_figures():
    m = {k.split("/")[1]: v for k, v in EAGLE3.items()}
    assert simulated_alpha(m, greedy=True) == ([0.8, 0.6], "top1_step{j}")
    assert simulated_alpha(m, greedy=False) == ([0.5, 0.4], "expected_accept_step{j}")
    # greedy, k = 3: α = 0.8, 0.6, then the last step's 0.6 again (the head drafts on past its unroll)
    assert sim_tau(m, 3, greedy=True) == pytest.approx(1 + 0.8 + 0.8 * 0.6 + 0.8 * 0.6 * 0.6)
    assert sim_tau(m, 1, greedy=False) == pytest.approx(1.5)
    assert sim_tau(m, 4, greedy=False, max_drafts=2) == pytest.approx(1 + 0.5 + 0.2)  # Medusa: two heads, two drafts
    # one teacher-forced figure (EAGLE-1, draft LM) stands for every position
    assert sim_tau({"top1": 0.5, "acceptance": 0.25}, 2, greedy=True) == pytest.approx(1.75)
    assert sim_tau({"loss": 1.0}, 4, greedy=True) == 1.0
    # the old name of the per-step figure is still read
    assert sim_tau({"acceptance_step0": 0.5, "acceptance_step1": 0.4}, 2, greedy=False) == pytest.approx(1.7)
    assert with_chain_summary({"expected_accept_step0": 0.5, "expected_accept_step1": 0.4})["expected_tokens"] == \
        pytest.approx(0.7)


def test_drafter_best_is_the_evaluation_with_the_best_sim_tau_and_loads(tmp_path, tiny_target_dir, tiny_train_data):
    from draftsmith.decode.rounds import speculative_decode
    from draftsmith.decode.reference import target_greedy
    from draftsmith.target import load_target

    recipe = tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "eagle3", "train.steps=4", "train.eval.every=1",
                         "train.ttt_steps=2", "drafter.feature_layers=[0,1,2]", "train.loss.kind=soft_ce",
                         "train.optimizer.lr=0.003", "decode.k=3", "decode.temperature=1.0")
    previous = os.umask(0o022)  # safetensors creates 0600 whatever the umask: a serving user could not read them
    try:
        summary = run_training(recipe)
    finally:
        os.umask(previous)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    assert "drafter-best/model.safetensors" in modes and "drafter/model.safetensors" in modes
    assert {p: m for p, m in modes.items() if m != (0o755 if (tmp_path / p).is_dir() else 0o644)} == {}
    log = [r for r in read_log(tmp_path) if "sim_tau" in r]
    assert [r["step"] for r in log] == [0, 1, 2, 3, 4]  # the untrained head, every step, the end
    # sampled decoding: α_j = held-out E[Σ min(p, q)] at unrolled step j (greedy would take top-1 agreement,
    # 0 for this near-uniform tiny target)
    for r in log:
        a0, a1 = r["heldout/expected_accept_step0"], r["heldout/expected_accept_step1"]
        assert r["sim_tau"] == pytest.approx(1 + a0 + a0 * a1 + a0 * a1 * a1)
    curve = [{"step": r["step"], "sim_tau": r["sim_tau"]} for r in log]
    assert summary["sim_tau_curve"] == curve
    best = max(reversed(curve), key=lambda p: p["sim_tau"])  # the last of equals (the most trained), as the run keeps it
    assert (summary["best"]["step"], summary["best"]["sim_tau"]) == (best["step"], best["sim_tau"])
    assert (summary["best"]["k"], summary["best"]["greedy"]) == (3, False)
    assert len({p["sim_tau"] for p in curve}) > 1  # the curve moved: the pick is not vacuous

    target = load_target(tiny_target_dir, "float32", "cpu")
    saved = load_recipe(None, [f"target.name={tiny_target_dir}", "drafter.type=saved",
                               f"drafter.path={summary['best_drafter']}"])
    drafter = saved.drafter.build(target)
    prompt = target.render_chat([{"role": "user", "content": "Name three colors."}])
    out = speculative_decode(target, drafter, prompt, k=3, max_new_tokens=10)
    assert out.tokens == target_greedy(target, prompt, 10)[: len(out.tokens)]
    final = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    kept = load_file(str(tmp_path / "drafter-best" / "model.safetensors"))
    assert kept.keys() == final.keys()
    same = all(torch.equal(kept[k], final[k]) for k in final)
    assert same == (best["step"] == 4)  # the final weights exactly when the end was best


def scripted_sim_tau(monkeypatch, values: list[float]) -> None:
    """sim_tau returns ``values`` one evaluation after another."""
    queue = list(values)
    monkeypatch.setattr(heldout, "sim_tau", lambda *a, **k: queue.pop(0))


def test_a_resumed_run_keeps_a_better_drafter_best_it_did_not_see_written(tmp_path, monkeypatch, tiny_target_dir,
                                                                        tiny_train_data):
    """Run 1 evaluates steps 0-4 with sim_tau 1.0, 1.5, 1.2, 2.0, 1.1: drafter-best is step 3's. Resumed
    from the step-2 checkpoint (which knew only 1.5), steps 3 and 4 give 1.6 and 1.7 — better than that
    checkpoint's best, worse than drafter-best's 2.0 — and must not replace it. A run started afresh
    replaces it whatever its value."""
    recipe = tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "eagle1", "train.steps=4", "train.eval.every=1",
                         "train.checkpoint.every=2", "train.checkpoint.keep=3", "train.optimizer.lr=0.003")
    scripted_sim_tau(monkeypatch, [1.0, 1.5, 1.2, 2.0, 1.1])
    first = run_training(recipe)
    assert (first["best"]["step"], first["best"]["sim_tau"]) == (3, 2.0)
    weights = tmp_path / "drafter-best" / "model.safetensors"
    step3 = weights.read_bytes()
    assert step3 != (tmp_path / "drafter" / "model.safetensors").read_bytes()

    scripted_sim_tau(monkeypatch, [1.6, 1.7])
    again = run_training(recipe, resume=str(tmp_path / "checkpoints" / "step_00000002"))
    assert (again["best"]["step"], again["best"]["sim_tau"]) == (3, 2.0)
    assert weights.read_bytes() == step3
    assert again["sim_tau_curve"] == [{"step": s, "sim_tau": v} for s, v in enumerate([1.0, 1.5, 1.2, 1.6, 1.7])]
    assert [r["sim_tau"] for r in read_log(tmp_path) if "sim_tau" in r] == [1.0, 1.5, 1.2, 2.0, 1.1, 1.6, 1.7]

    for name in ("checkpoints", "logs"):
        import shutil

        shutil.rmtree(tmp_path / name)
    scripted_sim_tau(monkeypatch, [0.5])
    fresh = run_training(tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "eagle1", "train.steps=2"))
    assert (fresh["best"]["step"], fresh["best"]["sim_tau"]) == (2, 0.5)
    assert weights.read_bytes() == (tmp_path / "drafter" / "model.safetensors").read_bytes()
    assert os.path.isdir(tmp_path / "drafter-best")
