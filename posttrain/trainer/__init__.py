"""The training loop and what surrounds it: setup, metrics, validation, checkpoints, export."""
