"""Saving: resumable checkpoints, the drafter folders, and the run's summary (train_summary.json).

**drafter-best.** Every held-out evaluation (``train.eval.every`` steps, the untrained drafter at
step 0 when that is on, and the end) logs ``sim_tau`` (``heldout.sim_tau``: the acceptance length the
held-out per-position acceptance predicts at the recipe's ``decode.k``); the drafter of the best one so
far is written to ``<run_dir>/drafter-best`` — the format of ``drafter/`` plus a ``selection`` entry in
its config.json (step, sim_tau, k, basis), written atomically with the weights. That entry is the
best value so far: a resumed run reads it (a drafter-best written after the checkpoint it resumes
from still counts) and never replaces drafter-best with a worse one; ties go to the later, more
trained drafter. A run started afresh replaces whatever drafter-best an earlier run left.

**With a moving average** (``train.ema_decay``, ``train/ema.py``) every evaluation is of the averaged
weights, which also pick drafter-best by the same rule, and the raw weights' figures are logged beside
them (``raw/sim_tau``, ``raw/heldout/…``) — both from one run. ``drafter/`` and ``drafter-best/`` hold the
averaged weights (what a user gets; config.json says so under ``weights``), ``drafter-raw/`` the raw
final ones, and each checkpoint the average's shadow. Off, nothing of this is written.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ..files import write_json
from . import checkpoint, distributed
from .data import Batch
from .heldout import RAW, Metrics, decoder_eval, heldout_figures, log_heldout
from .setup import Run, identity


def save_checkpoint(run: Run, engine: Any) -> str:
    """A resumable checkpoint of the engine and the run's state (all ranks together); its path."""
    state = {**asdict(run.state), "identity": identity(run)}
    ema = run.ema.state_dict() if run.ema is not None and run.world.is_main else None
    return checkpoint.save_checkpoint(engine, run.world, run.run_dir, state, run.cfg.checkpoint.keep, ema=ema)


BEST = "drafter-best"
RAW_DRAFTER = "drafter-raw"
"""With ``train.ema_decay``: the raw (not averaged) final weights, beside ``drafter/``'s average."""


def save_drafter(run: Run, engine: Any, name: str = "drafter", extra: dict[str, Any] | None = None,
                 raw: bool = False) -> str:
    """Write the drafter in the drafters format to ``<run_dir>/<name>`` (ZeRO-3 weights gathered;
    ``extra``: more config.json entries). All ranks call this together; rank 0 writes the trained
    module itself while its weights are whole (tied weights stay tied: stored once). With a moving
    average (``run.ema``) the averaged weights are written, unless ``raw``."""
    from ..drafters import save as save_folder

    path = os.path.join(run.run_dir, name)
    if run.ema is not None:
        extra = {**(extra or {}), "weights": {"kind": "raw" if raw else "ema", "ema_decay": run.ema.decay,
                                              "ema_updates": run.ema.updates}}
    with averaged(run, not raw), distributed.full_weights(engine) as module:
        if run.world.is_main:
            save_folder(path, run.recipe.drafter, module.drafter, run.target, extra=extra)
    distributed.barrier()
    return path


def averaged(run: Run, on: bool = True) -> contextlib.AbstractContextManager[None]:
    """The engine's module holds the moving average's weights in the block (when the run keeps one and ``on``)."""
    return run.ema.applied() if on and run.ema is not None else contextlib.nullcontext()


def baseline(run: Run, engine: Any, heldout_fn: Callable[[Any, Batch], Metrics]) -> None:
    """Held-out metrics of the untrained drafter (step 0), when periodic evaluation is on."""
    if run.state.step == 0 and run.cfg.eval.every > 0:
        evaluate(run, engine, heldout_fn)


def evaluate(run: Run, engine: Any, heldout_fn: Callable[[Any, Batch], Metrics]) -> dict[str, float]:
    """Held-out metrics and sim_tau, logged; ``drafter-best`` kept (:func:`keep_best`). With a moving average: its
    figures, and the raw weights' beside them as ``raw/…`` (before the first step both are the initial weights')."""
    with averaged(run):
        metrics = heldout_figures(run, engine, heldout_fn)
    if run.ema is not None:
        raw = heldout_figures(run, engine, heldout_fn) if run.ema.updates else metrics
        metrics = {**metrics, **{f"{RAW}{k}": v for k, v in raw.items()}}
    log_heldout(run, metrics)
    keep_best(run, engine, metrics["sim_tau"], metrics.get(f"{RAW}sim_tau"))
    return metrics


def selection_basis(run: Run) -> dict[str, Any]:
    """What a sim_tau value is comparable under: the decode depth, whether it simulates greedy decoding, and the
    moving average it is of (``train.ema_decay``; absent = the raw weights)."""
    decode = run.recipe.decode
    basis = {"k": decode.depth, "greedy": decode.warp.greedy, "max_drafts": run.max_drafts}
    if run.ema is not None:
        basis["ema_decay"] = run.ema.decay
    return basis


def best_selection(run_dir: str) -> dict[str, Any] | None:
    """The ``selection`` entry of ``<run_dir>/drafter-best`` (step, sim_tau, k, greedy, …), or None."""
    from ..drafters.checkpoint import read_meta
    from ..errors import DraftsmithError

    path = os.path.join(run_dir, BEST)
    if not os.path.isdir(path):
        return None
    try:
        selection = read_meta(path).get("selection")
    except DraftsmithError:
        return None  # damaged: replaced by the next evaluation
    return selection if isinstance(selection, dict) else None


def keep_best(run: Run, engine: Any, sim_tau: float, raw_sim_tau: float | None = None) -> bool:
    """Record (step, sim_tau[, raw_sim_tau]) on the curve; write ``drafter-best`` when sim_tau is at least the best so
    far (see the module docstring). All ranks call this together; rank 0's view of drafter-best decides."""
    step = run.state.step
    first_of_fresh_run = run.session.step == 0 and not run.state.sim_tau_curve
    point: dict[str, float] = {"step": step, "sim_tau": sim_tau}
    if raw_sim_tau is not None:  # with a moving average: the raw weights' beside it
        point["raw_sim_tau"] = raw_sim_tau
    # a resumed run replays the steps after its checkpoint: their old points are replaced
    run.state.sim_tau_curve = [p for p in run.state.sim_tau_curve if p["step"] < step] + [point]
    basis = selection_basis(run)
    better = 0.0
    if run.world.is_main:
        best = None if first_of_fresh_run else best_selection(run.run_dir)
        comparable = best is not None and all(best.get(k) == v for k, v in basis.items())
        better = float(not comparable or sim_tau >= float(best["sim_tau"]))  # a tie: the later, more trained one
    if not distributed.all_sum([better])[0]:
        return False
    save_drafter(run, engine, BEST, extra={"selection": {"step": step, "sim_tau": sim_tau, **basis,
                                                        "note": "the held-out evaluation with the best sim_tau so far"}})
    run.monitor.note(f"step {step}: sim_tau {sim_tau:.4f} is the best so far; saved {os.path.join(run.run_dir, BEST)}")
    return True


def finish(run: Run, engine: Any, heldout_fn: Callable[[Any, Batch], Metrics]) -> dict[str, Any]:
    """Final held-out metrics (and drafter-best), checkpoint, drafter folder, optional decoder eval; write
    train_summary.json."""
    heldout = evaluate(run, engine, heldout_fn)
    save_checkpoint(run, engine)
    drafter_path = save_drafter(run, engine)
    raw_path = save_drafter(run, engine, RAW_DRAFTER, raw=True) if run.ema is not None else None
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
        "best": best_selection(run.run_dir) if run.world.is_main else None,
        "best_drafter": os.path.join(run.run_dir, BEST),
        "sim_tau_curve": run.state.sim_tau_curve,
        "sim_tau_note": "1 + sum_i prod_{j<=i} alpha_j at the recipe's decode.k, alpha the held-out per-position "
                        "conditional acceptance (greedy: top-1 agreement; sampling: E[sum min(p,q)]) along the "
                        "drafter's own unrolled steps (EAGLE-3) / per head (Medusa, at most its heads) / teacher-forced "
                        "at every position (EAGLE-1, draft LM)",
        "target_fingerprint": run.target.fingerprint,
    }
    if run.ema is not None:
        summary["ema"] = {"decay": run.ema.decay, "updates": run.ema.updates, "raw_drafter": raw_path,
                          "note": "drafter, drafter-best and heldout are the bias-corrected moving average's; "
                                  "heldout's raw/ figures and raw_drafter the raw final weights'"}
    if run.world.is_main:
        write_json(os.path.join(run.run_dir, "train_summary.json"), summary)
    run.monitor.close(summary={k: v for k, v in heldout.items()})
    return {**summary, "rank": run.world.rank}


def _rate(tokens: int, seconds: float) -> float | None:
    return round(tokens / seconds, 3) if seconds > 0 else None
