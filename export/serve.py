"""The saved drafter exported to GGUF and measured where it is served (``eval.engine=llamacpp``).

``draftsmith eval`` (``eval.run.run_eval_recipe``, for the demo too) calls :func:`run_engine_eval` after the
built-in decoder's evaluation, and ``draftsmith report`` calls :func:`evaluate_in_llamacpp`: export sits above the
measurement layer (``measure/engine.py`` measures a GGUF in llama.cpp; exporting one is this folder's job), so the
stage commands that want both come here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from ..engines.targets import original_gguf, target_gguf
from ..measure.engine import measure, table
from ..files import write_json
from .run import export


def target_gguf_for(target_spec: str, kind: str, target: Any) -> str:
    """The target's GGUF to serve: the file it was loaded from (``as-loaded``; an F32 conversion for a target that
    came as an HF folder), else a conversion cached once per fingerprint."""
    return target_gguf(target, "f32" if kind == "as-loaded" and original_gguf(target_spec) is None else kind)


def evaluate_in_llamacpp(recipe: Any, prompts: Sequence[Sequence[int]], target: Any) -> dict[str, Any]:
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
          f"{os.path.basename(target_file)} ({ev.engine_target_type}), k = {ks}, {threads} thread(s)", flush=True)
    result = measure(target_file, prompts, recipe.decode.max_new_tokens, draft_gguf=os.path.join(out, "draft.gguf"),
                     family=info["source"]["family"], ks=ks, threads=threads, repeats=ev.repeats,
                     ngram=ev.engine_ngram, hybrid=True)
    result.update(target_type=ev.engine_target_type, draft_type=info["gguf"]["type"])
    return result


def run_engine_eval(recipe: Any) -> dict[str, Any]:
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
