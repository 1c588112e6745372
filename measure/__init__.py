"""Measurement: what the stages measure with, side by side — ``train/`` (held-out decoder τ), ``eval/``
(``draftsmith eval``), ``report/`` and ``export/`` (the engine comparison) stand on it, and the benchmarks
in ``benchmarks/`` call it.

``evaluate.py`` (a drafter over a prompt set in the built-in decoder, timed against the target alone),
``paired.py`` (paired timing), ``costs.py`` (the cost model: v(k), c, τ from acceptance), ``prompts.py``
(MT-bench, the packaged copy-heavy set in ``prompts/`` and its builder ``copyheavy.py``, JSONL files),
``baselines.py`` (model-free baseline rows), ``config.py``
(the recipe's ``decode`` section), ``engine.py`` (a GGUF measured in llama.cpp against its target alone).
It sits above ``decode/``, ``drafters/`` and ``engines/``; no stage folder lies below it.
"""
