"""Resumable training checkpoints in ``<run_dir>/checkpoints``.

A checkpoint is one folder ``step_00000040/`` holding DeepSpeed's files (model,
optimizer and scheduler state of every rank), each rank's RNG state
(``rng_rank{r}.pt``) and ``trainer_state.json`` (step, data position, counters).
Every rank first writes into a hidden temporary folder; only when all ranks are done
does rank 0 rename it into place and then point ``latest`` at it (both atomic
renames), so a kill at any moment leaves the previous checkpoint intact and
``latest`` never names a half-written one. The folder must be on storage every rank
sees (a shared filesystem on multi-node runs).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

import numpy as np
import torch

from ..errors import DraftsmithError
from ..files import write_json, write_text
from . import distributed
from .distributed import World

CHECKPOINTS = "checkpoints"


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


def save_checkpoint(engine: Any, world: World, run_dir: str, state: dict[str, Any], keep: int) -> str:
    """Write a checkpoint of the engine plus ``state`` (JSON-able); all ranks call this together."""
    root = checkpoint_root(run_dir)
    tag = f"step_{int(state['step']):08d}"
    tmp_tag = f".tmp-{tag}"
    if world.is_main:
        shutil.rmtree(os.path.join(root, tmp_tag), ignore_errors=True)  # left by a killed save
    distributed.barrier()
    distributed.save_engine(engine, root, tmp_tag)
    torch.save(rng_state(), os.path.join(root, tmp_tag, f"rng_rank{world.rank}.pt"))
    distributed.barrier()
    if world.is_main:
        write_json(os.path.join(root, tmp_tag, "trainer_state.json"), state)
        final = os.path.join(root, tag)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(os.path.join(root, tmp_tag), final)
        write_text(os.path.join(root, "latest"), tag + "\n")
        _prune(root, keep)
    distributed.barrier()
    return os.path.join(root, tag)


def load_checkpoint(engine: Any, world: World, path: str) -> dict[str, Any]:
    """Restore the engine and this rank's RNG from ``path``; return the trainer state."""
    path = os.path.abspath(path)
    state_file = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(state_file):
        raise DraftsmithError(f"'{path}' is not a draftsmith checkpoint (no trainer_state.json)")
    with open(state_file, encoding="utf-8") as f:
        state = json.load(f)
    distributed.load_engine(engine, os.path.dirname(path), os.path.basename(path))
    rng_file = os.path.join(path, f"rng_rank{world.rank}.pt")
    if state.get("world_size") == world.world_size and os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        # another number of processes: the data order maps over, per-rank random streams cannot
        seed_everything(int(state.get("seed", 0)) + 1000 * int(state["step"]) + world.rank)
    return state


def rng_state() -> dict[str, Any]:
    out = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
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
