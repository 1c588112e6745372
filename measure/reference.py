"""The target decoding alone (``decode/reference.py``, below export/ which checks with it too), re-exported where
evaluation has always imported it from."""

from ..decode.reference import hf_generate, target_greedy

__all__ = ["hf_generate", "target_greedy"]
