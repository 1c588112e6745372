"""What a training run shows and records: a progress bar, per-rank JSONL logs, wandb.

* ``<run_dir>/logs/train.rank{r}.jsonl`` — every rank logs its own local metrics (so a
  test, or a person, can see each rank's loss go down), rank 0 adds the global ones;
* a tqdm bar on rank 0: optimizer steps, tokens/s, loss, ETA;
* wandb on rank 0: online when a key is configured, else offline (files under
  ``<run_dir>/wandb``, ``wandb sync`` uploads them later), or disabled. The run id is
  kept in ``<run_dir>/wandb_id`` so that a resumed run continues the same wandb run. A run that raises is finished
  failed (:func:`closed_on_error`), not left "running" until the interpreter exits, whose hook guesses the exit code
  (0, "finished", under ``python -m draftsmith.cli``; a peer killed by its launcher finishes nothing).
"""

from __future__ import annotations

import contextlib
import json
import netrc
import os
import time
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

from tqdm import tqdm

from ..errors import DraftsmithError
from ..files import write_text
from ..progress import progress_bar


def wandb_mode(requested: str) -> str:
    """``auto`` → $WANDB_MODE if set, else online with a configured key, else offline."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


class Monitor:
    def __init__(
        self,
        run_dir: str,
        rank: int,
        total_steps: int,
        start_step: int,
        config: dict[str, Any],
        wandb: str = "auto",
        wandb_project: str = "draftsmith",
        progress: bool = True,
    ):
        self.rank = rank
        self.log_path = os.path.join(run_dir, "logs", f"train.rank{rank}.jsonl")
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self._log = open(self.log_path, "a", encoding="utf-8")
        self.bar = progress_bar(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        disable=not (progress and rank == 0))
        self.wandb_run = None
        self.mode = wandb_mode(wandb)
        _OPEN.add(self)
        if rank == 0 and self.mode != "disabled":
            self.wandb_run = _start_wandb(run_dir, self.mode, wandb_project, config)

    def advance(self, steps: int = 1) -> None:
        self.bar.update(steps)

    def log(self, step: int, metrics: dict[str, Any], shared: dict[str, Any] | None = None) -> None:
        """``metrics`` are this rank's; ``shared`` are global (identical on all ranks), written by rank 0."""
        record = {"step": step, "rank": self.rank, "time": round(time.time(), 3), **metrics}
        if self.rank == 0 and shared:
            record.update(shared)
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()
        if self.rank != 0:
            return
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "rank"}, step=step)
        show = {k: record[k] for k in ("loss", "tokens_per_s") if k in record}
        if show:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in show.items()}, refresh=False)

    def note(self, text: str) -> None:
        """A line for the person watching (rank 0), printed above the bar."""
        if self.rank == 0:
            tqdm.write(text)

    def close(self, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
        """End the bar and the log; finish the wandb run with ``summary`` and ``exit_code`` (non-zero: failed)."""
        _OPEN.discard(self)
        self.bar.close()
        self._log.close()
        if self.wandb_run is not None:
            if summary:
                for k, v in summary.items():
                    self.wandb_run.summary[k] = v
            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None


_OPEN: weakref.WeakSet[Monitor] = weakref.WeakSet()
"""The monitors of this process not closed yet."""


@contextlib.contextmanager
def closed_on_error() -> Iterator[None]:
    """Run a training; when it raises, close the monitors it left open, the wandb run finished with the exit code the
    CLI gives the error (a stop by a signal: 128 + the signal's number; another DraftsmithError: 2; a bug: 1), so that
    it reads failed, not finished or running."""
    try:
        yield
    except BaseException as e:
        code = int(getattr(e, "exit_code", 2 if isinstance(e, DraftsmithError) else 1))
        for monitor in list(_OPEN):
            monitor.close(exit_code=code)
        raise


def _start_wandb(run_dir: str, mode: str, project: str, config: dict[str, Any]) -> Any:
    import wandb

    id_file = os.path.join(run_dir, "wandb_id")
    if os.path.isfile(id_file):
        with open(id_file, encoding="utf-8") as f:
            run_id = f.read().strip()
    else:
        run_id = uuid.uuid4().hex[:12]
        write_text(id_file, run_id + "\n")
    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(project=project, dir=run_dir, mode=mode, config=config, id=run_id, resume="allow",
                      name=os.path.basename(os.path.abspath(run_dir)))
