"""``draftsmith eval``: the stage — its runner (``run.py``).

What it measures with (decoding a prompt set against the target alone, prompts, the cost model, baselines)
is the measurement layer ``measure/``, which ``train/`` and ``report/`` use too; so is its ``eval`` section
(``measure/config.py``: ``EvalConfig``, and ``EvalRecipe``, what the stage reads of a recipe), which they read too.
"""
