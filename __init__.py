"""draftsmith: train draft models for speculative decoding and prove them losslessly.

The package root is the repository root (see pyproject.toml). Submodules:
``target`` (frozen target loading), ``decode`` (the built-in speculative decoder),
``drafters`` (drafter modules), ``data``, ``train``, ``eval`` (decoding prompt sets, metrics
on disk, benchmarks) and ``cli``.
"""

__version__ = "0.1.0"
