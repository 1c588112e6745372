"""Data: sources → normalized conversations → chat template + loss mask → regenerate → feature cache → draft vocab."""
