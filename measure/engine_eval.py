"""``eval.engine=llamacpp``: the recipe's saved drafter measured where it is served, llama.cpp against llama.cpp's
target alone, on the prompts and max_new_tokens of the built-in decoder's evaluation (``evaluate.py``).

``draftsmith eval`` (``eval.run``) and ``draftsmith report`` (``report.run``) call :func:`evaluate_in_llamacpp`;
the measurement is :func:`~draftsmith.measure.engine.measure`'s sweep over k and p-min on the target's GGUF
(``engines.targets``). The drafter has to be a GGUF first, and writing one is ``export/``'s job, a layer above this
one: the stage hands in the writer (``export.run.export_gguf_draft``, a :class:`WritesDraftGGUF`), and the
:class:`DraftGGUF` it returns says where the fastest setting is recorded (the export's own record, as
``export --check`` records its own).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..engines.llamacpp import SPEC_TYPES
from ..engines.targets import target_gguf_for
from ..errors import ConfigError
from ..target import TargetFiles
from .config import EvalRecipe
from .engine import measure


@dataclass(frozen=True)
class DraftGGUF:
    """A drafter written as a GGUF for llama.cpp, as :func:`evaluate_in_llamacpp` receives it."""

    file: str
    """The draft model's GGUF."""
    family: str
    """The drafter family it was written from: it decides llama.cpp's spec type (``engines.llamacpp.SPEC_TYPES``)."""
    type: str
    """Its tensor type (one of ``engines.llamacpp.GGUF_TYPES``: ``auto`` resolved to the drafter's stored dtype)."""
    record: Callable[[dict[str, Any], str, int], None]
    """Keeps a measured best setting (``engine.best_setting``) beside the GGUF, given what measured it and
    max_new_tokens (``export.served.record_best``: under ``gguf.served`` in the export's record)."""


class WritesDraftGGUF(Protocol):
    def __call__(self, drafter: str, out: str, target: str, gguf_type: str) -> DraftGGUF:
        """The drafter folder ``drafter`` written as a GGUF of ``gguf_type`` into the folder ``out`` (replaced), for
        the target ``target`` (its spec: a GGUF drafter reads the target's vocabulary and layer count)."""
        ...


def evaluate_in_llamacpp(recipe: EvalRecipe, prompts: Sequence[Sequence[int]], target: TargetFiles,
                         write_gguf: WritesDraftGGUF) -> dict[str, Any]:
    """The recipe's saved drafter written as a GGUF by ``write_gguf`` (into ``<run_dir>/engine/draft``) and
    measured in llama.cpp against llama.cpp's target alone (:func:`~draftsmith.measure.engine.measure`; beside it
    the model-free methods of ``eval.engine_ngram`` and, unless that list is empty, the drafter mixed with
    ngram-simple) on ``prompts``
    (token ids) and ``decode.max_new_tokens``, at every k of ``eval.engine_k`` (default ``decode.k``) and p-min of
    ``eval.engine_p_min``; the fastest setting is recorded through ``DraftGGUF.record``. Returns the measurement
    with the draft's tensor type."""
    path = getattr(recipe.drafter, "path", None)
    if not path:
        raise ConfigError("eval.engine=llamacpp serves a saved drafter: set drafter.type=saved and drafter.path")
    ev = recipe.eval
    draft = write_gguf(path, os.path.join(recipe.run_dir, "engine", "draft"), recipe.target.name, ev.engine_draft_type)
    target_file = target_gguf_for(recipe.target.name, ev.engine_target_type, target)
    threads = ev.engine_threads or (os.cpu_count() or 1)
    ks = ev.engine_k or [recipe.decode.k]
    print(f"in llama.cpp: {SPEC_TYPES[draft.family]} draft ({draft.type}) on the target "
          f"{os.path.basename(target_file)} ({ev.engine_target_type}), k = {ks}, p-min = {ev.engine_p_min}, "
          f"{threads} thread(s)", flush=True)
    result = measure(target_file, prompts, recipe.decode.max_new_tokens, draft_gguf=draft.file, family=draft.family,
                     ks=ks, threads=threads, repeats=ev.repeats, ngram=ev.engine_ngram, hybrid=bool(ev.engine_ngram),
                     p_mins=ev.engine_p_min, target_type=ev.engine_target_type)
    result.update(draft_type=draft.type)
    if result.get("best"):
        draft.record(result["best"], "draftsmith eval (eval.engine=llamacpp)", recipe.decode.max_new_tokens)
    return result
