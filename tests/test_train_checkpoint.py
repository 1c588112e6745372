"""Training checkpoints never run code and are refused when changed: the sha256 manifest, the
weights-only unpickling (DeepSpeed's loaders included), on resume and on export.

One real ZeRO-2 run of one step on the tiny target (its optimizer state is DeepSpeed's partition
file, read by both ``engine.load_checkpoint`` and ``zero_to_fp32``); each test works on a copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch

from draftsmith.cli import main
from draftsmith.config import load_recipe
from draftsmith.errors import DraftsmithError
from draftsmith.train.checkpoint import CHECKSUMS, verify_checksums, write_checksums
from draftsmith.train.run import run_training

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = "smollm2-135m-eagle3"
CKPT = os.path.join("checkpoints", "step_00000001")
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def overrides(target_dir: str, data_dir: str, run_dir, steps: int) -> list[str]:
    return [f"target.name={target_dir}", "target.dtype=float32", "drafter.type=eagle3", "drafter.feature_layers=[0,1,2]",
            f"train.dataset={data_dir}", "train.batch_size=4", "train.max_length=48", "train.eval.heldout=8",
            f"train.steps={steps}", "train.ttt_steps=2", "train.deepspeed=zero2", "train.logging.wandb=disabled",
            "train.logging.progress=false", "train.eval.decoder_at_end=false", f"run_dir={run_dir}"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_target_dir, tiny_train_data, one_thread) -> str:
    """The run folder of one ZeRO-2 step (its checkpoint: ``checkpoints/step_00000001``)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    run_training(load_recipe(RECIPE, overrides(tiny_target_dir, tiny_train_data, run_dir, steps=1)))
    return str(run_dir)


@pytest.fixture
def run_copy(tmp_path, trained):
    return shutil.copytree(trained, tmp_path / "run")


class Payload:
    """Unpickling this creates ``marker`` (what an attacker's ``os.system`` would do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def resume(tiny_target_dir, tiny_train_data, run_dir) -> int:
    return main(["train", "--config", RECIPE, *overrides(tiny_target_dir, tiny_train_data, run_dir, steps=2)])


def test_a_checkpoint_lists_every_file_with_its_sha256(trained):
    ckpt = os.path.join(trained, CKPT)
    with open(os.path.join(ckpt, CHECKSUMS)) as f:
        listed = json.load(f)["sha256"]
    files = sorted(os.listdir(ckpt))
    assert sorted(listed) == [n for n in files if n != CHECKSUMS]
    assert {"trainer_state.json", "rng_rank0.pt", OPTIM, "mp_rank_00_model_states.pt"} <= set(listed)
    for name, digest in listed.items():
        assert hashlib.sha256(open(os.path.join(ckpt, name), "rb").read()).hexdigest() == digest
    # the RNG state is tensors and plain values: it reads back weights-only, with nothing allow-listed
    assert torch.load(os.path.join(ckpt, "rng_rank0.pt"), weights_only=True)["numpy"][1].dtype == torch.int64


def test_the_manifest_refuses_a_missing_an_added_and_a_changed_file(tmp_path):
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    (folder / "a.pt").write_bytes(b"abc")
    (folder / "trainer_state.json").write_text("{}")
    with pytest.raises(DraftsmithError, match=f"has no {CHECKSUMS} .*resume or export only checkpoints this draftsmith"):
        verify_checksums(str(folder))
    write_checksums(str(folder))
    verify_checksums(str(folder))
    (folder / "extra.pt").write_bytes(b"x")
    with pytest.raises(DraftsmithError, match=f"holds extra.pt, which its {CHECKSUMS} does not list"):
        verify_checksums(str(folder))
    (folder / "extra.pt").unlink()
    (folder / "a.pt").write_bytes(b"abd")
    with pytest.raises(DraftsmithError, match=f"a.pt does not match its sha256 in {CHECKSUMS}"):
        verify_checksums(str(folder))
    (folder / "a.pt").unlink()
    with pytest.raises(DraftsmithError, match=f"lacks a.pt, listed in its {CHECKSUMS}: it is incomplete"):
        verify_checksums(str(folder))
    (folder / CHECKSUMS).write_text("[]")
    with pytest.raises(DraftsmithError, match="not a checksum list"):
        verify_checksums(str(folder))


@pytest.mark.parametrize("forged", [False, True], ids=["tampered", "forged-manifest"])
@pytest.mark.parametrize("command, planted", [("train", "rng_rank0.pt"), ("train", OPTIM), ("export", OPTIM),
                                              ("export", "mp_rank_00_model_states.pt")])
def test_a_planted_payload_never_runs(tmp_path, run_copy, tiny_target_dir, tiny_train_data, capsys, command, planted,
                                      forged):
    """A pickle whose ``__reduce__`` runs a shell command, put into a checkpoint: resuming ``train`` and
    ``export`` refuse it in one line (exit 2) and the command never runs — by the checksum when the
    manifest was left alone, by the weights-only unpickler when it was rewritten to match."""
    ckpt = os.path.join(run_copy, CKPT)
    marker = tmp_path / "pwned"
    torch.save({"module": Payload(str(marker))}, os.path.join(ckpt, planted))
    if forged:
        write_checksums(ckpt)
    if command == "train":
        code = resume(tiny_target_dir, tiny_train_data, run_copy)
    else:
        code = main(["export", ckpt, "--to", "eagle3", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert not marker.exists(), "the payload ran"
    assert code == 2 and err[-1].startswith("draftsmith: error: "), err
    if forged:
        assert "holds objects other than tensors and plain data" in err[-1] and "posix.system" in err[-1], err[-1]
    else:
        assert f"{planted} does not match its sha256 in {CHECKSUMS}" in err[-1], err[-1]
    assert not (tmp_path / "out").exists()


def test_a_flipped_byte_in_the_optimizer_state_is_refused_on_resume(run_copy, tiny_target_dir, tiny_train_data, capsys):
    file = os.path.join(run_copy, CKPT, OPTIM)
    data = bytearray(open(file, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(file, "wb").write(bytes(data))
    assert resume(tiny_target_dir, tiny_train_data, run_copy) == 2
    err = capsys.readouterr().err
    assert f"{OPTIM} does not match its sha256 in {CHECKSUMS}, it changed after draftsmith saved it" in err
    with open(os.path.join(run_copy, "train_summary.json")) as f:
        assert json.load(f)["steps"] == 1  # the first run's: nothing trained on


def test_an_intact_checkpoint_resumes_under_weights_only_loading(run_copy, tiny_target_dir, tiny_train_data, capsys):
    """DeepSpeed's ZeRO-2 optimizer state reads back through the allow-list, and the run goes on."""
    assert resume(tiny_target_dir, tiny_train_data, run_copy) == 0
    out = capsys.readouterr()
    assert f"resumed from {os.path.join(run_copy, CKPT)} at step 1" in out.out + out.err
    with open(os.path.join(run_copy, "train_summary.json")) as f:
        assert json.load(f)["steps"] == 2


KILLED_SAVE = """
import os, signal, sys
import torch
from draftsmith.cli import main

save = torch.save


def killed_mid_write(obj, file, *args, **kwargs):  # the first file of step 3's checkpoint, half written
    if ".tmp-step_00000003" in str(file):
        with open(file, "wb") as f:
            f.write(b"half")
        os.kill(os.getpid(), signal.SIGKILL)
    return save(obj, file, *args, **kwargs)


torch.save = killed_mid_write
main(sys.argv[1:])
"""


def test_a_run_killed_while_writing_a_checkpoint_resumes_by_itself_and_leaves_nothing(tmp_path, tiny_target_dir,
                                                                                   tiny_train_data, capsys):
    """SIGKILL in the middle of step 3's checkpoint: the same command (here with checkpoints every 2 steps, so no
    save of step 3 ever sweeps its own folder away) resumes from step 2 and finishes; the killed save's temporary
    folder is gone."""
    import subprocess
    import sys

    from .test_cli_errors import _tiny_train_args

    run_dir = tmp_path / "run"
    args = _tiny_train_args(run_dir, tiny_target_dir, tiny_train_data, "train.steps=4")
    killed = subprocess.run([sys.executable, "-c", KILLED_SAVE, *args, "train.checkpoint.every=1"],
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    root = run_dir / "checkpoints"
    assert open(root / "latest").read().strip() == "step_00000002"
    assert (root / ".tmp-step_00000003").is_dir()  # what the kill left
    assert main([*args, "train.checkpoint.every=2"]) == 0
    assert f"resumed from {root / 'step_00000002'} at step 2" in capsys.readouterr().out
    assert open(root / "latest").read().strip() == "step_00000004"
    assert sorted(n for n in os.listdir(root) if not n.endswith(".py")) == ["latest", "step_00000002", "step_00000004"]


def test_a_rerun_of_a_finished_run_never_leaves_latest_or_the_drafter_missing(run_copy, tiny_target_dir,
                                                                             tiny_train_data, monkeypatch):
    """Running a finished run's command again saves its last checkpoint and the drafter again. A SIGKILL may fall
    between any two of the renames and removals that does: after each of them, ``latest`` names a whole checkpoint
    and ``drafter/`` (``drafter-best/``) is a whole drafter (the old ones or the new ones; deleting the old folder first left neither)."""
    from draftsmith.drafters.checkpoint import read_meta
    from draftsmith.train.checkpoint import latest_checkpoint

    ops = []

    def saved() -> list[int]:
        return [os.stat(run_copy / path).st_ino for path in (f"{CKPT}/trainer_state.json", "drafter/config.json")]

    before = saved()

    def intact() -> None:
        verify_checksums(latest_checkpoint(str(run_copy)))
        read_meta(os.path.join(run_copy, "drafter"))
        read_meta(os.path.join(run_copy, "drafter-best"))

    for module, name in ((os, "replace"), (os, "rename"), (shutil, "rmtree")):
        def recorded(*args, _real=getattr(module, name), _name=name, **kwargs):
            out = _real(*args, **kwargs)
            ops.append((_name, str(args[0])))
            intact()
            return out

        monkeypatch.setattr(module, name, recorded)
    assert main(["train", "--config", RECIPE, *overrides(tiny_target_dir, tiny_train_data, run_copy, steps=1)]) == 0
    monkeypatch.undo()
    assert saved() != before and ops  # both were saved again
    assert sorted(n for n in os.listdir(run_copy / "checkpoints") if not n.endswith(".py")) == ["latest", "step_00000001"]
    assert not [n for n in os.listdir(run_copy) if n.startswith(".") and not n.endswith(".lock")]
