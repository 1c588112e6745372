"""Evaluation: drafters in the built-in decoder (``decode/``) over prompt sets, metrics on disk, benchmarks."""
