"""Resumable training checkpoints in ``<run_dir>/checkpoints``.

A checkpoint is one folder ``step_00000040/`` holding DeepSpeed's files (model,
optimizer and scheduler state of every rank), each rank's RNG state
(``rng_rank{r}.pt``), ``trainer_state.json`` (step, data position, counters) and, when
the run keeps a moving average of the weights (``train.ema_decay``), ``ema.safetensors``
(its float32 shadow, which every rank holds alike: rank 0 writes it).
Every rank first writes into a hidden temporary folder; only when all ranks are done
does rank 0 rename it into place and then point ``latest`` at it (both atomic
renames), so a kill at any moment leaves the previous checkpoint intact and
``latest`` never names a half-written one; the next save removes what a killed one left. The folder must be on storage every rank
sees (a shared filesystem on multi-node runs).

Loading never executes code. Before the rename, rank 0 lists every file of the folder with
its sha256 in ``checksums.json``; resume and export refuse a folder whose files are not all
listed with matching checksums (a flipped byte, a truncated file, a file someone added) before
anything is unpickled. Every unpickling is then weights-only, DeepSpeed's own included
(:func:`distributed.weights_only_loads`), so even a folder whose manifest was forged to match
cannot run code: the manifest guards the integrity of the state, the weights-only unpickler
its safety.

Preemption: while a recipe runs (:func:`stop_on_signals`), SIGTERM or SIGUSR1 — what
schedulers send before they take the machines back (SLURM: ``--signal=USR1@120`` or
``scancel``; Kubernetes: SIGTERM then SIGKILL after the grace period) — does not kill
the process: the loop finishes its optimizer step, every rank agrees to stop, a checkpoint
is written and the run exits with 128 + the signal number. Running the same command again
resumes from it. A second signal kills at once.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ..errors import DraftsmithError, writing
from ..files import file_digests, folder_files, sha256_file, swap_dir, write_json, write_text
from . import distributed
from .distributed import World

CHECKPOINTS = "checkpoints"
CHECKSUMS = "checksums.json"
"""In each checkpoint folder: ``{"sha256": {relative path: hex digest}}`` of every other file."""
EMA_FILE = "ema.safetensors"
"""In a checkpoint of a run with ``train.ema_decay``: the shadow of the weights (``train/ema.py``), by the engine
module's parameter names."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_received: list[int] = []
"""Stop signals received while :func:`stop_on_signals` is active (this process only)."""


class Stopped(DraftsmithError):
    """Training stopped on a signal after saving a checkpoint; the same command resumes it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGTERM / SIGUSR1 into a stop request (:func:`stop_requested`) for the duration."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    previous = {sig: signal.signal(sig, _request_stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _received.clear()


def _request_stop(signum: int, frame: Any) -> None:
    _received.append(signum)
    signal.signal(signum, signal.SIG_DFL)  # a second one kills at once


def stop_requested() -> int:
    """The first stop signal this process received (0: none)."""
    return _received[0] if _received else 0


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def latest_checkpoint(run_dir: str) -> str | None:
    """Path of the newest complete checkpoint of a run folder, or None."""
    root = checkpoint_root(run_dir)
    pointer = os.path.join(root, "latest")
    if not os.path.isfile(pointer):
        return None
    with open(pointer, encoding="utf-8") as f:
        path = os.path.join(root, f.read().strip())
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise DraftsmithError(f"{pointer} names '{path}', which is not a complete checkpoint; delete the pointer "
                              f"to start over or point it at an existing step folder")
    return path


def save_checkpoint(engine: Any, world: World, run_dir: str, state: dict[str, Any], keep: int,
                    ema: dict[str, torch.Tensor] | None = None) -> str:
    """Write a checkpoint of the engine plus ``state`` (JSON-able) and the EMA shadow ``ema`` (rank 0's is written: the
    ranks' agree); all ranks call this together."""
    root = checkpoint_root(run_dir)
    tag = f"step_{int(state['step']):08d}"
    tmp_tag = f".tmp-{tag}"
    if world.is_main and os.path.isdir(root):  # every temporary folder is a killed save's: this process holds run_dir
        for name in os.listdir(root):
            if name.startswith(".tmp-step_") or (name.startswith(".latest.") and name.endswith(".tmp")):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    distributed.barrier()
    with writing(root, cleanup=os.path.join(root, tmp_tag)):  # a full disk: said so, no half checkpoint left
        distributed.save_engine(engine, root, tmp_tag)
        torch.save(rng_state(), os.path.join(root, tmp_tag, f"rng_rank{world.rank}.pt"))
        distributed.barrier()
        if world.is_main:
            write_json(os.path.join(root, tmp_tag, "trainer_state.json"), {**state, "zero_stage": distributed.zero_stage(engine)})
            if ema is not None:
                from safetensors.torch import save_file

                save_file(ema, os.path.join(root, tmp_tag, EMA_FILE), metadata={"format": "pt"})
            write_checksums(os.path.join(root, tmp_tag))
            # a rerun of a finished run saves its last step again: the folder ``latest`` names is exchanged, never
            # deleted first
            swap_dir(os.path.join(root, tmp_tag), os.path.join(root, tag))
            write_text(os.path.join(root, "latest"), tag + "\n")
            _prune(root, keep)
    distributed.barrier()
    return os.path.join(root, tag)


def load_checkpoint(engine: Any, world: World, path: str, identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """Restore the engine and this rank's RNG from ``path``; return the trainer state.

    ``identity`` (what the weights and the data position mean: the drafter config, the data,
    the target) must equal the one saved with the checkpoint, when it saved one.
    """
    path = os.path.abspath(path)
    state_file = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(state_file):
        raise DraftsmithError(f"'{path}' is not a draftsmith checkpoint (no trainer_state.json)")
    verify_checksums(path)
    state = _state_json(path)
    check_layout(state, distributed.zero_stage(engine), world.world_size, path)
    check_identity(state.get("identity"), identity, path)
    with damaged(path):
        distributed.load_engine(engine, os.path.dirname(path), os.path.basename(path))
    rng_file = os.path.join(path, f"rng_rank{world.rank}.pt")
    if state.get("world_size") == world.world_size and os.path.isfile(rng_file):
        with damaged(path):
            set_rng_state(load_tensors(rng_file))
    else:
        # another number of processes: the data order maps over, per-rank random streams cannot
        seed_everything(int(state.get("seed", 0)) + 1000 * int(state["step"]) + world.rank)
    return state


def load_ema(path: str) -> dict[str, torch.Tensor]:
    """The EMA shadow of the checkpoint ``path`` (checked by :func:`load_checkpoint` first); refused when it has none."""
    file = os.path.join(os.path.abspath(path), EMA_FILE)
    if not os.path.isfile(file):
        raise DraftsmithError(f"checkpoint '{path}' holds no {EMA_FILE}: train.ema_decay is set, but the run that wrote "
                              f"it kept no moving average; resume it with train.ema_decay unset, or start a new run_dir")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file)
    except SafetensorError as e:
        raise DraftsmithError(f"checkpoint '{path}': {EMA_FILE} cannot be read ({e}); it is damaged: {_DAMAGED_FIX}") from e


ENGINE_MODULE_PREFIX = "drafter."
"""The engine wraps the drafter in ``setup.Forward``, so checkpoint names start with this."""


def read_trainer_state(path: str) -> dict[str, Any]:
    """``trainer_state.json`` of a checkpoint folder, refused unless it records the drafter it holds."""
    path = os.path.abspath(path)
    state = _state_json(path)
    if not isinstance(state.get("identity"), dict) or "zero_stage" not in state:
        raise DraftsmithError(f"checkpoint '{path}' does not record the drafter it holds (identity, zero_stage in "
                              f"trainer_state.json): it was not written by this draftsmith's train")
    return state


def read_checkpoint(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The trainer state and the drafter's whole weights of a checkpoint folder, without an engine: the moving
    average's where the run kept one (``ema.safetensors``; what its ``drafter/`` holds), else the trained ones.

    Any ZeRO stage: ZeRO-0 keeps the module whole in ``mp_rank_00_model_states.pt``; from ZeRO-1 on
    the fp32 master weights are partitioned over the ranks' files and gathered here
    (:func:`distributed.consolidated_weights`). Names are the drafter module's (the engine
    wrapper's prefix removed). A folder that is not a complete draftsmith checkpoint is refused.
    """
    path = os.path.abspath(path)
    state = read_trainer_state(path)
    verify_checksums(path)
    stage = int(state["zero_stage"])
    if stage == 0:
        file = os.path.join(path, "mp_rank_00_model_states.pt")
        if not os.path.isfile(file):
            raise DraftsmithError(f"checkpoint '{path}' is incomplete: it has no {os.path.basename(file)}")
        with damaged(path):
            module = load_tensors(file)["module"]
    else:
        with damaged(path):
            module = distributed.consolidated_weights(os.path.dirname(path), os.path.basename(path))
    if os.path.isfile(os.path.join(path, EMA_FILE)):
        module = {**module, **load_ema(path)}
    weights = {k[len(ENGINE_MODULE_PREFIX):]: v for k, v in module.items() if k.startswith(ENGINE_MODULE_PREFIX)}
    if not weights:
        raise DraftsmithError(f"checkpoint '{path}' holds no drafter weights (no '{ENGINE_MODULE_PREFIX}*' tensors)")
    return state, weights


def write_checksums(folder: str) -> None:
    """Write ``folder/checksums.json``: the sha256 of every file below ``folder`` (atomically, last)."""
    write_json(os.path.join(folder, CHECKSUMS), {"sha256": file_digests(folder, skip=(CHECKSUMS,))})


def verify_checksums(path: str) -> None:
    """Refuse, in one line, a checkpoint folder whose files are not exactly those its ``checksums.json``
    lists with the same sha256 — before any of them is read. Every rank checks the whole folder."""
    manifest = os.path.join(path, CHECKSUMS)
    try:
        with open(manifest, encoding="utf-8") as f:
            listed = json.load(f)
    except FileNotFoundError:
        raise DraftsmithError(f"checkpoint '{path}' has no {CHECKSUMS} (the sha256 of each file, which draftsmith train "
                              f"writes with every checkpoint): refused, its files cannot be told from files someone "
                              f"else put there; resume or export only checkpoints this draftsmith wrote") from None
    except (OSError, ValueError):
        listed = None
    listed = listed.get("sha256") if isinstance(listed, dict) else None
    if not isinstance(listed, dict):
        raise DraftsmithError(f"checkpoint '{path}': {CHECKSUMS} is unreadable or not a checksum list; the checkpoint "
                              f"is damaged")
    present = folder_files(path, skip=(CHECKSUMS,))
    for name in present:
        if name not in listed:
            raise DraftsmithError(f"checkpoint '{path}' holds {name}, which its {CHECKSUMS} does not list: refused, "
                                  f"draftsmith did not write it; remove it to use this checkpoint")
        if sha256_file(os.path.join(path, name)) != listed[name]:
            raise DraftsmithError(f"checkpoint '{path}': {name} does not match its sha256 in {CHECKSUMS}, it changed "
                                  f"after draftsmith saved it: refused; resume from another checkpoint (point "
                                  f"{os.path.join(os.path.dirname(path), 'latest')} at it) or start a new run_dir")
    missing = sorted(set(listed) - set(present))
    if missing:
        raise DraftsmithError(f"checkpoint '{path}' lacks {', '.join(missing[:3])}, listed in its {CHECKSUMS}: it is "
                              f"incomplete")


def load_tensors(file: str) -> Any:
    """``torch.load(weights_only=True)`` on CPU: tensors and plain containers, nothing that could run code."""
    import pickle

    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise distributed.unsafe_checkpoint(os.path.dirname(file), e) from e


def _state_json(path: str) -> dict[str, Any]:
    """The parsed ``trainer_state.json`` of the checkpoint folder ``path``; a missing or damaged one is refused."""
    state_file = os.path.join(path, "trainer_state.json")
    if not os.path.isdir(path) or not os.path.isfile(state_file):
        raise DraftsmithError(f"'{path}' is not a draftsmith checkpoint folder (no trainer_state.json; a complete one "
                              f"is <run_dir>/checkpoints/step_N, written by draftsmith train)")
    try:
        with open(state_file, encoding="utf-8") as f:
            state = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftsmithError(f"{state_file} is not valid JSON ({e}); the checkpoint is damaged: {_DAMAGED_FIX}") from e
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise DraftsmithError(f"{state_file} does not hold a trainer state (a JSON object with the step); the "
                              f"checkpoint is damaged: {_DAMAGED_FIX}")
    return state


_DAMAGED_FIX = ("resume from an earlier one (draftsmith train --resume <run_dir>/checkpoints/step_N) or delete it "
                "(and <run_dir>/checkpoints/latest) to start over")


@contextmanager
def damaged(path: str) -> Iterator[None]:
    """Reading the tensor files of checkpoint ``path``: a truncated or garbled one (torch's zip reader, the
    unpickler, DeepSpeed's state-dict lookups) is refused in one line that names the checkpoint."""
    import pickle

    try:
        yield
    except DraftsmithError:
        raise
    except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError, KeyError, TypeError) as e:
        reason = str(e).splitlines()[0].split(". ")[0][:200] if str(e) else type(e).__name__
        raise DraftsmithError(f"checkpoint '{path}' cannot be read ({type(e).__name__}: {reason}); it is damaged: "
                              f"{_DAMAGED_FIX}") from e


def check_layout(state: dict[str, Any], stage: int, world_size: int, path: str) -> None:
    """Refuse, before DeepSpeed tries, a checkpoint whose optimizer state this run cannot read.

    The ZeRO stage decides the files a checkpoint holds, so it must match; from ZeRO-1 on the
    optimizer state is partitioned over the processes, so their number must match too (ZeRO-0
    keeps it whole and resumes on any number of processes).
    """
    saved_stage, saved_world = state.get("zero_stage"), state.get("world_size")
    if saved_stage is not None and saved_stage != stage:
        raise DraftsmithError(
            f"checkpoint '{path}' was written with ZeRO stage {saved_stage}, but this run uses stage {stage}; resume "
            f"with the engine config it was made with (train.deepspeed=zero{saved_stage} or the same JSON), or start "
            f"a new run in another run_dir")
    if stage > 0 and saved_world is not None and saved_world != world_size:
        raise DraftsmithError(
            f"checkpoint '{path}' was written by {saved_world} processes with ZeRO-{stage}, whose optimizer state is "
            f"partitioned per process, and this run has {world_size}; resume on {saved_world} processes, or start a "
            f"new run in another run_dir (ZeRO-0 checkpoints resume on any number of processes)")


def check_identity(saved: dict[str, Any] | None, current: dict[str, Any] | None, path: str) -> None:
    """Refuse to resume a checkpoint made for another drafter, data or target, naming what changed."""
    if saved is None or current is None:
        return
    changed = sorted(_differences(saved, current))
    if changed:
        shown = "; ".join(f"{key}: {a!r} then, {b!r} now" for key, a, b in changed[:6])
        raise DraftsmithError(
            f"checkpoint '{path}' was made for another run: {shown}. Its weights or data position would not fit; "
            f"restore those settings to resume, or train into a new run_dir")


def _differences(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in _differences(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else str(k))]
    return [] if a == b else [(prefix, a, b)]


def rng_state() -> dict[str, Any]:
    """Every random stream of this process, as tensors and plain values (``torch.load(weights_only=True)``
    reads it back: numpy's key array travels as an int64 tensor, not a pickled ndarray)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    out = {"python": random.getstate(), "torch": torch.get_rng_state(),
           "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _prune(root: str, keep: int) -> None:
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_") and os.path.isdir(os.path.join(root, d)))
    for old in steps[: max(len(steps) - max(keep, 1), 0)]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
