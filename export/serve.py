"""The saved drafter exported to GGUF and measured where it is served (``eval.engine=llamacpp``).

``draftsmith eval`` (``eval.run.run_eval_recipe``, for the demo too) calls :func:`run_engine_eval` after the
built-in decoder's evaluation, and ``draftsmith report`` calls :func:`evaluate_in_llamacpp`: export sits above the
measurement layer (``measure/engine.py`` measures a GGUF in llama.cpp; exporting one is this folder's job), so the
stage commands that want both come here. The sweep's best setting is recorded in the export as ``export --check``
records its own (``served.record_best``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from ..measure.config import EvalRecipe
from ..measure.engine import measure, table
from ..files import write_json
from . import gguf
from .run import INFO_FILE, export
from .served import record_best, target_gguf_for

__all__ = ["evaluate_in_llamacpp", "run_engine_eval", "target_gguf_for"]


def evaluate_in_llamacpp(recipe: EvalRecipe, prompts: Sequence[Sequence[int]], target: Any) -> dict[str, Any]:
    """``eval.engine=llamacpp``: the recipe's saved drafter exported to GGUF (``<run_dir>/engine``) and measured in
    llama.cpp against llama.cpp's target alone (:func:`measure`) on the same prompts and max_new_tokens."""
    import os

    from ..errors import ConfigError

    path = getattr(recipe.drafter, "path", None)
    if not path:
        raise ConfigError("eval.engine=llamacpp serves a saved drafter: set drafter.type=saved and drafter.path")
    ev = recipe.eval
    out = os.path.join(recipe.run_dir, "engine", "draft")
    info = export(path, "gguf", out, target=recipe.target.name, force=True, gguf_type=ev.engine_draft_type)
    target_file = target_gguf_for(recipe.target.name, ev.engine_target_type, target)
    threads = ev.engine_threads or (os.cpu_count() or 1)
    ks = ev.engine_k or [recipe.decode.k]
    print(f"in llama.cpp: {info['gguf']['spec_type']} draft ({info['gguf']['type']}) on the target "
          f"{os.path.basename(target_file)} ({ev.engine_target_type}), k = {ks}, p-min = {ev.engine_p_min}, "
          f"{threads} thread(s)", flush=True)
    result = measure(target_file, prompts, recipe.decode.max_new_tokens, draft_gguf=os.path.join(out, gguf.DRAFT_FILE),
                     family=info["source"]["family"], ks=ks, threads=threads, repeats=ev.repeats,
                     ngram=ev.engine_ngram, hybrid=True, p_mins=ev.engine_p_min, target_type=ev.engine_target_type)
    result.update(draft_type=info["gguf"]["type"])
    if result.get("best"):
        record_best(os.path.join(out, INFO_FILE), result["best"], "draftsmith eval (eval.engine=llamacpp)",
                    recipe.decode.max_new_tokens)
    return result


def run_engine_eval(recipe: EvalRecipe) -> dict[str, Any]:
    """After ``draftsmith eval`` wrote ``eval_metrics.json``: the same prompts through llama.cpp, written into it
    under "engine", and printed."""
    from ..measure.prompts import load_questions
    from ..target import load_target

    target = load_target(recipe.target.name, "float32", "cpu")
    questions = load_questions(recipe.eval.prompts, recipe.eval.num_prompts)
    result = evaluate_in_llamacpp(recipe, [target.render_chat(q.messages()) for q in questions], target)
    path = os.path.join(recipe.run_dir, "eval_metrics.json")
    with open(path, encoding="utf-8") as f:
        metrics = json.load(f)
    metrics["engine"] = result
    write_json(path, metrics)
    print(table(result))
    return result
