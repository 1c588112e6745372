"""Real multi-process DeepSpeed runs on CPU (gloo), and resume after a real kill.

Each run is a `draftsmith train` subprocess on the tiny target, kept to a few steps: two
processes under torchrun with ZeRO-2, two under the deepspeed launcher with ZeRO-3, and a
single process killed with SIGKILL (or preempted with SIGTERM) mid-run then resumed. Tests check the runs' results
(logs, summaries, saved drafters), not only exit codes: about 1 in 10 two-process ZeRO-3 gloo
runs crash *at exit* after finishing ("terminate called without an active exception").
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from draftsmith.config import load_recipe
from draftsmith.target import load_target
from draftsmith.train.run import run_training

pytestmark = pytest.mark.slow

BIN = os.path.dirname(sys.executable)


def overrides(target_dir: str, data_dir: str, run_dir, *extra: str) -> list[str]:
    # a random head (the recipe starts it from the target's last layer, which on this random target already drafts
    # better than a few steps of training: the loss and best-step checks below are about the distributed loop)
    return [f"target.name={target_dir}", "target.dtype=float32", "drafter.type=eagle3", "drafter.feature_layers=[0,1,2]",
            "drafter.init_from_layer=null",
            f"train.dataset={data_dir}", "train.batch_size=2", "train.max_length=48", "train.eval.heldout=8",
            "train.ttt_steps=2", "train.optimizer.lr=0.003", "train.loss.kind=soft_ce", "train.logging.wandb=disabled",
            "train.logging.progress=false", "train.logging.every=1", "train.schedule.warmup_steps=0",
            "train.eval.decoder_at_end=false", f"run_dir={run_dir}", *extra]


def env() -> dict[str, str]:
    # one thread per process: two processes share two cores, and tiny models run fastest so
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def launch(launcher: list[str], args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [*launcher, os.path.join(BIN, "draftsmith"), "train", "--config", "smollm2-135m-eagle3", *args]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)


def rank_losses(run_dir, rank: int) -> list[float]:
    with open(os.path.join(run_dir, "logs", f"train.rank{rank}.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def summary_of(run_dir, proc: subprocess.CompletedProcess) -> dict:
    path = os.path.join(run_dir, "train_summary.json")
    assert os.path.isfile(path), f"the run wrote no summary (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(path) as f:
        return json.load(f)


def test_two_processes_zero2_under_torchrun(tmp_path, tiny_target_dir, tiny_train_data):
    """Two ranks with ZeRO-2 and a moving average of the weights (each rank keeps its own, from the weights all ranks
    share): the loss falls on both, and the drafter saved is the average the checkpoint holds."""
    from safetensors.torch import load_file

    from draftsmith.train.checkpoint import read_checkpoint

    run_dir = tmp_path / "run"
    proc = launch([os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", free_port()],
                  overrides(tiny_target_dir, tiny_train_data, run_dir, "train.steps=8", "train.deepspeed=zero2",
                            "train.ema_decay=0.9", "train.eval.every=4"))
    summary = summary_of(run_dir, proc)
    assert (summary["world_size"], summary["zero_stage"], summary["steps"]) == (2, 2, 8)
    first, second = rank_losses(run_dir, 0), rank_losses(run_dir, 1)
    assert len(first) == len(second) == 8
    assert first != second  # each rank trains on its own shard of the data
    for losses in (first, second):  # the loss goes down on both ranks
        assert sum(losses[-3:]) < sum(losses[:3]), losses
    assert summary["ema"]["updates"] == 8 and "raw/sim_tau" in summary["heldout"]
    saved, raw = (load_file(os.path.join(run_dir, d, "model.safetensors")) for d in ("drafter", "drafter-raw"))
    _, shadow = read_checkpoint(os.path.join(run_dir, "checkpoints", "step_00000008"))
    assert all(torch.equal(saved[k], shadow[k]) for k in saved) and not torch.equal(saved["fc.weight"], raw["fc.weight"])


def test_zero3_under_the_deepspeed_launcher_saves_a_whole_drafter(tmp_path, tiny_target_dir, tiny_train_data):
    from draftsmith.decode.rounds import speculative_decode
    from draftsmith.drafters import load
    from draftsmith.decode.reference import target_greedy

    run_dir = tmp_path / "run"
    proc = launch([os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", free_port()],
                  overrides(tiny_target_dir, tiny_train_data, run_dir, "train.steps=4", "train.deepspeed=zero3"))
    summary = summary_of(run_dir, proc)
    assert (summary["world_size"], summary["zero_stage"]) == (2, 3)
    ckpt = os.path.join(run_dir, "checkpoints", "step_00000004")
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= set(os.listdir(ckpt))  # partitioned
    target = load_target(tiny_target_dir, "float32", "cpu")
    drafter = load(summary["drafter"], target)  # gathered: every tensor has its full shape
    fresh = load_recipe("smollm2-135m-eagle3", overrides(tiny_target_dir, tiny_train_data, tmp_path / "x")).drafter
    init = fresh.build_module(target).state_dict()
    trained = drafter.module.state_dict()
    for name, tensor in init.items():
        assert trained[name].shape == tensor.shape, name
    assert not torch.equal(trained["fc.weight"], init["fc.weight"])  # and it holds the trained weights
    best = load(summary["best_drafter"], target).module.state_dict()  # drafter-best: gathered the same way
    assert summary["best"]["step"] == 4 and all(torch.equal(best[n], trained[n]) for n in trained)  # the end only
    prompt = target.render_chat([{"role": "user", "content": "Hi!"}])
    out = speculative_decode(target, drafter, prompt, k=3, max_new_tokens=10)
    assert out.tokens == target_greedy(target, prompt, 10)[: len(out.tokens)]
    # export straight from the two ranks' partitions gives the saved drafter's tensors
    from safetensors.torch import load_file

    from draftsmith.export import export

    export(ckpt, "eagle3", str(tmp_path / "from_ckpt"))
    export(summary["drafter"], "eagle3", str(tmp_path / "from_drafter"))
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("from_ckpt", "from_drafter"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


RESUME_ARGS = ["train.steps=10", "train.feature_noise=0.05", "train.checkpoint.keep=1", "train.schedule.kind=cosine",
               "train.schedule.warmup_steps=2", "train.ema_decay=0.8"]
"""Gradient accumulation (the JSON below), feature noise (RNG), a decaying LR and a moving average of the weights
(drafter/ holds it, drafter-raw/ the trained weights) are all in play."""
RESUMED_DRAFTERS = ("drafter", "drafter-raw")


def resume_args(tmp_path, *extra: str) -> list[str]:
    ds_json = tmp_path / "zero2_gas2.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": False},
                                   "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}))
    return [*RESUME_ARGS, f"train.deepspeed={ds_json}", *extra]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_target_dir, tiny_train_data) -> dict[str, dict[str, torch.Tensor]]:
    """The drafter folders' weights (:data:`RESUMED_DRAFTERS`) of the resume tests' run, trained without
    interruption."""
    from safetensors.torch import load_file

    tmp = tmp_path_factory.mktemp("uninterrupted")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_training(load_recipe("smollm2-135m-eagle3",
                                 overrides(tiny_target_dir, tiny_train_data, tmp / "run", *resume_args(tmp))))
    finally:
        torch.set_num_threads(threads)
    return {d: load_file(os.path.join(tmp, "run", d, "model.safetensors")) for d in RESUMED_DRAFTERS}


def interrupt(tmp_path, args: list[str], run_dir, sig: signal.Signals, after_step: int) -> subprocess.Popen:
    """Start `draftsmith train`, send ``sig`` once its log shows step ``after_step``; return the ended process."""
    cmd = [os.path.join(BIN, "draftsmith"), "train", "--config", "smollm2-135m-eagle3", *args]
    err = tmp_path / f"{sig.name}.err"
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=open(err, "w"))
    log = run_dir / "logs" / "train.rank0.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if log.is_file() and any(json.loads(line).get("step", 0) >= after_step for line in log.read_text().splitlines()):
            proc.send_signal(sig)
            break
        time.sleep(0.02)
    proc.wait(timeout=120)
    proc.stderr_text = err.read_text()
    assert not (run_dir / "train_summary.json").exists(), "the run ended before it could be interrupted mid-way"
    return proc


def resume_and_compare(args: list[str], run_dir, uninterrupted: dict[str, dict[str, torch.Tensor]]) -> None:
    """Re-run the same command; it must resume, finish, and end with the uninterrupted run's weights: the moving
    average's (drafter/, restored from the checkpoint's shadow) and the trained ones (drafter-raw/)."""
    from safetensors.torch import load_file

    cmd = [os.path.join(BIN, "draftsmith"), "train", "--config", "smollm2-135m-eagle3", *args]
    resumed = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert "resumed from" in resumed.stdout + resumed.stderr, resumed.stderr[-3000:]
    summary = summary_of(run_dir, resumed)
    assert summary["steps"] == 10 and summary["micro_steps"] == 20
    for name in RESUMED_DRAFTERS:
        weights, want = load_file(os.path.join(run_dir, name, "model.safetensors")), uninterrupted[name]
        assert weights.keys() == want.keys()
        worst = max(float((weights[k].float() - want[k].float()).abs().max()) for k in weights)
        print(f"{name}: resumed vs uninterrupted: max weight difference {worst}")
        assert worst <= 1e-6, f"resumed {name} weights differ from the uninterrupted run's by up to {worst}"
    assert summary["ema"]["updates"] == 10


def test_killed_run_resumes_to_the_same_weights(tmp_path, tiny_target_dir, tiny_train_data, uninterrupted):
    """SIGKILL after the step-4 checkpoint, re-run the same command: the final weights equal an
    uninterrupted run's."""
    run_dir = tmp_path / "killed"
    args = overrides(tiny_target_dir, tiny_train_data, run_dir, *resume_args(tmp_path, "train.checkpoint.every=4"))
    proc = interrupt(tmp_path, args, run_dir, signal.SIGKILL, after_step=5)
    assert proc.returncode == -signal.SIGKILL, proc.stderr_text[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    resume_and_compare(args, run_dir, uninterrupted)


def test_preempted_run_checkpoints_on_sigterm_and_resumes(tmp_path, tiny_target_dir, tiny_train_data, uninterrupted):
    """SIGTERM (a scheduler's preemption) with no periodic checkpoint due: the run saves one at the
    end of the step it is in, exits with 128 + 15, and the same command resumes to the same weights."""
    run_dir = tmp_path / "preempted"
    args = overrides(tiny_target_dir, tiny_train_data, run_dir, *resume_args(tmp_path, "train.checkpoint.every=0"))
    proc = interrupt(tmp_path, args, run_dir, signal.SIGTERM, after_step=3)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr_text[-3000:]
    assert "stopped by SIGTERM after step" in proc.stderr_text and "run the same command again" in proc.stderr_text
    assert proc.stderr_text.count("stopped by SIGTERM after step") == 1  # printed once, by the CLI
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert 3 <= int(latest.removeprefix("step_")) < 10, latest
    resume_and_compare(args, run_dir, uninterrupted)


def test_resuming_with_another_zero_stage_is_refused(tmp_path, tiny_target_dir, tiny_train_data, one_thread):
    from draftsmith.errors import DraftsmithError

    run_dir = tmp_path / "run"
    run_training(load_recipe("smollm2-135m-eagle3", overrides(tiny_target_dir, tiny_train_data, run_dir,
                                                              "train.steps=1", "train.deepspeed=zero0")))
    again = overrides(tiny_target_dir, tiny_train_data, run_dir, "train.steps=2", "train.deepspeed=zero2")
    with pytest.raises(DraftsmithError, match=r"written with ZeRO stage 0, but this run uses stage 2.*train.deepspeed=zero0"):
        run_training(load_recipe("smollm2-135m-eagle3", again))


def test_partitioned_optimizer_state_needs_the_same_number_of_processes():
    from draftsmith.errors import DraftsmithError
    from draftsmith.train.checkpoint import check_layout

    check_layout({"zero_stage": 0, "world_size": 2}, 0, 1, "ckpt")  # ZeRO-0: whole optimizer state, any world
    check_layout({"zero_stage": 2, "world_size": 2}, 2, 2, "ckpt")
    check_layout({"step": 3}, 2, 4, "ckpt")  # written before the layout was recorded: DeepSpeed decides
    with pytest.raises(DraftsmithError, match="written by 2 processes with ZeRO-2.*resume on 2 processes"):
        check_layout({"zero_stage": 2, "world_size": 2}, 2, 1, "ckpt")


def test_resuming_with_another_drafter_or_data_is_refused(tmp_path, tiny_target_dir, tiny_train_data, one_thread):
    from draftsmith.errors import DraftsmithError

    run_dir = tmp_path / "run"
    run_training(load_recipe("smollm2-135m-eagle3", overrides(tiny_target_dir, tiny_train_data, run_dir, "train.steps=1")))
    changed = {"drafter.feature_layers=[1,2,3]": r"drafter.feature_layers: \[0, 1, 2\] then, \[1, 2, 3\] now",
               "train.batch_size=3": "train.batch_size: 2 then, 3 now"}
    for override, message in changed.items():
        again = overrides(tiny_target_dir, tiny_train_data, run_dir, "train.steps=2", override)
        with pytest.raises(DraftsmithError, match=f"was made for another run: {message}.*train into a new run_dir"):
            run_training(load_recipe("smollm2-135m-eagle3", again))
    # the learning rate and the number of steps may change: training continues
    summary = run_training(load_recipe("smollm2-135m-eagle3", overrides(
        tiny_target_dir, tiny_train_data, run_dir, "train.steps=2", "train.optimizer.lr=0.001")))
    assert summary["steps"] == 2


def test_two_ranks_weigh_every_token_like_one_process_holding_both(tmp_path, tiny_target_dir, make_tokenized):
    """Per-token normalization across ranks: two processes (batch 1 each, a 3-token and a 40-token
    answer) take the same first step as one process with both in its micro-batch. AdamW with
    lr = eps = 1000 makes the first update −lr·g/(|g|+eps) ≈ −g, so the weights after one step
    compare the gradients; averaging per rank instead would weigh each of the 3 tokens 13× more."""
    from safetensors.torch import load_file

    from draftsmith.train.data import BatchOrder, split_heldout

    order = BatchOrder(split_heldout(12, 8, 0).train, 1, 2, 0, 0)
    short, long = order.at(0)[0], BatchOrder(split_heldout(12, 8, 0).train, 1, 2, 1, 0).at(0)[0]
    assert sorted(BatchOrder(split_heldout(12, 8, 0).train, 2, 1, 0, 0).at(0)) == sorted([short, long])
    g = torch.Generator().manual_seed(1)
    ids, masks = [], []
    for i in range(12):
        answer = 3 if i == short else 40 if i == long else 12
        ids.append(torch.randint(100, 600, (4 + answer,), generator=g).tolist())
        masks.append([0] * 4 + [1] * answer)
    data = make_tokenized(tmp_path / "data", ids, masks)
    step = ["train.steps=1", "train.eval.heldout=8", "train.deepspeed=zero0", "train.schedule.kind=constant",
            "train.optimizer.weight_decay=0.0", "train.optimizer.eps=1000.0"]

    def weights(run_dir, batch_size: int, lr: float, launcher: list[str] | None = None) -> dict[str, torch.Tensor]:
        args = overrides(tiny_target_dir, data, run_dir, *step, f"train.batch_size={batch_size}",
                         f"train.optimizer.lr={lr}")
        if launcher:
            summary_of(run_dir, launch(launcher, args))
        else:
            run_training(load_recipe("smollm2-135m-eagle3", args))
        return load_file(os.path.join(run_dir, "drafter", "model.safetensors"))

    two = weights(tmp_path / "two", 1, 1000.0, [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2",
                                                 "--master_port", free_port()])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = weights(tmp_path / "one", 2, 1000.0)
        start = weights(tmp_path / "start", 2, 1e-30)  # the initial weights
    finally:
        torch.set_num_threads(threads)
    trained = [k for k in one if one[k].is_floating_point()]
    moved = max(float((one[k] - start[k]).abs().max()) for k in trained)
    worst = max(float((two[k] - one[k]).abs().max()) for k in trained)
    print(f"first update up to {moved:.3e}; two ranks vs one process differ by up to {worst:.3e}")
    assert moved > 1e-3 and worst < 1e-4 * moved


def test_a_second_launch_on_the_same_run_dir_is_refused_in_one_line(tmp_path, tiny_target_dir, tiny_train_data):
    """Two torchrun launches of two processes each on one run folder, started at once: one trains, the other is
    refused in one line (by its rank 0) before any of its ranks writes; the winner's run is whole: every rank logs each
    step once, and its last checkpoint holds the weights of the drafter it saved."""
    from safetensors.torch import load_file

    from draftsmith.train.distributed import consolidated_weights

    run_dir = tmp_path / "run"
    args = overrides(tiny_target_dir, tiny_train_data, run_dir, "train.steps=4", "train.deepspeed=zero2")
    cmd = [os.path.join(BIN, "draftsmith"), "train", "--config", "smollm2-135m-eagle3", *args]
    procs = [subprocess.Popen([os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", free_port(),
                               *cmd], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    ended = [(*p.communicate(timeout=300), p.returncode) for p in procs]
    assert sorted(code for _, _, code in ended) == [0, 1], [err[-3000:] for _, err, _ in ended]  # torchrun: 1
    won, lost = sorted(ended, key=lambda e: e[2])
    said = [line for line in lost[1].splitlines() if line.startswith("draftsmith: ")]
    assert len(said) == 1, said  # not one line per rank
    holder = (run_dir / ".train.lock").read_text().strip()  # the winner's rank 0
    assert said == [f"draftsmith: error: another `draftsmith train` (pid {holder}) is using run_dir '{run_dir}'; wait "
                    f"for it to end, or give this run another run_dir"], said
    summary = summary_of(run_dir, subprocess.CompletedProcess([], won[2], *won[:2]))
    assert (summary["world_size"], summary["steps"]) == (2, 4)
    for rank in (0, 1):
        with open(os.path.join(run_dir, "logs", f"train.rank{rank}.jsonl")) as f:
            assert [r["step"] for r in map(json.loads, f) if "loss" in r] == [1, 2, 3, 4]
    saved = load_file(os.path.join(run_dir, "drafter", "model.safetensors"))
    last = consolidated_weights(os.path.join(run_dir, "checkpoints"), "step_00000004")
    assert {f"drafter.{k}" for k in saved} == set(last) - {"drafter.embed_tokens.weight"}  # the target's, not saved
    assert all(torch.equal(saved[k], last[f"drafter.{k}"]) for k in saved)
