"""Training config, engine JSON checks, LR schedule and the resumable data order (no engine started)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from draftsmith.config import CONFIG_DIR, load_recipe
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.train import data as D
from draftsmith.train.setup import lr_lambda
from draftsmith.train.distributed import DEEPSPEED_CONFIG_DIR, load_engine_config
from draftsmith.train.run import run_training

CPU = torch.device("cpu")


def test_unknown_loss_names_the_choices():
    with pytest.raises(ConfigError, match="'train.loss.kind' = 'kl' is not valid; choose one of: forward_kl"):
        load_recipe(None, ["train.loss.kind=kl"])


def test_unknown_method_names_the_choices():
    with pytest.raises(ConfigError, match="'drafter.type' = 'eagle9' is not valid; choose one of: .*eagle1"):
        load_recipe(None, ["drafter.type=eagle9"])
    # a drafter family that exists but is not trained (layer-skip reuses the target's layers)
    with pytest.raises(ConfigError, match="drafter.type = 'layer_skip' has no training recipe; the trainable methods are: .*eagle1"):
        run_training(load_recipe(None, ["drafter.type=layer_skip"]))


def test_a_key_the_method_would_ignore_is_refused_in_one_line(tmp_path):
    """CORAL, GRIFFIN and the TTT depth are EAGLE-3's, the block's anchors DFlash's: set on another method they were
    once silently ignored. Refused before any process group or target is started."""
    run = f"run_dir={tmp_path / 'run'}"
    with pytest.raises(ConfigError, match=r"^train.coral_weight is read by the eagle3 recipe\(s\) only: "
                                          r"drafter.type = 'dflash' would ignore it; remove it or train one of those$"):
        run_training(load_recipe("smollm2-135m-dflash", [run, "train.coral_weight=0.1"]))
    with pytest.raises(ConfigError, match=r"^train.ttt_steps is read by the eagle3 recipe\(s\) only; "
                                          r"train.dflash is read by the dflash, dflash2 recipe\(s\) only: "
                                          r"drafter.type = 'peagle'"):
        run_training(load_recipe("smollm2-135m-peagle", [run, "train.ttt_steps=3", "train.dflash.anchors=4"]))
    with pytest.raises(ConfigError, match=r"^train.feature_noise is read by the eagle1, eagle3, peagle recipe\(s\) only"):
        run_training(load_recipe("smollm2-135m-medusa", [run, "train.feature_noise=0.1"]))
    assert not (tmp_path / "run").exists()  # nothing written


def test_bad_train_values_are_named():
    with pytest.raises(ConfigError, match="train.steps = 0 must be at least 1"):
        load_recipe(None, ["train.steps=0"])
    with pytest.raises(ConfigError, match="train.loss.jsd_beta"):
        load_recipe(None, ["train.loss.jsd_beta=1.5"])
    with pytest.raises(ConfigError, match="train.on_policy.fraction"):
        load_recipe(None, ["train.on_policy.fraction=2"])
    with pytest.raises(ConfigError, match="train.checkpoint.keep = 0 must be ≥ 1"):  # once silently 1
        load_recipe(None, ["train.checkpoint.keep=0"])
    with pytest.raises(ConfigError, match="train.max_records = -1"):
        load_recipe(None, ["train.max_records=-1"])
    with pytest.raises(ConfigError, match="train.loss.top_k = -1 must be ≥ 0"):
        load_recipe(None, ["train.loss.top_k=-1"])
    with pytest.raises(ConfigError, match="train.loss.top_k_weight = -0.5 must be ≥ 0"):
        load_recipe(None, ["train.loss.top_k=10", "train.loss.top_k_weight=-0.5"])
    with pytest.raises(ConfigError, match=r"train.loss.kind = top_k_ce needs train.loss.top_k ≥ 1, its K \(HASS: 10\)"):
        load_recipe(None, ["train.loss.kind=top_k_ce"])


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3"])
def test_shipped_engine_configs_load_and_resolve_auto_precision(name):
    cfg = load_engine_config(name, micro_batch_size=3, device=CPU)
    assert cfg["zero_optimization"]["stage"] == int(name[-1])
    assert cfg["bf16"]["enabled"] is False  # "auto" → fp32 on a CPU
    assert cfg["train_micro_batch_size_per_gpu"] == 3
    assert "optimizer" not in cfg and "scheduler" not in cfg


@pytest.mark.parametrize("dtype,bf16", [(torch.bfloat16, True), (torch.float32, False), (None, False)])
def test_auto_precision_follows_the_target_dtype(dtype, bf16):
    """A bf16 target trains in the bf16 engine, an fp32 one in fp32, on CPU as on GPU; without a target dtype
    the old rule (bf16 on a GPU only)."""
    cfg = load_engine_config("zero2", micro_batch_size=1, device=CPU, target_dtype=dtype)
    assert cfg["bf16"]["enabled"] is bf16


def _write(tmp_path, obj) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(obj))
    return str(path)


def test_zero_stage_that_does_not_exist(tmp_path):
    with pytest.raises(ConfigError, match="zero_optimization.stage = 4 does not exist; choose 0, 1, 2 or 3"):
        load_engine_config(_write(tmp_path, {"zero_optimization": {"stage": 4}}), 1, CPU)


def test_zero_block_is_checked_against_deepspeeds_schema(tmp_path):
    bad = {"zero_optimization": {"stage": 2, "overlap_com": True}}  # a typo of overlap_comm
    with pytest.raises(ConfigError, match=r"(?s)zero_optimization is not valid for DeepSpeed [\d.]+: .*\noverlap_com\n.*Extra inputs"):
        load_engine_config(_write(tmp_path, bad), 1, CPU)
    assert load_engine_config(_write(tmp_path, {"zero_optimization": {"stage": 2, "overlap_comm": True}}), 1, CPU)


def test_gradient_clipping_must_be_a_number(tmp_path):
    with pytest.raises(ConfigError, match="gradient_clipping = 'x' must be a number ≥ 0"):
        load_engine_config(_write(tmp_path, {"gradient_clipping": "x"}), 1, CPU)


def test_fp16_on_cpu_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="fp16, which DeepSpeed does not support on CPU; use bf16 or fp32"):
        load_engine_config(_write(tmp_path, {"fp16": {"enabled": True}}), 1, CPU)


def test_learning_rate_in_the_engine_json_is_refused(tmp_path):
    bad = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigError, match="sets 'optimizer', which belongs in the recipe YAML .train.optimizer."):
        load_engine_config(_write(tmp_path, bad), 1, CPU)


def test_unknown_engine_config_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match="choose one of: zero0, zero1, zero2, zero3"):
        load_engine_config("zero9", 1, CPU)


def test_every_shipped_deepspeed_json_is_engine_settings_only():
    import os

    for name in os.listdir(DEEPSPEED_CONFIG_DIR):
        if name.endswith(".json"):
            load_engine_config(os.path.join(DEEPSPEED_CONFIG_DIR, name), 1, CPU)
    assert os.path.dirname(DEEPSPEED_CONFIG_DIR) == CONFIG_DIR


def test_lr_schedule_warmup_then_cosine_to_floor():
    f = lr_lambda("cosine", warmup=2, total=10, min_ratio=0.1)
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0)
    assert f(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(10) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)
    assert lr_lambda("linear", 0, 10, 0.0)(5) == pytest.approx(0.5)
    assert lr_lambda("constant", 0, 10, 0.0)(7) == 1.0


def test_batch_order_is_a_pure_function_of_the_step():
    ids = list(range(10, 40))  # 30 records
    ranks = [D.BatchOrder(ids, batch_size=4, world_size=2, rank=r, seed=3) for r in (0, 1)]
    assert ranks[0].steps_per_epoch == 3  # 30 // (4·2); the remaining 6 records wait for the next epoch
    epoch0 = [x for step in range(3) for r in ranks for x in r.at(step)]
    assert len(epoch0) == len(set(epoch0)) == 24 and set(epoch0) <= set(ids)  # disjoint across ranks and steps
    assert ranks[0].at(3) != ranks[0].at(0)  # a new epoch is reshuffled
    fresh = D.BatchOrder(ids, batch_size=4, world_size=2, rank=1, seed=3)
    assert [fresh.at(s) for s in (5, 1, 4)] == [ranks[1].at(s) for s in (5, 1, 4)]  # resume anywhere, same batches
    with pytest.raises(DraftsmithError, match="cannot fill one micro-batch"):
        D.BatchOrder(ids[:5], batch_size=4, world_size=2, rank=0, seed=0).steps_per_epoch


def test_heldout_split_and_shards():
    split = D.split_heldout(20, 5, seed=1)
    assert len(split.heldout) == 5 and sorted(split.train + split.heldout) == list(range(20))
    assert D.split_heldout(20, 5, seed=1) == split
    with pytest.raises(DraftsmithError, match="leaves no training records"):
        D.split_heldout(5, 5, seed=0)
    sub = D.split_heldout(20, 5, seed=1, max_records=4)  # a curve's subset: the same held-out records, the first 4 others
    assert sub.heldout == split.heldout and sub.train == split.train[:4]
    shards = [D.heldout_batches(list(range(7)), 2, 2, r) for r in (0, 1)]
    assert shards == [[[0, 1], [2]], [[3, 4], [5]]]  # same number of batches on every rank


def test_collate_truncates_pads_and_masks_exactly():
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [1, 2], "loss_mask": [0, 1]},
        {"input_ids": [3, 3, 3, 3], "loss_mask": [0, 0, 0, 0]},
    ]
    b = D.collate(rows, pad_id=0, max_length=4)
    assert b.input_ids.tolist() == [[5, 6, 7, 8], [1, 2, 0, 0], [3, 3, 3, 3]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert b.loss_mask.tolist() == [[False, False, True, True], [False, True, False, False], [False] * 4]
    assert b.tokens == 10 and b.empty_rows == 1
    with pytest.raises(DraftsmithError, match="input_ids but 1 loss_mask"):
        D.collate([{"input_ids": [1, 2], "loss_mask": [1]}], 0, 8)


def test_collate_pads_cached_features_with_zeros():
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "hidden": torch.ones(3, 2)},
            {"input_ids": [4], "loss_mask": [1], "hidden": torch.full((1, 2), 2.0)}]
    b = D.collate(rows, pad_id=0, max_length=8)
    assert b.hidden.shape == (2, 3, 2)
    assert b.hidden[1].tolist() == [[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]


def test_rows_ahead_equals_the_masked_shifted_copy():
    from draftsmith.drafters.common import shift_left
    from draftsmith.train.target_side import rows_ahead

    x = torch.arange(2 * 6 * 3).view(2, 6, 3)  # [B, S, V]
    mask = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 1, 0, 1, 0, 0]], dtype=torch.bool)  # last 2 columns False
    for n in (0, 1, 2):
        assert torch.equal(rows_ahead(x, n, mask), shift_left(x, n)[mask])
    assert rows_ahead(x, 2, mask)[:, 0].tolist() == [6, 12, 15, 27, 33]  # x[b, t + 2, 0] = 18 b + 3 (t + 2)
    assert rows_ahead(x, 7, torch.zeros(2, 6, dtype=torch.bool)).shape == (0, 3)  # nothing n ahead in a short batch


def test_only_distributed_py_touches_deepspeed_or_torch_distributed():
    """Models, losses and the decoder take distribution from outside (DESIGN.md)."""
    import ast
    import os

    import draftsmith

    root = os.path.dirname(draftsmith.__file__)
    offenders = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "benchmarks", "runs", "__pycache__")]
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or os.path.relpath(path, root) == os.path.join("train", "distributed.py"):
                continue
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(m == "deepspeed" or m.startswith(("deepspeed.", "torch.distributed")) for m in mods):
                    offenders.append(os.path.relpath(path, root))
    assert offenders == []


def test_cli_reports_a_bad_engine_config_without_a_traceback(tmp_path, capsys):
    from draftsmith.cli import main

    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 7}}))
    code = main(["train", "--config", "smollm2-135m-eagle3", f"train.deepspeed={bad}", f"run_dir={tmp_path / 'run'}",
                 "train.logging.wandb=disabled"])
    err = capsys.readouterr().err
    assert code == 2 and "draftsmith: error:" in err and "zero_optimization.stage = 7 does not exist" in err
    assert "Traceback" not in err


def test_grouped_batches_pad_less_and_keep_every_property_of_the_order():
    """group_by_length: each epoch still takes every record at most once, ranks stay disjoint and
    resuming anywhere gives the same batches; micro-batches of a step hold records of similar length,
    so padding (the rows a micro-batch computes beyond its tokens) shrinks; 0 = the random order."""
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.choice([40, 60, 400, 500], size=70)]  # short and long records mixed
    ids = list(range(3, 67))  # 64 training records of 70 (the others held out)
    grouped = [D.BatchOrder(ids, 4, 2, r, seed=1, lengths=lengths, group=4) for r in (0, 1)]
    plain = [D.BatchOrder(ids, 4, 2, r, seed=1) for r in (0, 1)]
    steps = grouped[0].steps_per_epoch
    assert steps == 8
    epoch = [x for s in range(steps) for r in grouped for x in r.at(s)]
    assert sorted(epoch) == ids  # every record once
    assert grouped[0].at(steps) != grouped[0].at(0)  # a new epoch is regrouped
    fresh = D.BatchOrder(ids, 4, 2, 1, seed=1, lengths=lengths, group=4)
    assert [fresh.at(s) for s in (9, 2, 5)] == [grouped[1].at(s) for s in (9, 2, 5)]

    def padded_rows(orders) -> int:
        return sum(len(b) * max(lengths[i] for i in b) for s in range(steps) for b in (r.at(s) for r in orders))

    tokens = sum(lengths[i] for i in ids)
    assert padded_rows(grouped) < 1.15 * tokens < padded_rows(plain)  # random batches here pad ~1.6×
    assert D.BatchOrder(ids, 4, 2, 0, seed=1, lengths=lengths, group=0).at(3) == plain[0].at(3)
