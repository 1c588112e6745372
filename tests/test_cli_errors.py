"""Bad input through the command line: one line naming the fix, exit 2, never a traceback (issue 28).

Config values are refused when the recipe loads, before any target does; damaged files (feature cache,
drafter folder, checkpoint) when they are read; a write the system refuses (read-only folder, full disk)
names the folder and leaves no temporary folder behind.
"""

from __future__ import annotations

import os

import pytest

from draftsmith.config import load_recipe
from draftsmith.errors import ConfigError

from .test_cli import expect_error

TRAIN = "smollm2-135m-eagle3"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("override,fragments", [
    ("decode.k=[1", ["override 'decode.k=[1': the value is not valid YAML", "close a list with ]"]),
    ("train.optimizer.lr=nan", ["'train.optimizer.lr' must be a finite number, got nan"]),
    ("train.optimizer.lr=-0.001", ["train.optimizer.lr = -0.001 must be > 0"]),
    ("train.optimizer.betas=[0.9,1.0]", ["train.optimizer.betas[1] = 1.0 must be in [0, 1)"]),
    ("train.optimizer.betas=[-0.1,0.95]", ["train.optimizer.betas[0] = -0.1 must be in [0, 1)"]),
    ("decode.temperature=nan", ["'decode.temperature' must be a finite number, got nan"]),
    ("run_dir=", ["run_dir is empty", "run_dir=runs/mine"]),
    ("train.eval.heldout=-1", ["train.eval.heldout = -1 must be ≥ 0"]),
    ("data.stages=[]", ["data.stages is empty", "choose from: regenerate, tokenize, features, vocab"]),
    ("train.schedule.min_lr_ratio=1.5", ["train.schedule.min_lr_ratio = 1.5 must be in [0, 1]"]),
])
def test_bad_values_are_refused_when_the_recipe_loads(capsys, tmp_path, monkeypatch, override, fragments):
    monkeypatch.chdir(tmp_path)  # an empty run_dir must not write config.yaml here
    overrides = [f"run_dir={tmp_path}/run", override]
    with pytest.raises(ConfigError):  # at validation: before a target, a dataset or DeepSpeed is touched
        load_recipe(TRAIN, overrides)
    command = "prepare" if override.startswith("data.") else "train"
    expect_error(capsys, [command, "-c", TRAIN, *overrides], *fragments)
    assert os.listdir(tmp_path) == []


def test_a_config_file_that_is_not_utf8_or_is_a_folder(capsys, tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("run_dir: runs/caf\xe9\n".encode("latin-1"))
    expect_error(capsys, ["eval", "-c", str(latin1)], f"config file '{latin1}' is not UTF-8 text", "save it as UTF-8")
    expect_error(capsys, ["eval", "-c", str(tmp_path)], f"config file '{tmp_path}' is a folder")


def test_demo_refuses_zero_steps_before_it_prepares(capsys, tmp_path, monkeypatch):
    import draftsmith.data

    def prepare(*args, **kwargs):
        raise AssertionError("prepare ran")

    monkeypatch.setattr(draftsmith.data, "run_prepare", prepare)
    expect_error(capsys, ["demo", "--steps", "0", "--run-dir", str(tmp_path / "demo")], "train.steps = 0 must be at least 1")
    assert not os.path.exists(tmp_path / "demo")
