"""Baseline rows of an evaluation: model-free drafters on the same prompts (``eval.baselines``).

A trained drafter is worth shipping only if it beats what costs nothing, so every ``draftsmith
eval`` also decodes its prompts with each named model-free drafter (default settings, default
``["prompt_lookup"]``) in the same process and dtype, and reports its τ, tokens/s and
``speedup_vs_target`` — the median over prompts of its tokens/s over the target-alone tokens/s
that the main run timed on the same prompt — under ``"baselines"`` in ``eval_metrics.json``.
When the main run was identity-checked (greedy, fp32), each baseline's output must equal it token
for token; otherwise the row counts the prompts where the two outputs agree.
"""

from __future__ import annotations

import statistics
from typing import Any

from ..drafters.registry import model_free_config
from ..errors import DraftsmithError
from ..schema import to_dict
from ..target import Target
from .config import DecodeConfig
from .prompts import Question


def run_baselines(
    target: Target,
    questions: list[Question],
    decode: DecodeConfig,
    names: list[str],
    main_records: list[dict[str, Any]],
    check_identity: bool = False,
    progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """name → the baseline's stats summary, its drafter section and its speed against the target alone.

    main_records: the main run's per-prompt records (``evaluate``), whose target-alone timing
    (``rec["target"]``, when timed) the speedups divide by; check_identity: the main run's outputs
    were checked against the target's, so a baseline's must equal them (raises on a difference).
    """
    from .run import evaluate  # run.py calls this module: import at call time

    configs = {name: model_free_config(name) for name in names}  # refuse a bad name before decoding anything
    out: dict[str, dict[str, Any]] = {}
    for name, config in configs.items():
        result = evaluate(target, config.build(target), questions, decode, progress=progress)
        same = 0
        ratios = []
        for main, rec in zip(main_records, result.records):
            if main["tokens"] == rec["tokens"]:
                same += 1
            elif check_identity and decode.warp.greedy:
                raise DraftsmithError(f"baseline {name}, prompt {rec['id']}: output differs from the target's greedy "
                                      f"output (which the main run reproduced)")
            if "target" in main and main["target"]["tokens_per_s"]:
                ratios.append(rec["stats"]["tokens_per_s"] / main["target"]["tokens_per_s"])
        row: dict[str, Any] = {"drafter": to_dict(config), **result.stats.summary(),
                               "same_tokens_as_main": f"{same}/{len(result.records)}"}
        if ratios:
            row["speedup_vs_target"] = round(statistics.median(ratios), 4)
        out[name] = row
    return out


def baseline_lines(baselines: dict[str, dict[str, Any]]) -> list[str]:
    """One printable line per baseline row."""
    lines = []
    for name, s in baselines.items():
        speed = f", speedup_vs_target {s['speedup_vs_target']:.3f}x" if "speedup_vs_target" in s else ""
        lines.append(f"baseline {name}: tau {s['tau_with_bonus']:.3f}, acceptance {s['acceptance_rate']:.3f}, "
                     f"{s['tokens_per_s']:.1f} tok/s{speed}")
    return lines
