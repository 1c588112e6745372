"""The optimizer step on a tiny target: per-token loss normalization across gradient accumulation,
the learning rate of a resumed run, and the throughput of a run that was resumed."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from draftsmith.config import load_recipe
from draftsmith.data.tokenized import load_tokenized
from draftsmith.train import losses
from draftsmith.train.data import BatchOrder, collate, split_heldout
from draftsmith.train.run import run_training
from draftsmith.train.setup import every_token, lr_lambda

pytestmark = pytest.mark.usefixtures("one_thread")

N, HELDOUT = 12, 4


def recipe(run_dir, target_dir: str, data_dir: str, *extra: str):
    return load_recipe("smollm2-135m-eagle3", [
        f"target.name={target_dir}", "target.dtype=float32", "drafter.feature_layers=[0,1,2]",
        f"train.dataset={data_dir}", "train.max_length=48", f"train.eval.heldout={HELDOUT}", "train.ttt_steps=2",
        "train.loss.kind=soft_ce", "train.logging.wandb=disabled", "train.logging.progress=false",
        "train.logging.every=1", "train.eval.decoder_at_end=false", "train.eval.every=0", f"run_dir={run_dir}",
        "train.group_by_length=0",  # uneven_data places its records by the random order
        *extra,
    ])


def engine_json(tmp_path, gas: int) -> str:
    path = tmp_path / f"zero0_gas{gas}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0}, "bf16": {"enabled": False},
                                "gradient_accumulation_steps": gas, "gradient_clipping": 0.0}))
    return str(path)


@pytest.fixture(scope="module")
def uneven_data(tmp_path_factory, make_tokenized) -> tuple[str, list[int]]:
    """12 records whose first two training micro-batches (batch 1, seed 0) hold a 3-token and a
    40-token answer; the others 10–20. Returns (dataset folder, record lengths)."""
    order = BatchOrder(split_heldout(N, HELDOUT, 0).train, 1, 1, 0, 0)
    short, long = order.at(0)[0], order.at(1)[0]
    g = torch.Generator().manual_seed(1)
    ids, masks = [], []
    for i in range(N):
        answer = 3 if i == short else 40 if i == long else int(torch.randint(10, 21, (1,), generator=g))
        ids.append(torch.randint(100, 600, (4 + answer,), generator=g).tolist())
        masks.append([0] * 4 + [1] * answer)
    return make_tokenized(tmp_path_factory.mktemp("uneven"), ids, masks), [len(x) for x in ids]


def first_step_gradients(monkeypatch, run) -> list[torch.Tensor]:
    """The gradients the optimizer sees at its first step, in parameter order."""
    grads: list[list[torch.Tensor]] = []
    real = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        grads.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"] if p.grad is not None])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    run()
    monkeypatch.undo()
    return grads[0]


def test_summed_losses_are_the_mean_times_the_count_and_zero_when_empty():
    torch.manual_seed(0)
    q, p = torch.randn(5, 7, requires_grad=True), torch.randn(5, 7)
    mask = torch.tensor([True, False, True, True, False])
    for kind in losses.TOKEN_LOSSES:
        for top_k in (0, 2) if kind != "top_k_ce" else (2,):  # with HASS's top-K term beside it too
            mean = losses.token_loss(kind, q, p, mask, top_k=top_k)
            total = losses.token_loss(kind, q, p, mask, reduction="sum", top_k=top_k)
            assert float(total.detach()) == pytest.approx(3 * float(mean.detach()), rel=1e-6), (kind, top_k)
    empty = losses.token_loss("soft_ce", q[:0], p[:0], mask[:0], reduction="sum")
    empty.backward()  # a micro-batch with nothing to learn on this rank: zero gradient, not an error
    assert float(empty) == 0.0 and torch.equal(q.grad, torch.zeros_like(q))
    with pytest.raises(losses.EmptyBatchError):
        losses.token_loss("soft_ce", q[:0], p[:0], mask[:0])


def test_two_micro_batches_give_the_gradient_of_their_concatenation(tmp_path, monkeypatch, tiny_target_dir, uneven_data):
    """A 3-token and a 40-token answer accumulated over two micro-batches (gas=2) give the same
    gradient as one micro-batch holding both: every token weighs the same. (Averaging per
    micro-batch would weigh each of the 3 tokens 13× as much as each of the 40.)"""
    data, _ = uneven_data
    common = ["train.steps=1", "train.feature_noise=0.0"]
    accumulated = first_step_gradients(monkeypatch, lambda: run_training(recipe(
        tmp_path / "gas2", tiny_target_dir, data, "train.batch_size=1", f"train.deepspeed={engine_json(tmp_path, 2)}",
        *common)))
    together = first_step_gradients(monkeypatch, lambda: run_training(recipe(
        tmp_path / "gas1", tiny_target_dir, data, "train.batch_size=2", f"train.deepspeed={engine_json(tmp_path, 1)}",
        *common)))
    assert len(accumulated) == len(together) > 0
    worst = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(accumulated, together))
    assert worst < 1e-4, f"accumulated gradient differs from the concatenation's by up to {worst:.2e} (relative)"
    assert sum(float(g.abs().sum()) for g in together) > 0


def read_log(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "logs", "train.rank0.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, tiny_target_dir, uneven_data) -> dict:
    """Two steps at lr 0.003, then the same run resumed to four steps at lr 0.001 (cosine, warmup 1)."""
    data, _ = uneven_data
    run_dir = tmp_path_factory.mktemp("resumed") / "run"
    args = ["train.batch_size=2", "train.deepspeed=zero0", "train.schedule.kind=cosine", "train.schedule.warmup_steps=1",
            "train.schedule.min_lr_ratio=0.1"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = run_training(recipe(run_dir, tiny_target_dir, data, *args, "train.steps=2", "train.optimizer.lr=0.003"))
        second = run_training(recipe(run_dir, tiny_target_dir, data, *args, "train.steps=4", "train.optimizer.lr=0.001"))
    finally:
        torch.set_num_threads(threads)
    return {"first": first, "second": second, "log": read_log(run_dir)}


def test_a_resumed_run_uses_the_new_learning_rate(resumed):
    lrs = {r["step"]: r["lr"] for r in resumed["log"] if "lr" in r}
    before, after = lr_lambda("cosine", 1, 2, 0.1), lr_lambda("cosine", 1, 4, 0.1)
    assert lrs[1] == pytest.approx(0.003 * before(1), rel=1e-12) and lrs[2] == pytest.approx(0.003 * before(2), rel=1e-12)
    # the schedule continues at step 3 of 4 with the new peak (the checkpoint's 0.003 would give 3× these)
    assert lrs[3] == pytest.approx(0.001 * after(3), rel=1e-12)
    assert lrs[4] == pytest.approx(0.001 * after(4), rel=1e-12)


def test_new_peak_lr_applies_to_the_step_after_resuming():
    """``set_peak_lr`` sets the lr the optimizer uses next (base · λ(current step)), not only the schedule's base."""
    from draftsmith.train.distributed import set_peak_lr

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=0.003)
    factor = lr_lambda("linear", 0, 10, 0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert set_peak_lr(SimpleNamespace(lr_scheduler=scheduler), 0.001) == 0.003
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.001 * factor(4), rel=1e-12)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.001 * factor(5), rel=1e-12)


def test_summary_throughput_covers_the_whole_run_and_this_session(resumed, uneven_data):
    _, lengths = uneven_data
    order = BatchOrder(split_heldout(N, HELDOUT, 0).train, 2, 1, 0, 0)
    tokens = [sum(lengths[i] for i in order.at(s)) for s in range(4)]  # each step's real tokens (≤ max_length)
    first, second = resumed["first"], resumed["second"]
    assert first["tokens"] == sum(tokens[:2]) and second["tokens"] == sum(tokens)
    session = second["session"]
    assert session["steps"] == 2 and session["tokens"] == tokens[2] + tokens[3]
    assert second["run_train_s"] == pytest.approx(first["run_train_s"] + session["train_s"], abs=2e-3)
    # the rates come from the unrounded seconds, the seconds are shown to 1 ms: compare the seconds the rate implies
    assert second["tokens"] / second["run_tokens_per_s"] == pytest.approx(second["run_train_s"], abs=6e-4)
    assert session["tokens"] / session["tokens_per_s"] == pytest.approx(session["train_s"], abs=6e-4)
    assert (first["session"]["steps"], first["session"]["tokens"]) == (2, first["tokens"])  # a fresh run: all of it


def test_eagle3_targets_at_the_loss_rows_are_the_full_targets_shifted():
    """The recipe rebuilds the target's logits only where a loss reads them (positions whose next
    token is an answer token); Targets.at(j) must find, for each head row t kept at step j, the
    target's row t+j+1 — what shift_left(full logits, j+1)[keep] gave when every row was built."""
    from draftsmith.drafters.common import shift_left
    from draftsmith.train.eagle3 import Targets

    torch.manual_seed(0)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool)
    full = torch.randn(2, 8, 11)
    need = shift_left(loss_mask, 1, fill=False)
    index = (need.flatten().long().cumsum(0) - 1).view(need.shape)
    keep = [shift_left(loss_mask, j + 2, fill=False) for j in range(3)]
    t = Targets(full[need], index, keep)
    for j in range(3):
        assert torch.equal(t.logits[t.at(j)], shift_left(full, j + 1)[keep[j]])


def test_token_alignable_mask_drops_the_rows_a_chain_never_reaches():
    """GRIFFIN's mask, by hand: 3 rows at a step, draft vocabulary = target ids [10, 20, 30]; the target's tokens are
    20, 30, 10. Top-1 hits row 0 only; top-2 also row 1 (30 is its second); a row outside the step stays as it was."""
    from draftsmith.train.eagle3 import still_aligned

    alive = torch.tensor([[True, True, True, True]])
    rows = torch.tensor([[True, False, True, True]])  # row-major: columns 0, 2, 3
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 3.0], [0.0, 4.0, 2.0]])  # argmax 20; 10 then 30; 20 then 30
    draft_ids, target = torch.tensor([10, 20, 30]), torch.tensor([20, 30, 10])
    assert still_aligned(alive, rows, logits, draft_ids, target, 1).tolist() == [[True, True, False, False]]
    assert still_aligned(alive, rows, logits, draft_ids, target, 2).tolist() == [[True, True, True, False]]
    assert still_aligned(alive, rows, logits, draft_ids, target, 3).all()
    dead = torch.tensor([[False, True, True, True]])
    assert still_aligned(dead, rows, logits, draft_ids, target, 3).tolist() == [[False, True, True, True]]


def test_every_token_marks_each_real_token_but_the_first():
    batch = collate([{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
                     {"input_ids": [5, 6], "loss_mask": [0, 0]}], pad_id=0, max_length=8)
    widened = every_token(batch)
    assert widened.loss_mask.tolist() == [[False, True, True, True], [False, True, False, False]]
    assert widened.empty_rows == 0 and batch.empty_rows == 1  # the prompt-only record now has a target
    assert batch.loss_mask.tolist() == [[False, False, True, True], [False, False, False, False]]  # not changed


def test_training_on_every_token_is_training_on_records_masked_so(tmp_path, monkeypatch, tiny_target_dir, uneven_data,
                                                                   make_tokenized):
    """``train.loss_positions=all`` gives the first step's gradient of the same records with every token but the first
    in their loss mask; the held-out evaluation still reads the records' own (answer) mask."""
    data, lengths = uneven_data
    ids = [list(r["input_ids"]) for r in load_tokenized(data)]
    widened = make_tokenized(tmp_path / "all", ids, [[0] + [1] * (n - 1) for n in lengths])
    common = ["train.steps=1", "train.batch_size=2", f"train.deepspeed={engine_json(tmp_path, 1)}"]
    every = first_step_gradients(monkeypatch, lambda: run_training(recipe(
        tmp_path / "every", tiny_target_dir, data, "train.loss_positions=all", *common)))
    masked = first_step_gradients(monkeypatch, lambda: run_training(recipe(
        tmp_path / "masked", tiny_target_dir, widened, "train.loss_positions=answer", *common)))
    answers = first_step_gradients(monkeypatch, lambda: run_training(recipe(
        tmp_path / "answers", tiny_target_dir, data, "train.loss_positions=answer", *common)))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(every, masked))
    assert not all(torch.allclose(a, b) for a, b in zip(every, answers))
    baseline = [r for r in read_log(tmp_path / "every") if "heldout/loss" in r][0]
    assert baseline["heldout/loss"] == pytest.approx(
        [r for r in read_log(tmp_path / "answers") if "heldout/loss" in r][0]["heldout/loss"])


@pytest.mark.parametrize("every, logged, saved", [(0, [3], ["step_00000003"]),
                                                  (2, [2, 3], ["step_00000002", "step_00000003"])])
def test_logging_and_checkpoint_cadence_and_0_for_only_the_last_step(tmp_path, tiny_target_dir, uneven_data, every,
                                                                     logged, saved):
    """``train.logging.every`` and ``train.checkpoint.every``: every that many steps and at the end; 0 (documented in
    the fields and their errors) is the last step's log line and checkpoint only, not every step nor none."""
    data, _ = uneven_data
    run_training(recipe(tmp_path, tiny_target_dir, data, "train.steps=3", "train.batch_size=2",
                        "train.deepspeed=zero0", f"train.logging.every={every}", f"train.checkpoint.every={every}",
                        "train.checkpoint.keep=3"))
    lines = [r for r in read_log(tmp_path) if "lr" in r]  # the training lines (held-out ones carry no lr)
    assert [r["step"] for r in lines] == logged
    assert sorted(n for n in os.listdir(tmp_path / "checkpoints") if n.startswith("step_")) == saved


def test_hass_top_k_term_rides_the_eagle3_rows_masks_and_step_weights(tmp_path, monkeypatch, tiny_target_dir,
                                                                      uneven_data):
    """With K the whole vocabulary the top-K term is soft CE itself: as the loss (kind top_k_ce) it gives soft CE's
    first-step gradient, and added beside soft CE at w = 0.5 it gives 1.5 times it — the term goes through the same
    rows, masks and unrolled-step weights (0.5^j here) as the token loss, not around them. At HASS's K = 10 it
    changes the gradient."""
    data, _ = uneven_data
    common = ["train.steps=1", "train.batch_size=2", f"train.deepspeed={engine_json(tmp_path, 1)}",
              "train.loss.step_decay=0.5", "train.loss_positions=all"]

    def grads(name: str, *loss: str) -> list[torch.Tensor]:
        return first_step_gradients(monkeypatch, lambda: run_training(recipe(tmp_path / name, tiny_target_dir, data,
                                                                             *common, *loss)))

    soft = grads("soft", "train.loss.kind=soft_ce")
    alone = grads("alone", "train.loss.kind=top_k_ce", "train.loss.top_k=49152")
    both = grads("both", "train.loss.kind=soft_ce", "train.loss.top_k=49152", "train.loss.top_k_weight=0.5")
    hass = grads("hass", "train.loss.kind=soft_ce", "train.loss.top_k=10")
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(alone, soft))
    assert all(torch.allclose(a, 1.5 * b, rtol=1e-4, atol=1e-7) for a, b in zip(both, soft))
    assert not all(torch.allclose(a, b, rtol=1e-2) for a, b in zip(hass, soft))
