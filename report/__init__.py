"""``draftsmith report``: the alignment report a user reads before shipping a drafter.

It ties together what the built-in decoder measures (τ, acceptance by position, speed against the
target alone, by category, greedy and sampled), what the drafter's distributions say offline on
the target's own answers (α by position teacher-forced and along the drafter's rollouts, KL, top-1,
calibration, vocabulary coverage, failing tokens), the prediction of one from the other, and the
fp32 lossless audit. ``run.py`` is the command; each other file computes one part.

It sits above measure/, export/, decode/, drafters/ and data/; nothing below imports it (the recipe's
``report`` section lives in ``config.py`` here and is imported by the top-level ``config``).
"""
