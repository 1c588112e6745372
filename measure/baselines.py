"""Baseline rows of an evaluation: model-free drafters on the same prompts (``eval.baselines``).

A trained drafter is worth shipping only if it beats what costs nothing, so every ``draftsmith
eval`` also decodes its prompts with each named model-free drafter (default settings, default
``["prompt_lookup"]``) in the same process and dtype, and reports its τ, tokens/s and
``speedup_vs_target`` — the median over prompts of its tokens/s over the target-alone tokens/s
on the same prompt, timed in the same paired runs as the main drafter (``evaluate``'s
``baselines``) — under ``"baselines"`` in ``eval_metrics.json``.
When the main run was identity-checked (greedy, fp32), each baseline's output must equal it token
for token; otherwise the row counts the prompts where the two outputs agree.
"""

from __future__ import annotations

import statistics
from typing import Any

from ..drafters.registry import model_free_config
from ..errors import DraftsmithError
from ..schema import to_dict
from .config import DecodeConfig
from .costs import median_interval


def baseline_configs(names: list[str]) -> dict[str, Any]:
    """name → the model-free drafter's default config (refuses an unknown name before anything is decoded)."""
    return {name: model_free_config(name) for name in names}


def baseline_rows(
    result: Any,
    configs: dict[str, Any],
    decode: DecodeConfig,
    check_identity: bool = False,
) -> dict[str, dict[str, Any]]:
    """name → the baseline's stats summary, its drafter section and its speed against the target alone.

    result: the :class:`~draftsmith.measure.evaluate.Evaluation` whose ``baselines`` decoded these drafters beside
    the main one (same prompts, paired timing); check_identity: the main run's outputs were checked against
    the target's, so a baseline's must equal them (raises on a difference).
    """
    out: dict[str, dict[str, Any]] = {}
    for name, config in configs.items():
        side = result.baselines[name]
        same = 0
        for main, rec in zip(result.records, side.records):
            if main["tokens"] == rec["tokens"]:
                same += 1
            elif check_identity and decode.warp.greedy:
                raise DraftsmithError(f"baseline {name}, prompt {rec['id']}: output differs from the target's greedy "
                                      f"output (which the main run reproduced)")
        row: dict[str, Any] = {"drafter": to_dict(config), **side.stats.summary(),
                               "same_tokens_as_main": f"{same}/{len(side.records)}"}
        ratios = [rec["speedup_vs_target"] for rec in side.records if "speedup_vs_target" in rec]
        if ratios:
            row["speedup_vs_target"] = round(statistics.median(ratios), 4)
            row["speedup_interval_90"] = [round(x, 4) for x in median_interval(ratios)]
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
