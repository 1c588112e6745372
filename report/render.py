"""report.json, report.md and the plots, from the report's content (all written atomically)."""

from __future__ import annotations

import os
from typing import Any

from ..files import write_json, write_text
from ..tables import markdown_table
from .plots import PLOTS, training_sim_tau


def write_report(report: dict[str, Any], out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, "report.json"), report)
    for name, plot in PLOTS.items():
        plot(report, os.path.join(out_dir, name))
    if any(res.get("training") for res in report["drafters"].values()):
        training_sim_tau(report, os.path.join(out_dir, "training_sim_tau.png"))
    write_text(os.path.join(out_dir, "report.md"), markdown(report))


def _f(x: Any, digits: int = 3, suffix: str = "") -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, float):
        return f"{x:.{digits}f}{suffix}"
    return f"{x}{suffix}"


def _table(header: list[str], rows: list[list[Any]], text: bool = False) -> list[str]:
    """The table and a blank line: the first column left-aligned and the figures right, or every column left
    (``text``: contexts, curves)."""
    return [*markdown_table(header, rows, left=len(header) if text else 1), ""]


def markdown(report: dict[str, Any]) -> str:
    d = report["decode"]
    t = report["target"]
    names = list(report["drafters"])
    res = report["drafters"]
    lines = [
        f"# Alignment report: {', '.join(names)}",
        "",
        f"Target **{t['name']}** ({t['layers']} layers); {report['prompts']['asked']} prompts from "
        f"`{report['prompts']['source']}` ({report['prompts']['second_turns']} second turns, asked after the target's "
        f"own first answer); k = {d['k']}, up to {d['max_new_tokens']} new tokens; speed in {d['speed_dtype']}; "
        f"sampled at T = {d['temperature']} with seeds {d['seeds']}.",
        "",
        f"τ is {report['tau_note']}.",
        "",
        "## Summary",
        "",
    ]
    rows = []

    def get(name: str, *path: str) -> Any:
        node: Any = res[name]
        for p in path:
            if not isinstance(node, dict) or p not in node:
                return None
            node = node[p]
        return node

    for label, path, digits in (
        ("τ greedy, decoder", ("decoding", "greedy", "tau_with_bonus"), 3),
        ("τ greedy, predicted offline", ("prediction_vs_measurement", "greedy", "predicted"), 3),
        ("  within tolerance (±)", None, 3),
        ("τ greedy fp32, decoder", ("decoding", "greedy_fp32", "tau_with_bonus"), 3),
        ("  fp32 histogram predicted exactly", ("prediction_vs_measurement", "greedy_fp32_replay", "exact"), 3),
        ("τ(k) of full rounds greedy: decoder / offline", None, 3),
        ("τ sampled, decoder (all seeds)", ("decoding", "sampled", "tau_with_bonus"), 3),
        ("τ sampled, predicted (rollout α)", ("prediction_vs_measurement", "sampled", "predicted"), 3),
        ("τ sampled, predicted (teacher-forced α)", ("prediction_vs_measurement", "sampled", "predicted_teacher_forced"), 3),
        ("  within tolerance (±)", "sampled", 3),
        ("tokens/s (greedy)", ("decoding", "greedy", "speed", "tokens_per_s"), 1),
        ("target alone, tokens/s", ("decoding", "greedy", "speed", "target_tokens_per_s"), 1),
        ("speedup vs target, measured", ("decoding", "greedy", "speed", "speedup_vs_target"), 3),
        ("speedup, predicted (c, v(k), offline τ)", ("prediction_vs_measurement", "speedup_greedy", "predicted"), 3),
        ("draft cost c (target steps)", ("decoding", "greedy", "speed", "cost_model", "draft_cost_c"), 3),
        ("in llama.cpp: τ (same k, F32 or as served)", ("engine", "tau"), 3),
        ("in llama.cpp: speedup vs its target alone", ("engine", "speedup"), 3),
        ("in llama.cpp: predicted from the decoder's τ", ("engine", "predicted_speedup"), 3),
        ("in llama.cpp: break-even τ (round cost)", ("engine", "break_even_tau"), 3),
        ("τ gap: built-in fp32 decoder − llama.cpp", ("engine", "tau_gap"), 3),
        ("α₁ teacher-forced / rollout", None, 3),
        ("top-1 at position 1", ("alignment", "teacher_forced", "top1"), 3),
        ("forward KL at position 1 (nats)", ("alignment", "teacher_forced", "forward_kl"), 3),
        ("ECE (calibration)", ("alignment", "calibration", "ece"), 3),
        ("answer tokens in draft vocabulary", ("alignment", "vocab_coverage", "answer_tokens_in_draft_vocab"), 3),
        ("lossless audit (fp32): identical", None, 3),
    ):
        cells = [label]
        for n in names:
            if label.startswith("  within"):
                mode = "greedy" if path is None else path
                c = get(n, "prediction_vs_measurement", mode)
                cells.append("—" if c is None else f"{_f(c['within'])} (Δ {c['difference']:+.3f}, tolerance {c['tolerance']:.3f})")
            elif label.startswith("α₁"):
                a, b = get(n, "alignment", "teacher_forced", "alpha"), get(n, "alignment", "rollout", "alpha")
                cells.append("—" if a is None else f"{_f(a[0])} / {_f(b[0])}")
            elif label.startswith("τ(k)"):
                c = get(n, "prediction_vs_measurement", "steady_state_greedy")
                cells.append("—" if c is None else f"{_f(c['decoder'])} / {_f(c['predicted'])}")
            elif label.startswith("lossless"):
                a = get(n, "audit")
                cells.append(f"{a['identical']}/{a['prompts']}")
            else:
                v = get(n, *path)
                if isinstance(v, list):
                    v = v[0] if v else None
                cells.append(_f(v, digits))
        rows.append(cells)
    lines += _table(["", *names], rows)
    lines += ["![predicted vs measured](predicted_vs_measured.png)", "", "## Tolerance", "",
              report["tolerance_note"], ""]

    lines += ["## Acceptance by draft position", "",
              "Cumulative: the share of rounds (decoder) or starts (offline) proposing draft j in which drafts 1..j "
              "were all accepted. Conditional α_j: the share of those that accepted 1..j−1 in which j was accepted "
              "too (do not compare it with a cumulative row). Offline α_j = E[Σ min(p, q)] per position over the "
              "starts proposing j, teacher-forced (the drafter reads the target's tokens: for greedy, the context of "
              "a draft whose predecessors were accepted, i.e. the conditional quantity) and along the drafter's own "
              "argmax rollout.", ""]
    header = ["drafter", "quantity", *[f"j={j}" for j in range(1, d["k"] + 1)]]
    rows = []
    for n in names:
        for label, path in (("decoder greedy (cumulative)", ("decoding", "greedy", "acceptance_at_position")),
                            ("decoder greedy (conditional α_j)", ("decoding", "greedy", "conditional_acceptance_at_position")),
                            ("offline top-1 (cumulative)", ("alignment", "teacher_forced", "cumulative_top1")),
                            ("decoder sampled (cumulative)", ("decoding", "sampled", "acceptance_at_position")),
                            ("offline α rollout (cumulative)", ("alignment", "rollout", "cumulative_alpha")),
                            ("offline α teacher-forced (per position)", ("alignment", "teacher_forced", "alpha")),
                            ("offline α rollout (per position)", ("alignment", "rollout", "alpha")),
                            ("offline top-1 teacher-forced (per position)", ("alignment", "teacher_forced", "top1")),
                            ("forward KL teacher-forced (nats)", ("alignment", "teacher_forced", "forward_kl"))):
            v = get(n, *path)
            if v is not None:
                rows.append([n, label, *[_f(x) for x in v]])
    rows.sort(key=lambda r: names.index(r[0]))
    lines += _table(header, rows)
    lines += ["![acceptance by position](acceptance_by_position.png)", "",
              "![accepted length histogram](accepted_length_histogram.png)", ""]

    lines += ["## By category", "", "Greedy τ and speedup per category (median over prompts), the offline prediction "
              "beside it; spread = min – max of per-prompt τ.", ""]
    rows = []
    for n in names:
        g = res[n]["decoding"]["greedy"]
        s = res[n]["decoding"]["sampled"] or {"by_category": {}}
        pred = res[n]["alignment"].get("by_category", {})
        for c, v in {**g["by_category"], **g["by_turn"]}.items():
            sp = v.get("tau_per_prompt") or {}
            rows.append([n, c, v["prompts"], _f(v["tau_with_bonus"]), _f(pred.get(c, {}).get("tau_greedy")),
                         f"{_f(sp.get('min'), 2)} – {_f(sp.get('max'), 2)}",
                         _f(s["by_category"].get(c, {}).get("tau_with_bonus")), _f(v.get("speedup_vs_target"))])
    lines += _table(["drafter", "category", "prompts", "τ greedy", "τ predicted", "τ spread", "τ sampled",
                     "speedup"], rows)
    lines += ["![per category](per_category.png)", ""]

    lines += ["## Calibration", "", "The drafter's top-1 probability against how often its top-1 is the target's "
              "greedy token (teacher-forced drafts, all positions).", ""]
    for n in names:
        cal = get(n, "alignment", "calibration")
        if cal is None:
            continue
        lines += [f"**{n}**: ECE {cal['ece']:.3f} over {cal['drafts']} drafts", ""]
        lines += _table(["confidence bin", "drafts", "mean confidence", "accuracy"],
                        [[f"[{b['lo']:.1f}, {b['hi']:.1f})", b["count"], _f(b["confidence"]), _f(b["accuracy"])]
                         for b in cal["bins"]])
    lines += ["![calibration](calibration.png)", ""]

    lines += ["## Where the drafters fail", ""]
    for n in names:
        al = res[n]["alignment"]
        if "skipped" in al:
            lines += [f"**{n}**: offline alignment skipped: {al['skipped']}", ""]
            continue
        cov = al["vocab_coverage"]
        lines += [f"**{n}** — draft vocabulary: {cov['answer_tokens_in_draft_vocab']:.1%} of the answer tokens, "
                  f"{cov['target_mass_in_draft_vocab']:.1%} of the target's probability mass.", "",
                  "Tokens missed most at draft position 1 (teacher-forced):", ""]
        lines += _table(["token", "count", "misses", "miss rate", "mean α"],
                        [[repr(r["text"]), r["count"], r["misses"], _f(r["miss_rate"]), _f(r["mean_alpha"])]
                         for r in al["failing_tokens"]])
        lines += ["Contexts with the lowest α at position 1:", ""]
        lines += _table(["prompt", "context (before)", "target", "drafted", "p(target)", "q(target)", "α"],
                        [[f"{r['id']} @{r['answer_position']}", repr(r["context"]), repr(r["target_token"]),
                          repr(r["drafted_token"]), _f(r["p_target"]), _f(r["q_target"]), _f(r["alpha"])]
                         for r in al["failing_contexts"]], text=True)

    trained = [n for n in names if res[n].get("training")]
    if trained:
        lines += ["## Over training", "", "The simulated τ training logged at every held-out evaluation (its "
                  "train_summary.json) and the step drafter-best was kept at, beside the decoder's τ measured here.", ""]
        rows = []
        for n in trained:
            tr = res[n]["training"]
            best = tr.get("best") or {}
            curve = ", ".join(f"{p['step']}: {p['sim_tau']:.3f}" for p in tr["sim_tau_curve"])
            rows.append([n, curve, f"{best.get('step', '—')} ({_f(best.get('sim_tau'))})",
                         _f(res[n]["decoding"]["greedy"]["tau_with_bonus"])])
        lines += _table(["drafter", "sim_tau by step", "drafter-best step (sim_tau)", "decoder τ greedy"], rows, text=True)
        lines += ["![training](training_sim_tau.png)", ""]

    lines += ["## Lossless audit (fp32 greedy, with and without speculation)", ""]
    for n in names:
        a = res[n]["audit"]
        lines.append(f"**{n}**: {a['identical']}/{a['prompts']} prompts token-identical.")
        for dv in a["divergences"]:
            lines.append(f"- prompt {dv['id']}: first difference at new token {dv['position']}: target "
                         f"{dv['target_token']} ({dv['target_text']!r}), speculative {dv['speculative_token']} "
                         f"({dv['speculative_text']!r})")
        lines.append("")
    return "\n".join(lines) + "\n"
