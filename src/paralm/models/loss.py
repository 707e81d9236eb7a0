"""The training loss every family shares."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor, tokens: float | None = None) -> torch.Tensor:
    """Next-token cross-entropy, computed in fp32 whatever the logits' dtype: the mean over the targets
    (those set to -100, `IGNORE`, skipped), or with `tokens` their sum divided by it. A masked loss
    normalises by the trained targets of the whole global batch (`tokens`, per loss replica), so every
    micro-batch and rank weighs each trained token alike, however the mask falls."""
    if tokens is None:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="sum") / tokens
