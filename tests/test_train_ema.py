"""``train.ema_decay``: a bias-corrected moving average of the drafter's weights, evaluated, kept as drafter-best and
saved as ``drafter/``, while training itself runs exactly as without it (the raw weights are ``drafter-raw/``)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.train.checkpoint import CHECKSUMS, EMA_FILE, read_checkpoint
from draftsmith.train.ema import EMA, keep_share
from draftsmith.train.run import run_training

from .test_train_recipes import read_log, tiny_recipe

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_average_is_the_bias_corrected_mean_of_the_weights_each_step_left():
    """After steps with weights w_1 … w_n the shadow is Σ d^{n−i} w_i / Σ d^{n−i}: w_1 itself after the first step
    (the initial weights never count), frozen parameters are not averaged."""
    layer = torch.nn.Linear(3, 2)
    layer.bias.requires_grad_(False)
    ema = EMA(layer, 0.9)
    assert set(ema.shadow) == {"weight"} and torch.equal(ema.shadow["weight"], layer.weight.detach())  # before a step
    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(2, 3, generator=g) for _ in range(4)]
    for n, w in enumerate(steps, start=1):
        with torch.no_grad():
            layer.weight.copy_(w)
        ema.update()
        weights = [0.9 ** (n - i) for i in range(1, n + 1)]
        want = sum(c * s.double() for c, s in zip(weights, steps)) / sum(weights)
        assert torch.allclose(ema.shadow["weight"].double(), want, atol=1e-6), n
        if n == 1:
            assert torch.equal(ema.shadow["weight"], steps[0])
    assert ema.updates == 4 and ema.shadow["weight"].dtype == torch.float32
    # the share kept: β_1 = 0, β_2 = d·(1 − d)/(1 − d²) = d/(1 + d), → d
    assert keep_share(0.9, 1) == 0.0 and keep_share(0.9, 2) == pytest.approx(0.9 / 1.9)
    assert keep_share(0.9, 500) == pytest.approx(0.9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_average_is_applied_in_the_modules_dtype_and_taken_out_bit_for_bit(dtype):
    layer = torch.nn.Linear(4, 4).to(dtype)
    ema = EMA(layer, 0.5)
    before = layer.weight.detach().clone()
    ema.shadow["weight"] = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    ema.shadow["bias"] = torch.zeros(4)
    with pytest.raises(RuntimeError, match="inside"):
        with ema.applied():
            assert torch.equal(layer.weight, ema.shadow["weight"].to(dtype)) and layer.weight.dtype == dtype
            raise RuntimeError("inside")
    assert torch.equal(layer.weight, before)  # an error in the block puts the module's own weights back too


def ema_recipe(run_dir, target_dir, data_dir, *extra: str):
    return tiny_recipe(run_dir, target_dir, data_dir, "eagle3", "train.steps=4", "train.ttt_steps=2",
                       "drafter.feature_layers=[0,1,2]", "train.loss.kind=soft_ce", "train.optimizer.lr=0.003",
                       "train.eval.every=1", "train.checkpoint.every=1", "train.checkpoint.keep=10",
                       "decode.temperature=1.0", *extra)


def tensors(folder) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def checkpoint_weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    return read_checkpoint(os.path.join(run_dir, "checkpoints", f"step_{step:08d}"))[1]


ENGINES = {
    "zero1": ["train.deepspeed=zero1"],
    # the GPU's configuration: a bf16 engine (bf16 module, fp32 master weights in the optimizer) under ZeRO-2
    "bf16_zero2": ["train.deepspeed=zero2", "target.dtype=bfloat16"],
}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_average_is_evaluated_and_saved_while_training_runs_as_without_it(tmp_path, tiny_target_dir,
                                                                              tiny_train_data, engine):
    """The same run with and without ``train.ema_decay``: the raw weights, losses and raw held-out figures are
    bit-identical (the average never touches training); drafter/, drafter-best/ and the held-out figures are the
    average's, computed from the raw run's own step weights."""
    off, on = tmp_path / "off", tmp_path / "on"
    plain = run_training(ema_recipe(off, tiny_target_dir, tiny_train_data, *ENGINES[engine]))
    summary = run_training(ema_recipe(on, tiny_target_dir, tiny_train_data, *ENGINES[engine], "train.ema_decay=0.5"))
    bf16 = engine.startswith("bf16")
    assert summary["dtype"] == ("bfloat16" if bf16 else "float32") and summary["zero_stage"] == int(engine[-1])

    # training is the run without the average, bit for bit
    raw, base = tensors(on / "drafter-raw"), tensors(off / "drafter")
    assert raw.keys() == base.keys() and all(torch.equal(raw[k], base[k]) for k in raw)
    log_on, log_off = read_log(on), read_log(off)
    assert [r["loss"] for r in log_on if "loss" in r] == [r["loss"] for r in log_off if "loss" in r]
    held_on, held_off = [r for r in log_on if "sim_tau" in r], [r for r in log_off if "sim_tau" in r]
    assert [r["step"] for r in held_on] == [0, 1, 2, 3, 4]
    for a, b in zip(held_on, held_off):  # the raw weights' figures, beside the average's
        assert {k[len("raw/"):]: v for k, v in a.items() if k.startswith("raw/")} == \
            {k: v for k, v in b.items() if k.startswith("heldout/") or k == "sim_tau"}
    assert held_on[0]["sim_tau"] == held_on[0]["raw/sim_tau"]  # before a step the average is the initial weights
    assert held_on[1]["sim_tau"] == held_on[1]["raw/sim_tau"]  # and after one, the first step's
    assert held_on[4]["sim_tau"] != held_on[4]["raw/sim_tau"]
    assert summary["heldout"]["sim_tau"] == held_on[4]["sim_tau"]
    assert summary["heldout"]["raw/sim_tau"] == plain["heldout"]["sim_tau"]
    assert [p["raw_sim_tau"] for p in summary["sim_tau_curve"]] == [p["sim_tau"] for p in plain["sim_tau_curve"]]
    assert "ema" not in plain and not (off / "drafter-raw").exists() and "raw/sim_tau" not in plain["heldout"]
    assert "weights" not in json.loads((off / "drafter" / "config.json").read_text())

    # the average: Σ 0.5^{4−i} w_i / Σ 0.5^{4−i} over the weights of steps 1–4 (fp32 masters, read from the
    # checkpoints of the run without it); a bf16 engine averages the module's bf16 copies of them
    saved = tensors(on / "drafter")
    coef = [0.5 ** (4 - i) for i in range(1, 5)]
    steps = [checkpoint_weights(off, i) for i in range(1, 5)]
    averaged = [k for k in saved if not torch.equal(saved[k], base[k])]
    assert len(averaged) > 3  # the layer's weights; d2t/t2d and frozen parts equal
    for k in averaged:
        want = sum(c * (s[k].to(torch.bfloat16) if bf16 else s[k]).double() for c, s in zip(coef, steps)) / sum(coef)
        assert saved[k].dtype == (torch.bfloat16 if bf16 else torch.float32)
        assert torch.allclose(saved[k].double(), want, rtol=2**-8 if bf16 else 1e-6, atol=1e-6), k  # rounding
    # ... and its shadow in the last checkpoint is what drafter/ holds (rounded to the engine's dtype), which export
    # reads from a checkpoint too; the checkpoint lists the shadow with its sha256
    last = on / "checkpoints" / "step_00000004"
    assert EMA_FILE in json.loads((last / CHECKSUMS).read_text())["sha256"]
    shadow = checkpoint_weights(on, 4)
    assert all(torch.equal(shadow[k].to(saved[k].dtype), saved[k]) for k in averaged)
    meta = json.loads((on / "drafter" / "config.json").read_text())["weights"]
    assert meta == {"kind": "ema", "ema_decay": 0.5, "ema_updates": 4}
    assert json.loads((on / "drafter-raw" / "config.json").read_text())["weights"]["kind"] == "raw"
    assert summary["ema"]["raw_drafter"] == str(on / "drafter-raw") and summary["ema"]["updates"] == 4

    # drafter-best: the average of the evaluation with the best sim_tau, by the usual rule
    curve = summary["sim_tau_curve"]
    best = max(reversed(curve), key=lambda p: p["sim_tau"])
    assert (summary["best"]["step"], summary["best"]["sim_tau"], summary["best"]["ema_decay"]) == \
        (best["step"], best["sim_tau"], 0.5)
    assert best["step"] > 0, curve  # a step's average, not the untrained head
    kept, at_best = tensors(on / "drafter-best"), checkpoint_weights(on, best["step"])
    assert all(torch.equal(at_best[k].to(kept[k].dtype), kept[k]) for k in averaged)
    assert json.loads((on / "drafter-best" / "config.json").read_text())["weights"]["ema_updates"] == best["step"]


def test_a_resumed_run_ends_with_the_same_average_and_a_damaged_one_is_refused(tmp_path, tiny_target_dir,
                                                                                tiny_train_data):
    """Resumed from step 2, the run replays steps 3–4 and ends with the uninterrupted run's average and raw
    weights, bit for bit; a flipped byte in the shadow is refused by the checksum; a checkpoint without an average
    does not resume into a run that keeps one."""
    recipe = ema_recipe(tmp_path, tiny_target_dir, tiny_train_data, "train.ema_decay=0.7", "train.deepspeed=zero2",
                        "train.feature_noise=0.05")
    run_training(recipe)
    first = {d: tensors(tmp_path / d) for d in ("drafter", "drafter-raw")}
    step2 = tmp_path / "checkpoints" / "step_00000002"
    summary = run_training(recipe, resume=str(step2))
    assert summary["ema"]["updates"] == 4
    for d, weights in first.items():
        again = tensors(tmp_path / d)
        assert all(torch.equal(weights[k], again[k]) for k in weights), d
    assert not all(torch.equal(first["drafter"][k], first["drafter-raw"][k]) for k in first["drafter"])

    data = bytearray((step2 / EMA_FILE).read_bytes())
    data[-5] ^= 0x40
    (step2 / EMA_FILE).write_bytes(bytes(data))
    with pytest.raises(DraftsmithError, match=f"{EMA_FILE} does not match its sha256"):
        run_training(recipe, resume=str(step2))

    plain = tmp_path / "plain"
    run_training(ema_recipe(plain, tiny_target_dir, tiny_train_data, "train.steps=1"))
    with pytest.raises(DraftsmithError, match=r"made for another run: train.ema_decay: None then, 0.7 now"):
        run_training(ema_recipe(plain, tiny_target_dir, tiny_train_data, "train.ema_decay=0.7"))


def test_zero3_and_a_decay_outside_0_1_are_refused_in_one_line(tmp_path, tiny_target_dir, tiny_train_data):
    with pytest.raises(ConfigError, match=r"^train.ema_decay averages the whole drafter on every rank, which ZeRO-3 "
                                          r"\(train.deepspeed = 'zero3'\) partitions; use zero2"):
        run_training(ema_recipe(tmp_path, tiny_target_dir, tiny_train_data, "train.ema_decay=0.99",
                                "train.deepspeed=zero3"))
    for bad in ("1.0", "0.0", "-0.5"):
        with pytest.raises(ConfigError, match=rf"train.ema_decay = {bad} must be in \(0, 1\)"):
            ema_recipe(tmp_path, tiny_target_dir, tiny_train_data, f"train.ema_decay={bad}")


FAMILIES = {
    "eagle1": ["train.loss.feature_weight=1.0"],
    "medusa": ["drafter.num_heads=2"],
    "draft_lm": ["drafter.num_layers=1"],
    "dflash": ["drafter.num_layers=1", "drafter.block_size=4", "drafter.feature_layers=[1,2]", "train.dflash.anchors=8"],
    "dflash2": ["drafter.num_layers=1", "drafter.block_size=4", "drafter.feature_layers=[1,2]", "drafter.conv_group_size=8",
                "drafter.selector_rank=16", "drafter.selector_top_k=8", "train.dflash.anchors=8"],
    "peagle": ["drafter.num_layers=1", "drafter.feature_layers=[0,1,2]", "train.peagle.max_anchors=8"],
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_trains_with_the_average_and_hass_top_k_term(tmp_path, tiny_target_dir, tiny_train_data, family):
    """The average and the top-K term live in the shared engine, step, save and loss paths: every trained family
    keeps, evaluates and saves the average (drafter/ the last checkpoint's shadow, drafter-raw/ apart from it)."""
    summary = run_training(tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, family, "train.steps=2",
                                       "train.optimizer.lr=0.003", "train.loss.kind=soft_ce", "train.ema_decay=0.5",
                                       "train.loss.top_k=4", *FAMILIES[family]))
    assert summary["ema"]["updates"] == 2 and "raw/sim_tau" in summary["heldout"]
    saved, raw = tensors(tmp_path / "drafter"), tensors(tmp_path / "drafter-raw")
    shadow = checkpoint_weights(tmp_path, 2)
    assert all(torch.equal(shadow[k], saved[k]) for k in saved)
    assert not all(torch.equal(saved[k], raw[k]) for k in saved)
