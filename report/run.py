"""``draftsmith report``: one or several drafters through every part of the alignment report.

Order of work (the target is loaded at most twice):

1. **fp32** — the target's own greedy answers to the prompt set (turn 1; with ``report.turns=2`` the
   second MT-bench turn asked after the target's own first answer): the held-out text of the
   offline alignment and the reference of the lossless audit. Per drafter: the offline alignment
   (``alignment.py``) and the audit (greedy speculative decoding in fp32 compared token for token).
2. **the recipe's dtype** (bf16 for speed on a CPU) — per drafter: greedy decoding timed against
   the target alone (``measure.evaluate.evaluate``: tokens/s, speedup_vs_target, the cost model c, v(k)),
   then one sampled decode at ``report.temperature`` per seed in ``report.seeds``. When the recipe's
   dtype is fp32 the timed greedy decode is also the audit's.

Then predicted vs measured (``summary.compare``), ``report.json``, ``report.md`` and the plots,
written atomically into ``report.out_dir`` (default ``<run_dir>/report``).
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import replace
from typing import Any

import torch

from ..decode.protocol import BindsTargetCache, common_prefix
from ..devices import detect_device, resolve_dtype
from ..drafters.checkpoint import SavedDrafterConfig, read_meta
from ..drafters.registry import DrafterConfig
from ..errors import ConfigError, DraftsmithError
from ..measure.baselines import baseline_configs
from ..measure.config import DecodeConfig
from ..measure.engine_eval import evaluate_in_llamacpp
from ..measure.evaluate import Evaluation, evaluate
from ..measure.prompts import Question, load_questions
from ..decode.reference import target_greedy
from ..schema import save_recipe, to_dict
from ..target import Target, describe, load_target
from . import summary as S
from .config import ReportConfig, ReportRecipe
from .alignment import AnswerAlignment, align_answer


def drafter_entries(drafter: DrafterConfig, compare: list[str],
                    baselines: list[str] = ()) -> list[tuple[str, DrafterConfig]]:
    """(label, drafter config) for the recipe's drafter, each ``--compare`` folder (each checked: config.json +
    model.safetensors, draftsmith's format, before anything is loaded) and each model-free baseline of
    ``eval.baselines`` (default settings; prompt lookup by default, so every report shows the free floor
    beside the trained drafters) that is not the recipe's drafter already."""
    def label(cfg: DrafterConfig) -> str:
        return os.path.basename(os.path.normpath(cfg.path)) if cfg.type == "saved" else cfg.type

    entries = [drafter] + [SavedDrafterConfig(path=p) for p in compare]
    entries += [cfg for name, cfg in baseline_configs(list(baselines)).items() if name != drafter.type]
    for cfg in entries:
        if cfg.type == "saved":
            if not os.path.isdir(cfg.path):
                raise DraftsmithError(f"drafter folder '{cfg.path}' does not exist (--compare takes drafter folders "
                                      f"written by draftsmith train, e.g. runs/NAME/drafter)")
            read_meta(cfg.path)
    labels, out = set(), []
    for cfg in entries:
        name = label(cfg)
        while name in labels:
            name += "'"
        labels.add(name)
        out.append((name, cfg))
    return out


def training_curve(cfg: DrafterConfig) -> dict[str, Any] | None:
    """For a saved drafter whose folder sits in a training run (``<run_dir>/drafter`` or ``drafter-best``):
    the run's sim_tau curve over training and the step drafter-best was picked at (train_summary.json)."""
    import json

    if cfg.type != "saved":
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(os.path.normpath(cfg.path))), "train_summary.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    curve = summary.get("sim_tau_curve") or []
    if not curve:
        return None
    return {"summary": path, "sim_tau_curve": curve, "best": summary.get("best"), "steps": summary.get("steps"),
            "note": summary.get("sim_tau_note", "")}


def select_questions(source: str, num_prompts: int, per_category: int) -> list[Question]:
    """The first ``num_prompts`` questions, or with ``per_category`` > 0 the first that many of each category."""
    if per_category <= 0:
        return load_questions(source, num_prompts)
    seen: dict[str, int] = {}
    out = []
    for q in load_questions(source):
        if seen.get(q.category, 0) < per_category:
            seen[q.category] = seen.get(q.category, 0) + 1
            out.append(q)
    return out


def reference_answers(target: Target, questions: list[Question], max_new_tokens: int,
                      turns: int) -> tuple[list[Question], list[int], list[list[int]]]:
    """The prompts the report decodes, their turn numbers and the target's greedy answers to them.

    Turn 2 of a question (when ``turns`` = 2 and it has one) is asked after turn 1 and the target's
    own answer to it, as MT-bench does."""
    asked, turn_of, answers = [], [], []
    firsts = []
    for q in questions:
        first = Question(q.id, q.category, [q.turns[0]])
        answer = target_greedy(target, target.render_chat(first.messages()), max_new_tokens)
        asked.append(first)
        turn_of.append(1)
        answers.append(answer)
        firsts.append((q, answer))
    if turns == 2:
        for q, answer in firsts:
            if len(q.turns) < 2:
                continue
            text = target.tokenizer.decode(answer, skip_special_tokens=True)
            second = Question(f"{q.id}.2", q.category, [q.turns[1]],
                              history=[{"role": "user", "content": q.turns[0]}, {"role": "assistant", "content": text}])
            asked.append(second)
            turn_of.append(2)
            answers.append(target_greedy(target, target.render_chat(second.messages()), max_new_tokens))
    return asked, turn_of, answers


def alignment_pass(target: Target, cfg: DrafterConfig, asked: list[Question], turn_of: list[int],
                   answers: list[list[int]], decode: DecodeConfig, report: ReportConfig) -> dict[str, Any]:
    """The offline alignment of one drafter (two instances: teacher-forced and rollout) at ``decode.k`` and
    ``report.temperature``."""
    teacher, rollout = cfg.build(target), cfg.build(target)
    if isinstance(teacher, BindsTargetCache):
        return {"skipped": "a self-speculative drafter drafts inside the target's KV cache; run the same drafts "
                           "with drafter.share_cache=false for the offline alignment"}
    module = getattr(teacher, "module", None)
    draft_ids = getattr(module, "draft_ids", None) if module is not None else None
    if draft_ids is not None and draft_ids.numel() == target.vocab_size:
        draft_ids = None
    k, max_new = decode.k, decode.max_new_tokens
    aligned: list[AnswerAlignment] = []
    t0 = time.perf_counter()
    for q, turn, answer in zip(asked, turn_of, answers):
        prompt = target.render_chat(q.messages())
        aligned.append(align_answer(target, teacher, rollout, prompt, answer, k, max_new, report.temperature,
                                    draft_ids, (q.id, q.category, turn)))
    decode_text = lambda ids: target.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    out = S.summarize_alignment(aligned, k, max_new, target.eos_token_ids, report.calibration_bins,
                                report.worst, decode_text, report.temperature)
    out["by_category"] = S.predicted_by_group(aligned, lambda a: a.category)
    out["by_turn"] = S.predicted_by_group(aligned, lambda a: f"turn {a.turn}")
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


def audit(records: list[dict[str, Any]], answers: list[list[int]], target: Target) -> dict[str, Any]:
    """Greedy speculative outputs (fp32) against the target's own greedy answers, token for token."""
    divergences = []
    for rec, ref in zip(records, answers):
        if rec["tokens"] != ref:
            at = common_prefix(ref, rec["tokens"])
            pick = lambda xs: xs[at] if at < len(xs) else None  # noqa: E731
            divergences.append({"id": rec["id"], "position": at, "target_token": pick(ref),
                                "speculative_token": pick(rec["tokens"]),
                                "target_text": target.tokenizer.decode(ref[at: at + 1]),
                                "speculative_text": target.tokenizer.decode(rec["tokens"][at: at + 1]),
                                "target_length": len(ref), "speculative_length": len(rec["tokens"])})
    return {"dtype": "float32", "prompts": len(records), "identical": len(records) - len(divergences),
            "divergences": divergences,
            "note": "greedy decoding with the drafter vs the target's own greedy generate, both fp32; position = "
                    "index of the first differing new token"}


def decoding_summary(ev: Evaluation, turn_of: dict[str, int]) -> dict[str, Any]:
    """Overall (from the merged DecodeStats), by category and by turn, for one decode of the set."""
    out = {**ev.stats.summary(), **S.group_records(ev.records)}
    out["by_category"] = S.by_group(ev.records, lambda r: r["category"] or "(none)")
    out["by_turn"] = S.by_group(ev.records, lambda r: f"turn {turn_of[r['id']]}")
    if ev.speed is not None:
        out["speed"] = ev.speed
    return out


def run_report(recipe: ReportRecipe, compare: list[str] | None = None) -> dict[str, Any]:
    """The whole command; returns report.json's content (also written with report.md and the plots)."""
    cfg = recipe.report
    if recipe.decode.tree != "none":
        raise ConfigError("draftsmith report measures chains (the cost model and the α-by-position prediction are "
                          "chain quantities): set decode.tree=none")
    if recipe.decode.min_confidence > 0:
        raise ConfigError("draftsmith report predicts ungated chains from the drafters' acceptance: set "
                          "decode.min_confidence=0 (the confidence gate is measured by draftsmith eval)")
    entries = drafter_entries(recipe.drafter, list(compare or []), recipe.eval.baselines)
    questions = select_questions(recipe.eval.prompts, recipe.eval.num_prompts, cfg.per_category)
    out_dir = cfg.out_dir or os.path.join(recipe.run_dir, "report")
    save_recipe(recipe)
    greedy = replace(recipe.decode, temperature=0.0, top_k=0, top_p=1.0)
    speed_dtype = resolve_dtype(recipe.target.dtype, detect_device(recipe.target.device))

    t0 = time.perf_counter()
    target = load_target(replace(recipe.target, dtype="float32"))
    print(f"report: target {target.name} in float32 loaded in {time.perf_counter() - t0:.1f}s; drafters: "
          + ", ".join(name for name, _ in entries), flush=True)
    asked, turns, answers = reference_answers(target, questions, greedy.max_new_tokens, cfg.turns)
    turn_of = {q.id: t for q, t in zip(asked, turns)}
    print(f"report: {len(asked)} prompts ({sum(t == 2 for t in turns)} second turns), the target's fp32 greedy "
          f"answers: {sum(map(len, answers))} tokens", flush=True)
    results: dict[str, dict[str, Any]] = {name: {"drafter": to_dict(d)} for name, d in entries}
    for name, d in entries:
        curve = training_curve(d)
        if curve is not None:
            results[name]["training"] = curve
    for name, d in entries:
        res = results[name]
        print(f"report [{name}]: offline alignment", flush=True)
        res["alignment"] = al = alignment_pass(target, d, asked, turns, answers, recipe.decode, cfg)
        if "skipped" not in al:
            print(f"report [{name}]: alpha by position {al['teacher_forced']['alpha']} (teacher-forced), top-1 "
                  f"{al['teacher_forced']['top1']}; predicted tau greedy {al['prediction']['greedy']['tau']}, sampled "
                  f"{al['prediction']['sampled']['tau']} ({al['wall_s']}s)", flush=True)
        print(f"report [{name}]: fp32 audit decode", flush=True)
        timed = speed_dtype == torch.float32
        ev = evaluate(target, d.build(target), asked, greedy, progress=False,
                      time_target=timed and recipe.eval.time_target, repeats=recipe.eval.repeats)
        res["audit"] = audit(ev.records, answers, target)
        print(f"report [{name}]: fp32 greedy tau {ev.stats.tau:.3f}; identical to the target's greedy output on "
              f"{res['audit']['identical']}/{res['audit']['prompts']} prompts", flush=True)
        res["_fp32_greedy"] = decoding_summary(ev, turn_of)
        if timed:
            res["_greedy"] = res["_fp32_greedy"]
    if speed_dtype != torch.float32:
        del target
        gc.collect()
        target = load_target(recipe.target)
    described = describe(target)
    for name, d in entries:
        res = results[name]
        drafter = d.build(target)
        if "_greedy" not in res:
            print(f"report [{name}]: greedy decode ({described.get('dtype', speed_dtype)}), timed against the target alone", flush=True)
            res["_greedy"] = decoding_summary(evaluate(target, drafter, asked, greedy, progress=False,
                                                      time_target=recipe.eval.time_target,
                                                      repeats=recipe.eval.repeats), turn_of)
        sampled = []
        for seed in cfg.seeds:
            print(f"report [{name}]: sampled decode, temperature {cfg.temperature}, seed {seed}", flush=True)
            warm = replace(recipe.decode, temperature=cfg.temperature, top_k=0, top_p=1.0, seed=seed)
            sampled.append(evaluate(target, drafter, asked, warm, progress=False))
        res["decoding"] = {"greedy": res.pop("_greedy"), "greedy_fp32": res.pop("_fp32_greedy"),
                           "sampled": sampled_summary(sampled, cfg, turn_of)}
        res["prediction_vs_measurement"] = predicted_vs_measured(res, cfg, recipe.decode.k)
    if recipe.eval.engine == "llamacpp":  # the first drafter served in llama.cpp, chains of decode.k
        name, _ = entries[0]
        print(f"report [{name}]: served in llama.cpp (k = {recipe.decode.k})", flush=True)
        from ..export.run import export_gguf_draft

        # chains of decode.k without a gate: the engine's τ is compared with the built-in decoder's chain
        served = replace(recipe, eval=replace(recipe.eval, engine_k=[recipe.decode.k], engine_p_min=[0.0]))
        measured = evaluate_in_llamacpp(served, [target.render_chat(q.messages()) for q in questions], target,
                                        export_gguf_draft)
        results[name]["engine"] = engine_vs_builtin(measured, results[name], recipe.decode.k)
    report = {
        "target": described,
        "prompts": {"source": recipe.eval.prompts, "questions": len(questions), "asked": len(asked),
                    "second_turns": sum(t == 2 for t in turns)},
        "decode": {"k": recipe.decode.k, "max_new_tokens": recipe.decode.max_new_tokens,
                   "speed_dtype": str(speed_dtype).replace("torch.", ""), "temperature": cfg.temperature,
                   "seeds": list(cfg.seeds)},
        "tau_note": "tau = tokens emitted per target verification forward, the bonus/resampled token counted (tau >= 1)",
        "tolerance_note": TOLERANCE_NOTE.format(sigmas=cfg.tolerance_sigmas),
        "drafters": results,
    }
    from .render import write_report

    write_report(report, out_dir)
    print(f"wrote {os.path.join(out_dir, 'report.md')} and report.json with the plots")
    return report


TOLERANCE_NOTE = (
    "predicted and measured tau agree when |measured - predicted| <= {sigmas} SE, SE the standard error of the "
    "decoder's tau: the largest of the error with prompts as the independent units (rounds inside one answer are "
    "correlated), the error of a mean over that many independent rounds (sd of the accepted length / sqrt(rounds)), "
    "and the same with the sd of the predicted accepted-length distribution (the error expected if the prediction is "
    "right; it keeps a tolerance when the measured rounds have no spread). "
    "The prediction itself carries no sampling error: it is an expectation over every start of the fixed fp32 answers. "
    "Greedy fp32 must agree exactly (the prediction is then the replay of the decoder's rounds: the histograms must be "
    "equal); greedy in a lower dtype drifts from the fp32 answers after tens of tokens, and sampled decoding draws its "
    "drafts where the prediction follows the drafter's argmax rollout along the target's greedy text, so those two are "
    "statistical comparisons at {sigmas} SE (a 0.3 % false-alarm rate for a normal error)."
)


def sampled_summary(evs: list[Evaluation], cfg: ReportConfig, turn_of: dict[str, int]) -> dict[str, Any] | None:
    """Per seed τ, and all seeds pooled per prompt (a prompt's rounds over every seed form one unit)."""
    if not evs:
        return None
    merged = evs[0].stats
    for ev in evs[1:]:
        merged = merged.merge(ev.stats)
    pooled: dict[str, dict[str, Any]] = {}
    for ev in evs:
        for r in ev.records:
            p = pooled.setdefault(r["id"], {"id": r["id"], "category": r["category"], "stats": {
                "verify_rounds": 0, "eos_rounds": 0, "accepted": 0, "accepted_length_histogram": [0] * len(r["stats"]["accepted_length_histogram"]),
                "new_tokens": 0, "wall_s": 0.0}})
            s = p["stats"]
            s["verify_rounds"] += r["stats"]["verify_rounds"]
            s["eos_rounds"] += r["stats"].get("eos_rounds", 0)
            s["accepted"] += r["stats"]["accepted"]
            s["new_tokens"] += r["stats"]["new_tokens"]
            s["wall_s"] += r["stats"]["wall_s"]
            s["accepted_length_histogram"] = [a + b for a, b in zip(s["accepted_length_histogram"],
                                                                    r["stats"]["accepted_length_histogram"])]
    for p in pooled.values():
        s = p["stats"]
        s["tau_with_bonus"] = ((s["accepted"] + s["verify_rounds"] - s["eos_rounds"]) / s["verify_rounds"]
                               if s["verify_rounds"] else 0.0)
        s["tokens_per_s"] = s["new_tokens"] / s["wall_s"] if s["wall_s"] else 0.0
    records = list(pooled.values())
    out = {"temperature": cfg.temperature, "seeds": list(cfg.seeds), **merged.summary(), **S.group_records(records),
           "tau_by_seed": [round(ev.stats.tau, 4) for ev in evs]}
    out["by_category"] = S.by_group(records, lambda r: r["category"] or "(none)")
    out["by_turn"] = S.by_group(records, lambda r: f"turn {turn_of[r['id']]}")
    return out


def predicted_vs_measured(res: dict[str, Any], cfg: ReportConfig, k: int) -> dict[str, Any]:
    """τ predicted offline next to the decoder's (agreeing within ``cfg.tolerance_sigmas``), and the speedup the
    cost model predicts from it for chains of ``k`` drafts."""
    al = res["alignment"]
    if "skipped" in al:
        return {"skipped": al["skipped"]}
    pred, sig = al["prediction"], cfg.tolerance_sigmas
    dec = res["decoding"]
    g, g32 = dec["greedy"], dec["greedy_fp32"]
    out: dict[str, Any] = {
        "greedy": S.compare(pred["greedy"], g, sig),
        "greedy_fp32": S.compare(pred["greedy"], g32, sig),
        "greedy_fp32_replay": {"predicted_histogram": pred["greedy"]["accepted_length_histogram"],
                               "decoder_histogram": g32["accepted_length_histogram"],
                               "exact": [round(x) for x in pred["greedy"]["accepted_length_histogram"]]
                               == g32["accepted_length_histogram"]},
        "steady_state_greedy": {"predicted": pred["tau_steady_greedy"],
                                "decoder": round(S.tau_of(g["acceptance_at_position"]), 4)},
    }
    if dec["sampled"] is not None:
        s = dec["sampled"]
        out["sampled"] = S.compare(pred["sampled"], s, sig)
        out["sampled"]["predicted_teacher_forced"] = pred["sampled_teacher_forced"]["tau"]
        out["steady_state_sampled"] = {"predicted": pred["tau_steady_sampled"],
                                       "decoder": round(S.tau_of(s["acceptance_at_position"]), 4)}
    speed = g.get("speed")
    if speed is not None:
        predicted = S.speedup_prediction(al["teacher_forced"]["cumulative_top1"], k, speed["cost_model"])
        measured = speed["speedup_vs_target"]
        out["speedup_greedy"] = {
            "predicted": predicted, "measured": measured,
            "ratio_measured_to_predicted": round(measured / predicted, 4) if predicted else None,
            "from_decoder_acceptance": speed["cost_model"]["predicted_speedup"],
            "note": "predicted = tau(k) / (v(k) + k c), tau from the offline cumulative top-1, c and v(k) measured in "
                    "the speed pass; the decoder's own per-round overhead is not in the model, so a ratio below 1 "
                    "is that overhead (no tolerance: it is a model, not an estimate of the same quantity)",
        }
    return out


def engine_vs_builtin(measured: dict[str, Any], res: dict[str, Any], k: int) -> dict[str, Any]:
    """llama.cpp's τ and speedup beside the built-in decoder's, and the engine's speedup predicted from the built-in
    decoder's fp32 τ and the engine's own measured round cost (drafting + verification, in target-alone steps)."""
    row = measured["methods"][f"drafter k={k}"]
    ours = res["decoding"]["greedy_fp32"]
    cost = row.get("round_cost_steps")
    tau = row.get("tau")
    return {"k": k, "tau": tau, "speedup": row.get("speedup"), "interval": row.get("interval"),
            "break_even_tau": row.get("break_even_tau"), "round_cost_steps": cost,
            "acceptance_at_position": row.get("acceptance_at_position"),
            "builtin_tau": ours["tau_with_bonus"], "builtin_acceptance_at_position": ours["acceptance_at_position"],
            "tau_gap": None if tau is None else round(ours["tau_with_bonus"] - tau, 4),
            "predicted_speedup": round(ours["tau_with_bonus"] / cost, 4) if cost else None,
            "identical_to_target": row.get("identical_to_target"), "prompts": measured["prompts"],
            "target_type": measured.get("target_type"), "threads": measured["threads"],
            "note": "predicted = the built-in decoder's fp32 tau / the engine's measured cost of a round (its decode "
                    "time per round / its target-alone decode time per token): the tau llama.cpp must reach to break "
                    "even is that cost; tau_gap = built-in tau - llama.cpp's tau on the same prompts (the train/serve "
                    "gap)", "methods": measured["methods"]}
