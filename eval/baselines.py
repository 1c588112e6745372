"""Baseline rows of an evaluation: model-free drafters on the same prompts (``eval.baselines``).

A trained drafter is worth shipping only if it beats what costs nothing, so every ``draftsmith
eval`` also decodes its prompts with each named model-free drafter (default settings, default
``["prompt_lookup"]``) and reports its τ and tokens/s beside the drafter's own figures, under
``"baselines"`` in ``eval_metrics.json``. In greedy mode with ``eval.check_identity`` each
baseline's output must equal the checked output of the main run, token for token.
"""

from __future__ import annotations

from typing import Any

from ..decode.stats import DecodeStats
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
    main_records: list[dict[str, Any]] | None = None,
    progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """name → the baseline's stats summary (+ its drafter section); ``main_records``: the main run's
    per-prompt records, whose tokens a greedy baseline must reproduce when they were identity-checked."""
    from .run import evaluate  # run.py calls this module: import at call time

    configs = {name: model_free_config(name) for name in names}  # refuse a bad name before decoding anything
    out: dict[str, dict[str, Any]] = {}
    for name, config in configs.items():
        stats, records = evaluate(target, config.build(target), questions, decode, progress=progress)
        if decode.warp.greedy and main_records is not None:
            for main, rec in zip(main_records, records):
                if main.get("identical_to_target") and main["tokens"] != rec["tokens"]:
                    raise DraftsmithError(f"baseline {name}, prompt {rec['id']}: output differs from the target's "
                                          f"greedy output")
        out[name] = {"drafter": to_dict(config), **stats.summary()}
    return out


def baseline_lines(main: DecodeStats, baselines: dict[str, dict[str, Any]]) -> list[str]:
    """One printable line per baseline, with its tokens/s relative to the main drafter's."""
    lines = []
    ours = main.tokens_per_s
    for name, s in baselines.items():
        ratio = f"; the drafter runs at {ours / s['tokens_per_s']:.2f}x its tokens/s" if s["tokens_per_s"] else ""
        lines.append(f"baseline {name}: tau {s['tau_with_bonus']:.3f}, acceptance {s['acceptance_rate']:.3f}, "
                     f"{s['tokens_per_s']:.1f} tok/s{ratio}")
    return lines
