"""The learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math

import torch

from paralm.config.schema import TrainConfig


def learning_rate(step: int, train: TrainConfig) -> float:
    """Linear warm-up to `lr`, cosine decay to `min_lr` at `decay_steps`, then `min_lr`.

    The decay length is its own field, not `steps`, so stopping at step 5 and resuming up to step 10
    follows exactly the schedule of a run that went to step 10 at once.
    """
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    if step >= train.decay_steps:
        return train.min_lr
    progress = (step - train.warmup_steps) / max(train.decay_steps - train.warmup_steps, 1)
    return train.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (train.lr - train.min_lr)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
