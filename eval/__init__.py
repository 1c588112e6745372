"""Evaluation: the built-in speculative decoder, its metrics, benchmarks and reports."""
