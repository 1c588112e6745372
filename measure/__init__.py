"""Measurement: what the stages measure with — ``train/`` (held-out decoder τ), ``export/`` (``--check``'s sweep
in llama.cpp), ``eval/`` (``draftsmith eval``) and ``report/`` stand on it (stacked in that order:
``tests/test_imports.py``), and the benchmarks in ``benchmarks/`` call it.

``evaluate.py`` (a drafter over a prompt set in the built-in decoder, timed against the target alone),
``paired.py`` (paired timing), ``costs.py`` (the cost model: v(k), c, τ from acceptance), ``prompts.py``
(MT-bench, the packaged copy-heavy set in ``prompts/`` and its builder ``copyheavy.py``, JSONL files),
``baselines.py`` (model-free baseline rows), ``config.py``
(the recipe's ``decode`` and ``eval`` sections), ``engine.py`` (a GGUF measured in llama.cpp against its target
alone), ``engine_eval.py`` (``eval.engine=llamacpp``: the recipe's saved drafter measured there, its GGUF written
by the writer the stage hands in, since exporting lies above). It sits above ``decode/``, ``drafters/`` and
``engines/``; no stage folder lies below it.
"""
