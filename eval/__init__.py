"""``draftsmith eval``: the stage — its ``eval`` section (``config.py``) and its runner (``run.py``).

What it measures with (decoding a prompt set against the target alone, prompts, the cost model, baselines)
is the measurement layer ``measure/``, which ``train/`` and ``report/`` use too.
"""
