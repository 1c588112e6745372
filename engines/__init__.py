"""Serving engines as real dependencies, managed in one place.

``llamacpp`` builds llama.cpp once per machine into a cache outside the repository, converts
drafters and targets to GGUF with llama.cpp's own converter, and runs ``llama-server`` on a
loopback port, always stopped by its own PID. This folder imports only ``devices``, ``errors``,
``files``, ``target`` (the target's files to convert: ``targets.py``) and ``decode.stats`` (to read
llama.cpp's rounds as draftsmith's stats): data/, export/ and measure/ stand on it.
"""

from typing import Literal

Launch = Literal["none", "llamacpp"]
"""What a stage may start for itself (``eval.engine``, ``data.regenerate.server.launch``): nothing, or a
llama-server (``llamacpp.py``)."""
