"""The report's PNG plots (matplotlib, Agg): every drafter on the same axes, units on every axis.

Each function takes report.json's content and a path, and writes one PNG atomically.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..files import atomic_path

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str) -> None:
    plt = _pyplot()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def _finish(fig: Any, ax: Any, path: str, xlabel: str, ylabel: str, title: str) -> None:
    """Axis labels (with units), title, grid and legend of a one-axes plot, then save it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


def _drafters(report: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    return [(name, res, COLORS[i % len(COLORS)]) for i, (name, res) in enumerate(report["drafters"].items())]


def _values(xs: list[float | None]) -> list[float]:
    return [np.nan if x is None else x for x in xs]


def acceptance_by_position(report: dict[str, Any], path: str) -> None:
    """Cumulative acceptance at each draft position: decoder (solid) and offline (dashed), greedy | sampled."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    k = report["decode"]["k"]
    x = np.arange(1, k + 1)
    for name, res, color in _drafters(report):
        dec, al = res["decoding"], res["alignment"]
        axes[0].plot(x, _values(dec["greedy"]["acceptance_at_position"]), "-o", color=color, label=f"{name}: decoder")
        if "skipped" not in al:
            axes[0].plot(x, _values(al["teacher_forced"]["cumulative_top1"]), "--s", color=color, alpha=0.7,
                         label=f"{name}: offline top-1")
        if dec["sampled"] is not None:
            axes[1].plot(x, _values(dec["sampled"]["acceptance_at_position"]), "-o", color=color, label=f"{name}: decoder")
        if "skipped" not in al:
            axes[1].plot(x, _values(al["rollout"]["cumulative_alpha"]), "--s", color=color, alpha=0.7,
                         label=f"{name}: offline α (rollout)")
            axes[1].plot(x, _values(al["teacher_forced"]["cumulative_alpha"]), ":^", color=color, alpha=0.5,
                         label=f"{name}: offline α (teacher-forced)")
    axes[0].set_title("greedy")
    axes[1].set_title(f"sampled, T = {report['decode']['temperature']}")
    for ax in axes:
        ax.set_xlabel("draft position j (tokens after the last committed one)")
        ax.set_xticks(x)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("P(drafts 1..j all accepted) (share of rounds)")
    _save(fig, path)


def accepted_length_histogram(report: dict[str, Any], path: str) -> None:
    """Share of greedy rounds that accepted exactly n drafts (bars), and the offline prediction (markers)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    k = report["decode"]["k"]
    items = _drafters(report)
    width = 0.8 / max(len(items), 1)
    x = np.arange(k + 1)
    for i, (name, res, color) in enumerate(items):
        hist = np.array(res["decoding"]["greedy"]["accepted_length_histogram"], dtype=float)
        share = 100 * hist / max(hist.sum(), 1)
        ax.bar(x + (i - (len(items) - 1) / 2) * width, share, width, color=color,
               label=f"{name} (τ {res['decoding']['greedy']['tau_with_bonus']:.2f}, {int(hist.sum())} rounds)")
        al = res["alignment"]
        if "skipped" not in al:
            rep = np.array(al["prediction"]["greedy"]["accepted_length_histogram"], dtype=float)
            ax.plot(x + (i - (len(items) - 1) / 2) * width, 100 * rep / max(rep.sum(), 1), "k_", markersize=14,
                    label="predicted offline (fp32 replay)" if i == 0 else None)
    ax.set_xticks(x)
    ax.set_xlabel("drafts accepted in a round (tokens; the round emits one more)")
    ax.set_ylabel("rounds (%)")
    ax.set_title(f"accepted length per round, greedy, k = {k}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def calibration_curve(report: dict[str, Any], path: str) -> None:
    """Reliability curve: the drafter's top-1 confidence against how often its top-1 is the target's."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.8, 5.2))
    ax.plot([0, 1], [0, 1], color="gray", lw=1, ls="--", label="perfectly calibrated")
    for name, res, color in _drafters(report):
        al = res["alignment"]
        if "skipped" in al:
            continue
        cal = al["calibration"]
        bins = [b for b in cal["bins"] if b["count"]]
        ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], "-o", color=color,
                label=f"{name} (ECE {cal['ece']:.3f}, {cal['drafts']} drafts)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("drafter's top-1 probability (mean in bin)")
    ax.set_ylabel("top-1 = target's greedy token (share of drafts)")
    ax.set_title("calibration (teacher-forced drafts)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    _save(fig, path)


def per_category(report: dict[str, Any], path: str) -> None:
    """τ (greedy and sampled) and greedy speedup vs the target alone, by category, drafters side by side."""
    plt = _pyplot()
    items = _drafters(report)
    cats = sorted({c for _, res, _ in items for c in res["decoding"]["greedy"]["by_category"]})
    labels = cats + ["overall"]
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 1.3 * len(labels) * 2), 4.5))
    width = 0.8 / max(len(items), 1)
    x = np.arange(len(labels))
    for i, (name, res, color) in enumerate(items):
        g = res["decoding"]["greedy"]
        s = res["decoding"]["sampled"]
        off = (i - (len(items) - 1) / 2) * width
        tau = [g["by_category"].get(c, {}).get("tau_with_bonus", np.nan) for c in cats] + [g["tau_with_bonus"]]
        axes[0].bar(x + off, tau, width, color=color, label=f"{name}: greedy")
        if s is not None:
            ts = [s["by_category"].get(c, {}).get("tau_with_bonus", np.nan) for c in cats] + [s["tau_with_bonus"]]
            axes[0].plot(x + off, ts, "kx", label="sampled" if i == 0 else None)
        sp = [g["by_category"].get(c, {}).get("speedup_vs_target", np.nan) for c in cats] + [g.get("speedup_vs_target", np.nan)]
        axes[1].bar(x + off, sp, width, color=color, label=name)
    top = max([1.0] + [v for _, res, _ in items for mode in ("greedy", "sampled") if res["decoding"][mode]
                       for v in [res["decoding"][mode]["tau_with_bonus"], *[c["tau_with_bonus"] for c in
                                                                              res["decoding"][mode]["by_category"].values()]]])
    axes[0].set_ylim(0, 1.35 * top)  # room for the legend above the bars
    axes[0].set_ylabel("τ (tokens per target forward, bonus counted)")
    axes[0].set_title("τ by category (bars greedy, × sampled)")
    speeds = [v for _, res, _ in items for v in [res["decoding"]["greedy"].get("speedup_vs_target", 1.0),
                                                  *[c.get("speedup_vs_target", 1.0) for c in
                                                    res["decoding"]["greedy"]["by_category"].values()]]]
    axes[1].set_ylim(0, 1.35 * max([1.0] + speeds))
    axes[1].axhline(1.0, color="gray", lw=1, ls="--")
    axes[1].set_ylabel("speedup vs the target alone (×, median over prompts)")
    axes[1].set_title(f"greedy speedup by category ({report['decode']['speed_dtype']})")
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
        ax.set_xlabel("MT-bench category (prompt set category)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    _save(fig, path)


def predicted_vs_measured(report: dict[str, Any], path: str) -> None:
    """Predicted τ against the decoder's, with the stated tolerance as error bars; diagonal = agreement."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.8, 5.2))
    lo, hi = 1.0, 1.0
    for name, res, color in _drafters(report):
        pvm = res["prediction_vs_measurement"]
        if "skipped" in pvm:
            continue
        for mode, marker in (("greedy", "o"), ("greedy_fp32", "s"), ("sampled", "^")):
            if mode not in pvm:
                continue
            c = pvm[mode]
            ax.errorbar(c["predicted"], c["measured"], yerr=c["tolerance"], fmt=marker, color=color, capsize=3,
                        label=f"{name}: {mode}{'' if c['within'] else ' (outside tolerance)'}")
            lo, hi = min(lo, c["predicted"], c["measured"] - c["tolerance"]), max(hi, c["predicted"], c["measured"] + c["tolerance"])
        by_cat = res["alignment"].get("by_category", {})
        meas = res["decoding"]["greedy"]["by_category"]
        pts = [(by_cat[c]["tau_greedy"], meas[c]["tau_with_bonus"]) for c in by_cat if c in meas]
        if pts:
            ax.plot(*zip(*pts), ".", color=color, alpha=0.4, label=f"{name}: greedy by category")
            lo, hi = min(lo, *[min(p) for p in pts]), max(hi, *[max(p) for p in pts])
    pad = 0.1 * (hi - lo) + 0.05
    ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="gray", lw=1, ls="--", label="predicted = measured")
    ax.set_xlim(lo - pad, hi + pad)
    ax.set_ylim(lo - pad, hi + pad)
    _finish(fig, ax, path, "predicted τ from offline α (tokens per target forward)",
            "decoder's τ (tokens per target forward)", "predicted vs measured τ (error bar: tolerance)")


def training_sim_tau(report: dict[str, Any], path: str) -> None:
    """Training's simulated τ over steps (train_summary.json), the decoder's τ as a line; only drafters with a run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, res, color in _drafters(report):
        tr = res.get("training")
        if not tr:
            continue
        pts = tr["sim_tau_curve"]
        ax.plot([p["step"] for p in pts], [p["sim_tau"] for p in pts], "-o", color=color, label=f"{name}: sim_tau")
        best = tr.get("best") or {}
        if "step" in best:
            ax.plot([best["step"]], [best["sim_tau"]], "*", color=color, markersize=14, label=f"{name}: drafter-best")
        mode = "greedy" if (best.get("greedy", True)) else "sampled"
        dec = res["decoding"].get(mode)
        if dec:
            ax.axhline(dec["tau_with_bonus"], color=color, ls="--", lw=1, label=f"{name}: decoder τ ({mode}, this report)")
    _finish(fig, ax, path, "training step (optimizer steps)", "τ (tokens per target forward, bonus counted)",
            "simulated τ over training (held-out α) vs the decoder")


PLOTS = {
    "acceptance_by_position.png": acceptance_by_position,
    "accepted_length_histogram.png": accepted_length_histogram,
    "calibration.png": calibration_curve,
    "per_category.png": per_category,
    "predicted_vs_measured.png": predicted_vs_measured,
}
