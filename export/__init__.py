"""Export drafters to serving engines, each format proven by loading it back.

``export(source, fmt, out)`` writes a drafter folder or a training checkpoint (any ZeRO stage)
in one engine format; ``check(folder)`` proves an export. One state-dict adapter per (family,
format) (``adapters.py``); the layer-id and vocabulary conventions written once
(``conventions.py``). This package reads drafters/ and train/'s checkpoints (``train/checkpoint.py``), converts
through engines/, proves exports in decode/ and measures a GGUF through measure/; above it the CLI, and ``eval/``
and ``report/`` for the GGUF that ``eval.engine=llamacpp`` measures (``run.export_gguf_draft``).
``import_drafter(folder, out, target)`` is the inverse (``importer.py``): a drafter trained elsewhere, in one of
``IMPORTS``, becomes a draftsmith drafter folder.
"""

from .importer import IMPORTS, import_drafter
from .run import FORMATS, TARGET_FORMAT, CheckFailed, check, export, export_target

__all__ = ["FORMATS", "IMPORTS", "TARGET_FORMAT", "CheckFailed", "check", "export", "export_target", "import_drafter"]
