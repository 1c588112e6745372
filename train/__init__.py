"""Training: pure loss functions, one recipe file per method, and ``distributed.py`` (all DeepSpeed code)."""
