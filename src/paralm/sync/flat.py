"""Many tensors as one flat buffer, for one message or one collective instead of one per tensor."""

from __future__ import annotations

import torch


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A new 1-D tensor holding `tensors` one after the other (they share a dtype and device)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped as `like`, in order: the inverse of `flatten`."""
    pieces = torch.split(flat, [t.numel() for t in like])
    return [piece.view_as(t) for piece, t in zip(pieces, like, strict=True)]
