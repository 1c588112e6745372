"""Each training recipe, in this process, on a tiny target: it learns, saves a loadable drafter,
and handles bad batches (no valid token, NaN loss) with a count and a clear message."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from draftsmith.config import load_recipe
from draftsmith.errors import DraftsmithError
from draftsmith.target import load_target
from draftsmith.train.run import run_training

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_recipe(run_dir, target_dir: str, data_dir: str, method: str, *overrides: str):
    return load_recipe(None, [
        f"target.name={target_dir}", "target.dtype=float32", f"drafter.type={method}",
        f"train.dataset={data_dir}", "train.batch_size=4", "train.max_length=48", "train.eval.heldout=8",
        "train.deepspeed=zero0", "train.logging.wandb=disabled", "train.logging.progress=false",
        "train.logging.every=1", f"run_dir={run_dir}", *overrides,
    ])


def read_log(run_dir, rank: int = 0) -> list[dict]:
    with open(os.path.join(run_dir, "logs", f"train.rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def heldout(log: list[dict], name: str) -> list[float]:
    return [r[f"heldout/{name}"] for r in log if f"heldout/{name}" in r]


def decodes_like_the_target(folder: str, target_dir: str, k: int, tokens: int = 16):
    """The saved drafter ``folder``, loaded against the fp32 target, after checking that it decodes a chat prompt
    token for token as the target's own greedy decoding (``tokens`` of them, k drafts a round)."""
    from draftsmith.decode.rounds import speculative_decode
    from draftsmith.drafters import load
    from draftsmith.decode.reference import target_greedy

    target = load_target(target_dir, "float32", "cpu")
    drafter = load(folder, target)
    prompt = target.render_chat([{"role": "user", "content": "Name three colors."}])
    out = speculative_decode(target, drafter, prompt, k=k, max_new_tokens=tokens)
    assert out.tokens == target_greedy(target, prompt, tokens)[: len(out.tokens)] and len(out.tokens) == tokens
    return drafter


def test_eagle1_learns_and_saves_a_loadable_drafter(tmp_path, tiny_target_dir, tiny_train_data):
    from draftsmith.decode.rounds import speculative_decode
    from draftsmith.drafters import load
    from draftsmith.decode.reference import target_greedy

    recipe = tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "eagle1", "train.steps=12", "train.eval.every=12",
                         "train.optimizer.lr=0.003", "train.loss.kind=soft_ce", "train.loss.feature_weight=1.0",
                         "train.loss.token_weight=0.1", "train.feature_noise=0.05",
                         "train.group_by_length=0")  # the 1.2× gain was set on the random order of these 12 steps
    summary = run_training(recipe)
    log = read_log(tmp_path)
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    acceptance = heldout(log, "acceptance")
    assert len(acceptance) == 2 and acceptance[1] > acceptance[0] * 1.2  # untrained head vs trained one
    assert summary["heldout"]["heldout/acceptance"] == acceptance[1]

    target = load_target(tiny_target_dir, "float32", "cpu")
    assert summary["target_fingerprint"] == target.fingerprint  # the target was frozen: same weights
    drafter = load(summary["drafter"], target)
    prompt = target.render_chat([{"role": "user", "content": "Name three colors."}])
    out = speculative_decode(target, drafter, prompt, k=3, max_new_tokens=12)
    assert out.tokens == target_greedy(target, prompt, 12)[: len(out.tokens)]


@pytest.mark.parametrize("method, gain, extra", [
    ("eagle3", 1.2, ["train.ttt_steps=3", "train.loss.kind=soft_ce", "drafter.feature_layers=[0,1,2]"]),
    # levers of benchmarks/levers.py: the LK losses, GRIFFIN's mask (the head started as the target's layer has its
    # own exact test in test_drafters_eagle.py: on this random target it starts at acceptance 0.56, not from zero)
    ("eagle3", 1.2, ["train.ttt_steps=3", "train.loss.kind=lk_hybrid", "train.align_top_k=1",
                     "drafter.feature_layers=[0,1,2]"]),
    ("eagle3", 1.2, ["train.ttt_steps=2", "train.loss.kind=lk_alpha", "drafter.feature_layers=[0,1,2]"]),
    # a reduced vocabulary: this random target spreads p over ~1100 distinct tokens, so a 2048-token
    # draft vocabulary caps acceptance low; the loss over it must still fall and acceptance rise
    ("eagle3", 1.0, ["train.ttt_steps=2", "train.loss.kind=soft_ce", "drafter.feature_layers=[0,1,2]",
                     "drafter.draft_vocab={draft_vocab}"]),
    # Medusa starts from the target's lm_head (acceptance ≈ 0.55 here) and its residual blocks from
    # zero: ten tiny steps move the held-out loss clearly, the acceptance only a little
    ("medusa", 1.0, ["drafter.num_heads=2", "train.loss.kind=soft_ce", "train.optimizer.lr=0.001"]),
    ("draft_lm", 1.2, ["drafter.num_layers=1", "train.loss.kind=forward_kl", "train.on_policy.fraction=0.5",
                       "train.on_policy.max_new_tokens=8"]),
])
def test_recipe_improves_heldout_metrics(tmp_path, tiny_target_dir, tiny_train_data, draft_vocab, method, gain, extra):
    extra = [x.format(draft_vocab=draft_vocab) for x in extra]
    summary = run_training(tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, method, "train.steps=10",
                                       "train.eval.every=10", "train.optimizer.lr=0.003", *extra))
    log = read_log(tmp_path)
    acceptance, loss = heldout(log, "acceptance"), heldout(log, "loss")
    assert len(acceptance) == 2 and acceptance[1] > acceptance[0] * gain, acceptance
    assert loss[1] < loss[0], loss
    assert summary["method"] == method and summary["steps"] == 10
    if method in ("eagle3", "medusa"):  # per unrolled step / per head, and the chain summary
        assert {"heldout/expected_accept_step0", "heldout/expected_accept_step1", "heldout/top1_step1", "sim_tau"} <= set(log[-1])
        assert summary["heldout"]["heldout/expected_tokens"] > 0


@pytest.mark.parametrize("method,extra", [
    ("eagle1", []), ("eagle3", ["train.ttt_steps=2", "drafter.feature_layers=[0,1,2]"]),
    ("medusa", ["drafter.num_heads=2"]), ("draft_lm", ["drafter.num_layers=1"]),
])
def test_bf16_engine_under_zero2_trains_every_method(tmp_path, tiny_target_dir, tiny_train_data, method, extra):
    """The GPU configuration (bf16 target, bf16 DeepSpeed engine with its fp32 master weights,
    ZeRO-2), run on CPU: the held-out loss falls and the saved drafter drafts for a bf16 target."""
    from draftsmith.decode.rounds import speculative_decode
    from draftsmith.drafters import load

    ds = tmp_path / "bf16_zero2.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "gradient_clipping": 1.0}))
    summary = run_training(tiny_recipe(tmp_path / "run", tiny_target_dir, tiny_train_data, method, "train.steps=6",
                                       "train.eval.every=6", "train.optimizer.lr=0.003", "target.dtype=bfloat16",
                                       f"train.deepspeed={ds}", "train.loss.kind=soft_ce", *extra))
    assert (summary["dtype"], summary["zero_stage"], summary["skipped"]) == ("bfloat16", 2, {})
    loss = heldout(read_log(tmp_path / "run"), "loss")
    assert len(loss) == 2 and loss[1] < loss[0], loss
    target = load_target(tiny_target_dir, "bfloat16", "cpu")
    drafter = load(summary["drafter"], target)
    prompt = target.render_chat([{"role": "user", "content": "Name three colors."}])
    out = speculative_decode(target, drafter, prompt, k=3, max_new_tokens=8)
    assert len(out.tokens) == 8 and out.stats.target_forwards <= 8


def flaky_smooth_l1(monkeypatch, nan_calls) -> None:
    """Make the recipe's training loss NaN on the given (1-based) training calls."""
    from draftsmith.train import losses

    real, calls = losses.smooth_l1, [0]

    def smooth_l1(pred, target, mask, beta=1.0, reduction="mean"):
        out = real(pred, target, mask, beta, reduction)
        if not torch.is_grad_enabled():  # held-out evaluation
            return out
        calls[0] += 1
        return out * float("nan") if nan_calls(calls[0]) else out

    monkeypatch.setattr(losses, "smooth_l1", smooth_l1)


def test_nan_loss_is_skipped_and_counted(tmp_path, monkeypatch, tiny_target_dir, tiny_train_data):
    flaky_smooth_l1(monkeypatch, lambda n: n in (2, 4))
    recipe = tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "eagle1", "train.steps=4", "train.max_bad_steps=2",
                         "train.loss.feature_weight=1.0", "train.deepspeed=zero2")
    summary = run_training(recipe)
    assert summary["skipped"] == {"non_finite_loss": 2}
    assert summary["steps"] == 4 and summary["micro_steps"] == 6  # two micro-batches dropped, not stepped on
    log = read_log(tmp_path)
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log if "loss" in r)
    assert log[-2]["skipped/non_finite_loss"] == 2


def test_nan_loss_stops_after_max_bad_steps(tmp_path, monkeypatch, tiny_target_dir, tiny_train_data):
    flaky_smooth_l1(monkeypatch, lambda n: n >= 2)
    recipe = tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "eagle1", "train.steps=10", "train.max_bad_steps=2",
                         "train.loss.feature_weight=1.0")
    with pytest.raises(DraftsmithError, match=r"NaN or infinite on 3 micro-batches \(train.max_bad_steps = 2\); "
                                              r"stopping at step 1. Lower train.optimizer.lr"):
        run_training(recipe)


def test_out_of_memory_names_the_settings_that_shrink_a_step(tmp_path, monkeypatch, tiny_target_dir, tiny_train_data):
    from draftsmith.train import losses

    def smooth_l1(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(losses, "smooth_l1", smooth_l1)
    recipe = tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "eagle1", "train.steps=2",
                         "train.loss.feature_weight=1.0")
    with pytest.raises(DraftsmithError, match=r"out of memory on cpu at step 0 .* Lower train.batch_size \(4\) or "
                                              r"train.max_length \(48\)") as e:
        run_training(recipe)
    assert isinstance(e.value.__cause__, torch.cuda.OutOfMemoryError)


def test_batches_without_valid_tokens_are_skipped_and_counted(tmp_path, tiny_target_dir, make_tokenized):
    from draftsmith.train.data import BatchOrder, split_heldout

    # 16 records, every other one with no loss token (a prompt with no answer left after truncation)
    ids = [[100 + i, 200 + i, 300 + i, 400 + i, 500 + i, 100 + i] for i in range(16)]
    masks = [[0, 0, 1, 1, 1, 1] if i % 2 else [0] * 6 for i in range(16)]
    data = make_tokenized(tmp_path / "data", ids, masks)
    recipe = tiny_recipe(tmp_path / "run", tiny_target_dir, data, "eagle1", "train.steps=5", "train.batch_size=1",
                         "train.eval.heldout=4")
    summary = run_training(recipe)
    order = BatchOrder(split_heldout(16, 4, 0).train, 1, 1, 0, 0)
    empties = sum(1 for step in range(summary["micro_steps"]) if order.at(step)[0] % 2 == 0)
    assert summary["steps"] == 5 and summary["micro_steps"] == 5 + empties and empties > 0
    assert summary["skipped"] == {"no_valid_tokens": empties}


def test_offline_features_train_like_online_without_running_the_target(tmp_path, monkeypatch, tiny_target_dir,
                                                                        tiny_train_data):
    from draftsmith.data.feature_cache import write_feature_cache
    from draftsmith.data.tokenized import load_tokenized
    from draftsmith.target import Target

    target = load_target(tiny_target_dir, "float32", "cpu")
    cache = str(tmp_path / "features")
    write_feature_cache(load_tokenized(tiny_train_data), cache, target, layer_ids=[0, 1, 2, 3], progress=False)
    from draftsmith.data.feature_cache import FeatureCache
    from draftsmith.train.data import record_lengths

    lengths = [len(x) for x in load_tokenized(tiny_train_data)["input_ids"]]  # what group_by_length sorts by
    assert FeatureCache.open(cache, target).lengths() == record_lengths(load_tokenized(tiny_train_data)) == lengths
    args = ["train.steps=3", "train.ttt_steps=2", "train.loss.kind=soft_ce", "drafter.feature_layers=[0,1,2]"]
    run_training(tiny_recipe(tmp_path / "online", tiny_target_dir, tiny_train_data, "eagle3", *args))

    calls = []
    real_forward = Target.forward
    monkeypatch.setattr(Target, "forward", lambda self, *a, **k: calls.append(1) or real_forward(self, *a, **k))
    summary = run_training(tiny_recipe(tmp_path / "offline", tiny_target_dir, tiny_train_data, "eagle3",
                                       f"train.features={cache}", *args))
    assert calls == [] and summary["online_target"] is False  # features and logits came from the cache
    online = [r["loss"] for r in read_log(tmp_path / "online") if "loss" in r]
    offline = [r["loss"] for r in read_log(tmp_path / "offline") if "loss" in r]
    # the same batches, the same init: only the cache's bf16 rounding of the features differs
    assert offline == pytest.approx(online, rel=2e-2)
    assert offline != online


def test_offline_cache_without_the_layers_a_drafter_needs(tmp_path, tiny_target_dir, tiny_train_data):
    from draftsmith.data.feature_cache import write_feature_cache
    from draftsmith.data.tokenized import load_tokenized

    target = load_target(tiny_target_dir, "float32", "cpu")
    cache = str(tmp_path / "features")
    write_feature_cache(load_tokenized(tiny_train_data), cache, target, layer_ids=[0, 3], progress=False)
    recipe = tiny_recipe(tmp_path / "run", tiny_target_dir, tiny_train_data, "eagle3", f"train.features={cache}",
                         "drafter.feature_layers=[0,1,2]", "train.steps=1")
    with pytest.raises(DraftsmithError, match=r"holds target layers \[0, 3\], but this drafter needs \[0, 1, 2\]"):
        run_training(recipe)


def test_wandb_offline_and_decoder_evaluation_during_training(tmp_path, tiny_target_dir, tiny_train_data):
    from draftsmith.drafters import load
    from draftsmith.measure.prompts import load_questions
    from draftsmith.measure.evaluate import evaluate

    recipe = tiny_recipe(
        tmp_path, tiny_target_dir, tiny_train_data, "eagle1", "train.steps=2", "train.logging.wandb=offline",
        "train.eval.decoder_every=1", "train.eval.decoder_at_end=true", "train.eval.decoder_prompts=1",
        "decode.max_new_tokens=6", "decode.k=2")
    summary = run_training(recipe)
    log = read_log(tmp_path)
    taus = [r["decoder/tau_with_bonus"] for r in log if "decoder/tau_with_bonus" in r]
    assert len(taus) == 2  # step 1 and the end
    end = summary["decoder"]
    assert end["tau_with_bonus"] == taus[-1]
    # τ counts the bonus token of every round that emitted one: what the decoder emitted after each prefill
    assert end["verify_rounds"] * end["tau_with_bonus"] == pytest.approx(end["new_tokens"] - end["sequences"], abs=1e-3)
    # and it is the decoder's τ of the saved drafter: the same greedy decoding again gives the same figures
    target = load_target(tiny_target_dir, "float32", "cpu")
    again = evaluate(target, load(summary["drafter"], target), load_questions(recipe.eval.prompts, 1), recipe.decode,
                     progress=False).stats.summary()
    assert {k: again[k] for k in ("tau_with_bonus", "new_tokens", "accepted", "verify_rounds")} == \
        {k: end[k] for k in ("tau_with_bonus", "new_tokens", "accepted", "verify_rounds")}
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    run_id = (tmp_path / "wandb_id").read_text().strip()
    assert len(runs) == 1 and runs[0].endswith(run_id)
    assert wandb_exit_code(tmp_path) == 0  # finished


def wandb_records(run_dir) -> list:
    """The records of the one offline wandb run in ``run_dir``, read from its ``.wandb`` file (wandb's LevelDB-style
    log: a 7-byte file header, then 32 KiB blocks of chunks, each a 7-byte header (crc, length, type) and its bytes;
    a record is one FULL chunk, or FIRST, MIDDLE…, LAST), as ``wandb sync`` reads them."""
    import glob
    import struct

    from wandb.proto import wandb_internal_pb2

    [path] = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, part, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # no room for a chunk header: the rest of the block is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL, LAST
            records.append(wandb_internal_pb2.Record.FromString(part))
            part = b""
    return records


def wandb_exit_code(run_dir) -> int | None:
    """The exit code the offline wandb run was finished with; None while it is not finished (it reads "running")."""
    ends = [r.exit.exit_code for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "exit"]
    assert len(ends) <= 1, ends
    return ends[0] if ends else None


@pytest.mark.parametrize("how", ["full_disk", "preempted"])
def test_a_failed_run_finishes_its_wandb_run_failed(tmp_path, tiny_target_dir, tiny_train_data, monkeypatch, how):
    """A run that raises finishes its wandb run with the exit code the CLI gives (non-zero: failed) before the error
    leaves ``run_training``: it was left "running" until the interpreter's exit hook finished it, with exit code 0
    under ``python -m draftsmith.cli`` (or never, for a rank its launcher kills). A stop by a signal (SIGUSR1:
    preemption) is 128 + 10, what the process exits with."""
    import errno
    import signal

    from draftsmith.train import checkpoint

    if how == "full_disk":
        def full(obj, file, *args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(checkpoint.torch, "save", full)
        error, code, steps = DraftsmithError, 2, [1, 2]  # "no space left on …/checkpoints": the last checkpoint failed
    else:
        monkeypatch.setattr(checkpoint, "stop_requested", lambda: int(signal.SIGUSR1))
        error, code, steps = checkpoint.Stopped, 128 + signal.SIGUSR1, [1]  # stopped after step 1
    with pytest.raises(error):
        run_training(tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "eagle3", "train.steps=2",
                                 "train.ttt_steps=1", "drafter.feature_layers=[0,1,2]", "train.logging.wandb=offline",
                                 "train.eval.decoder_at_end=false"))
    assert wandb_exit_code(tmp_path) == code
    logged = [r for r in wandb_records(tmp_path) if r.WhichOneof("record_type") == "history"]
    assert [int(i.value_json) for r in logged for i in r.history.item if list(i.nested_key) == ["step"]] == steps


def test_resume_from_a_named_checkpoint_replays_the_same_steps(tmp_path, tiny_target_dir, tiny_train_data):
    from safetensors.torch import load_file

    recipe = tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "eagle1", "train.steps=4", "train.deepspeed=zero1",
                         "train.checkpoint.every=2", "train.checkpoint.keep=2", "train.feature_noise=0.05",
                         "train.loss.feature_weight=1.0")
    run_training(recipe)
    first = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert sorted(os.listdir(tmp_path / "checkpoints"))[:2] == ["latest", "step_00000002"]
    summary = run_training(recipe, resume=str(tmp_path / "checkpoints" / "step_00000002"))
    assert summary["steps"] == 4
    again = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert all(torch.equal(first[k], again[k]) for k in first)
    steps = [r["step"] for r in read_log(tmp_path) if "loss" in r]
    assert steps == [1, 2, 3, 4, 3, 4]  # the second run replayed steps 3 and 4 only


def test_eagle31_norms_train_from_the_recipe(tmp_path, tiny_target_dir, tiny_train_data):
    """drafter.fc_norm / norm_output in the recipe: the norms are trained (off their init of 1) and saved."""
    from safetensors.torch import load_file

    run_training(tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "eagle3", "train.steps=2", "train.ttt_steps=2",
                             "drafter.feature_layers=[0,1,2]", "drafter.fc_norm=true", "drafter.norm_output=true",
                             "train.optimizer.lr=0.003", "train.eval.decoder_at_end=false"))
    saved = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    for i in range(3):
        assert not torch.equal(saved[f"fc_norm.{i}.weight"], torch.ones(64)), i
    meta = json.load(open(tmp_path / "drafter" / "config.json"))
    assert meta["drafter"]["fc_norm"] is True and meta["drafter"]["norm_output"] is True


def test_a_second_train_on_the_same_run_dir_is_refused(tmp_path, tiny_target_dir, tiny_train_data):
    """Two `train` processes on one run folder would interleave checkpoints and logs: the second is refused with the
    first one's pid, and writes nothing; the kernel's lock goes with the process that held it."""
    import subprocess
    import sys

    recipe = tiny_recipe(tmp_path, tiny_target_dir, tiny_train_data, "eagle3", "train.steps=1")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom draftsmith.train.run import using\n"
                               f"with using({str(tmp_path)!r}):\n    print('held', flush=True)\n    time.sleep(600)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DraftsmithError, match=rf"another `draftsmith train` \(pid {holder.pid}\) is using run_dir "
                                                  rf"'{tmp_path}'; wait for it to end, or give this run another run_dir"):
            run_training(recipe)
        assert not (tmp_path / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    from draftsmith.train.run import using

    with using(str(tmp_path)):  # free again once the holder is gone (killed: nothing stale to delete)
        pass


def test_a_tampered_tokenized_file_is_refused_naming_it(tmp_path, tiny_target_dir, tiny_train_data):
    """train checks the tokenized dataset's files against the sha256 its manifest records: one bit flipped in the Arrow
    file (its size intact, so it would still read, with one wrong token) is one line naming that file, before a step
    is taken; a manifest of an older draftsmith, which records no sha256, is read as before."""
    import shutil

    from draftsmith.data.tokenized import MANIFEST
    from draftsmith.files import file_digests
    from draftsmith.train.data import load_rows

    data = tmp_path / "data"
    shutil.copytree(tiny_train_data, data)
    older = json.loads((data / MANIFEST).read_text())
    (data / MANIFEST).write_text(json.dumps({**older, "files": file_digests(str(data), skip=(MANIFEST,))}))
    target = load_target(tiny_target_dir, "float32", "cpu")
    intact = load_rows(str(data), "", target)[:]["input_ids"]
    arrow = data / "data-00000-of-00001.arrow"
    raw = bytearray(arrow.read_bytes())
    raw[raw.rfind(np.asarray(intact[-1], dtype=np.int32).tobytes())] ^= 1  # the last record's first token id
    arrow.write_bytes(bytes(raw))
    run = tmp_path / "run"
    with pytest.raises(DraftsmithError) as refused:
        run_training(tiny_recipe(run, tiny_target_dir, str(data), "eagle3", "train.steps=1"))
    assert str(refused.value) == (f"tokenized dataset '{data}' is damaged: data-00000-of-00001.arrow changed after it "
                                  f"was written (sha256). Re-run `draftsmith prepare` with 'tokenize' in data.stages: "
                                  f"it tokenizes again")
    assert sorted(os.listdir(run)) == [".train.lock", "config.yaml"]  # refused before a log or a checkpoint
    (data / MANIFEST).write_text(json.dumps(older))  # no "files": read unchecked, the flipped bit and all
    tampered = load_rows(str(data), "", target)[:]["input_ids"]
    assert sum(int((a != b).sum()) for a, b in zip(intact, tampered)) == 1
