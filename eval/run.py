"""``draftsmith eval``: a drafter in the built-in decoder over a prompt set, with metrics on disk.

:func:`run_eval_recipe` is the whole command (the CLI and the demo call it); the measurement itself,
:func:`~draftsmith.measure.evaluate.evaluate`, lives in ``measure/`` beside the other users of it
(``draftsmith report``, training-time evaluation, the benchmarks).

Writes to the run folder: ``config.yaml`` (resolved recipe), ``eval_outputs.jsonl``
(one line per prompt: tokens, text, per-prompt stats) and ``eval_metrics.json``
(aggregate stats; τ counts the bonus token, as the file says; ``baselines``: the model-free drafters
of ``eval.baselines`` on the same prompts, see ``measure/baselines.py``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from typing import Any

import torch

from ..files import atomic_path, write_json
from ..measure.baselines import baseline_configs, baseline_lines, baseline_rows
from ..measure.config import EvalRecipe
from ..measure.engine import table
from ..measure.engine_eval import evaluate_in_llamacpp
from ..measure.evaluate import Evaluation, evaluate
from ..measure.prompts import fields_note, load_questions
from ..schema import save_recipe, to_dict
from ..tables import WIDTH, wrapped
from ..target import describe, load_target


def write_eval(run_dir: str, target_info: dict[str, Any], result: Evaluation, extra: dict[str, Any]) -> dict[str, Any]:
    """Write eval_outputs.jsonl and eval_metrics.json (atomically); return the metrics.

    target_info: :func:`~draftsmith.target.describe` of the target the speed was measured on."""
    os.makedirs(run_dir, exist_ok=True)
    with atomic_path(os.path.join(run_dir, "eval_outputs.jsonl")) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in result.records:
                f.write(json.dumps(rec) + "\n")
    metrics: dict[str, Any] = {"target": target_info, **extra, **result.stats.summary()}
    if result.speed is not None:
        metrics["target_tokens_per_s"] = result.speed["target_tokens_per_s"]
        metrics["speedup_vs_target"] = result.speed["speedup_vs_target"]
        metrics["speed"] = result.speed
    write_json(os.path.join(run_dir, "eval_metrics.json"), metrics)
    return metrics


def run_eval_recipe(recipe: EvalRecipe) -> dict[str, Any]:
    """``draftsmith eval``: decode the recipe's prompts with its drafter and with the target alone in the
    recipe's dtype (speed), check greedy identity in fp32 (``eval.check_identity``), write and print the metrics,
    and with ``eval.engine=llamacpp`` measure the same drafter where it is served (:func:`run_engine_eval`, written
    into eval_metrics.json under "engine"). Writes ``<run_dir>/config.yaml`` first; returns the metrics.

    When the recipe's dtype is not fp32 the identity audit is a second pass: the target reloaded in fp32,
    the drafter rebuilt for it, every prompt decoded speculatively and by the target alone, compared token
    for token (in bf16 outputs drift after tens of tokens, so identity is checked where it is exact).
    """
    import gc

    save_recipe(recipe)
    t0 = time.perf_counter()
    target = load_target(recipe.target)
    drafter = recipe.drafter.build(target)
    dtype = str(target.dtype).replace("torch.", "")
    print(f"target {target.name} ({target.num_layers} layers, {dtype}, {target.device}) loaded in "
          f"{time.perf_counter() - t0:.1f}s; drafter {recipe.drafter.type}")
    questions = load_questions(recipe.eval.prompts, recipe.eval.num_prompts)
    print(fields_note(recipe.eval.prompts, questions))
    exact = target.dtype == torch.float32
    configs = baseline_configs(recipe.eval.baselines)
    result = evaluate(target, drafter, questions, recipe.decode, recipe.eval.check_identity and exact,
                      time_target=recipe.eval.time_target, repeats=recipe.eval.repeats,
                      baselines={name: config.build(target) for name, config in configs.items()})
    identity, described = None, describe(target)
    baselines = baseline_rows(result, configs, recipe.decode, check_identity=recipe.eval.check_identity and exact)
    if recipe.eval.check_identity:
        if exact:
            identity = {"dtype": "float32", "identical": sum(r["identical_to_target"] for r in result.records)}
        else:
            del drafter, target
            gc.collect()
            print(f"identity audit: reloading the target in float32 (speed was measured in {dtype})")
            target = load_target(replace(recipe.target, dtype="float32"))
            audit = evaluate(target, recipe.drafter.build(target), questions, recipe.decode, check_identity=True)
            identity = {"dtype": "float32", "identical": sum(r["identical_to_target"] for r in audit.records),
                        "tau_with_bonus": round(audit.stats.tau, 4)}
            for rec, checked in zip(result.records, audit.records):
                rec["identical_to_target_fp32"] = checked["identical_to_target"]
        identity["prompts"] = len(result.records)
    extra: dict[str, Any] = {"drafter": to_dict(recipe.drafter), "decode": to_dict(recipe.decode), "baselines": baselines}
    if identity is not None:
        extra["identity"] = identity
    metrics = write_eval(recipe.run_dir, described, result, extra)
    print_eval(metrics)
    print("\n".join(line for entry in baseline_lines(baselines) for line in wrapped(entry))
          or "no baselines (eval.baselines=[])")
    print(f"wrote {os.path.join(recipe.run_dir, 'eval_metrics.json')}")
    if recipe.eval.engine == "llamacpp":
        target = drafter = None  # freed first: the target is loaded again there (fp32, CPU) to serve it
        gc.collect()
        metrics["engine"] = run_engine_eval(recipe)
    return metrics


def run_engine_eval(recipe: EvalRecipe) -> dict[str, Any]:
    """After ``eval_metrics.json`` is written: the same prompts through llama.cpp (``measure.engine_eval``, the
    drafter exported to GGUF by ``export.run.export_gguf_draft``), written into it under "engine", and printed."""
    from ..export.run import export_gguf_draft

    target = load_target(recipe.target.name, "float32", "cpu")
    questions = load_questions(recipe.eval.prompts, recipe.eval.num_prompts)
    result = evaluate_in_llamacpp(recipe, [target.render_chat(q.messages()) for q in questions], target,
                                  export_gguf_draft)
    path = os.path.join(recipe.run_dir, "eval_metrics.json")
    with open(path, encoding="utf-8") as f:
        metrics = json.load(f)
    metrics["engine"] = result
    write_json(path, metrics)
    print(table(result))
    return result


def eval_lines(m: dict[str, Any], width: int = WIDTH) -> list[str]:
    """The figures a user reads first, as lines of at most ``width`` columns: speed against the target
    alone, then τ and acceptance, then identity (everything else is in eval_metrics.json)."""
    out = [f"{m['sequences']} prompts, {m['new_tokens']} new tokens, k={m['k']}"]
    speed = m.get("speed")
    if speed:
        cm = speed["cost_model"]
        out.append(f"speed ({speed['dtype']}, {speed['device']}, {speed['threads']} threads): "
                   f"{speed['tokens_per_s']:.1f} tok/s vs the target alone {speed['target_tokens_per_s']:.1f} tok/s -> "
                   f"speedup_vs_target {speed['speedup_vs_target']:.3f}x" + (
                       f" [90% interval over prompts {speed['speedup_interval_90'][0]:.3f}-"
                       f"{speed['speedup_interval_90'][1]:.3f}]" if "speedup_interval_90" in speed else ""))
        if cm["predicted_speedup"] is not None:
            out.append(f"cost model: predicted {cm['predicted_speedup']}x from c={cm['draft_cost_c']:.3f}, "
                       f"v(k)={cm['verify_cost_by_k'].get(str(m['k']), cm['verify_cost_by_k'].get(m['k']))}; "
                       f"best k by the cost model: {cm['best_k']}")
        elif cm.get("as_decoded_speedup") is not None:
            out.append(f"cost model over the rounds as decoded: {cm['as_decoded_speedup']}x, "
                       f"c={cm['draft_cost_c']:.3f}")
    out.append(f"tau (tokens per target forward, bonus token counted) = {m['tau_with_bonus']:.3f}; "
               f"acceptance rate {m['acceptance_rate']:.3f}; by position: cumulative {m['acceptance_at_position']}, "
               f"conditional {m['conditional_acceptance_at_position']}")
    ident = m.get("identity")
    if ident:
        out.append(f"identity ({ident['dtype']}): greedy output token-identical to the target's own greedy "
                   f"decoding on {ident['identical']}/{ident['prompts']} prompts")
    return [line for entry in out for line in wrapped(entry, width)]


def print_eval(m: dict[str, Any]) -> None:
    print("\n".join(eval_lines(m)))
