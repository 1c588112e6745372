"""What the benchmark scripts' ``main()`` share, written once: the parser with the script's docstring as its help,
the target and thread options, the thread count and the environment of a script that loads the target, the MT-bench
first turns rendered for a target, and the result file.

benchmarks/ is not a package: a script imports this file by its folder, as ``data_curve.py`` imports ``levers``::

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_common import script_parser  # noqa: E402 — the benchmarks folder is not a package
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

TARGET = "smollm2-135m-instruct"
"""The default target of every script: the builtin SmolLM2-135M-Instruct."""


def draft_types(spec: str, target_type: str) -> list[str]:
    """The drafter GGUF types a ``--draft-type(s)`` option names for a target type: ``matched`` is BF16 on a BF16
    target and F32 on any other, else the comma-separated types as given (``auto``: the drafter's stored dtype)."""
    return [("bf16" if target_type == "bf16" else "f32")] if spec == "matched" else spec.split(",")


def script_parser(doc: str | None, target: bool = False, threads: bool = False) -> argparse.ArgumentParser:
    """The script's parser, its module docstring (as written) for ``--help``; with ``target``, ``--target`` (a target
    spec, default the builtin SmolLM2); with ``threads``, ``--threads`` (torch threads, 0: torch's default: see
    :func:`set_threads`)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if target:
        ap.add_argument("--target", default=TARGET, help="target spec (default: the builtin SmolLM2)")
    if threads:
        ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return ap


def set_threads(threads: int) -> None:
    """``torch.set_num_threads(threads)``; 0 leaves torch's default."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def offline(threads: int) -> None:
    """The environment of a script that loads the target, unless the caller's says otherwise: the Hugging Face hub
    offline (builtin and local targets need no network, and a missing file fails at once instead of waiting on a
    download), tokenizers without their own thread pool (it warns and may deadlock once the script forks), and
    ``threads`` torch threads (:func:`set_threads`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    set_threads(threads)


def save_result(path: str, result: Any) -> None:
    """The script's result as JSON at ``path`` (its folder made, the file replaced whole: ``files.write_json``), and a
    line that says where."""
    from draftsmith.files import write_json

    write_json(path, result)
    print(f"wrote {path}")


def first_turns(target: Any, questions: Sequence[Any]) -> list[list[int]]:
    """Each question's first turn alone, rendered with the target's chat template: token ids [S] per prompt."""
    return [target.render_chat([{"role": "user", "content": q.turns[0]}]) for q in questions]
