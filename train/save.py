"""Saving: resumable checkpoints, the drafter folder, and the run's summary (train_summary.json)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ..files import write_json
from . import checkpoint, distributed
from .data import Batch
from .heldout import Metrics, decoder_eval, log_heldout
from .setup import Run, identity


def save_checkpoint(run: Run, engine: Any) -> str:
    """A resumable checkpoint of the engine and the run's state (all ranks together); its path."""
    state = {**asdict(run.state), "identity": identity(run)}
    return checkpoint.save_checkpoint(engine, run.world, run.run_dir, state, run.cfg.checkpoint.keep)


def save_drafter(run: Run, engine: Any) -> str:
    """Write the drafter in the drafters format to ``<run_dir>/drafter`` (ZeRO-3 weights gathered)."""
    from ..drafters import save as save_folder

    path = os.path.join(run.run_dir, "drafter")
    with distributed.full_weights(engine) as module:
        drafter = module.drafter
        state = {k: v.detach().to("cpu", copy=True) for k, v in drafter.state_dict().items()} if run.world.is_main else None
    if run.world.is_main:
        config = run.recipe.drafter
        fresh = config.build_module(run.target)
        fresh.load_state_dict(state)
        save_folder(config.runtime(fresh, run.target), path)
    distributed.barrier()
    return path


def finish(run: Run, engine: Any, heldout_fn: Callable[[Any, Batch], Metrics]) -> dict[str, Any]:
    """Final held-out metrics, checkpoint, drafter folder, optional decoder eval; write train_summary.json."""
    heldout = log_heldout(run, engine, heldout_fn)
    save_checkpoint(run, engine)
    drafter_path = save_drafter(run, engine)
    decoder = decoder_eval(run, drafter_path) if run.cfg.eval.decoder_at_end else None
    summary = {
        "method": run.recipe.drafter.type,
        "steps": run.state.step,
        "micro_steps": run.state.micro_step,
        "tokens": run.state.tokens,
        "skipped": run.state.skipped,
        "world_size": run.world.world_size,
        "zero_stage": distributed.zero_stage(engine),
        "dtype": str(run.dtype).replace("torch.", ""),
        "online_target": not run.offline,
        # the whole run, every session together (setup, evaluation and checkpoints not counted) ...
        "run_train_s": round(run.state.train_s, 3),
        "run_tokens_per_s": _rate(run.state.tokens, run.state.train_s),
        # ... and this process alone (it may have resumed a checkpoint)
        "session": {"steps": run.state.step - run.session.step, "tokens": run.state.tokens - run.session.tokens,
                    "train_s": round(run.state.train_s - run.session.train_s, 3),
                    "tokens_per_s": _rate(run.state.tokens - run.session.tokens, run.state.train_s - run.session.train_s)},
        "heldout": heldout,
        "decoder": decoder,
        "drafter": drafter_path,
        "target_fingerprint": run.target.fingerprint,
    }
    if run.world.is_main:
        write_json(os.path.join(run.run_dir, "train_summary.json"), summary)
    run.monitor.close(summary={k: v for k, v in heldout.items()})
    return {**summary, "rank": run.world.rank}


def _rate(tokens: int, seconds: float) -> float | None:
    return round(tokens / seconds, 3) if seconds > 0 else None
