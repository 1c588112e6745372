"""The DFlash recipe on a tiny target: it learns (held-out loss and acceptance by block position), keeps
the best drafter by simulated τ, resumes exactly, trains offline from the feature cache like online,
and under a bf16 ZeRO-2 engine; with a reduced draft vocabulary and D-PACE weights (golden values)."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.target import load_target
from draftsmith.train.dflash import dpace_weights
from draftsmith.train.run import run_training

from .test_train_recipes import heldout, read_log, tiny_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["drafter.num_layers=1", "drafter.block_size=4", "drafter.feature_layers=[1,2]", "train.dflash.anchors=8",
        "train.loss.kind=soft_ce"]


def test_dflash_learns_and_saves_a_drafter_that_decodes_like_the_target(tmp_path, tiny_target_dir, tiny_train_data):
    from draftsmith.decode.rounds import speculative_decode
    from draftsmith.drafters import load
    from draftsmith.decode.reference import target_greedy

    summary = run_training(tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "dflash", "train.steps=10",
                                       "train.eval.every=5", "train.optimizer.lr=0.003", *ARGS))
    log = read_log(tmp_path)
    loss, first, second = heldout(log, "loss"), heldout(log, "expected_accept_step0"), heldout(log, "top1_step2")
    assert len(loss) == 3 and loss[-1] < loss[0], loss
    assert first[-1] > first[0], first
    assert len(second) == 3  # a figure per block position (Bs − 1 = 3)
    assert "heldout/expected_accept_step3" not in log[-1]
    assert {"heldout/block_tau", "sim_tau"} <= set(log[-1]) and log[-1]["heldout/block_tau"] >= 1.0
    assert summary["method"] == "dflash" and summary["steps"] == 10
    assert {"loss/pos1", "loss/pos3"} <= {k for r in log for k in r}

    target = load_target(tiny_target_dir, "float32", "cpu")
    drafter = load(summary["drafter"], target)
    assert drafter.config.feature_layers == [1, 2] and drafter.module.block_size == 4
    prompt = target.render_chat([{"role": "user", "content": "Name three colors."}])
    out = speculative_decode(target, drafter, prompt, k=3, max_new_tokens=16)
    assert out.tokens == target_greedy(target, prompt, 16)[: len(out.tokens)] and len(out.tokens) == 16


def test_dflash_resume_replays_the_same_steps(tmp_path, tiny_target_dir, tiny_train_data):
    from safetensors.torch import load_file

    recipe = tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "dflash", "train.steps=4", "train.deepspeed=zero1",
                         "train.checkpoint.every=2", "train.checkpoint.keep=2", *ARGS)
    run_training(recipe)
    first = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert "fc.weight" in first and not any(k.startswith(("embed_tokens.", "lm_head.")) for k in first)
    run_training(recipe, resume=str(tmp_path / "checkpoints" / "step_00000002"))
    again = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert all(torch.equal(first[k], again[k]) for k in first)  # the same anchors and batches after the resume
    assert [r["step"] for r in read_log(tmp_path) if "loss" in r] == [1, 2, 3, 4, 3, 4]


def test_dflash_offline_from_the_feature_cache_trains_like_online(tmp_path, monkeypatch, tiny_target_dir, tiny_train_data):
    from draftsmith.data.feature_cache import write_feature_cache
    from draftsmith.data.tokenized import load_tokenized
    from draftsmith.target import Target

    target = load_target(tiny_target_dir, "float32", "cpu")
    cache = str(tmp_path / "features")
    write_feature_cache(load_tokenized(tiny_train_data), cache, target, layer_ids=[1, 2, 3], progress=False)
    run_training(tiny_recipe(tmp_path / "online", tiny_target_dir, tiny_train_data, "dflash", "train.steps=3", *ARGS))
    calls = []
    real_forward = Target.forward
    monkeypatch.setattr(Target, "forward", lambda self, *a, **k: calls.append(1) or real_forward(self, *a, **k))
    summary = run_training(tiny_recipe(tmp_path / "offline", tiny_target_dir, tiny_train_data, "dflash",
                                       f"train.features={cache}", "train.steps=3", *ARGS))
    assert calls == [] and summary["online_target"] is False
    online = [r["loss"] for r in read_log(tmp_path / "online") if "loss" in r]
    offline = [r["loss"] for r in read_log(tmp_path / "offline") if "loss" in r]
    assert offline == pytest.approx(online, rel=2e-2) and offline != online  # only the cache's bf16 rounding differs


def test_dflash_bf16_engine_under_zero2(tmp_path, tiny_target_dir, tiny_train_data):
    ds = tmp_path / "bf16_zero2.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "gradient_clipping": 1.0}))
    summary = run_training(tiny_recipe(tmp_path / "run", tiny_target_dir, tiny_train_data, "dflash", "train.steps=6",
                                       "train.eval.every=6", "train.optimizer.lr=0.003", "target.dtype=bfloat16",
                                       f"train.deepspeed={ds}", *ARGS))
    assert (summary["dtype"], summary["zero_stage"], summary["skipped"]) == ("bfloat16", 2, {})
    loss = heldout(read_log(tmp_path / "run"), "loss")
    assert len(loss) == 2 and loss[1] < loss[0], loss


def test_dpace_weights_golden_on_toy_blocks():
    """Bs = 4, α = 0.5. Block 1: q̃ = (·, 0.9, 0.75, 1.0), prefix products 0.9, 0.675, 0.675, suffix sums
    2.25, 1.35, 0.675. Block 2: its position 2 does not count (q̃ = 1 there, weight 0): prefix 0.6, ·, 0.48."""
    confidence = torch.tensor([[0.0, 0.8, 0.5, 1.0], [0.0, 0.2, 0.9, 0.6]])
    valid = torch.tensor([[False, True, True, True], [False, True, False, True]])
    w = dpace_weights(confidence.requires_grad_(), valid, 0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 2.25, 1.35, 0.675], [0.0, 1.08, 0.0, 0.48]]))
    assert not w.requires_grad
    # α = 1: every valid position weighs the valid positions from it on (its suffix length)
    assert dpace_weights(confidence, valid, 1.0).tolist() == [[0.0, 3.0, 2.0, 1.0], [0.0, 2.0, 0.0, 1.0]]


def test_dpace_weights_match_speculators():
    utils = pytest.importorskip("speculators.losses.utils")
    gen = torch.Generator().manual_seed(0)
    ce = torch.rand(3 * 8, generator=gen) * 3  # 3 blocks of 8
    mask = torch.rand(3 * 8, generator=gen) > 0.2
    mask[::8] = False  # the anchors
    theirs = utils.dpace_loss_decay(None, loss_mask=mask[None].float(), block_size=8, dpace_alpha=0.3,
                                    elementwise_loss=ce[None])
    ours = dpace_weights((-ce).exp().view(3, 8), mask.view(3, 8), 0.3)
    torch.testing.assert_close(ours.flatten(), theirs.flatten())


def test_dflash_with_a_draft_vocabulary_and_dpace_learns_and_decodes_like_the_target(tmp_path, tiny_target_dir,
                                                                                     tiny_train_data):
    from safetensors.torch import load_file

    from draftsmith.data.tokenized import load_tokenized
    from draftsmith.data.vocab import vocab_from_counts
    from draftsmith.decode.rounds import speculative_decode
    from draftsmith.drafters import load
    from draftsmith.decode.reference import target_greedy

    target = load_target(tiny_target_dir, "float32", "cpu")
    # the random target's argmax tokens, not the data's (which it never predicts): most rows keep their loss
    data = load_tokenized(tiny_train_data)
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    for ids in data["input_ids"][:16]:
        counts += torch.bincount(target.forward(torch.tensor([ids])).logits[0].argmax(-1), minlength=target.vocab_size)
    vocab = vocab_from_counts(counts.numpy(), 512)
    vocab.save(str(tmp_path / "draft_vocab.safetensors"))
    summary = run_training(tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "dflash", "train.steps=10",
                                       "train.eval.every=5", "train.optimizer.lr=0.003", *ARGS[:-1],
                                       "train.loss.kind=ce", "train.dflash.weighting=dpace",
                                       f"drafter.draft_vocab={tmp_path / 'draft_vocab.safetensors'}"))
    log = read_log(tmp_path)
    loss, first = heldout(log, "loss"), heldout(log, "expected_accept_step0")
    assert len(first) == 3 and first[0] < first[1] < first[2] and loss[-1] < loss[0], (first, loss)
    stored = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert torch.equal(stored["d2t"], vocab.d2t) and "lm_head.weight" not in stored
    drafter = load(summary["drafter"], target)
    assert drafter.config.draft_vocab_size == 512 and drafter.module.lm_head.weight.shape[0] == 512
    prompt = target.render_chat([{"role": "user", "content": "Name three colors."}])
    out = speculative_decode(target, drafter, prompt, k=3, max_new_tokens=16)
    assert out.tokens == target_greedy(target, prompt, 16)[: len(out.tokens)] and len(out.tokens) == 16
