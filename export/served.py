"""What a GGUF export is served with in llama.cpp: its best measured setting, recorded in the export.

``export --check`` (``run.check_gguf``) and ``eval.engine=llamacpp`` (``measure/engine_eval.py``, handed
:func:`record_best` by ``run.export_gguf_draft``) sweep the draft length k and ``--spec-draft-p-min`` through the
same ``measure.engine.measure`` and record its fastest setting (``measure.engine.best_setting``) with the target
GGUF type it was measured on in the export's ``draftsmith_export.json``, under ``gguf.served``
(:func:`record_best`); :func:`serve_command` is the ``llama-server`` command that serves the export with it. Below
``run.py`` (which imports it), so it takes the record's path rather than reading ``run.INFO_FILE``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..engines import llamacpp
from ..engines.targets import target_gguf_for
from ..files import write_json
from ..measure.engine import command, describe_best, measure
from . import gguf
from .tensors import read_json


@dataclass(frozen=True)
class Sweep:
    """What ``export --check`` of a GGUF export serves to find the export's best setting (a DFlash drafter is served
    whole, k = block size - 1, whatever ``ks`` says)."""

    ks: tuple[int, ...] = (1, 2)
    check_k: int = gguf.ENGINE_CHECK_K
    """The draft length the engine check before the sweep (``gguf.engine_check``) compares acceptance at: the largest
    of ``--k`` where it is given."""
    p_mins: tuple[float, ...] = (0.0, 0.5)
    target_type: str = "f32"
    """The target GGUF it is measured on (``engines.llamacpp.TARGET_GGUF_TYPES``)."""
    threads: int = 0
    """llama.cpp's threads (0 = every core)."""
    max_new_tokens: int = 64
    repeats: int = 1


def sweep_export(folder: str, info_file: str, target: Any, source: Any, prompts: Sequence[Sequence[int]],
                 sweep: Sweep) -> list[str]:
    """Serve the GGUF export in ``folder`` at every (k, p-min) of ``sweep`` against llama.cpp's target alone
    (:func:`measure`, no n-gram methods), record the fastest setting in its ``draftsmith_export.json`` and return
    the check's lines: the setting and the command that serves it."""
    ks = [source.drafter.module.block_size - 1] if source.family in gguf.BLOCK_FAMILIES else list(sweep.ks)
    threads = sweep.threads or (os.cpu_count() or 1)
    result = measure(target_gguf_for(target.name, sweep.target_type, target), prompts, sweep.max_new_tokens,
                     draft_gguf=os.path.join(folder, gguf.DRAFT_FILE), family=source.family, ks=ks, threads=threads,
                     repeats=sweep.repeats, ngram=(), hybrid=False, p_mins=sweep.p_mins, target_type=sweep.target_type)
    best = result["best"]
    record_best(os.path.join(folder, info_file), best, "draftsmith export --check", sweep.max_new_tokens)
    return [f"served in llama.cpp at k = {ks} × p-min = {list(sweep.p_mins)} on {len(prompts)} prompts × "
            f"{sweep.max_new_tokens} tokens ({threads} thread(s)); " + describe_best(best)
            + f"; recorded in {info_file} (gguf.served)",
            "serve it: " + best["command"]]


def record_best(path: str, best: dict[str, Any], measured_by: str, max_new_tokens: int) -> None:
    """The export record at ``path`` (``draftsmith_export.json``) gets ``gguf.served``: the best setting (k, p-min,
    spec type, target type, speedup with its interval, the runner-up, the command), what measured it, and when."""
    info = read_json(path)
    info["gguf"]["served"] = {**best, "measured_by": measured_by, "max_new_tokens": max_new_tokens,
                              "measured_unix": int(time.time())}
    write_json(path, info)


def serve_command(folder: str, info: dict[str, Any]) -> str:
    """How to serve the GGUF export in ``folder``: its measured best setting (``gguf.served``, written by
    :func:`record_best`) and its command, or, unmeasured, k = 1 without a gate on the target ``TARGET.gguf``."""
    served = info["gguf"].get("served")
    if served:
        return describe_best(served) + "\nserve it: " + served["command"]
    draft = os.path.join(folder, gguf.DRAFT_FILE)
    k = 1 if info["source"]["family"] not in gguf.BLOCK_FAMILIES else int(gguf.read_metadata(draft)["dflash.block_size"]) - 1
    spec = llamacpp.ServerSpec(model="TARGET.gguf", draft=draft, spec_type=info["gguf"]["spec_type"], n_max=k,
                               threads=os.cpu_count() or 1)
    return (f"serve it (unmeasured: k = {k}, no p-min gate; `draftsmith export --check {folder}` measures the fastest k "
            f"and p-min and records it):\n" + command(spec))
