"""Bad input through the command line: one line naming the fix, exit 2, never a traceback (issue 28).

Config values are refused when the recipe loads, before any target does; damaged files (feature cache,
drafter folder, checkpoint) when they are read; a write the system refuses (read-only folder, full disk)
names the folder and leaves no temporary folder behind.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil

import pytest

from draftsmith.config import load_recipe
from draftsmith.errors import ConfigError, DraftsmithError

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

    monkeypatch.setattr(draftsmith.data, "run_prepare_recipe", prepare)
    expect_error(capsys, ["demo", "--steps", "0", "--run-dir", str(tmp_path / "demo")], "train.steps = 0 must be at least 1")
    assert not os.path.exists(tmp_path / "demo")


# ---------------------------------------------------------------- damaged files


@pytest.mark.parametrize("manifest,fragments", [
    ([], ["manifest.json holds a JSON list, not the manifest's object"]),
    ({"format": "draftsmith-feature-cache/1", "target": None}, ["manifest.json is damaged ('target' should be a JSON object"]),
])
def test_a_damaged_feature_cache_manifest(capsys, tmp_path, tiny_target_dir, tiny_train_data, manifest, fragments):
    cache = tmp_path / "features"
    cache.mkdir()
    (cache / "manifest.json").write_text(json.dumps(manifest))
    expect_error(capsys, ["train", "-c", TRAIN, f"target.name={tiny_target_dir}", "target.dtype=float32",
                          f"train.dataset={tiny_train_data}", f"train.features={cache}", "drafter.draft_vocab=",
                          "drafter.feature_layers=[0,1,2]", "train.deepspeed=zero0", "train.logging.wandb=disabled",
                          f"run_dir={tmp_path}/run"], f"feature cache '{cache}'", *fragments, "draftsmith prepare")


@pytest.mark.parametrize("meta,fragments", [
    ([], ["config.json holds a JSON list, not a draftsmith drafter config"]),
    ({"format": "draftsmith-drafter", "format_version": 1, "target": None, "drafter": {"type": "eagle3"}},
     ["does not record the target the drafter was trained for ('target' = None"]),
])
def test_a_damaged_drafter_config(capsys, tmp_path, tiny_target_dir, meta, fragments):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(meta))
    (drafter / "model.safetensors").write_bytes(b"")
    expect_error(capsys, ["export", str(drafter), "--to", "eagle3", "--out", str(tmp_path / "out")], *fragments,
                 "re-save the drafter")
    expect_error(capsys, ["eval", "-c", TRAIN, "drafter.type=saved", f"drafter.path={drafter}",
                          f"target.name={tiny_target_dir}", "target.dtype=float32", f"run_dir={tmp_path}/run"], *fragments)


def _tiny_train_args(run_dir, tiny_target_dir, tiny_train_data, *extra: str) -> list[str]:
    return ["train", "-c", TRAIN, f"target.name={tiny_target_dir}", "target.dtype=float32", "drafter.draft_vocab=",
            "drafter.feature_layers=[0,1,2]", "train.ttt_steps=1", f"train.dataset={tiny_train_data}", "train.batch_size=4", "train.max_length=32", "train.eval.heldout=4",
            "train.deepspeed=zero1", "train.logging.wandb=disabled", "train.logging.progress=false",
            "train.eval.decoder_at_end=false", "train.features=", f"run_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_target_dir, tiny_train_data) -> str:
    """A one-step ZeRO-1 run of the tiny target: checkpoints/step_00000001 holds model and optimizer files."""
    from draftsmith.cli import main

    run_dir = str(tmp_path_factory.mktemp("trained") / "run")
    assert main(_tiny_train_args(run_dir, tiny_target_dir, tiny_train_data, "train.steps=1")) == 0
    return run_dir


STEP = os.path.join("checkpoints", "step_00000001")


def _truncate_optimizer_state(step: str) -> None:
    file = os.path.join(step, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)


def _garble_trainer_state(step: str) -> None:
    with open(os.path.join(step, "trainer_state.json"), "w") as f:
        f.write('{"step": 1, "zero_st')


def _rehash(step: str) -> None:
    """Rewrite the checkpoint's checksums over its damaged files: past the checksum check, the damage itself must
    still be refused in one line (the damaged-file path behind it)."""
    from draftsmith.train.checkpoint import write_checksums

    write_checksums(step)


@pytest.mark.parametrize("damage,fragments", [
    (_truncate_optimizer_state, ["cannot be read (RuntimeError: PytorchStreamReader failed reading zip archive", "damaged"]),
    (_garble_trainer_state, ["trainer_state.json is not valid JSON", "the checkpoint is damaged"]),
])
@pytest.mark.parametrize("checksums", ["kept", "rewritten"])
def test_a_damaged_checkpoint_is_refused_on_resume(capsys, tmp_path, trained_run, tiny_target_dir, tiny_train_data,
                                                   damage, fragments, checksums):
    run_dir = str(tmp_path / "run")
    shutil.copytree(trained_run, run_dir)
    damage(os.path.join(run_dir, STEP))
    if checksums == "kept":  # the checksum check refuses it before anything is read
        fragments = ["does not match its sha256 in checksums.json", "refused"]
    else:
        _rehash(os.path.join(run_dir, STEP))
        fragments = [*fragments, "draftsmith train --resume <run_dir>/checkpoints/step_N"]
    expect_error(capsys, _tiny_train_args(run_dir, tiny_target_dir, tiny_train_data, "train.steps=2"), *fragments)


def test_a_truncated_optimizer_state_is_refused_on_export(capsys, tmp_path, trained_run):
    step = str(tmp_path / "step")
    shutil.copytree(os.path.join(trained_run, STEP), step)
    _truncate_optimizer_state(step)  # under ZeRO-1 it holds the fp32 weights export gathers
    expect_error(capsys, ["export", step, "--to", "eagle3", "--out", str(tmp_path / "out")],
                 "does not match its sha256 in checksums.json")
    _rehash(step)
    expect_error(capsys, ["export", step, "--to", "eagle3", "--out", str(tmp_path / "out")],
                 f"checkpoint '{step}' cannot be read", "damaged")


# ---------------------------------------------------------------- writes the system refuses


def test_a_read_only_run_dir(capsys, tmp_path, monkeypatch):
    from draftsmith import files

    def read_only(directory, path, make):
        raise OSError(errno.EROFS, "Read-only file system", directory)

    monkeypatch.setattr(files, "_create_unique", read_only)  # where every atomic write creates its temporary
    run_dir = tmp_path / "run"
    expect_error(capsys, ["prepare", "-c", "smollm2-135m-prepare", f"run_dir={run_dir}"],
                 f"'{run_dir}' is on a read-only file system", "choose a writable folder")


def _read_only(folder: pathlib.Path) -> list[str]:
    """A command prefix that runs a command with ``folder`` bind-mounted read-only over itself, in a mount namespace of
    its own inside a user namespace (root ignores a chmod, and a user needs no privilege for this); skips the test
    when the system allows no such namespace, saying why."""
    import subprocess

    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("a read-only folder needs unshare and mount (util-linux), which are not installed")
    mount = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
    prefix = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount, str(folder)]
    probe = subprocess.run([*prefix, "touch", str(folder / "probe")], capture_output=True, text=True)
    if probe.returncode == 0 or "Read-only file system" not in probe.stderr:
        (folder / "probe").unlink(missing_ok=True)
        pytest.skip(f"no read-only bind mount in a user + mount namespace here (exit {probe.returncode}): "
                    f"{probe.stderr.strip() or 'the write was not refused'}")
    return prefix


def small_disk(folder: pathlib.Path, size: str) -> list[str]:
    """A command prefix that runs a command with a ``size`` tmpfs mounted on ``folder`` (a real disk that fills up),
    in a mount namespace of its own inside a user namespace; skips the test when the system allows none."""
    import subprocess

    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("a small disk needs unshare and mount (util-linux), which are not installed")
    prefix = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
              'mount -t tmpfs -o size="$1" tmpfs "$0" && shift && exec "$@"', str(folder), size]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no tmpfs in a user + mount namespace here (exit {probe.returncode}): {probe.stderr.strip()}")
    return prefix


def _run_read_only(folder: pathlib.Path, args: list[str]):
    """``draftsmith <args>`` in a subprocess with ``folder`` mounted read-only; the finished process."""
    import subprocess
    import sys

    return subprocess.run([*_read_only(folder), sys.executable, "-m", "draftsmith.cli", *args],
                          capture_output=True, text=True, timeout=1800)


def _is_one_line_naming(done, folder: pathlib.Path) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.splitlines()[-1] == (
        f"draftsmith: error: '{folder}' is on a read-only file system: choose a writable folder (run_dir, "
        f"data.out_dir, --out)")


def _partial(root: pathlib.Path) -> list[str]:
    """Temporary or half-written files and folders under ``root``."""
    names = [os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files]
    return [n for n in names if ".tmp" in n or n.endswith(".partial")]


@pytest.mark.parametrize("read_only", ["run_dir", "checkpoints"])
def test_train_on_a_read_only_folder_is_one_line_naming_it(tmp_path, tiny_target_dir, tiny_train_data, read_only):
    """A real read-only mount (no monkeypatch): over the whole run folder, `train` stops before it loads anything; over
    its checkpoints folder, at the first checkpoint, after a step. Either way one line naming that folder — not
    a file in it — exit 2, and no file left behind half-written or temporary."""
    run_dir = tmp_path / "run"
    folder = run_dir if read_only == "run_dir" else run_dir / "checkpoints"
    folder.mkdir(parents=True)
    done = _run_read_only(folder, _tiny_train_args(run_dir, tiny_target_dir, tiny_train_data, "train.steps=1"))
    _is_one_line_naming(done, folder)
    assert os.listdir(folder) == []
    assert not _partial(run_dir), _partial(run_dir)
    if read_only == "checkpoints":  # it trained: the step's log line is there, the drafter is not
        assert any("loss" in json.loads(line) for line in open(run_dir / "logs" / "train.rank0.jsonl"))
        assert not (run_dir / "drafter").exists()


def test_prepare_on_a_read_only_run_folder_is_one_line_naming_it(tmp_path, tiny_target_dir):
    """A real read-only mount over the run folder (the prepared data goes to <run_dir>/data): `prepare` writes nothing,
    says so in one line naming the run folder, exit 2."""
    source = tmp_path / "convs.jsonl"
    source.write_text("".join(json.dumps({"id": f"q{i}", "messages": [
        {"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]}) + "\n"
        for i in range(3)))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    done = _run_read_only(run_dir, ["prepare", f"target.name={tiny_target_dir}", f"data.sources=[{{path: {source}}}]",
                                    "data.stages=[tokenize]", "data.render.num_proc=1", f"run_dir={run_dir}"])
    _is_one_line_naming(done, run_dir)
    assert os.listdir(run_dir) == []


def test_export_into_a_read_only_folder_is_one_line_naming_it(tmp_path, tiny_target_dir):
    """A real read-only mount over the folder ``--out`` goes in: `export` writes nothing, says so in one line naming
    that folder, exit 2; the drafter is untouched."""
    from draftsmith import drafters
    from draftsmith.drafters import Eagle3Config
    from draftsmith.target import load_target

    target = load_target(tiny_target_dir, "float32", "cpu")
    config = Eagle3Config(feature_layers=[0, 1, 3])
    source = tmp_path / "drafter"
    drafters.save(str(source), config, config.build_module(target), target)
    before = sorted(os.listdir(source))
    parent = tmp_path / "exports"
    parent.mkdir()
    done = _run_read_only(parent, ["export", str(source), "--to", "eagle3", "--out", str(parent / "eagle3")])
    _is_one_line_naming(done, parent)
    assert os.listdir(parent) == [] and sorted(os.listdir(source)) == before
    assert not _partial(tmp_path), _partial(tmp_path)


def test_a_full_disk_during_a_checkpoint_says_so_and_leaves_no_temporary_folder(capsys, tmp_path, monkeypatch,
                                                                                tiny_target_dir, tiny_train_data):
    import torch

    from draftsmith.train import checkpoint

    written = []

    def full(obj, file, *args, **kwargs):
        written.append(str(file))
        with open(file, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    run_dir = tmp_path / "run"
    expect_error(capsys, _tiny_train_args(run_dir, tiny_target_dir, tiny_train_data, "train.steps=1"),
                 f"no space left on {run_dir / 'checkpoints'}", "free some space")
    assert ".tmp-step_" in written[0]  # the partial file was in the checkpoint's temporary folder ...
    assert not [d for d in os.listdir(run_dir / "checkpoints") if d.startswith(".tmp")]  # ... which is gone


def test_a_library_that_hides_the_errno_of_a_full_disk(tmp_path, monkeypatch):
    """torch.save's C++ stream says only "basic_ios::clear": the free space right after the failure tells."""
    import collections

    from draftsmith import errors

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(errors.shutil, "disk_usage", lambda path: usage(10 << 20, 10 << 20, 4096))
    message = errors.write_refusal(RuntimeError("basic_ios::clear: iostream error"), str(tmp_path))
    assert message == f"no space left on {tmp_path}: free some space (or write elsewhere: run_dir, --out) and rerun"
    monkeypatch.setattr(errors.shutil, "disk_usage", lambda path: usage(10 << 30, 1 << 30, 9 << 30))
    assert errors.write_refusal(RuntimeError("basic_ios::clear: iostream error"), str(tmp_path)) is None  # a bug stays one
    assert errors.write_refusal(ValueError("no"), str(tmp_path)) is None


def test_a_full_disk_under_an_output_folder_not_created_yet_names_the_folder_that_exists(tmp_path):
    """`df` on the folder a full-disk line names works: an output folder whose parents are not created yet either is
    named by the nearest folder above it that exists, as is a file the error names inside a folder already removed."""
    from draftsmith.errors import write_refusal

    full = OSError(errno.ENOSPC, "No space left on device")
    rest = ": free some space (or write elsewhere: run_dir, --out) and rerun"
    assert write_refusal(full, str(tmp_path / "runs" / "new" / "data")) == f"no space left on {tmp_path}{rest}"
    assert write_refusal(full, str(tmp_path)) == f"no space left on {tmp_path}{rest}"
    gone = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / ".tmp-tokenized-1" / "data.arrow"))
    assert write_refusal(gone, str(tmp_path / "tokenized")) == f"no space left on {tmp_path}{rest}"


def test_an_error_while_a_progress_bar_is_open_is_the_last_line_and_a_line_of_its_own(capsys, monkeypatch):
    """A stage stopped by an error (a full disk, a server that fails, SIGTERM) has its progress bar open: the message
    was written into the bar's line (``…| 1/3 [00:00<…]draftsmith: error: …``) and the bar drawn again below it."""
    from draftsmith import cli
    from draftsmith.cli import main
    from draftsmith.progress import progress_bar

    def stage(args):
        bar = progress_bar(total=3, desc="features", unit="sample")
        bar.update(1)
        raise DraftsmithError("no space left on /data: free some space and rerun")

    monkeypatch.setattr(cli, "cmd_configs", stage)
    assert main(["configs"]) == 2
    err = capsys.readouterr().err
    assert "features:  33%" in err
    assert err.endswith("\ndraftsmith: error: no space left on /data: free some space and rerun\n"), err[-300:]


def test_every_progress_bar_of_draftsmith_is_one_the_cli_can_end():
    """The CLI ends the bars ``progress.progress_bar`` opened (above): a stage's bar opened as ``tqdm(…)`` would be
    missed. Every call of tqdm in the package's code is that one function's."""
    import ast

    import draftsmith

    root = os.path.dirname(draftsmith.__file__)
    calls = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in {"tests", "benchmarks", "runs", "__pycache__"} and not d.startswith(".")]
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            calls += [f"{os.path.relpath(path, root)}:{node.lineno}" for node in ast.walk(tree)
                      if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "tqdm"]
    assert [call.split(":")[0] for call in calls] == ["progress.py"], calls
