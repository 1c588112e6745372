"""draftsmith: train draft models for speculative decoding and prove them losslessly.

The package root is the repository root (see pyproject.toml). Submodules:
``target`` (frozen target loading), ``drafters`` (drafter modules), ``data``,
``train``, ``eval`` (the built-in speculative decoder) and ``cli``.
"""

__version__ = "0.1.0"
