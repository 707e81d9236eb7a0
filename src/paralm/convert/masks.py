"""Pruning masks through training: saved in checkpoints, applied after every optimizer step.

A pruned run's checkpoints hold a boolean mask per pruned parameter under `masks.<parameter>`. Whoever
resumes such a checkpoint (`paralm train`, any layout) builds a mask laid out as its parameter is (a
DTensor with the same placements under FSDP or TP, so DCP reshards the saved one into it and
multiplying touches only local shards) and zeroes the masked weights after each optimizer step; the
masks travel into every later checkpoint. A checkpoint without masks trains as always.
"""

from __future__ import annotations

import torch
from torch import nn

from paralm.convert.layers import canonical
from paralm.models.step import StepHook

MASKS = "masks"


class Masks(StepHook):
    """Boolean masks for some parameters of a (possibly sharded) model; `True` keeps a weight."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        params = {canonical(n): p for n, p in model.named_parameters()}
        # a pipeline stage holds only some parameters: it masks those it holds
        self.pairs = {n: (params[n], torch.ones_like(params[n], dtype=torch.bool)) for n in names if n in params}

    @torch.no_grad()
    def apply(self) -> None:
        """Zero the masked weights (each rank its own shards)."""
        for param, mask in self.pairs.values():
            param.mul_(mask)

    def ended(self, step: int, skipped: torch.Tensor) -> dict[str, torch.Tensor]:
        """After every optimizer step (an after-step hook): pruned weights stay zero."""
        self.apply()
        return {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: mask for name, (_, mask) in self.pairs.items()}

    def load(self, masks: dict[str, torch.Tensor]) -> None:
        for name, (_, mask) in self.pairs.items():
            if masks[name] is not mask:  # DCP loads in place; a plain dict may bring new tensors
                mask.copy_(masks[name])
        self.apply()
