"""Paired timing: every method on the same prompt, the order rotating from run to run.

Its own file because both the built-in decoder's evaluation (``evaluate.py``) and the engine comparison
(``engine.py``) time this way.
"""

from __future__ import annotations

from typing import Any, Callable


def paired_runs(methods: dict[str, Callable[[list[int]], tuple[Any, float]]], prompt: list[int], repeats: int,
                start: int = 0) -> dict[str, tuple[tuple[Any, float], list[float]]]:
    """Run every method on one prompt ``repeats`` times; name → (the fastest run's (output, seconds), all seconds).

    Run r goes through the methods starting at position ``(start + r) % len(methods)``, so who runs first
    rotates (with two methods and two runs: A B, B A), and a load change mid-prompt hits every method alike.
    """
    names = list(methods)
    best: dict[str, tuple[Any, float]] = {}
    runs: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        shift = (start + r) % len(names)
        for name in names[shift:] + names[:shift]:
            got = methods[name](prompt)
            runs[name].append(got[1])
            if name not in best or got[1] < best[name][1]:
                best[name] = got
    return {name: (best[name], runs[name]) for name in names}
