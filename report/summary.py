"""From per-answer alignment arrays and per-prompt decoder records to the report's figures.

Standard errors treat **prompts as the independent units**: rounds (and start positions) inside one
answer are correlated, so a per-round binomial error would be too small. τ is a ratio of sums
(tokens emitted / rounds, over prompts); its error is the delta-method one of a ratio estimator,
:func:`ratio_se`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..decode.stats import conditional_acceptance, tau_from_acceptance
from ..measure.costs import predicted_speedup
from .alignment import AnswerAlignment, expected_rounds


def ratio_se(nums: Sequence[float], dens: Sequence[float]) -> float:
    """Standard error of Σ nums / Σ dens with the pairs (one per prompt) as independent samples."""
    n = len(nums)
    total = float(sum(dens))
    if n < 2 or total <= 0:
        return 0.0
    r = float(sum(nums)) / total
    return math.sqrt(n / (n - 1) * sum((a - r * d) ** 2 for a, d in zip(nums, dens))) / total


def _mean_cols(x: np.ndarray) -> list[float | None]:
    """Column means over non-NaN entries ([rows, k] → k values, None where a column is empty)."""
    out = []
    for col in x.T:
        v = col[~np.isnan(col)]
        out.append(round(float(v.mean()), 4) if v.size else None)
    return out


def _cumulative(x: np.ndarray) -> np.ndarray:
    """[rows, k] per-draft acceptance → Π_{i≤j} (NaN where position j was not available)."""
    return np.cumprod(np.nan_to_num(x, nan=0.0), axis=1) + np.where(np.isnan(x), np.nan, 0.0)


def _stack(items: list[np.ndarray], k: int) -> np.ndarray:
    rows = [x for x in items if x.size]
    return np.concatenate(rows) if rows else np.zeros((0, k))


def tau_of(cumulative: list[float | None]) -> float:
    """1 + Σ_j cumulative α_j, through measure/costs (τ from the conditional acceptances they imply)."""
    cond = conditional_acceptance(cumulative)
    return tau_from_acceptance(cond, len(cond))


def iid_round_se(hist: Sequence[float]) -> float:
    """Standard error of the mean accepted length (= of τ) if the rounds of ``hist`` [k+1] were independent."""
    h = np.asarray(hist, dtype=float)
    r = h.sum()
    if r < 2:
        return 0.0
    n = np.arange(h.size)
    mean = (h * n).sum() / r
    return float(np.sqrt((h * (n - mean) ** 2).sum() / (r - 1) / r))


def predict_tau(aligned: list[AnswerAlignment], values: str) -> dict[str, Any]:
    """The decoder's τ expected from per-start acceptance (``values``: tf_top1 for greedy, ro_alpha for
    sampled), with the rounds it would take (:func:`~draftsmith.report.alignment.expected_rounds`)."""
    k = aligned[0].tf_top1.shape[1] if aligned else 1
    rounds = tokens = 0.0
    hist = np.zeros(k + 1)
    for a in aligned:
        r, t, h = expected_rounds(_cumulative(getattr(a, values)), a.k_m, len(a.answer), k, a.ends_with_eos)
        rounds, tokens, hist = rounds + r, tokens + t, hist + h
    return {"tau": round(tokens / rounds, 4) if rounds else 0.0, "rounds": round(rounds, 3),
            "accepted_length_histogram": [round(float(x), 3) for x in hist]}


def calibration(conf: np.ndarray, correct: np.ndarray, bins: int) -> dict[str, Any]:
    """Reliability curve over equal-width confidence bins and the expected calibration error.

    conf, correct: [drafts] the drafter's top-1 probability and whether its top-1 is the target's argmax.
    ECE = Σ_b (n_b / n) |accuracy_b − confidence_b|. The last bin includes confidence 1."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    idx = np.clip(np.digitize(conf, edges[1:-1], right=False), 0, bins - 1)
    out, ece, n = [], 0.0, int(conf.size)
    for b in range(bins):
        sel = idx == b
        c = int(sel.sum())
        row: dict[str, Any] = {"lo": round(float(edges[b]), 4), "hi": round(float(edges[b + 1]), 4), "count": c,
                               "confidence": None, "accuracy": None}
        if c:
            mc, acc = float(conf[sel].mean()), float(correct[sel].mean())
            row["confidence"], row["accuracy"] = round(mc, 4), round(acc, 4)
            ece += c / n * abs(acc - mc)
        out.append(row)
    return {"bins": out, "ece": round(ece, 4), "drafts": n,
            "note": "teacher-forced drafts at every position: confidence = the drafter's top-1 probability "
                    "(temperature 1), accuracy = share whose top-1 is the target's greedy token; greedy serving checks "
                    "draft j only after drafts 1..j-1 were accepted, i.e. in exactly this context"}


def summarize_alignment(aligned: list[AnswerAlignment], k: int, max_new_tokens: int, eos: set[int], bins: int,
                        worst: int, decode_text: Any, temperature: float) -> dict[str, Any]:
    """The offline part of the report for one drafter, over all answers (see ``alignment.py``)."""
    stack = {name: _stack([getattr(a, name) for a in aligned], k)
             for name in ("tf_alpha", "tf_top1", "tf_kl", "tf_conf", "ro_alpha", "ro_top1")}
    proposed = (~np.isnan(stack["tf_alpha"])).sum(axis=0).tolist()
    cum = {name: _mean_cols(_cumulative(stack[name])) for name in ("tf_alpha", "tf_top1", "ro_alpha", "ro_top1")}
    drafted = ~np.isnan(stack["tf_conf"])
    cal = calibration(stack["tf_conf"][drafted], stack["tf_top1"][drafted], bins)

    out: dict[str, Any] = {
        "temperature": temperature,
        "answers": len(aligned),
        "answer_tokens": sum(len(a.answer) for a in aligned),
        "starts": int(stack["tf_alpha"].shape[0]),
        "proposed_at_position": proposed,
        "teacher_forced": {
            "alpha": _mean_cols(stack["tf_alpha"]), "top1": _mean_cols(stack["tf_top1"]),
            "forward_kl": _mean_cols(stack["tf_kl"]),
            "cumulative_alpha": cum["tf_alpha"], "cumulative_top1": cum["tf_top1"],
        },
        "rollout": {
            "alpha": _mean_cols(stack["ro_alpha"]), "top1": _mean_cols(stack["ro_top1"]),
            "cumulative_alpha": cum["ro_alpha"], "cumulative_top1": cum["ro_top1"],
        },
        "alpha_note": f"alpha_j = E[sum_x min(p_T, q_T)] at draft position j (T = {temperature}), over the starts of "
                      "the target's fp32 greedy answers at which the drafter proposed draft j (proposed_at_position); top1 = share of drafts equal to the target's greedy token "
                      "(greedy acceptance); cumulative_* = E[product over positions 1..j] (all of drafts 1..j "
                      "accepted), the quantity the decoder's acceptance_at_position measures; forward_kl = KL(p_T || "
                      "q_T), q floored at 1e-10",
        "calibration": cal,
        "prediction": {
            "greedy": predict_tau(aligned, "tf_top1"),
            "sampled": predict_tau(aligned, "ro_alpha"),
            "sampled_teacher_forced": predict_tau(aligned, "tf_alpha"),
            "tau_steady_greedy": round(tau_of(cum["tf_top1"]), 4),
            "tau_steady_sampled": round(tau_of(cum["ro_alpha"]), 4),
            "note": "tau / rounds / histogram: the decoder's rounds over every answer in expectation, each round at "
                    "start m accepting >= j drafts with the cumulative acceptance at m (greedy: top-1, exact in fp32 - "
                    "the decoder's replay; sampled: alpha along the drafter's own argmax rollout, or teacher-forced), "
                    "rounds cut short at the answer's end included; tau_steady = 1 + sum_j cumulative alpha_j, the "
                    "tau of full rounds of k drafts (measure/costs.tau_from_acceptance), the figure the cost model uses",
        },
        "failing_tokens": failing_tokens(aligned, worst, decode_text),
        "failing_contexts": failing_contexts(aligned, worst, decode_text),
    }
    masses = [a.vocab_mass for a in aligned if a.vocab_mass is not None]
    if masses:
        tokens = sum(len(a.answer) for a in aligned)
        out["vocab_coverage"] = {
            "answer_tokens_in_draft_vocab": round(sum(a.in_vocab or 0 for a in aligned) / max(tokens, 1), 4),
            "target_mass_in_draft_vocab": round(float(np.average(masses, weights=[len(a.answer) for a in aligned
                                                                                  if a.vocab_mass is not None])), 4),
            "note": "share of the target's answer tokens the draft vocabulary holds, and the mean p_T mass on it "
                    "(an upper bound on alpha at every position)",
        }
    else:
        out["vocab_coverage"] = {"answer_tokens_in_draft_vocab": 1.0, "target_mass_in_draft_vocab": 1.0,
                                 "note": "the drafter proposes over the target's full vocabulary"}
    return out


def failing_tokens(aligned: list[AnswerAlignment], worst: int, decode_text: Any) -> list[dict[str, Any]]:
    """Target tokens the drafter misses most at draft position 1 (teacher-forced), by misses."""
    by: dict[int, list[float]] = {}
    for a in aligned:
        for f in a.first:
            acc = by.setdefault(f["target"], [0, 0, 0.0])
            acc[0] += 1
            acc[1] += int(f["drafted"] != f["target"])
            acc[2] += f["alpha"]
    rows = sorted(by.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))
    return [{"token": t, "text": decode_text([t]), "count": int(n), "misses": int(miss),
             "miss_rate": round(miss / n, 4), "mean_alpha": round(s / n, 4)}
            for t, (n, miss, s) in rows[:worst] if miss]


def failing_contexts(aligned: list[AnswerAlignment], worst: int, decode_text: Any, width: int = 12) -> list[dict[str, Any]]:
    """The starts with the lowest position-1 α (teacher-forced), with the text before them."""
    rows = [(f["alpha"], a, f) for a in aligned for f in a.first]
    rows.sort(key=lambda r: r[0])
    out = []
    for alpha, a, f in rows[:worst]:
        at = len(a.context) - len(a.answer) + f["m"]
        out.append({"id": a.id, "turn": a.turn, "answer_position": f["m"], "alpha": round(alpha, 4),
                    "context": decode_text(a.context[max(0, at - width): at]),
                    "target_token": decode_text([f["target"]]), "drafted_token": decode_text([f["drafted"]]),
                    "p_target": round(f["p_target"], 4), "q_target": round(f["q_target"], 4),
                    "q_drafted": round(f["q_drafted"], 4)})
    return out


# ------------------------------------------------------------------ decoding


def spread(values: list[float]) -> dict[str, float] | None:
    """mean, sd, min, median, max of per-prompt values."""
    if not values:
        return None
    return {"mean": round(statistics.fmean(values), 4), "sd": round(statistics.pstdev(values), 4),
            "min": round(min(values), 4), "median": round(statistics.median(values), 4), "max": round(max(values), 4)}


def group_records(records: list[dict[str, Any]], key: str = "") -> dict[str, Any]:
    """τ (bonus counted), its SE over prompts, accepted-length histogram and the per-prompt spread
    of τ and speedup for one group of decoder records (``measure.evaluate.evaluate``'s)."""
    rounds = [r["stats"]["verify_rounds"] for r in records]
    emitted = [r["stats"]["accepted"] + r["stats"]["verify_rounds"] - r["stats"].get("eos_rounds", 0) for r in records]
    hist = [sum(col) for col in zip(*(r["stats"]["accepted_length_histogram"] for r in records))]
    total = sum(rounds)
    out: dict[str, Any] = {
        "prompts": len(records),
        "verify_rounds": total,
        "tau_with_bonus": round(sum(emitted) / total, 4) if total else 0.0,
        "tau_se": round(max(ratio_se(emitted, rounds), iid_round_se(hist)), 4),
        "tau_se_note": "the larger of the prompt-clustered and the independent-rounds standard error",
        "accepted_length_histogram": hist,
        "tau_per_prompt": spread([r["stats"]["tau_with_bonus"] for r in records if r["stats"]["verify_rounds"]]),
        "tokens_per_s_per_prompt": spread([r["stats"]["tokens_per_s"] for r in records]),
    }
    speedups = [r["speedup_vs_target"] for r in records if "speedup_vs_target" in r]
    if speedups:
        out["speedup_vs_target"] = round(statistics.median(speedups), 4)
        out["speedup_per_prompt"] = spread(speedups)
    return out


def by_group(records: list[dict[str, Any]], name: Any) -> dict[str, Any]:
    """:func:`group_records` for every value of ``name(record)``, sorted by it."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(str(name(r)), []).append(r)
    return {g: group_records(rs) for g, rs in sorted(groups.items())}


def compare(predicted: dict[str, Any], measured: dict[str, Any], sigmas: float) -> dict[str, Any]:
    """Predicted (``predict_tau``) vs measured (``group_records``) τ: they agree when |Δ| ≤ sigmas · SE.

    SE is the larger of the measured τ's own (``tau_se``) and the error a mean over the measured number
    of independent rounds would have if the predicted accepted-length distribution were the truth
    (so that a measured histogram with no spread, e.g. no draft ever accepted, still gets a tolerance)."""
    se = max(measured["tau_se"], null_round_se(predicted["accepted_length_histogram"], measured["verify_rounds"]))
    tol = sigmas * se
    diff = measured["tau_with_bonus"] - predicted["tau"]
    return {"predicted": round(predicted["tau"], 4), "measured": round(measured["tau_with_bonus"], 4),
            "difference": round(diff, 4), "se": round(se, 4), "tolerance": round(tol, 4), "within": abs(diff) <= tol + 1e-9}


def null_round_se(predicted_hist: Sequence[float], rounds: int) -> float:
    """SE of a mean accepted length over ``rounds`` independent rounds drawn from ``predicted_hist`` [k+1]."""
    h = np.asarray(predicted_hist, dtype=float)
    if rounds < 1 or h.sum() <= 0:
        return 0.0
    h = h / h.sum()
    n = np.arange(h.size)
    return float(np.sqrt((h * (n - (h * n).sum()) ** 2).sum() / rounds))


def speedup_prediction(cumulative: list[float | None], k: int, cost_model: dict[str, Any]) -> float | None:
    """τ / (v(k) + k c) with the measured v(k) and c of the speed pass (measure/costs.py)."""
    v = cost_model.get("verify_cost_by_k", {})
    vk = v.get(k, v.get(str(k)))
    if vk is None:
        return None
    return round(predicted_speedup(conditional_acceptance(cumulative), k, vk, cost_model["draft_cost_c"]), 4)


def predicted_by_group(aligned: list[AnswerAlignment], key: Any) -> dict[str, Any]:
    """The offline τ predictions (greedy, sampled) for every value of ``key(answer)``."""
    groups: dict[str, list[AnswerAlignment]] = {}
    for a in aligned:
        groups.setdefault(str(key(a)), []).append(a)
    return {g: {"answers": len(items), "tau_greedy": predict_tau(items, "tf_top1")["tau"],
                "tau_sampled": predict_tau(items, "ro_alpha")["tau"]} for g, items in sorted(groups.items())}
