"""The training loop and what it composes: optimizer and schedule, precision, checkpoints, metrics."""
